"""router/admission.py: the router's bound on queued requests and prompt tokens.

No model, no Ray. Every test ends with the queue empty again.
"""

import asyncio

import grpc
import pytest

from pdserve.router.admission import Admission
from pdserve.router.errors import RequestError


def refused(adm: Admission, num_tokens: int, *in_message: str) -> RequestError:
    """admit() raises RESOURCE_EXHAUSTED naming `in_message`, and changes no count."""
    before = (adm.queued_requests, adm.queued_tokens)
    with pytest.raises(RequestError) as ei:
        adm.admit(num_tokens)
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for s in in_message:
        assert s in str(ei.value), str(ei.value)
    assert (adm.queued_requests, adm.queued_tokens) == before
    return ei.value


def assert_empty(adm: Admission) -> None:
    assert (adm.queued_requests, adm.queued_tokens) == (0, 0)


def release_all(adm: Admission, *tickets) -> None:
    """Release the tickets still held; the queue must then be empty."""
    for t in tickets:
        t.release()
    assert_empty(adm)


def test_admit_counts_requests_and_prompt_tokens_until_released():
    adm = Admission(max_requests=4, max_tokens=100)
    a, b = adm.admit(10), adm.admit(25)
    assert (adm.queued_requests, adm.queued_tokens) == (2, 35)
    assert a.num_tokens == 10 and not a.released
    a.release()
    assert (adm.queued_requests, adm.queued_tokens) == (1, 25) and a.released
    release_all(adm, b)


def test_request_bound_refuses_the_next_and_names_max_queued_requests():
    adm = Admission(max_requests=2, max_tokens=1000)
    a, b = adm.admit(1), adm.admit(1)
    err = refused(adm, 1, "server overloaded", "2 requests already queued",
                  "max_queued_requests=2", "retry later")
    assert "max_queued_tokens" not in str(err)
    a.release()
    c = adm.admit(1)                    # room again once one is released
    release_all(adm, b, c)


def test_token_bound_counts_queued_plus_this_request():
    adm = Admission(max_requests=10, max_tokens=100)
    a = adm.admit(60)
    refused(adm, 41, "60 prompt tokens queued + 41 in this request > max_queued_tokens=100",
            "retry later")
    b = adm.admit(40)                   # exactly at the bound: admitted
    assert adm.queued_tokens == 100
    refused(adm, 1, "max_queued_tokens=100")
    release_all(adm, a, b)


def test_request_bound_is_checked_before_the_token_bound():
    adm = Admission(max_requests=1, max_tokens=10)
    a = adm.admit(10)
    refused(adm, 5, "max_queued_requests=1")
    release_all(adm, a)


def test_prompt_larger_than_token_bound_is_refused_even_when_idle():
    adm = Admission(max_requests=10, max_tokens=100)
    err = refused(adm, 101, "prompt of 101 tokens exceeds max_queued_tokens=100",
                  "shorten the prompt")
    assert "retry later" not in str(err)   # retrying can never help
    adm.admit(100).release()               # a prompt of exactly the bound fits an idle queue
    assert_empty(adm)


def test_release_is_idempotent():
    adm = Admission(max_requests=3, max_tokens=100)
    a, b = adm.admit(7), adm.admit(11)
    a.release()
    a.release()
    with a:                             # leaving the block releases again: still a no-op
        pass
    assert (adm.queued_requests, adm.queued_tokens) == (1, 11)
    release_all(adm, b)


def test_with_block_releases_on_exception_and_after_early_release():
    adm = Admission(max_requests=1, max_tokens=100)
    with pytest.raises(RuntimeError), adm.admit(5):
        assert adm.queued_requests == 1
        raise RuntimeError("prefill failed")
    assert_empty(adm)
    with adm.admit(5) as ticket:
        ticket.release()                # first token back: no longer queued
        assert_empty(adm)
        adm.admit(5).release()          # so another request fits within max_requests=1
    assert_empty(adm)


def test_with_block_releases_when_the_task_is_cancelled():
    """A client cancel or deadline cancels the task awaiting inside the block."""
    adm = Admission(max_requests=1, max_tokens=100)

    async def serve():
        with adm.admit(5):
            await asyncio.sleep(60)

    async def main():
        task = asyncio.create_task(serve())
        await asyncio.sleep(0)
        assert (adm.queued_requests, adm.queued_tokens) == (1, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert_empty(adm)
