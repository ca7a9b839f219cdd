"""Prompt blocks a prefill worker reads from its decode worker, or from another prefill
worker, instead of computing them.

Every prompt's K/V ends on a decode worker D, so D's prefix cache and KV tiers hold the
histories of the conversations it serves; a next turn sent to a prefill worker P that
lacks the history (evicted from P's pool, or computed on D) would compute it again. With
WorkerConfig.kv_pull, D's reservation names the leading prompt blocks D holds
(`num_cached_blocks`: its pool's hit and the blocks it loaded from its tier at reserve),
and P reads those past its own cache's hit over the KV transport, D to P:

    P  PrefillScheduler._admit: D holds blocks [h, c) that P lacks, and the cost model
       says reading them beats computing them → start(req, h, c - h): P's pull receiver
       expects the transfer `<request id>/pull` into req.block_table[h:c], and
       ask(D, KVPullOrder) calls D.send_prompt_kv
    D  DecodeScheduler.export holds those blocks; D's KV sender sends every layer of
       them (the frames and CRC32C checks of a prefill's send), then DONE with no
       token; end_export drops the holds
    P  finished(): the receiver reports the transfer done → the blocks enter P's prefix
       cache and count as computed; P computes the rest and sends D only blocks c on

A prefix D lacks (its pool evicted it, or the turn went to another decode worker) may
still be in another prefill worker's prefix cache or tiers: the router's mirror of every
prefill worker's cache and tiers names the one holding the most (PrefillOrder.kv_peer,
peer_blocks), and P reads from that worker instead when it holds more than D does. The
peer finds the blocks by their hashes (KVPullOrder.block_hashes,
PrefillScheduler.export), loads those only its tiers hold into its pool, and sends them
as D would; it sends nothing (and P computes them) when it has lost any of them since
the router's last look.

A failed, refused (D no longer holds the blocks, or died) or overdue pull, or one whose
request was aborted, is forgotten on the receiver; once the receiver reports the blocks released (no write can touch them) the
request goes on from the blocks it had: a pull costs at most its wait, never a token.

Tensor-parallel workers, on either side, of any sizes the model's KV heads allow: every
rank holds its KV heads of each block (engine/parallel.py), so a pull runs as a P→D
transfer does, the holder in the prefill's place. P's ranks each have a pull receiver
(kv_transfer/tp_receiver.py: rank 0 expects on them all before it asks the holder, and
the pull is done once every rank's share is); the order carries every P rank's address
(KVPullOrder.kv_rank_addresses); each holder rank sends the heads it holds to the P
ranks that hold them (send_held_blocks, kv_transfer/tp_plan.py rank_targets with the
holder as the sender), then a DONE for those heads, while rank 0 holds the blocks.

The cost model (PullCost) compares the two times, each from this worker's own history.
"""

from __future__ import annotations

import asyncio
import time
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..config import WorkerConfig
from ..engine.block_pool import BlockPool
from ..kv_transfer import KVLayout, KVReceiver, KVSender, KVTransferError, make_receiver
from ..kv_transfer.tp_receiver import TPReceiver
from ..messages import KVPullOrder
from ..tp_group import rank_addresses
from .requests import PrefillRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PullCost:
    """Seconds to compute `n` prompt tokens, ``n / tokens_per_s``, against seconds to read
    `b` bytes of their K/V from a decode worker, ``latency_s + b / bytes_per_s``. The two
    rates are running means (weight `alpha` per observation) of this worker's prefill
    steps and of its pulls slower than `latency_s` (which stays fixed; an overdue pull
    counts as one that took its timeout), starting from these values: `pdserve bench
    pull` on the 2-core CPU box (2026-11-28; fp32 default model, a prefill worker on one
    core, TCP loopback; bench/results/kv_pull/pull.json): steps of 256-2,048 tokens at
    322-403 tokens/s, pulls of 11.8-94.4 MB in 13-52 ms, fitted as 10.8 ms + bytes /
    2.14 GB/s. There a block (16 tokens, 0.74 MB) reads in 0.3 ms and computes in 44: a
    pull wins from one block on; on a GPU it is the transport that must be fast. No pull
    for `probe_s` seconds: the next is worth it whatever the rates say (so a rate that
    fell is measured again, not kept for good)."""

    tokens_per_s: float = 360.0
    bytes_per_s: float = 2.1e9
    latency_s: float = 0.011
    alpha: float = 0.2
    probe_s: float = 30.0
    last_pull: float = field(default_factory=lambda: time.monotonic())   # started

    def worth(self, num_tokens: int, num_bytes: int) -> bool:
        """Whether reading `num_bytes` beats computing `num_tokens`, or it is time to
        probe."""
        return (self.latency_s + num_bytes / self.bytes_per_s < num_tokens / self.tokens_per_s
                or time.monotonic() - self.last_pull > self.probe_s)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.tokens_per_s += self.alpha * (num_tokens / seconds - self.tokens_per_s)

    def observe_pull(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > self.latency_s:
            rate = num_bytes / (seconds - self.latency_s)
            self.bytes_per_s += self.alpha * (rate - self.bytes_per_s)


def answered_nothing(answer: Future) -> bool:
    """Whether the holder answered a pull (`answer`: the Future `ask` gave of what its
    send_prompt_kv returned) without sending (0 bytes), or failed (it died, or a rank
    of the puller could not expect the pull); False while it has not answered."""
    if not answer.done():
        return False
    try:
        return answer.result() == 0
    except Exception:
        return True


@dataclass(slots=True)
class _Pull:
    req: PrefillRequest
    first: int          # block-table position of its first pulled block
    count: int
    started: float      # time.monotonic()
    answer: Future      # what ask() returned (refused() reads it)
    answered: float | None = None   # time.monotonic() when the holder's send returned


class KVPulls:
    """The pulls in flight of one prefill scheduler (called under its lock, on the step
    thread); see the module docstring. `receiver`: P's own KV receiver over its cache,
    started at `address` with P's `epoch` (a tensor-parallel P: rank 0's TPReceiver,
    ranks 1..N-1's pull receivers at `rank_addresses`); `ask(source, order)` asks the
    worker `source` (PrefillRequest.kv_source, or kv_peer: see source()) to send and
    returns a Future of the bytes it says it sent, and `refused(answer)` (default
    answered_nothing) says from that whether it answered without sending or failed (the
    pull is given up then); `block_bytes`: K/V bytes of one block (every layer, every
    rank); a pull not done after `timeout_s` seconds is given up.

    Counters: `pulled_blocks`, `bytes_pulled`, `pull_seconds` (asked to done, summed),
    `num_failed` (pulls given up or failed)."""

    def __init__(self, receiver: KVReceiver, address: tuple[str, int], epoch: int,
                 pool: BlockPool, block_size: int, block_bytes: int,
                 ask: Callable[[object, KVPullOrder], Future],
                 refused: Callable[[Future], bool] | None = None,
                 cost: PullCost | None = None, timeout_s: float = 10.0,
                 rank_addresses: Sequence[tuple[str, int]] = ()):
        self.receiver, self.address, self.epoch = receiver, tuple(address), epoch
        self.rank_addresses = tuple(tuple(a) for a in rank_addresses)
        self.pool, self.block_size, self.block_bytes = pool, block_size, block_bytes
        self.ask, self.refused = ask, refused or answered_nothing
        self.cost, self.timeout_s = cost or PullCost(), timeout_s
        self._pulling: dict[str, _Pull] = {}     # pull id -> in flight
        self._forgotten: dict[str, _Pull] = {}   # given up, waiting for the release
        self.pulled_blocks = self.bytes_pulled = self.num_failed = 0
        self.pull_seconds = 0.0

    @staticmethod
    def source(req: PrefillRequest, num_hit: int) -> tuple[object, int, bool]:
        """(whom to ask, how many blocks after P's `num_hit` it holds, whether it is a
        prefill worker): req's decode worker, or the peer the router named when it holds
        more."""
        d = req.num_cached_blocks - num_hit if req.kv_source is not None else 0
        peer = req.peer_blocks - num_hit if req.kv_peer is not None else 0
        return (req.kv_peer, peer, True) if peer > d else (req.kv_source, d, False)

    def count(self, req: PrefillRequest, num_hit: int, num_local: int) -> int:
        """Blocks after P's `num_hit` worth reading from req's decode worker or peer
        (source): those it holds, when they are more than the `num_local` P's tiers hold
        and the cost model prefers reading them; else 0."""
        _, n, _ = self.source(req, num_hit)
        if n <= num_local:
            return 0
        return n if self.cost.worth(n * self.block_size, n * self.block_bytes) else 0

    def start(self, req: PrefillRequest, first: int, count: int) -> None:
        """Read the source's blocks at block-table positions first..first+count-1 into
        req's (count as count() gave for num_hit `first`)."""
        source, _, peer = self.source(req, first)
        pull_id = f"{req.request_id}/pull"
        end = first + count
        self.receiver.expect(pull_id, req.block_table[first:end])
        answer = self.ask(source, KVPullOrder(
            req.request_id, pull_id, first, count, self.address, self.epoch,
            tuple(req.block_hashes[first:end]) if peer else (), self.rank_addresses,
            self.timeout_s))
        self._pulling[pull_id] = pull = _Pull(req, first, count, time.monotonic(), answer)
        self.cost.last_pull = pull.started
        answer.add_done_callback(lambda _: setattr(pull, "answered", time.monotonic()))

    def finished(self) -> list[tuple[PrefillRequest, int]]:
        """(request, leading blocks holding K/V) of each pull that ended since the last
        call: done (its blocks cached), or failed, refused, overdue or aborted and
        released."""
        news = self.receiver.get_finished()
        now = time.monotonic()
        out = []
        for c in news.completions:
            p = self._pulling.pop(c.request_id, None)
            if p is None:
                continue
            if not c.ok:
                self._forgotten[c.request_id] = p
                self.num_failed += 1
            else:
                end = p.first + p.count
                self.pool.cache_blocks(p.req.block_table[p.first:end],
                                       p.req.block_hashes[p.first:end])
                self.pulled_blocks += p.count
                self.bytes_pulled += p.count * self.block_bytes
                self.pull_seconds += now - p.started     # what the prompt waited
                # the transport's time: asked to the holder's answer (its DONE sent),
                # not to this poll, which may come a whole prefill step later
                self.cost.observe_pull(p.count * self.block_bytes,
                                       min(now, p.answered or now) - p.started)
                out.append((p.req, end))
            self.receiver.forget(c.request_id, lease_timeout_s=self.timeout_s)
        for pull_id, p in list(self._pulling.items()):       # still in flight
            overdue = now - p.started > self.timeout_s
            if overdue:
                self.cost.observe_pull(p.count * self.block_bytes, self.timeout_s)
            if overdue or p.req.finish is not None or self.refused(p.answer):
                self._give_up(pull_id)
        for pull_id in news.released:
            p = self._forgotten.pop(pull_id, None)
            if p is not None:
                out.append((p.req, p.first))
        return out

    def _give_up(self, pull_id: str) -> None:
        self._forgotten[pull_id] = self._pulling.pop(pull_id)
        self.num_failed += 1
        # the holder sends nothing past the pull's expiry (its send started after ours,
        # so timeout_s more is a bound): a writer's lease still held then (a holder that
        # froze or vanished after BEGIN) ends, so these blocks are not held for good
        self.receiver.forget(pull_id, lease_timeout_s=self.timeout_s)

    def __contains__(self, request_id: str) -> bool:
        return f"{request_id}/pull" in self._pulling or f"{request_id}/pull" in self._forgotten

    def loading(self) -> bool:
        """Whether a pull is in flight or waiting for its release."""
        return bool(self._pulling or self._forgotten)


def worker_pulls(config: WorkerConfig, runner, kv_layout: KVLayout, epoch: int,
                 pool: BlockPool, notify: Callable[[], None], ranks: Sequence,
                 on_broken: Callable[[Exception], None],
                 loop: Callable[[], asyncio.AbstractEventLoop]) -> KVPulls:
    """A prefill worker's KVPulls over a pull receiver on its cache (config.transport,
    bound to config.node_host(); `notify` called on its news). `runner`: rank 0's
    ModelRunner; `ranks`: the TPRank handles of ranks 1..N-1 ([] at TP 1), each with its
    own pull receiver, seen through a TPReceiver (`on_broken` called if one is lost);
    `loop()`: the actor's event loop, which asks the holders (asker). Raises what the
    receiver's start raises (OSError: no port)."""
    receiver = make_receiver(config.transport, runner.kv_cache, kv_layout, epoch,
                             notify=notify, host=config.node_host(), secret=config.kv_secret)
    address, rank_addrs = receiver.start(), ()
    if ranks:                       # every rank's pull receiver, polled by the step loop
        rank_addrs = rank_addresses(ranks, "pull_address")
        receiver = TPReceiver(receiver, runner, ranks, on_broken, prefix="pull",
                              role="prefill")
    block_bytes = kv_layout.payload_bytes(runner.config.num_layers, 1) * (len(ranks) + 1)
    return KVPulls(receiver, address, epoch, pool, runner.block_size, block_bytes,
                   ask=asker(receiver, loop), rank_addresses=rank_addrs)


def asker(receiver: KVReceiver,
          loop: Callable[[], asyncio.AbstractEventLoop]) -> Callable[[object, KVPullOrder],
                                                                     Future]:
    """KVPulls' ask for a worker pulling into `receiver`: ``ask(holder, order)`` (from the
    step thread) runs on the event loop `loop()` and, once the worker's ranks 1..N-1
    expect the pull (a TPReceiver's expect_ranks), calls `holder`'s (an actor handle)
    send_prompt_kv. Returns a Future of what that returns; 0 without asking when the pull
    was forgotten meanwhile; a failure is logged and fails the Future (answered_nothing
    reads it: the pull is given up)."""
    async def ask(holder, order: KVPullOrder) -> int:
        try:
            if (isinstance(receiver, TPReceiver)
                    and not await receiver.expect_ranks(order.pull_id)):
                return 0                        # given up meanwhile: nothing to send
            return await holder.send_prompt_kv.remote(order)
        except Exception as e:
            logger.warning("pull of %s failed: %s: %s", order.request_id,
                           type(e).__name__, e)
            raise
    return lambda holder, order: asyncio.run_coroutine_threadsafe(ask(holder, order), loop())


def pull_expiry(order: KVPullOrder) -> float | None:
    """When (time.time(), seconds) a holder that got `order` now stops sending it: the
    puller has given it up by then; None: no limit."""
    return time.time() + order.timeout_s if order.timeout_s > 0 else None


def send_held_blocks(sender: KVSender, order: KVPullOrder, blocks: Sequence[int],
                     num_layers: int,
                     targets: Callable[[int], Sequence[tuple[int, range | None]]],
                     expires: float | None = None) -> int:
    """One holder rank's share of a pull: send the pulling prefill worker's ranks
    (order.kv_address, then order.kv_rank_addresses) the K/V of `blocks` (this rank's
    cache; positions order.first_block.. of the prompt) every layer a frame per P rank,
    then DONE with no token. `targets(n)`: (P rank, KV heads or None for all) pairs
    for a puller of n ranks (tp_plan.rank_targets with this rank as the sender);
    `expires` (pull_expiry, time.time() seconds): no layer is sent after it. Returns
    the payload bytes sent (0 when every head this rank holds reaches P from another).

    Raises what the sender raises (KVTransferError, KVLayoutMismatch, KVAuthError), or
    KVTransferError once `expires` passed, after sending ABORT to every P rank it sends
    to that can be reached."""
    addresses = (tuple(order.kv_address), *(tuple(a) for a in order.kv_rank_addresses))
    dests = [(addresses[r], heads) for r, heads in targets(len(addresses))]
    try:
        sent = 0
        for layer in range(num_layers):
            if expires is not None and time.time() > expires:
                raise KVTransferError(f"pull {order.pull_id} overdue: its puller gave it "
                                      f"up after {order.timeout_s} s")
            for addr, heads in dests:
                sent += sender.send_layers(addr, order.pull_id, order.epoch, layer, layer + 1,
                                           blocks, heads=heads)
        for addr, heads in dests:
            sender.send_done(addr, order.pull_id, order.epoch, None, num_layers, heads=heads)
        return sent
    except Exception as e:
        for addr, _ in dests:
            try:
                sender.send_abort(addr, order.pull_id, order.epoch, f"{type(e).__name__}: {e}")
            except Exception as abort_error:      # unreachable: P's pull times out
                logger.debug("ABORT of %s not sent to %s: %s", order.pull_id, addr, abort_error)
        raise
