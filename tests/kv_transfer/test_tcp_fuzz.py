"""Raw bytes at a live KV port (hypothesis), of each transport's receiver (both pair
over the same TCP control port): random bytes, cut-off handshakes, a handshake with a
wrong secret, a good handshake (as a TCP peer, or with NIXL pairing fields naming
made-up agents) followed by garbage or forged frames (huge length fields, BEGINs for
requests nobody expects included). After every example the receiver's accept thread is
alive, its one standing reservation is untouched, no other reservation or writer's
lease was left behind, staging never grew past a reservation's bytes, and a valid
transfer on the sender's connection still lands exact bytes."""

import itertools
import socket

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from pdserve.kv_transfer import (  # noqa: E402
    KVLayout, TransferState, control, frames, make_receiver, make_sender,
)
from pdserve.kv_transfer.frames import FrameType  # noqa: E402
from kvtest import (  # noqa: E402
    EPOCH, MODEL, NUM_LAYERS, PER_LAYER, TIMEOUT_S, TRANSPORTS, Completions, make_cache,
    send_request,
)
from tcp_client import handshake_bytes, read_frame, wait_closed  # noqa: E402

SECRET = "fuzz-secret"
NUM_BLOCKS = 12
SENTINEL, SENTINEL_IDS = "sentinel", [10, 11]  # expected for the whole run, never sent
VALID_SRC, VALID_DST = [5, 1, 6], [7, 2, 9]  # each example's valid transfer
LAYOUT = KVLayout.for_cache(make_cache(1), MODEL)
DTYPE = frames.dtype_code(LAYOUT.dtype)
_valid_ids = itertools.count()


@pytest.fixture(scope="module", params=TRANSPORTS)
def port(request):
    """One receiver (with a secret) and one paired sender for every example; grow_buffer
    spied so the test can bound what staging ever asked for."""
    staged = []
    mp = pytest.MonkeyPatch()
    real_grow = frames.grow_buffer
    mp.setattr(frames, "grow_buffer", lambda b, n, pinned: staged.append(n) or real_grow(b, n, pinned))
    src, dst = make_cache(8, seed=1), make_cache(NUM_BLOCKS, seed=2)
    expected = dst.clone()
    expected[:, :, VALID_DST] = src[:, :, VALID_SRC]
    done = Completions()
    rx = make_receiver(request.param, dst, LAYOUT, EPOCH, notify=done, io_timeout_s=2.0,
                       secret=SECRET)
    done.attach(rx)
    tx = make_sender(request.param, src, LAYOUT, secret=SECRET, checksum=True,
                     io_timeout_s=2.0)
    addr = rx.start()
    rx.expect(SENTINEL, SENTINEL_IDS)
    tx.connect(addr)
    yield dict(rx=rx, tx=tx, addr=addr, done=done, dst=dst, expected=expected, staged=staged)
    tx.close()
    rx.close()
    mp.undo()


# ---- strategies ---------------------------------------------------------------------

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 16)
huge = st.sampled_from([2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1])
rids = st.one_of(st.sampled_from(["ghost", "x" * 256, "valid-x"]),
                 st.text(max_size=12)).filter(lambda r: r != SENTINEL)


@st.composite
def forged_header(draw):
    """A header with the right magic and version and every other field drawn, sizes and
    lengths often huge; followed by a request id and a few payload bytes."""
    rid = draw(rids).encode("utf-8")
    fields = dict(
        ftype=draw(st.one_of(st.sampled_from([int(t) for t in FrameType]), st.integers(0, 255))),
        flags=draw(st.sampled_from([0, frames.FLAG_CRC32C, 0xFF])),
        dcode=draw(st.one_of(st.just(DTYPE), st.integers(0, 255))),
        epoch=draw(st.one_of(st.sampled_from([EPOCH, EPOCH - 1, 0]), u64)),
        layer_start=draw(st.one_of(small, u32)), layer_end=draw(st.one_of(small, u32)),
        block_start=draw(st.one_of(small, u32)), num_blocks=draw(st.one_of(small, u32)),
        first_token=draw(st.integers(-(2**63), 2**63 - 1)),
        payload_len=draw(st.one_of(st.integers(0, 4096), huge, u64)),
        rid_len=draw(st.one_of(st.just(len(rid)), st.integers(0, 2**16 - 1))),
        head_start=draw(st.one_of(st.just(0), st.integers(0, 2**16 - 1))),
        num_heads=draw(st.one_of(st.just(0), small, st.integers(0, 2**16 - 1))),
    )
    fixed = frames.HEADER.pack(frames.MAGIC, frames.PROTOCOL_VERSION, *fields.values())
    return fixed + rid + draw(st.binary(max_size=64))


@st.composite
def plausible_frame(draw):
    """A well-formed frame for a request nobody expects (so it must be read and
    dropped), with a random payload."""
    rid = draw(rids) or "ghost"
    kind = draw(st.sampled_from(["kv", "kv-crc", "done", "abort", "begin"]))
    epoch = draw(st.sampled_from([EPOCH, EPOCH - 1]))
    if kind == "begin":
        return frames.pack_header(FrameType.BEGIN, rid, epoch=epoch)
    if kind == "done":
        return frames.done_header(rid, epoch, draw(st.integers(0, 2**31)), NUM_LAYERS)
    if kind == "abort":
        return b"".join(frames.abort_frame(rid, epoch, draw(st.text(max_size=40))))
    layer = draw(st.integers(0, NUM_LAYERS - 1))
    n, start = draw(st.integers(1, NUM_BLOCKS)), draw(st.integers(0, 3))
    crc = kind == "kv-crc"
    plen = LAYOUT.payload_bytes(1, n) + (frames.CRC_BYTES if crc else 0)
    header = frames.pack_header(
        FrameType.KV, rid, flags=frames.FLAG_CRC32C if crc else 0, epoch=epoch,
        layer_start=layer, layer_end=layer + 1, block_start=start, num_blocks=n,
        dtype_code=DTYPE, payload_len=plen)
    return header + draw(st.binary(min_size=min(plen, 32), max_size=32)) + bytes(max(0, plen - 32))


frames_after_handshake = st.lists(  # plausible frames twice as often: they go deeper
    st.one_of(forged_header(), plausible_frame(), plausible_frame(), st.binary(max_size=200)),
    max_size=4,
).map(b"".join)

attacks = st.one_of(
    st.tuples(st.just("raw"), st.binary(max_size=2048)),
    st.tuples(st.just("raw"), forged_header()),
    st.tuples(st.just("cut-handshake"), st.integers(0, 400)),
    st.tuples(st.just("wrong-secret"), frames_after_handshake),
    st.tuples(st.just("no-secret"), frames_after_handshake),
    st.tuples(st.just("paired"), frames_after_handshake),
    st.tuples(st.just("paired"), frames_after_handshake),
    st.tuples(st.just("paired-nixl"), frames_after_handshake),
)


# ---- the test -----------------------------------------------------------------------


def attack(addr, mode, data):
    """Play one attack against the port, then hang up and wait until D has closed too."""
    with socket.create_connection(addr, timeout=TIMEOUT_S) as s:
        try:
            if mode == "raw":
                s.sendall(data)
            else:
                h, nonce_d = read_frame(s)
                assert h.frame_type == FrameType.CHALLENGE
                secret = {"wrong-secret": "guess", "no-secret": None}.get(mode, SECRET)
                nixl = {"agents": ["made-up-agent"]} if mode == "paired-nixl" else None
                hs = handshake_bytes(LAYOUT, nonce_d, secret, nixl=nixl)
                if mode == "cut-handshake":
                    s.sendall(hs[: data % len(hs)])
                else:
                    s.sendall(hs)
                    h, body = read_frame(s)
                    ack = control.decode_handshake(body, ack=True)
                    assert (ack.error is None) == mode.startswith("paired"), ack
                    s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # D hung up first: what the rest of the test checks is the same
        assert wait_closed(s), "receiver kept a garbage connection open"


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(attacks)
def test_garbage_at_the_kv_port(port, case):
    rx, tx, addr, done = port["rx"], port["tx"], port["addr"], port["done"]
    attack(addr, *case)
    accept = [t for t in rx._control._threads if t.name == f"kvrecv-accept-{addr[1]}"]
    assert accept and accept[0].is_alive()
    table = rx._table
    assert set(table._active) == {SENTINEL}  # nothing left behind, nothing of ours failed
    assert not any(getattr(rx, "_writers", {}).values())   # and no writer's lease
    assert rx.state(SENTINEL) == TransferState.WAITING
    assert not any(table._active[SENTINEL].arrived)
    assert max(port["staged"], default=0) <= LAYOUT.payload_bytes(1, len(VALID_DST))
    rid = f"valid-{next(_valid_ids)}"  # a valid transfer on the long-lived connection
    rx.expect(rid, VALID_DST)
    send_request(tx, addr, rid, PER_LAYER, src_ids=VALID_SRC)
    assert done.wait(rid).ok
    rx.forget(rid)
    u8 = lambda t: t.view(torch.uint8)
    assert torch.equal(u8(port["dst"]), u8(port["expected"]))  # every byte as it should be
    assert all(r.startswith("valid-") for r in done.ids())
