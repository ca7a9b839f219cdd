"""Security settings of the router's gRPC front with no cluster: RouterConfig's tls_*,
api_key and max_request_bytes, router/security.py's credentials and api-key check, the
real build_server over a stand-in router (TLS, key, size limit), and the CLI flags."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recording_cluster import recording  # noqa: F401  (fixture)

from pdserve import cli
from pdserve.client import Client, make_request
from pdserve.config import RouterConfig
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.heap import HeapTrim
from pdserve.router.security import (
    UNAUTHENTICATED_MESSAGE,
    ApiKeyInterceptor,
    SecurityConfigError,
    server_credentials,
)
from pdserve.router.service import build_server

KEY = "k3y-for-tests"


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    """ca.pem, server.pem and server.key (127.0.0.1) under one directory."""
    root = tmp_path_factory.mktemp("pem")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(root / "server.key"))
    for i, p in enumerate(cert.cert_chain_pems):
        p.write_to_path(str(root / "server.pem"), append=i > 0)
    return SimpleNamespace(ca=str(root / "ca.pem"), cert=str(root / "server.pem"),
                           key=str(root / "server.key"), root=root)


# --- RouterConfig ---------------------------------------------------------------------

def test_defaults_are_plaintext_without_key():
    rc = RouterConfig()
    assert (rc.tls_cert_file, rc.tls_key_file, rc.tls_client_ca_file, rc.api_key) == (None,) * 4
    assert rc.max_request_bytes == 8 << 20


@pytest.mark.parametrize("given, missing", [("tls_cert_file", "tls_key_file"),
                                            ("tls_key_file", "tls_cert_file")])
def test_cert_and_key_go_together(given, missing):
    with pytest.raises(ValueError, match=f"^{missing} is unset but {given} is set"):
        RouterConfig(**{given: "x.pem"})


def test_client_ca_needs_tls():
    with pytest.raises(ValueError, match="^tls_client_ca_file needs TLS"):
        RouterConfig(tls_client_ca_file="ca.pem")


@pytest.mark.parametrize("key", ["", "has space", "caf\u00e9", "tab\there"])
def test_bad_api_key_is_refused_without_echoing_it(key):
    with pytest.raises(ValueError, match="^api_key: must be non-empty printable ASCII") as e:
        RouterConfig(api_key=key)
    assert not key or key not in str(e.value)


def test_api_key_is_not_in_repr():
    assert KEY not in repr(RouterConfig(api_key=KEY))


def test_max_request_bytes_lower_bound():
    assert RouterConfig(max_request_bytes=1024).max_request_bytes == 1024
    with pytest.raises(ValueError, match="^max_request_bytes=1023: must be >= 1024"):
        RouterConfig(max_request_bytes=1023)


# --- credentials and the api-key check -------------------------------------------------

def test_server_credentials(pem):
    assert server_credentials(RouterConfig()) is None
    rc = RouterConfig(tls_cert_file=pem.cert, tls_key_file=pem.key, tls_client_ca_file=pem.ca)
    assert isinstance(server_credentials(rc), grpc.ServerCredentials)


def test_missing_or_non_pem_file_names_the_field(pem):
    missing = str(pem.root / "nope.pem")
    with pytest.raises(SecurityConfigError, match=f"^tls_key_file='{missing}': cannot read"):
        server_credentials(RouterConfig(tls_cert_file=pem.cert, tls_key_file=missing))
    junk = pem.root / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(SecurityConfigError, match="^tls_client_ca_file=.*: not a PEM file"):
        server_credentials(RouterConfig(tls_cert_file=pem.cert, tls_key_file=pem.key,
                                        tls_client_ca_file=str(junk)))


@pytest.mark.parametrize("metadata, ok", [
    ((("authorization", f"Bearer {KEY}"),), True),
    ((("x-other", "1"), ("authorization", f"bearer {KEY}")), True),
    ((("authorization", f"Bearer {KEY}x"),), False),
    ((("authorization", KEY),), False),
    ((("authorization", f"Basic {KEY}"),), False),
    ((), False),
    (None, False),
])
def test_authorized(metadata, ok):
    assert ApiKeyInterceptor(KEY).authorized(metadata) is ok


# --- build_server over a stand-in router ----------------------------------------------

class _Timer:
    def tokens(self, n, sample=0):
        pass

    def finish(self, status, prompt_tokens):
        pass


class FakeRouter:
    """What GeneratorService and AdminService use of router.Router: two tokens, a status."""

    def __init__(self, rc: RouterConfig):
        self.config = SimpleNamespace(router=rc, num_routers=1)
        self.metrics = SimpleNamespace(request=_Timer)
        self.heap_trim = HeapTrim(trim=lambda pad: 0)

    async def generate(self, req, deadline_s):
        yield pb.GenerateResponse(token_ids=[7], text="a")
        yield pb.GenerateResponse(token_ids=[8], text="b", finish_reason="length")

    async def cluster_status(self):
        return pb.ClusterStatusResponse(model="fake")


def _calls(rc: RouterConfig, body, router=None) -> None:
    """Serve `router` (a FakeRouter) with `rc` on a free loopback port in this thread's
    loop (the interceptor goes by rc.host), run the blocking `body(address)` in a worker
    thread, stop."""
    async def main():
        server, port = build_server((router or FakeRouter)(rc), "127.0.0.1:0")
        await server.start()
        try:
            await asyncio.to_thread(body, f"127.0.0.1:{port}")
        finally:
            await server.stop(0)
    asyncio.run(main())


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_server_with_tls_key_and_size_limit(pem):
    rc = RouterConfig(tls_cert_file=pem.cert, tls_key_file=pem.key, api_key=KEY,
                      max_request_bytes=4096)

    def body(addr):
        with Client(addr, tls_ca_file=pem.ca, api_key=KEY) as c:
            assert c.generate(make_request("hi"))[1:] == ("ab", "length")
            assert c.status().model == "fake"
            assert _code(lambda: c.generate(make_request("x" * 5000)))[0] == \
                grpc.StatusCode.RESOURCE_EXHAUSTED
        with Client(addr, tls_ca_file=pem.ca) as c:
            for call in (lambda: c.generate(make_request("hi")), c.status):
                assert _code(call) == (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
            health = health_pb2_grpc.HealthStub(c.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        with Client(addr, api_key=KEY) as c:
            assert _code(c.status)[0] == grpc.StatusCode.UNAVAILABLE

    _calls(rc, body)


class HangingRouter(FakeRouter):
    """A "hang" prompt's call stays open after its first token until `go` is set."""

    def __init__(self, rc: RouterConfig):
        super().__init__(rc)
        self.go = asyncio.Event()

    async def generate(self, req, deadline_s):
        if req.text == "hang":
            yield pb.GenerateResponse(token_ids=[7], text="a")
            await self.go.wait()
        async for msg in super().generate(req, deadline_s):
            yield msg


def test_calls_past_max_concurrent_calls_are_refused():
    router = HangingRouter(RouterConfig(max_concurrent_calls=1))

    async def main():
        server, port = build_server(router, "127.0.0.1:0")
        await server.start()
        loop = asyncio.get_running_loop()

        def body(addr):
            with Client(addr) as c:
                held = iter(c.stream(make_request("hang")))
                assert next(held).text == "a"                    # one call open
                assert _code(lambda: c.generate(make_request("hi")))[0] == \
                    grpc.StatusCode.RESOURCE_EXHAUSTED
                loop.call_soon_threadsafe(router.go.set)
                assert "".join(m.text for m in held) == "ab"
                assert c.generate(make_request("hi"))[1:] == ("ab", "length")

        try:
            await asyncio.to_thread(body, f"127.0.0.1:{port}")
        finally:
            await server.stop(0)
    asyncio.run(main())


def test_plaintext_server_still_takes_plain_clients():
    def body(addr):
        with Client(addr) as c:
            assert c.status().model == "fake"

    _calls(RouterConfig(), body)


def test_build_server_refuses_a_missing_cert_before_binding(pem):
    rc = RouterConfig(tls_cert_file=str(pem.root / "gone.pem"), tls_key_file=pem.key)

    async def main():
        build_server(FakeRouter(rc), "127.0.0.1:0")
    with pytest.raises(SecurityConfigError, match="^tls_cert_file=.*gone.pem'"):
        asyncio.run(main())


def test_client_cert_without_key_is_refused():
    with pytest.raises(ValueError, match="tls_client_cert_file and tls_client_key_file"):
        Client("127.0.0.1:1", tls_client_cert_file="c.pem")


# --- CLI -------------------------------------------------------------------------------


def test_serve_security_flags(recording):
    assert cli.main(["serve", "--tls-cert", "s.pem", "--tls-key", "s.key", "--tls-client-ca",
                     "ca.pem", "--api-key", KEY, "--max-request-bytes", "65536"]) == 1
    rc = recording[0].router
    assert (rc.tls_cert_file, rc.tls_key_file, rc.tls_client_ca_file, rc.api_key,
            rc.max_request_bytes) == ("s.pem", "s.key", "ca.pem", KEY, 65536)


def test_serve_api_key_from_env(recording, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    assert cli.main(["serve"]) == 1
    assert recording[0].router.api_key == KEY


def test_serve_refuses_cert_without_key(recording, capsys):
    assert cli.main(["serve", "--tls-cert", "s.pem"]) == 2
    assert "tls_key_file is unset but tls_cert_file is set" in capsys.readouterr().err
    assert recording == []


@pytest.mark.parametrize("cmd", [["status"], ["generate", "hi"]])
def test_client_commands_refuse_cert_without_key(cmd, capsys):
    assert cli.main([*cmd, "--server", "127.0.0.1:1", "--tls-cert", "c.pem"]) == 2
    assert "tls_client_key_file" in capsys.readouterr().err


def test_status_reports_an_unauthenticated_call(pem, monkeypatch, capsys):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    rc = RouterConfig(tls_cert_file=pem.cert, tls_key_file=pem.key, api_key=KEY)

    def body(addr):
        assert cli.main(["status", "--server", addr, "--tls-ca", pem.ca]) == 1
        monkeypatch.setenv("PDSERVE_API_KEY", KEY)
        assert cli.main(["status", "--server", addr, "--tls-ca", pem.ca]) == 0

    _calls(rc, body)
    out = capsys.readouterr()
    assert f"UNAUTHENTICATED: {UNAUTHENTICATED_MESSAGE}" in out.err and "model: fake" in out.out


def test_undecodable_request_bytes_get_invalid_argument():
    """Bytes that are not a GenerateRequest (invalid UTF-8 in `text`, a truncated field)
    get INVALID_ARGUMENT naming the request, not gRPC's INTERNAL; the server serves on."""
    def body(addr):
        with Client(addr) as c:
            raw = c.channel.unary_stream("/pdserve.v1.Generator/Generate",
                                         request_serializer=lambda b: b,
                                         response_deserializer=pb.GenerateResponse.FromString)
            text = pb.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number
            for data in (bytes([text << 3 | 2, 2, 0xFF, 0xFE]),    # invalid UTF-8
                         bytes([text << 3 | 2, 50, 0x61])):         # length past the end
                code, details = _code(lambda: list(raw(data, timeout=10)))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
                assert details.startswith("request: not a valid GenerateRequest"), details
            assert c.generate(make_request("hi"))[1:] == ("ab", "length")

    _calls(RouterConfig(), body)
