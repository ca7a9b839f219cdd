"""The decode worker's side of the KV connector: the one interface between the decode
scheduler and the KV receiver (kv_transfer: ``KVReceiver``), the mirror of
prefill_worker/connector.py (vLLM's scheduler-side connector has the same three calls)::

    scheduler                                  receiver (its own threads write the KV)
    reserve():  expect(rid, blocks)     ──▶    expect: frames / writes for rid land there
    _finish():  request_finished(rid, blocks)  forget: no write for rid is accepted now
    step loop:  get_finished()          ◀──    transfers done or failed; forgotten
                                               requests released (no write in flight)

A finished request's blocks are held here, not freed, until the receiver reports it
released: a write still in flight (a one-sided NIXL write, a frame being received) may
land in them, so they must not go to another request before. All calls come from the
scheduler with its lock held (expect from RPC threads, the others from the step thread);
the receiver's calls never block, and its threads never take the scheduler's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..kv_transfer import KVCompletion, KVReceiver


class DecodeKVConnector:
    """What the decode scheduler asks of the KV receiver; see the module docstring."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self._releasing: dict[str, list[int]] = {}  # finished; blocks held until released
        self.num_failed = 0                         # transfers that failed to arrive

    def expect(self, request_id: str, block_ids: Sequence[int]) -> None:
        """The receiver writes ``request_id``'s KV into ``block_ids`` (block-table order).
        ValueError from the receiver for bad ids."""
        self.receiver.expect(request_id, block_ids)

    def request_finished(self, request_id: str, block_ids: list[int]) -> None:
        """The request finished on D (any reason): the receiver forgets it, and its
        blocks are held until get_finished() reports them released."""
        self._releasing[request_id] = block_ids
        self.receiver.forget(request_id)

    def get_finished(self) -> tuple[list[KVCompletion], list[int]]:
        """(transfers done or failed since the last call, blocks now safe to free)."""
        finished = self.receiver.get_finished()
        self.num_failed += sum(not c.ok for c in finished.completions)
        freed = [b for rid in finished.released for b in self._releasing.pop(rid, ())]
        return finished.completions, freed
