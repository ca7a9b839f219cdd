"""Who may pair with a KV port: only a peer proving the cluster's shared secret
(kv_transfer/auth.py), over TCP and NIXL; and the TCP receiver binds only the host given."""

import logging
import socket

import pytest

from pdserve.kv_transfer import (
    KVAuthError,
    KVLayout,
    TransferState,
    auth,
    control,
    frames,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.frames import FrameType
from kvtest import (  # noqa: E402  (shared with the other transport's tests)
    DST_IDS, EPOCH, MODEL, PER_LAYER, TIMEOUT_S, TRANSPORTS, Completions, TransportEnv,
    assert_copied, make_cache, send_request,
)
from tcp_client import handshake_bytes, read_frame, wait_closed  # noqa: E402

SECRET = "4f2a" * 16


@pytest.fixture
def env(request):
    """Receivers and senders of the transport named by the test's param, each with the
    secret it is given (senders checksum where the transport can)."""
    class Env(TransportEnv):
        def receiver(self, kv, secret):
            return super().receiver(kv, secret=secret)

        def sender(self, kv, secret):
            return super().sender(kv, secret=secret, checksum=True)

    e = Env(request.param)
    yield e
    e.close()


@pytest.mark.parametrize("env", TRANSPORTS, indirect=True)
def test_right_secret_pairs(env):
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst, SECRET)
    tx = env.sender(src, SECRET)
    assert tx.connect(addr) == EPOCH
    rx.expect("r", DST_IDS)
    send_request(tx, addr, "r", PER_LAYER)
    assert done.wait("r").ok
    assert_copied(src, dst, before)


@pytest.mark.parametrize("env", TRANSPORTS, indirect=True)
@pytest.mark.parametrize("rx_secret, tx_secret", [
    pytest.param(SECRET, "not-" + SECRET, id="wrong"),
    pytest.param(SECRET, None, id="sender-has-none"),
    pytest.param(None, SECRET, id="receiver-has-none"),
])
def test_secret_mismatch_is_refused(env, rx_secret, tx_secret, caplog):
    """The sender's connect raises KVAuthError naming the address; the receiver logs the
    refusal, touches no reservation, and keeps serving peers that hold the secret."""
    caplog.set_level(logging.WARNING, logger="pdserve.kv_transfer")
    src, dst = make_cache(8, seed=1), make_cache(10, seed=2)
    before = dst.clone()
    rx, addr, done = env.receiver(dst, rx_secret)
    rx.expect("r", DST_IDS)
    tx = env.sender(src, tx_secret)
    msg = f"KV handshake refused by {addr[0]}:{addr[1]}: cluster secret mismatch"
    with pytest.raises(KVAuthError, match=msg):
        tx.connect(addr)
    with pytest.raises(KVAuthError, match=msg):  # every call: no frame goes out unpaired
        tx.send_layers(addr, "r", EPOCH, 0, 1, [0, 1, 2])
    assert rx.state("r") == TransferState.WAITING and done.ids() == []
    assert any("refused" in r.getMessage() for r in caplog.records)
    send_request(env.sender(src, rx_secret), addr, "r", PER_LAYER)
    assert done.wait("r").ok
    assert_copied(src, dst, before)


def test_tcp_refusal_tells_nothing_and_closes(monkeypatch):
    """On the wire: the secret itself is never sent (only HMAC proofs); a peer with a wrong
    proof gets the refusal and nothing about D (no layout, epoch 0), then EOF, and a KV
    frame it sends anyway is never read."""
    sent = []
    real = socket.socket.sendall
    monkeypatch.setattr(socket.socket, "sendall",
                        lambda self, data, *a: sent.append(bytes(data)) or real(self, data, *a))
    dst = make_cache(10)
    layout = KVLayout.for_cache(dst, MODEL)
    done = Completions()
    rx = make_receiver("tcp", dst, layout, EPOCH, notify=done, secret=SECRET)
    done.attach(rx)
    tx = make_sender("tcp", make_cache(8), layout, secret=SECRET)
    try:
        addr = rx.start()
        tx.connect(addr)  # a good pairing, both ways recorded
        rx.expect("r", DST_IDS)
        with socket.create_connection(addr, timeout=TIMEOUT_S) as s:
            h, nonce_d = read_frame(s)
            assert h.frame_type == FrameType.CHALLENGE and len(nonce_d) == frames.NONCE_BYTES
            s.sendall(handshake_bytes(layout, nonce_d, secret="guess"))
            h, body = read_frame(s)
            ack = control.decode_handshake(body, ack=True)
            assert (h.epoch, ack.layout, ack.error) == (0, None, frames.AUTH_REFUSED)
            try:
                s.sendall(frames.done_header("r", EPOCH, 1, 4))
            except OSError:
                pass  # already closed: also fine
            assert wait_closed(s)
        assert rx.state("r") == TransferState.WAITING and done.ids() == []
    finally:
        tx.close()
        rx.close()
    wire = b"".join(sent)
    assert b"PDKV" in wire
    assert SECRET.encode() not in wire and SECRET.encode().hex().encode() not in wire


def test_proofs_are_bound_to_nonces_and_roles():
    key = auth.secret_bytes(SECRET)
    nd, np_ = auth.new_nonce(), auth.new_nonce()
    p = auth.proof(key, auth.PREFILL, nd, np_)
    assert auth.verify(key, auth.PREFILL, nd, np_, p)
    assert not auth.verify(key, auth.PREFILL, auth.new_nonce(), np_, p)  # replayed elsewhere
    assert not auth.verify(key, auth.DECODE, nd, np_, p)  # reflected as D's proof
    assert not auth.verify(key, auth.PREFILL, nd, np_, None)
    assert not auth.verify(None, auth.PREFILL, nd, np_, p)
    assert auth.verify(None, auth.PREFILL, nd, np_, None)  # no secret on either side
    with pytest.raises(ValueError, match="non-empty"):
        auth.secret_bytes("")


def test_tcp_receiver_binds_only_the_host_given():
    """The KV port listens on the worker's cluster address, never a wildcard: here
    127.0.0.2, so 127.0.0.1 on the same port finds nothing."""
    dst = make_cache(10)
    rx = make_receiver("tcp", dst, KVLayout.for_cache(dst, MODEL), EPOCH, host="127.0.0.2")
    try:
        host, port = rx.start()
        assert (host, port) == ("127.0.0.2", port)
        assert rx._control._listen.getsockname() == ("127.0.0.2", port)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S).close()
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as s:
            assert read_frame(s)[0].frame_type == FrameType.CHALLENGE
    finally:
        rx.close()


@pytest.mark.parametrize("env", TRANSPORTS, indirect=True)
def test_a_failed_pairing_is_logged_once_per_peer(env, caplog):
    """A sender retries pairing on every call; its warning comes once per decode worker
    (later failures at debug), and each error it raises says it was a pairing."""
    caplog.set_level(logging.DEBUG, logger="pdserve.kv_transfer")
    src = make_cache(8, seed=1)
    peers = [env.receiver(make_cache(10, seed=2), SECRET)[1] for _ in range(2)]
    tx = env.sender(src, "not-" + SECRET)
    for addr in peers:
        for _ in range(3):
            with pytest.raises(KVAuthError) as e:
                tx.connect(addr)
            assert e.value.pairing
        with pytest.raises(KVAuthError):
            tx.send_layers(addr, "r", EPOCH, 0, 1, [0, 1, 2])
    mine = [r for r in caplog.records if "pairing with decode worker" in r.getMessage()]
    warned = [r.getMessage() for r in mine if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all(f"{a[0]}:{a[1]}" in w for a, w in zip(peers, warned)), warned
    assert sum(r.levelno == logging.DEBUG for r in mine) == 6, [r.getMessage() for r in mine]
