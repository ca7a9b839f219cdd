"""One NIXL agent of the sender (nixl_sender.py) with its own thread posting WRITEs: the
shares queued behind its last WRITE go out as one WRITE (docs/nixl.md)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import numpy as np
import torch

from .base import KVLayout
from .nixl import LANE_POLL_S, MAX_MERGED_SHARES, block_descs, make_agent

logger = logging.getLogger(__name__)


class Lane:
    """One NIXL agent (its own UCX worker) with its own thread posting WRITEs and
    driving their progress; the caller only queues shares. With cma the copy runs
    inside ``transfer()`` on the posting thread, so lanes copy in parallel. Shares
    queued while the lane was busy go out as one WRITE (their descriptors and
    notifications concatenated): fewer, larger posts when P produces faster than the
    link drains (docs/nixl.md). Idle: blocked on its queue, not spinning."""

    def __init__(self, index: int, kv: torch.Tensor, layout: KVLayout, host: str,
                 mem: str, device_id: int, unit: int) -> None:
        self.agent = make_agent(f"prefill{index}", host)
        self.agent.register_memory([kv])
        self._kv, self._mem, self._device_id = kv, mem, device_id
        self.src = self.agent.prep_xfer_dlist(
            "", block_descs(kv.data_ptr(), layout.num_layers, kv.shape[2], unit, device_id),
            mem)
        self._head_src = None               # per (layer, K/V, block, head): head_src()
        # (D's agent name, its heads per block, 0: whole blocks) -> prepared dst list
        self.remote: dict[tuple[str, int], Any] = {}
        self.lock = threading.Lock()        # the agent, and in_flight
        # (the requests' _Begun, handle, the peer's dst list) of each posted WRITE
        self.in_flight: list[tuple[list, Any, Any]] = []
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name=f"kvsend-nixl-{index}",
                                       daemon=True)
        self.thread.start()

    def head_src(self) -> Any:
        """This cache's descriptors per (layer, K/V, block, head), row ((layer * 2 +
        half) * num_blocks + block) * heads + head: a share of a block's heads is one
        run of them (a tensor-parallel peer holding other heads, tp_plan.py). Prepared
        on first use."""
        with self.lock:
            if self._head_src is None:
                kv = self._kv
                self._head_src = self.agent.prep_xfer_dlist("", block_descs(
                    kv.data_ptr(), kv.shape[0], kv.shape[2] * kv.shape[3],
                    kv[0, 0, 0, 0].numel() * kv.element_size(), self._device_id), self._mem)
            return self._head_src

    def pair(self, metadata: bytes, base: int, num_blocks: int, num_layers: int,
             unit: int, mem: str, device_id: int, heads: int = 0) -> tuple[str, Any]:
        """Load D's agent; its cache's descriptors, whole blocks of `unit` bytes, or with
        `heads` (D's KV heads per block) one per head of unit / heads bytes."""
        with self.lock:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            if (name, heads) not in self.remote:  # a reconnect to the same D reuses it
                descs = (block_descs(base, num_layers, num_blocks, unit, device_id) if not heads
                         else block_descs(base, num_layers, num_blocks * heads, unit // heads,
                                          device_id))
                self.remote[(name, heads)] = self.agent.prep_xfer_dlist(name, descs, mem)
                self.agent.make_connection(name)
        return name, self.remote[(name, heads)]

    def post(self, jobs: list[tuple]) -> None:
        """One WRITE of every job (begun, src list, dst list, src rows, dst rows,
        notification; all to the same lists), its notifications
        concatenated; each job's request counts it finished when the WRITE does.
        Never raises: a job that is not posted is counted finished with the reason."""
        with self.lock:
            # checked under the lock: kill() cancels a dropped connection's requests,
            # then must find every WRITE to that peer already in in_flight
            skip = [job for job in jobs if job[0].cancelled or self.closed]
            live = [job for job in jobs if not (job[0].cancelled or self.closed)]
            error, begun = None, [job[0] for job in live]
            if live:
                try:
                    src, dst = live[0][1], live[0][2]
                    handle = self.agent.make_prepped_xfer(
                        "WRITE", src, np.concatenate([job[3] for job in live]), dst,
                        np.concatenate([job[4] for job in live]),
                        notif_msg=b"".join(job[5] for job in live))
                    if self.agent.transfer(handle) != "ERR":
                        self.in_flight.append((begun, handle, dst))
                        begun = []
                    else:
                        handle.release()
                        error = "NIXL refused to post a WRITE"
                except Exception as e:  # nixl raises its own error types; these WRITEs fail
                    error = f"NIXL WRITE failed to post: {type(e).__name__}: {e}"
        for job in skip:   # D may have handed these blocks on already
            job[0].finished_one("not posted: the request failed, its connection dropped, "
                                "or the sender closed")
        for b in begun:
            b.finished_one(error)

    def reap(self) -> bool:
        """One progress pass: completed WRITEs, oldest first up to the first still in
        progress (they complete in order; checking all would make a long queue cost
        a call per WRITE per pass), are released and counted on their requests. True
        while some are still in flight."""
        with self.lock:
            done = []
            while self.in_flight:
                try:
                    state = self.agent.check_xfer_state(self.in_flight[0][1])
                except Exception as e:  # NIXL raises its own errors for a failed transfer
                    logger.warning("NIXL WRITE failed: %s: %s", type(e).__name__, e)
                    state = "ERR"
                if state == "PROC":
                    break
                begun, handle, _ = self.in_flight.pop(0)
                try:
                    handle.release()
                except Exception as e:  # a failed transfer's handle may refuse; NIXL logs it
                    logger.debug("NIXL handle release: %s", e)
                done.append((begun, state))
            busy = bool(self.in_flight)
        for begun, state in done:
            for b in begun:
                b.finished_one(None if state == "DONE" else "a NIXL WRITE failed")
        return busy

    def kill(self, dst: Any, deadline: float) -> int:
        """End every WRITE in flight to the peer whose prepared list is `dst` (a lost or
        dropped connection's decode worker), so that none lands in its blocks once D
        hands them on: each handle is released, which cancels an active transfer; one
        NIXL cannot cancel is waited for until it completes or fails, up to `deadline`
        (time.monotonic()). Their requests count them finished with an error. Returns
        how many are still in flight (0: nothing of this lane can write to that peer)."""
        while True:
            ended, alive = [], 0
            with self.lock:
                keep = []
                for entry in self.in_flight:
                    if entry[2] is not dst:
                        keep.append(entry)
                        continue
                    if not self._release(entry[1]):   # active, not cancellable: writing
                        keep.append(entry)
                        alive += 1
                        continue
                    ended.append(entry[0])
                self.in_flight = keep
            for begun in ended:
                for b in begun:
                    b.finished_one("a NIXL WRITE cancelled: its connection dropped")
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(LANE_POLL_S)

    def _release(self, handle: Any) -> bool:
        """Release a WRITE's handle (under self.lock), cancelling it if still active;
        False when NIXL could not cancel it and it is still in progress."""
        try:
            handle.release()
            return True
        except Exception as e:   # NIXL's own error types
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception:
                state = "ERR"
            if state == "PROC":
                logger.debug("NIXL WRITE not cancelled: %s", e)
                return False
        try:
            handle.release()
        except Exception as e:   # ended; a failed transfer's handle may refuse: NIXL logs it
            logger.debug("NIXL handle release: %s", e)
        return True

    def close(self) -> None:
        self.closed = True         # what is still queued is not posted
        self.jobs.put(None)
        self.thread.join(5.0)
        if self.thread.is_alive():   # stuck in a transfer: its handles stay (a leak, not a crash)
            logger.warning("NIXL lane %s did not stop in 5s", self.agent.name)
            return
        with self.lock:
            for begun, handle, _ in self.in_flight:
                for b in begun:
                    b.finished_one("sender closed")
            self.in_flight = []
            for handle in [self.src, self._head_src, *self.remote.values()]:
                if handle is not None:
                    handle.release()
            self.remote.clear()

    def _take(self) -> tuple[list[tuple], bool]:
        """Block for the next share (LANE_POLL_S at most while WRITEs are in flight),
        then take every share queued behind it: (shares, whether to stop)."""
        try:
            job = self.jobs.get(timeout=LANE_POLL_S if self.in_flight else None)
        except queue.Empty:
            return [], False
        jobs = []
        while job is not None:
            jobs.append(job)
            if len(jobs) >= MAX_MERGED_SHARES:
                return jobs, False
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return jobs, False
        return jobs, True

    def _run(self) -> None:
        # No spinning: a progress pass after each post, and every LANE_POLL_S while
        # WRITEs are in flight; whoever waits for a request's WRITEs (_settle) also drives
        # every lane's progress itself.
        stop = False
        while not stop:
            jobs, stop = self._take()
            try:
                start = 0
                for i in range(1, len(jobs) + 1):   # one WRITE per run of the same peer
                    if i == len(jobs) or jobs[i][2] is not jobs[start][2]:
                        self.post(jobs[start:i])
                        start = i
                self.reap()
            except Exception:  # a bug here must cost its requests, not every later one
                logger.exception("NIXL lane %s failed a pass", self.agent.name)
