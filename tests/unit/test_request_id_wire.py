"""The router refuses an over-long request_id from the serialized request's length
prefix, before parsing it (router/validation.py request_id_on_wire), and leaves every
other request, valid or malformed, to the parser."""

import pytest

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router import validation
from pdserve.router.service import parse_request


def request(rid: str, n_tokens: int = 300) -> bytes:
    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=list(range(n_tokens))))
    req.sampling.max_tokens = 7
    req.sampling.temperature = 0.5          # a fixed32 field on the way
    return req.SerializeToString()


def test_an_over_long_id_is_refused_from_its_length_prefix():
    rid = "x" * (validation.MAX_REQUEST_ID_BYTES + 1)
    with pytest.raises(InvalidRequestError, match="request_id: at most 128 bytes UTF-8, got 129"):
        validation.request_id_on_wire(request(rid))
    # wherever the field sits among the others (fields may come in any order)
    tail = pb.GenerateRequest(request_id=rid).SerializeToString()
    with pytest.raises(InvalidRequestError, match="request_id"):
        parse_request(request("") + tail)
    # the check reads the prefix: a body cut short is refused as well, unparsed
    with pytest.raises(InvalidRequestError, match="got 8388608"):
        validation.request_id_on_wire(b"\x0a\x80\x80\x80\x04" + b"x" * 100)


def test_other_requests_reach_the_parser_unchanged():
    ok = request("a" * validation.MAX_REQUEST_ID_BYTES)
    assert parse_request(ok).request_id == "a" * validation.MAX_REQUEST_ID_BYTES
    assert parse_request(request("")).sampling.max_tokens == 7
    for bad in (b"\x0a", b"\x0a\xff", b"\xff\xff\xff", b"\x0b", ok[:-3]):
        validation.request_id_on_wire(bad)      # not its to judge
        with pytest.raises(InvalidRequestError, match="^request: not a valid GenerateRequest"):
            parse_request(bad)
