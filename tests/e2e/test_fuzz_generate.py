"""Hostile-input fuzz of Generate through the real server (gRPC → router → prefill →
TCP → decode) on the tiny random llama: 2,000 Hypothesis-generated requests
(tests/hostile_requests.py), then undecodable request bytes sent raw.

Every call must end either in a finished stream (finish_reason and usage on the last
message) or in a deliberate status with a message: INVALID_ARGUMENT naming the field
(the same error the router's validation gives locally), or RESOURCE_EXHAUSTED for a
request over gRPC's 8 MiB limit. Never UNKNOWN or INTERNAL, never past a 10 s deadline.
Afterwards the cluster still serves, no worker died or restarted, and every KV pool is
free (Served.stop).

Valid requests generate 1..4 tokens mostly, so the 2,000 calls take ~40 s on 2 cores (and
the whole file ~60 s): a call costs ~2 ms when refused, ~20 ms plus ~10 ms a token when
served, and 256 default tokens ~2 s, hence the default is drawn rarely.
"""

from __future__ import annotations

import collections

import grpc
import pytest
from hostile_requests import FIELDS, GRPC_MAX_BYTES, describe, generate_requests
from hypothesis import HealthCheck, Phase, given, settings
from serving import Served, start_ray
from tiny_models import tiny_model_dir

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc
from pdserve.router import validation

pytestmark = pytest.mark.slow

NUM_CASES = 2000
CALL_TIMEOUT_S = 10.0
GENERATE = "/" + pb.DESCRIPTOR.services_by_name["Generator"].full_name + "/Generate"


@pytest.fixture(scope="module")
def model():
    """(model dir, tokenizer, ModelConfig) as the router builds them."""
    from transformers import AutoConfig, AutoTokenizer

    from pdserve.engine.config import ModelConfig

    d = tiny_model_dir("llama")
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(d))
    return str(d), AutoTokenizer.from_pretrained(d), cfg


@pytest.fixture(scope="module")
def served(model):
    start_ray()
    s = Served(model[0])
    yield s
    s.stop()           # every KV pool free and the router's queue empty


def _expected_error(req, tokenizer, cfg) -> str | None:
    """The INVALID_ARGUMENT message the router's validation gives `req`, or None."""
    try:
        validation.request_id_on_wire(req.SerializeToString())   # before the parse
        validation.request_id(req)
        ids = validation.prompt_token_ids(req, tokenizer, cfg.vocab_size, cfg.max_model_len)
        validation.sampling_params(req, len(ids), cfg.max_model_len, cfg.vocab_size,
                                   check_grammar=True)
    except InvalidRequestError as e:
        return str(e)
    return None


def _call(stub, req: pb.GenerateRequest, expected_error: str | None) -> str:
    """Send `req`; check how the call ended; return the outcome's name."""
    try:
        msgs = list(stub.Generate(req, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
        assert details, (code, describe(req))
        if req.ByteSize() > GRPC_MAX_BYTES:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details, describe(req))
            return code.name
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, describe(req))
        field = details.split(": ", 1)[0]
        assert field in FIELDS, (details, describe(req))
        assert details == expected_error, (details, expected_error, describe(req))
        return f"{code.name} {field}"
    assert expected_error is None, (expected_error, describe(req))
    assert msgs, describe(req)
    samples: dict[int, list] = {}           # sampling.n: each sample's own stream
    for m in msgs:
        samples.setdefault(m.index, []).append(m)
    n = req.sampling.n if req.sampling.HasField("n") else 1
    assert sorted(samples) == list(range(n)), (sorted(samples), describe(req))
    for one in samples.values():
        *body, last = one
        assert last.finish_reason in ("stop", "length"), (last, describe(req))
        assert not any(m.finish_reason for m in body), describe(req)
        assert last.HasField("usage") and last.usage.prompt_tokens > 0, (last, describe(req))
        generated = sum(len(m.token_ids) for m in one)
        assert last.usage.completion_tokens == generated, (last.usage, generated,
                                                           describe(req))
        if req.sampling.HasField("max_tokens"):
            assert 1 <= generated <= req.sampling.max_tokens, (generated, describe(req))
    assert all(m.request_id == (req.request_id or msgs[0].request_id) and m.request_id
               for m in msgs), describe(req)
    return f"finished {msgs[-1].finish_reason}"


def _worker_pids(served) -> dict[str, int]:
    st = served.client.status()
    dead = [f"{w.worker_id}: {w.state}" for w in st.workers if w.state.startswith("dead")]
    assert not dead, dead
    return {w.worker_id: w.pid for w in st.workers}


def test_generate_survives_hostile_requests(served, model):
    _, tokenizer, cfg = model
    stub = pb_grpc.GeneratorStub(served.client.channel)
    pids = _worker_pids(served)
    outcomes: collections.Counter[str] = collections.Counter()

    @settings(max_examples=NUM_CASES, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(drawn=generate_requests(cfg.vocab_size, cfg.max_model_len))
    def fuzz(drawn):
        req = drawn.msg
        over_grpc = req.ByteSize() > GRPC_MAX_BYTES     # refused before validation
        outcomes[_call(stub, req, None if over_grpc else _expected_error(req, tokenizer, cfg))] += 1

    fuzz()
    print("\n".join(f"{n:5d} {k}" for k, n in outcomes.most_common()))
    assert sum(outcomes.values()) >= NUM_CASES, outcomes
    # The mix covers both common ways a call ends (requests over 8 MiB are rare: see
    # test_request_over_the_size_limit_is_resource_exhausted).
    assert sum(n for k, n in outcomes.items() if k.startswith("finished")) >= NUM_CASES // 5
    assert sum(n for k, n in outcomes.items() if k.startswith("INVALID_ARGUMENT")) >= NUM_CASES // 5

    # Still serving, and no worker died or was restarted.
    ids, _, reason = served.generate([1, 500, 77], max_tokens=5, temperature=0, ignore_eos=True)
    assert len(ids) == 5 and reason == "length"
    assert _worker_pids(served) == pids


def test_request_over_the_size_limit_is_resource_exhausted(served):
    with pytest.raises(grpc.RpcError) as ei:
        served.generate("a" * (GRPC_MAX_BYTES + 1), max_tokens=1)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value.code()
    assert ei.value.details(), ei.value.code()


# --- undecodable request bytes -------------------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited (wire type 2) protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


BAD_UTF8 = b"\xff\xfe"
SURROGATE = b"\xed\xa0\x80"        # U+D800 encoded: not valid UTF-8
TEXT_OK = _field(2, b"hello")
UNDECODABLE = {
    "text": _field(2, BAD_UTF8),
    "request_id": _field(1, BAD_UTF8) + TEXT_OK,
    "message content": _field(4, _field(1, _field(1, b"user") + _field(2, b"hi " + SURROGATE))),
    "message role": _field(4, _field(1, _field(1, BAD_UTF8) + _field(2, b"hi"))),
    "stop string": TEXT_OK + _field(5, _field(6, b"ok\xc3")),   # truncated 2-byte sequence
    "corrupt wire format": b"\xff\xff\xff\xff",
    "truncated field": b"\x12\x05ab",
}


@pytest.fixture(scope="module")
def raw_generate(served):
    """Generate taking the request as already-serialized bytes."""
    channel = grpc.insecure_channel(served.address)
    yield channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
    channel.close()


def test_raw_bytes_path_serves_a_valid_request(raw_generate):
    req = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=2, temperature=0))
    msgs = list(raw_generate(req.SerializeToString(), timeout=CALL_TIMEOUT_S))
    assert msgs[-1].finish_reason in ("stop", "length")


@pytest.mark.parametrize("case", list(UNDECODABLE))
def test_undecodable_request_is_invalid_argument(raw_generate, case):
    with pytest.raises(grpc.RpcError) as ei:
        list(raw_generate(UNDECODABLE[case], timeout=CALL_TIMEOUT_S))
    code, details = ei.value.code(), ei.value.details()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details, case
