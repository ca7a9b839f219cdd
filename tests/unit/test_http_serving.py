"""router/http_api.py with test_http_api.py's fake router, continued: the API key,
request size and health checks, client disconnects (raw ASGI calls: the generator is
closed the moment the client goes), and the app served by uvicorn over mutual TLS.
Every test ends with the fake's generators all closed.
"""

from __future__ import annotations

import asyncio
import json
import ssl

import httpx2
import openai
import pytest
import trustme

from pdserve.config import RouterConfig
from pdserve.router.http_api import build_app
from pdserve.router.http_server import serve_http
from test_http_api import (KEY, MODEL, FakeRouter, assert_openai_error, client,  # noqa: E402
                           oai_client, script)


# --- security, health ---------------------------------------------------------------

def test_api_key_required_except_health():
    r = FakeRouter(api_key=KEY)
    c = client(r)
    for path, method in (("/v1/models", "get"), ("/v1/completions", "post")):
        resp = getattr(c, method)(path, headers={"Authorization": "Bearer wrong"})
        err = assert_openai_error(resp, 401, None)
        assert err["code"] == "invalid_api_key"
        assert resp.headers["www-authenticate"] == "Bearer"
    assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401  # no header
    assert c.get("/health").status_code == 200
    assert c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        oai_client(r, api_key="wrong").models.list()
    assert oai_client(r, api_key=KEY).completions.create(model=MODEL, prompt="x") \
        .choices[0].text == "Hello"
    assert len(r.requests) == 1 and r.all_closed()


def test_body_over_max_request_bytes_is_413():
    r = FakeRouter(max_request_bytes=1024)
    resp = client(r).post("/v1/completions", json={"prompt": "x" * 2000})
    assert_openai_error(resp, 413, None)
    assert not r.requests


def test_health_503_without_a_worker_of_each_role():
    r = FakeRouter()
    c = client(r)
    assert c.get("/health").json() == {"status": "ok"}
    r.decode[0].available = False
    err = assert_openai_error(c.get("/health"), 503, None, "server_error")
    assert "decode" in err["message"]


# --- disconnects --------------------------------------------------------------------

async def asgi_call(app, path: str, body: dict, disconnect: asyncio.Event,
                    router: FakeRouter | None = None) -> list[dict]:
    """One POST through the ASGI app as uvicorn's h11 protocol makes it (spec 2.3); the
    client disconnects when `disconnect` is set. Returns what the app sent. With
    `router`, asserts its generators are closed the moment the app returns (not later,
    by garbage collection: asyncio's finalizer hook would close them too)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent, first = [], True

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": json.dumps(body).encode(),
                    "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    async def call():
        await app(scope, receive, send)
        assert router is None or router.all_closed(), "closed only by garbage collection"

    await asyncio.wait_for(call(), 5)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_waiting_for_the_first_token_closes_the_generator(stream):
    r = FakeRouter(hang_after=0)

    async def main():
        gone = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, gone.set)
        await asgi_call(build_app(r), "/v1/completions", {"prompt": "x", "stream": stream},
                        gone, router=r)

    asyncio.run(main())
    assert r.hanging.is_set() and r.all_closed()
    assert r.statuses() == {"cancelled": 1.0}


def test_disconnect_mid_stream_closes_the_generator():
    r = FakeRouter(messages=script("a", "b", "c"), hang_after=2)

    async def main():
        gone = asyncio.Event()

        async def leave_after_two_events():
            while not r.hanging.is_set():
                await asyncio.sleep(0.01)
            gone.set()

        watcher = asyncio.ensure_future(leave_after_two_events())
        sent = await asgi_call(build_app(r), "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "x"}],
                                "stream": True}, gone, router=r)
        await watcher
        return sent

    sent = asyncio.run(main())
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert b'"content":"b"' in body and b"[DONE]" not in body
    assert r.all_closed() and r.statuses() == {"cancelled": 1.0}


# --- served by uvicorn --------------------------------------------------------------

def test_serve_http_over_mutual_tls(tmp_path):
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("client@pdserve.test")
    files = {}
    for name, blob in (("ca.pem", ca.cert_pem), ("server.pem", server_cert.cert_chain_pems[0]),
                       ("server.key", server_cert.private_key_pem),
                       ("client.pem", client_cert.cert_chain_pems[0]),
                       ("client.key", client_cert.private_key_pem)):
        files[name] = str(tmp_path / name)
        blob.write_to_path(files[name])
    r = FakeRouter(api_key=KEY, tls_cert_file=files["server.pem"],
                   tls_key_file=files["server.key"], tls_client_ca_file=files["ca.pem"])

    async def main():
        server = await serve_http(r, "127.0.0.1", 0)
        url = f"https://127.0.0.1:{server.port}"
        try:
            ctx = ssl.create_default_context(cafile=files["ca.pem"])
            ctx.load_cert_chain(files["client.pem"], files["client.key"])
            async with httpx2.AsyncClient(verify=ctx) as c:
                assert (await c.get(url + "/health")).json() == {"status": "ok"}
                resp = await c.post(url + "/v1/completions", json={"prompt": "x"},
                                    headers={"Authorization": f"Bearer {KEY}"})
                assert resp.json()["choices"][0]["text"] == "Hello"
            no_cert = ssl.create_default_context(cafile=files["ca.pem"])
            async with httpx2.AsyncClient(verify=no_cert) as c:
                with pytest.raises(httpx2.TransportError):   # handshake refused
                    await c.get(url + "/health")
        finally:
            await server.stop(grace_s=1)

    asyncio.run(main())
    assert r.all_closed()


def test_connections_past_max_concurrent_calls_get_503():
    """Two connections are held open (one hangs in a completion); the third is
    answered 503 at once; once the hanging one is gone, requests are served again."""
    r = FakeRouter(hang_after=0, max_concurrent_calls=2)

    async def main():
        server = await serve_http(r, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.port}"
        try:
            async with httpx2.AsyncClient() as held, httpx2.AsyncClient() as idle:
                hung = asyncio.ensure_future(held.post(url + "/v1/completions",
                                                       json={"prompt": "x"}))
                while not r.hanging.is_set():
                    await asyncio.sleep(0.01)
                assert (await idle.get(url + "/health")).status_code == 200  # 2nd: kept
                async with httpx2.AsyncClient() as third:
                    assert (await third.get(url + "/health")).status_code == 503
                hung.cancel()
                await asyncio.gather(hung, return_exceptions=True)
            r.messages, r.hang_after = script("a"), None
            async with httpx2.AsyncClient() as c:
                for _ in range(50):          # the server sees the closes
                    if (await c.get(url + "/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                resp = await c.post(url + "/v1/completions", json={"prompt": "x"})
                assert resp.json()["choices"][0]["text"] == "a"
        finally:
            await server.stop(grace_s=1)

    asyncio.run(main())
    assert r.all_closed()


def test_a_response_its_client_does_not_read_is_aborted_after_the_write_timeout(monkeypatch):
    """A ~500 KB JSON body to a client that sent its request and reads nothing: the
    server's writes wait, and after stream_stall_timeout_s + the margin the connection
    is aborted; the client, reading at last, gets at most part of the body, then the
    end (EOF, or the abort's reset)."""
    import socket
    import time

    from pdserve.router import http_server

    monkeypatch.setattr(http_server, "WRITE_TIMEOUT_MARGIN_S", 0.5)
    r = FakeRouter(messages=script(*["x" * 1000] * 500), stream_stall_timeout_s=0.5)

    async def main():
        server = await serve_http(r, "127.0.0.1", 0)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            await asyncio.to_thread(sock.connect, ("127.0.0.1", server.port))
            body = json.dumps({"prompt": "x"}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await asyncio.sleep(2.5)              # > 1 s: the write timeout
            got, t0 = b"", time.monotonic()
            while time.monotonic() - t0 < 10:
                try:
                    chunk = await asyncio.to_thread(sock.recv, 1 << 16)
                except ConnectionResetError:      # the abort's RST
                    break
                if not chunk:
                    break
                got += chunk
            else:
                raise AssertionError("the connection was not aborted")
            return got
        finally:
            sock.close()
            await server.stop(grace_s=1)

    got = asyncio.run(main())
    assert len(got) < 400_000, len(got)
    assert r.all_closed()


def test_router_config_http_port():
    assert RouterConfig().http_port is None                      # off by default
    assert RouterConfig(http_port=0, port=0).http_port == 0      # a free port
    with pytest.raises(ValueError, match="http_port=70000: must be in"):
        RouterConfig(http_port=70000)
    with pytest.raises(ValueError, match="http_port=50051 is also port"):
        RouterConfig(http_port=50051)
