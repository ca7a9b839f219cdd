"""router/scaling.py without a cluster: a bad Admin.Scale request is refused naming
the field, before anything starts; new workers get ids past every one the router had."""

import asyncio

import pytest

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.router.scaling import MAX_WORKERS, Scaler
from pdserve.router.workers import Worker


@pytest.mark.parametrize("args, field", [
    ((0, 1, 10), "num_prefill_workers"), ((1, MAX_WORKERS + 1, 10), "num_decode_workers"),
    ((1, 1, -1), "timeout_s"), ((1, 1, 3601), "timeout_s")])
def test_a_bad_request_is_refused_naming_the_field(args, field):
    with pytest.raises(InvalidRequestError, match=field):
        asyncio.run(Scaler(router=None).scale(*args))


def test_new_ids_never_reuse_a_retired_workers_name():
    s = Scaler(router=None)
    have = [Worker(None, "prefill-0", 8), Worker(None, "prefill-2", 8)]
    assert s._next_id("prefill", have, []) == "prefill-3"
    assert s._next_id("prefill", have[:1], []) == "prefill-4"     # prefill-3 retired since
    assert s._next_id("decode", [Worker(None, "decode-0", 8)], [("prefill", "prefill-5", None)]
                      ) == "decode-1"
    # a worker the cluster started, retired before the router issued an id of its role
    s._issued("decode", ["decode-7"])          # what _retire notes
    assert s._next_id("decode", [Worker(None, "decode-0", 8)], []) == "decode-8"
