"""A request's samples on the router (sampling.n, best_of): merging the streams of
samples retried each on its own, ranking best_of's samples, and splitting a decode
worker's events by request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import replace

from ..engine.request import TokenEvent
from ..engine.sampling_params import SamplingParams
from ..proto import pdserve_pb2 as pb
from .detokenizer import Detokenizer
from .relay import Relay

_END = object()


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def sample_relays(rid: str, tokenizer, ids: list[int], params: SamplingParams,
                  eos_token_ids: Collection[int], max_model_len: int
                  ) -> tuple[SamplingParams, list[Relay]]:
    """A Relay per sample of `params` (n, or best_of), and the params to serve them with:
    best_of ranks its samples by their logprobs, so it asks for them (k = 0) where the
    client did not (whose relays then do not send them)."""
    asked = params.logprobs is not None
    if params.num_samples > params.n and not asked:
        params = replace(params, logprobs=0)
    return params, [Relay(rid, Detokenizer(tokenizer, ids, params.stop), ids, params.sample(i),
                          frozenset(eos_token_ids), max_model_len, index=i,
                          emit_logprobs=asked) for i in range(params.num_samples)]


async def merge(streams: Sequence[AsyncIterator]) -> AsyncIterator:
    """The items of every stream of `streams`, in the order they come. The first
    exception raised by a stream ends the merge with it. Ending (or closing) the merge
    cancels the streams still running, and each is closed (its `finally` runs) before
    this returns."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
            queue.put_nowait(_END)
        except Exception as e:
            queue.put_nowait(_Raised(e))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, _Raised):
                raise item.error
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def best_of(stream: AsyncIterator[pb.GenerateResponse], relays: Sequence[Relay],
                  n: int) -> list[pb.GenerateResponse]:
    """Every message of `stream` (the samples of `relays`), then the messages of the `n`
    samples with the highest cumulative logprob (the sum of their tokens' raw
    logprobs; vLLM's ranking of best_of), best first, each renumbered 0..n-1 in that
    order (GenerateResponse.index)."""
    held: dict[int, list[pb.GenerateResponse]] = {r.index: [] for r in relays}
    async for msg in stream:
        held[msg.index].append(msg)
    best = sorted(relays, key=lambda r: r.cumulative_logprob, reverse=True)[:n]
    out = []
    for index, r in enumerate(best):
        for msg in held[r.index]:
            msg.index = index
            out.append(msg)
    return out


def retry_groups(live: Sequence[Relay]) -> list[list[Relay]]:
    """How the unfinished samples of a failed attempt retry: each that streamed tokens
    alone (its prompt is now its own), the others in runs of consecutive indices (one
    prompt again, forked on D; sample i keeps seed + i)."""
    groups: list[list[Relay]] = []
    for r in live:
        prev = groups[-1][-1] if groups else None
        if (not r.token_ids and prev is not None and not prev.token_ids
                and prev.index == r.index - 1):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def by_request(events: Sequence[TokenEvent]) -> dict[str, list[TokenEvent]]:
    """`events` by request id, in order (of first appearance, and within each id)."""
    out: dict[str, list[TokenEvent]] = {}
    for ev in events:
        out.setdefault(ev.request_id, []).append(ev)
    return out
