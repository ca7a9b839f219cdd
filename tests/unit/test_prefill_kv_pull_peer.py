"""prefill_worker/kv_pull.py reading from another prefill worker (fakes and fixture of
test_prefill_kv_pull.py): when it holds more of the prefix than the decode worker, P
reads from it instead; it finds the blocks in its prefix cache by their hashes (only
those past P's own prefix cache), loads those its pool evicted from its host tier first,
sends them with the send both roles run (EngineActor._send_held_kv), and sends nothing
when it lost any. Every test ends with P's pool free and the receiver idle."""

import asyncio
import time
from concurrent.futures import Future
from types import SimpleNamespace

import torch

from pdserve.engine.block_pool import BlockPool, block_hashes
from pdserve.engine.kv_tiers import KVTiers, fingerprint
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine_actor import EngineActor
from pdserve.prefill_worker.requests import PrefillRequest
from pdserve.prefill_worker.scheduler import PrefillScheduler
from test_prefill_kv_pull import (BLOCK_BYTES, BS, D_KV, LAYERS, P_KV, PROMPT, FakeD,
                                  compute_rest, finish, one_rank, pull, request,
                                  until_rows)
from tier_helpers import settle

__all__ = ["pull"]     # the fixture, from test_prefill_kv_pull.py


class FakePeer(FakeD):
    """Another prefill worker's side of send_prompt_kv: its real PrefillScheduler, whose
    prefix cache holds PROMPT's full blocks (computed into D_KV's blocks), exports them
    by hash, and EngineActor._send_held_kv (what both roles' send_prompt_kv run) sends
    them with a real sender and gives them back (end_export). With `tiers`, a host tier
    under its pool holds them too (stored as they were cached); the test's thread runs
    the peer's schedule() as its step thread would, until an export's load is done."""

    def __init__(self, kind, tiers=False):
        super().__init__(kind)
        self.pool = BlockPool(32)
        self.tiers = (KVTiers(self.pool, D_KV, fingerprint("m", D_KV),
                              32 * BLOCK_BYTES / (1 << 30)) if tiers else None)
        self.sched = PrefillScheduler(self.pool, BS, 64, tiers=self.tiers)
        held = PrefillRequest("peer", list(PROMPT), SamplingParams(), ("127.0.0.1", 1), epoch=1)
        self.sched.add(held)
        finish(self.sched, held, self.sched.schedule())       # its 6 full blocks cached
        if self.tiers is not None:
            settle(self.tiers)
            assert self.tiers.stats.stored_host == 6
        self.actor = SimpleNamespace(worker_id="prefill-1", _pull_sender=lambda: self.sender,
                                     runner=SimpleNamespace(config=SimpleNamespace(
                                         num_layers=LAYERS)),
                                     _ranks=[], _pull_targets=one_rank)
        self.sent: list[int] = []

    def _send(self, order, answer: Future):
        exported = self.sched.export(list(order.block_hashes))
        deadline = time.monotonic() + 5
        while not exported.done():                        # a tier load: the step thread
            assert time.monotonic() < deadline, "the export's tier load never ended"
            self.sched.schedule()
            time.sleep(0.002)
        self.sent.append(asyncio.run(EngineActor._send_held_kv(
            self.actor, order, exported.result(), self.sched.end_export)))
        answer.set_result(self.sent[-1])

    def close(self):
        super().close()
        if self.tiers is not None:
            assert self.tiers.idle() and not self.sched.loading()
            self.tiers.close()


def peer_pull(pull, peer, d_blocks=2, first=0):
    """A request whose decode worker holds `d_blocks` leading blocks and `peer` all 6,
    P itself the first `first`, added and scheduled (its pull asked); returns it."""
    pool, sched, pulls, kind = pull
    pulls.ask = peer.ask
    req = request(d=object(), cached=d_blocks)
    req.kv_peer, req.peer_blocks = peer, 6
    sched.add(req)
    assert sched.schedule().requests == ()
    [order] = peer.orders
    assert (order.first_block, order.num_blocks) == (first, 6 - first)
    assert list(order.block_hashes) == req.block_hashes[first:6]
    return req


def test_a_prefix_another_prefill_worker_holds_is_read_from_it(pull):
    """D holds 2 leading blocks, the peer 6 (the router's guess, peer_blocks): the
    peer's 6 are read, found by hash in its prefix cache."""
    pool, sched, pulls, kind = pull
    peer = FakePeer(kind)
    try:
        D_KV.normal_()
        req = peer_pull(pull, peer)
        out = until_rows(sched)
        assert out.num_scheduled_tokens == (2,) and pulls.pulled_blocks == 6
        theirs = peer.pool.match_prefix(req.block_hashes[:6])
        for mine, block in zip(req.block_table[:6], theirs):
            assert torch.equal(P_KV[:, :, mine], D_KV[:, :, block])
        peer.pool.free(theirs)
        finish(sched, req, out)
        peer.join()      # the puller is done before the peer's send returns
        assert peer.pool.all_free() and peer.sent == [6 * BLOCK_BYTES]
    finally:
        peer.close()


def test_only_the_blocks_past_its_own_prefix_cache_are_read_from_another_worker(pull):
    """P's prefix cache holds the prompt's first 2 blocks already: the peer is asked for
    blocks 2-5 only, by their hashes, and P's first 2 stay its own."""
    pool, sched, pulls, kind = pull
    peer = FakePeer(kind)
    try:
        D_KV.normal_()
        P_KV.zero_()
        mine = PrefillRequest("mine", list(PROMPT[:2 * BS + 1]), SamplingParams(),
                              ("127.0.0.1", 1), epoch=1)
        sched.add(mine)
        finish(sched, mine, sched.schedule())             # 2 full blocks cached, zeros
        req = peer_pull(pull, peer, first=2)
        out = until_rows(sched)
        assert out.num_scheduled_tokens == (2,) and pulls.pulled_blocks == 4
        assert sched.cached_tokens == 6 * BS
        theirs = peer.pool.match_prefix(req.block_hashes[:6])
        for i, (block, their) in enumerate(zip(req.block_table[:6], theirs)):
            assert torch.equal(P_KV[:, :, block], D_KV[:, :, their] if i >= 2
                               else torch.zeros_like(P_KV[:, :, block]))
        peer.pool.free(theirs)
        finish(sched, req, out)
        peer.join()      # the puller is done before the peer's send returns
        assert peer.pool.all_free() and peer.sent == [4 * BLOCK_BYTES]
    finally:
        peer.close()


def test_a_peer_loads_what_its_pool_evicted_from_its_host_tier_then_sends_it(pull):
    """The peer's prefix cache keeps the prompt's first 2 blocks, its host tier all 6:
    it takes blocks for the other 4, loads them from the tier (the cache tensor's old
    copies zeroed first, so the bytes sent are the tier's), then sends the 6; the 4 are
    in its prefix cache afterwards."""
    pool, sched, pulls, kind = pull
    D_KV.normal_()
    peer = FakePeer(kind, tiers=True)
    try:
        hashes = block_hashes(PROMPT, BS)[:6]
        cached = peer.pool.match_prefix(hashes)
        want = [D_KV[:, :, b].clone() for b in cached]
        peer.pool.free(cached[2:])
        peer.pool.free(cached[:2])                # the first 2 used last: kept
        taken = peer.pool.allocate(peer.pool.num_free - peer.pool.num_cached + 4)
        peer.pool.free(taken)
        assert peer.pool.num_cached == 2 and peer.tiers.lookup(hashes) == 6
        D_KV[:, :, [b for b in range(D_KV.shape[2]) if b not in cached[:2]]] = 0
        req = peer_pull(pull, peer)
        out = until_rows(sched)
        assert out.num_scheduled_tokens == (2,) and pulls.pulled_blocks == 6
        for got, block in zip(want, req.block_table[:6]):
            assert torch.equal(P_KV[:, :, block], got)
        assert peer.tiers.stats.host_hits == 4 and peer.pool.num_cached == 6
        finish(sched, req, out)
        peer.join()      # the puller is done before the peer's send returns
        assert peer.pool.all_free() and peer.sent == [6 * BLOCK_BYTES]
    finally:
        peer.close()


def test_a_peer_that_lost_a_block_sends_nothing_and_the_prompt_computes(pull):
    pool, sched, pulls, kind = pull
    peer = FakePeer(kind)
    try:
        # the peer's pool evicts its least recently used cached block: the prompt's first
        taken = peer.pool.allocate(peer.pool.num_free - peer.pool.num_cached + 1)
        peer.pool.free(taken)
        req = peer_pull(pull, peer)
        out = until_rows(sched)
        assert req.num_computed_tokens == 0 and pulls.num_failed == 1
        compute_rest(sched, req, out)
        peer.join()      # the puller is done before the peer's send returns
        assert peer.pool.all_free() and peer.pool.num_cached == 5 and peer.sent == [0]
    finally:
        peer.close()
