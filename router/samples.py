"""A request's samples on the router (sampling.n, best_of): SampleGroup serves them by
attempts, retried after a failure; merging the streams of samples retried each on its
own, ranking best_of's samples, and splitting a decode worker's events by request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import aclosing
from dataclasses import replace

import grpc

from ..engine.request import TokenEvent
from ..engine.sampling_params import SamplingParams
from ..proto import pdserve_pb2 as pb
from .detokenizer import Detokenizer
from .errors import RequestError
from .relay import Relay
from .workers import AttemptFailed

logger = logging.getLogger(__name__)

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


class SampleGroup:
    """One request's samples (sampling.n, or best_of of them) on the router: a Relay
    each (detokenizing, applying the stop rule), the attempts that serve them and the
    retries after a failed one, and best_of's ranking.

    Attempts (`attempt(ids, params, relays)`, an async iterator of messages; router/
    attempt.py): all samples together while none has streamed a token (one
    reservation and prefill, forked on D), else those with tokens each on its own
    (their prompts differ by the tokens streamed) and the others in runs forked
    again (retry_groups), merged. A retry serves `prompt + tokens already streamed`
    for the rest of max_tokens with the sampler's step continuing (step_offset), so
    greedy and seeded outputs equal an uninterrupted run's; at most `max_migrations`
    failures per request.
    """

    def __init__(self, rid: str, tokenizer, ids: list[int], params: SamplingParams,
                 eos_token_ids: Collection[int], max_model_len: int):
        self.rid, self.ids = rid, ids
        self.ranked = params.num_samples > params.n       # best_of: sent once ranked
        self.params, self.relays = sample_relays(rid, tokenizer, ids, params, eos_token_ids,
                                                 max_model_len)

    def resume(self, token_ids: list[int]) -> None:
        """The client streamed `token_ids` of sample 0 from an earlier router
        (GenerateRequest.resume_token_ids): go on after them, as a retry does."""
        self.relays[0].resume(token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens streamed, of every sample."""
        return sum(len(r.token_ids) for r in self.relays)

    async def serve(self, attempt: Callable[..., AsyncIterator[pb.GenerateResponse]],
                    max_migrations: int, on_retry: Callable[[str], None] = lambda reason: None
                    ) -> AsyncIterator[pb.GenerateResponse]:
        """The samples' messages until every one has finished (best_of: the n best,
        renumbered, once all have). `on_retry(reason)` counts each retry.

        Raises:
            RequestError: UNAVAILABLE after more than `max_migrations` failed attempts;
                what an attempt raised that no retry mends (deadline, capacity).
        """
        run = self._serve(self.params, self.relays, [], attempt, max_migrations, on_retry)
        async with aclosing(run) as stream:
            if self.ranked:
                for msg in await best_of(stream, self.relays, self.params.n):
                    yield msg
            else:
                async for msg in stream:
                    yield msg

    async def _serve(self, params: SamplingParams, relays: list[Relay], failures: list[str],
                     attempt, max_migrations: int, on_retry
                     ) -> AsyncIterator[pb.GenerateResponse]:
        """Attempts until every sample of `relays` has finished; `params`' sample 0 is
        relays[0]'s."""
        while True:
            # The relay applies D's stop rule to every token it streams, so a stream
            # that had ended (even if D died before its finish event) is finished
            # there and no attempt fails after it: a retry always resumes a live one.
            live = [r for r in relays if r.finish_reason is None]
            if not live:
                return
            if len(live) > 1 and (len(live) < len(relays) or any(r.token_ids for r in live)):
                base = relays[0].index
                each = merge([self._serve(replace(params.sample(g[0].index - base), n=len(g)),
                                          g, list(failures), attempt, max_migrations, on_retry)
                              for g in retry_groups(live)])
                async with aclosing(each):
                    async for msg in each:
                        yield msg
                return
            one = live[0] if len(live) == 1 else None
            sent = one.token_ids if one is not None else []
            try:
                async with aclosing(attempt(self.ids + sent, self._rest(params, relays, one),
                                            live)) as tried:
                    async for msg in tried:
                        yield msg
            except AttemptFailed as e:
                failures += [str(e)] if e.reason != "rebalance" else []   # not a fault
                on_retry(e.reason)
                if len(failures) > max_migrations:
                    raise RequestError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"request failed {len(failures)} times (router.max_migrations="
                        f"{max_migrations}): " + "; ".join(failures[-3:])) from None
                logger.warning("request %s: %s; retrying on live workers after the %s "
                               "tokens streamed (%d/%d)", self.rid, e,
                               "+".join(str(len(r.token_ids)) for r in live),
                               len(failures), max_migrations)

    @staticmethod
    def _rest(params: SamplingParams, relays: list[Relay], one: Relay | None
              ) -> SamplingParams:
        """The params of the next attempt: all of `relays`' samples (`one` None), or
        sample `one` alone after the tokens it streamed."""
        sent = one.token_ids if one is not None else []
        rest = params if one is None else params.sample(one.index - relays[0].index)
        had = (relays[0] if one is None else one).prompt_logprobs is not None   # sent
        return replace(rest, max_tokens=rest.max_tokens - len(sent),
                       step_offset=rest.step_offset + len(sent),
                       prompt_logprobs=None if had else rest.prompt_logprobs)
