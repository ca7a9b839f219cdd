"""router/router.py: a client resumes a stream after the tokens it had
(GenerateRequest.resume_token_ids), or is refused where the request cannot go on.

Fake prefill and decode workers (tests/failover_fakes.py) run a deterministic toy "model"
(the next token is a function of the whole context), so the tokens of an uninterrupted run
are known. No model, no Ray.
"""

import asyncio

import pytest

from failover_fakes import (MAX_TOKENS, PROMPT, FakeDecode, FakePrefill, make_router, tokens,
                            uninterrupted)
from pdserve.client import make_request
from pdserve.engine.sampling_params import InvalidRequestError
from router_fakes import EOS


@pytest.mark.parametrize("had", [1, 3, MAX_TOKENS - 1])
def test_a_client_resumes_a_stream_after_the_tokens_it_had(had):
    """GenerateRequest.resume_token_ids (a client whose router died): the request goes
    on as the router's own retry does, and the stream carries only what follows."""
    async def main():
        d = FakeDecode()
        r = make_router([FakePrefill([d])], [d])
        whole = uninterrupted(PROMPT, MAX_TOKENS)
        msgs = [m async for m in r.generate(_resuming(whole[:had]), 10.0)]
        assert tokens(msgs) == whole[had:]
        assert msgs[-1].finish_reason == "length"
        assert msgs[-1].usage.completion_tokens == MAX_TOKENS
        (ids, params), = d.reserved.values()
        assert ids == PROMPT + whole[:had]
        assert params.max_tokens == MAX_TOKENS - had and params.step_offset == had
        return r

    r = asyncio.run(main())
    assert r.admission.queued_requests == 0


def _resuming(had: list[int], **kw):
    req = make_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0, **kw)
    req.resume_token_ids.extend(had)
    return req


@pytest.mark.parametrize("had, kw, message", [
    ([5] * MAX_TOKENS, {}, "at most max_tokens - 1"),
    ([5, 64], {}, "token id 64 is out of range"),
    ([5], {"n": 2}, "n = 1"),
    ([5, EOS], {}, "already ended at them (stop)"),
])
def test_a_resume_that_cannot_go_on_is_refused(had, kw, message):
    async def main():
        d = FakeDecode()
        r = make_router([FakePrefill([d])], [d])
        with pytest.raises(InvalidRequestError, match="resume_token_ids") as e:
            [m async for m in r.generate(_resuming(had, **kw), 10.0)]
        assert message in str(e.value)
        assert not d.reserved and r.admission.queued_requests == 0

    asyncio.run(main())
