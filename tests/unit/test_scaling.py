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
        asyncio.run(Scaler(None, None, None).scale(*args))


def test_new_ids_never_reuse_a_retired_workers_name():
    s = Scaler(None, None, None)
    have = [Worker(None, "prefill-0", 8), Worker(None, "prefill-2", 8)]
    assert s._next_id("prefill", have, []) == "prefill-3"
    assert s._next_id("prefill", have[:1], []) == "prefill-4"     # prefill-3 retired since
    assert s._next_id("decode", [Worker(None, "decode-0", 8)], [("prefill", "prefill-5", None)]
                      ) == "decode-1"
    # a worker the cluster started, retired before the router issued an id of its role
    s._issued("decode", ["decode-7"])          # what _retire notes
    assert s._next_id("decode", [Worker(None, "decode-0", 8)], []) == "decode-8"


def test_a_name_another_replica_took_meanwhile_is_skipped():
    """Two router replicas scaling at once issue the same `decode-N`; Ray refuses the
    second actor of that name, and this replica starts its worker under the next."""
    import ray.exceptions

    s = Scaler(None, None, None)
    taken = {"decode-1", "decode-2"}
    started = []

    def start_worker(config, role, worker_id):
        if worker_id in taken:
            raise ray.exceptions.ActorAlreadyExistsError(f"The name {worker_id} is already "
                                                         "taken")
        started.append(worker_id)
        return f"handle of {worker_id}", None

    have = [Worker(None, "decode-0", 8)]
    assert s._start_named(start_worker, "decode", have, []) == (
        "decode-3", "handle of decode-3", None)
    assert started == ["decode-3"]
    taken = {f"decode-{n}" for n in range(4, 4 + Scaler.NAME_TRIES)}
    with pytest.raises(ray.exceptions.ActorAlreadyExistsError):
        s._start_named(start_worker, "decode", have, [])
