"""The admin role of the router's gRPC front (router/security.py): Drain and Scale need
the admin key, the generate key is refused them, and with no admin key they are served
only on a loopback bind; Scale's bound on workers (router.max_workers); Drain of an
unknown node names nothing but it, and a hung worker is not counted idle. Over the real
build_server with a stand-in router, and the CLI."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest

from failover_fakes import FakeDecode, FakePrefill, make_router
from pdserve import cli
from pdserve.client import Client, make_request
from pdserve.config import ClusterConfig, RouterConfig
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router import admin
from pdserve.router.scaling import Scaler
from pdserve.router.security import UNAUTHENTICATED_MESSAGE, ApiKeyInterceptor, is_loopback
from test_security import KEY, FakeRouter, _calls, _code

ADMIN = "adm1n-key-for-tests"
SCALE, DRAIN = "/pdserve.v1.Admin/Scale", "/pdserve.v1.Admin/Drain"
GENERATE, STATUS = "/pdserve.v1.Generator/Generate", "/pdserve.v1.Admin/ClusterStatus"
HEALTH = "/grpc.health.v1.Health/Check"


def bearer(key):
    return (("authorization", f"Bearer {key}"),)


DENIED, UNAUTH = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("keys, admin_open, method, metadata, refused", [
    # an admin key configured: only it passes Drain and Scale
    ((KEY, ADMIN), False, SCALE, bearer(ADMIN), None),
    ((KEY, ADMIN), True, DRAIN, bearer(KEY), DENIED),        # loopback changes nothing
    ((KEY, ADMIN), False, SCALE, (), UNAUTH),
    ((KEY, ADMIN), False, GENERATE, bearer(ADMIN), None),     # admin may generate
    ((KEY, ADMIN), False, STATUS, bearer(KEY), None),
    ((KEY, ADMIN), False, STATUS, (), UNAUTH),
    ((KEY, ADMIN), False, HEALTH, (), None),
    ((None, ADMIN), False, GENERATE, (), None),               # no generate key needed
    ((None, ADMIN), False, SCALE, (), DENIED),
    ((None, ADMIN), False, DRAIN, bearer("wrong"), DENIED),
    # no admin key: Drain and Scale on a loopback bind only
    ((None, None), True, SCALE, (), None),
    ((None, None), False, SCALE, (), DENIED),
    ((None, None), False, STATUS, (), None),
    ((KEY, None), True, DRAIN, bearer(KEY), None),
    ((KEY, None), True, DRAIN, (), UNAUTH),
    ((KEY, None), False, DRAIN, bearer(KEY), DENIED),
])
def test_each_call_s_refusal(keys, admin_open, method, metadata, refused):
    got = ApiKeyInterceptor(*keys, admin_open=admin_open).refusal(method, metadata)
    assert (got and got[0]) == refused, got


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.53", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("auto", False), ("", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


class AdminRouter(FakeRouter):
    """FakeRouter that also drains and scales (what AdminService calls)."""

    async def drain(self, node_ip, timeout_s):
        return pb.DrainResponse(worker_ids=["decode-0"], drained=True)

    async def scale(self, num_prefill, num_decode, timeout_s):
        return pb.ScaleResponse(num_prefill_workers=num_prefill, num_decode_workers=num_decode)


def _serve(rc: RouterConfig, body) -> None:
    _calls(rc, body, AdminRouter)


def test_the_generate_key_is_refused_drain_and_scale_and_the_admin_key_passes():
    def body(addr):
        with Client(addr, api_key=KEY) as c:
            assert c.generate(make_request("hi"))[1:] == ("ab", "length")
            assert c.status().model == "fake"
            for call in (lambda: c.drain("10.0.0.1", 1.0), lambda: c.scale(2, 2, 1.0)):
                code, details = _code(call)
                assert code == DENIED and "--admin-api-key" in details, details
                assert KEY not in details and ADMIN not in details
        with Client(addr, api_key=KEY, admin_api_key=ADMIN) as c:
            assert c.scale(2, 3, 1.0).num_decode_workers == 3
            assert c.drain("10.0.0.1", 1.0).drained
            assert c.status().model == "fake"            # the generate key, as before
        with Client(addr) as c:
            assert _code(lambda: c.scale(2, 2, 1.0)) == (UNAUTH, UNAUTHENTICATED_MESSAGE)

    _serve(RouterConfig(api_key=KEY, admin_api_key=ADMIN), body)


def test_no_admin_key_serves_drain_and_scale_on_loopback_only():
    def open_body(addr):
        with Client(addr) as c:
            assert c.scale(1, 2, 1.0).num_decode_workers == 2

    def closed_body(addr):
        with Client(addr) as c:
            assert c.generate(make_request("hi"))[1:] == ("ab", "length")
            assert c.status().model == "fake"
            code, details = _code(lambda: c.scale(1, 2, 1.0))
            assert code == DENIED and "non-loopback" in details and "--admin-api-key" in details

    _serve(RouterConfig(), open_body)
    _serve(RouterConfig(host="0.0.0.0"), closed_body)     # what the interceptor is told


def test_the_cli_sends_the_admin_key(monkeypatch, capsys):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_ADMIN_API_KEY", raising=False)

    def body(addr):
        assert cli.main(["scale", "--server", addr, "--prefill", "1", "--decode", "2",
                         "--api-key", KEY]) == 1
        monkeypatch.setenv("PDSERVE_ADMIN_API_KEY", ADMIN)
        assert cli.main(["scale", "--server", addr, "--prefill", "1", "--decode", "2"]) == 0
        assert cli.main(["drain", "--server", addr, "--node-ip", "10.0.0.1",
                         "--admin-api-key", ADMIN]) == 0

    _serve(RouterConfig(api_key=KEY, admin_api_key=ADMIN), body)
    out = capsys.readouterr()
    assert "PERMISSION_DENIED" in out.err and "serving: 1 prefill, 2 decode" in out.out


def test_keys_and_the_worker_bound_are_checked():
    with pytest.raises(ValueError, match="admin_api_key equals api_key"):
        RouterConfig(api_key=KEY, admin_api_key=KEY)
    with pytest.raises(ValueError, match="admin_api_key: must be non-empty printable"):
        RouterConfig(admin_api_key="has space")
    with pytest.raises(ValueError, match="max_workers=1"):
        RouterConfig(max_workers=1)
    with pytest.raises(ValueError, match="exceed router.max_workers=16"):
        ClusterConfig.local(prefill_workers=9, decode_workers=8)


def test_scale_refuses_more_workers_than_max_workers():
    config = SimpleNamespace(router=RouterConfig(max_workers=6))
    with pytest.raises(InvalidRequestError, match=r"4 prefill \+ 3 decode workers exceed "
                                                  r"the cluster's max_workers=6"):
        asyncio.run(Scaler(config, None, None).scale(4, 3, 10))


def test_drain_of_an_unknown_node_names_no_other_and_a_hung_worker_is_busy(monkeypatch):
    monkeypatch.setattr(admin, "STATUS_TIMEOUT_S", 0.05)

    async def main():
        d = FakeDecode()
        r = make_router([FakePrefill([d])], [d])
        r.prefill[0].node_ip, r.decode[0].node_ip = "10.0.0.1", "10.0.0.2"
        with pytest.raises(InvalidRequestError) as e:
            await r.drain("10.9.9.9", timeout_s=1)
        assert str(e.value) == "node_ip: no worker runs on '10.9.9.9'"

        async def hung():
            await asyncio.sleep(10)
        r.decode[0].handle.status = SimpleNamespace(remote=hung)
        reply = await r.drain("10.0.0.2", timeout_s=0.2)
        assert not reply.drained and reply.running_requests == 1

    asyncio.run(main())


def test_a_replaced_config_keeps_the_admin_fields_out_of_repr():
    rc = replace(RouterConfig(), api_key=KEY, admin_api_key=ADMIN)
    assert KEY not in repr(rc) and ADMIN not in repr(rc)
