"""RawClient: a hand-driven prefill side for the UCX receiver's tests (junk, a bare
handshake, raw frames, a hang-up without EOS), on the process's shared UCX runtime."""

import asyncio

import numpy as np
import pytest

from pdserve.kv_transfer import auth, frames, ucx, ucx_wire
from pdserve.kv_transfer.frames import FrameType

from kvtest import EPOCH, TIMEOUT_S


class RawClient:
    """A hand-driven P on the shared runtime: junk or a handshake, then raw frames."""

    def __init__(self, addr):
        self.rt = ucx.acquire_runtime()
        self.addr, self.ctl, self.data, self.tag = addr, None, None, 0

    def run(self, coro):
        return self.rt.call(coro, TIMEOUT_S)

    async def connect(self):
        """Open the control endpoint and take D's challenge (self.nonce_d)."""
        self.ctl = await ucx.ucx.create_endpoint(*self.addr)
        h, self.nonce_d = await self.recv_ctl()
        assert h.frame_type == FrameType.CHALLENGE, h

    async def recv_ctl(self):
        """(header, payload) of D's next control-endpoint frame."""
        hbuf = np.zeros(ucx_wire.HEADER_MSG_BYTES, np.uint8)
        await self.ctl.recv(hbuf)
        h = frames.unpack_header(memoryview(hbuf))
        body = np.zeros(h.payload_len, np.uint8)
        await self.ctl.recv(body)
        return h, body.tobytes()

    async def send_ctl(self, payload: bytes):
        await self.ctl.send(np.frombuffer(payload, np.uint8))

    async def handshake(self, layout, secret=None):
        nonce_p = auth.new_nonce()
        proof = auth.proof(auth.secret_bytes(secret), auth.PREFILL, self.nonce_d, nonce_p)
        body = ucx_wire.handshake_payload(layout, 0, ack=False, nonce=nonce_p, auth=proof,
                                          worker_address=self.rt.worker_address)
        hs = frames.pack_header(FrameType.HANDSHAKE, payload_len=len(body))
        await self.send_ctl(bytes(ucx_wire.header_message(hs)))
        await self.send_ctl(body)
        _, ack = await self.recv_ctl()
        hs = ucx_wire.parse_handshake(ack, ack=True)
        assert hs.error is None, hs.error
        self.tag, self.slot_bytes = hs.data_tag, hs.slot_bytes
        self.data = await ucx.endpoint_to_worker(hs.worker_address)

    async def send_kv(self, layout, rid, layer, blocks):
        """One layer of `blocks` [L, 2, n, bs, H, D]: header, then K and V messages."""
        k, v = (ucx_wire.ucx_buffer(blocks[layer, half].contiguous()) for half in (0, 1))
        header = frames.pack_header(
            FrameType.KV, rid, epoch=EPOCH, layer_start=layer, layer_end=layer + 1,
            num_blocks=blocks.shape[2], dtype_code=frames.dtype_code(layout.dtype),
            payload_len=k.nbytes + v.nbytes,
        )
        hdr = np.frombuffer(ucx_wire.header_message(header), np.uint8)
        await ucx.tag_send(self.data, hdr, self.tag)  # payload pieces go under tag + 1
        for piece in (k, v):
            await ucx.tag_send(self.data, piece, self.tag + 1)

    async def wait_hung_up(self):
        """Until D closes the control endpoint (it never sends on it otherwise)."""
        with pytest.raises(ucx.UCX_ERRORS):
            await asyncio.wait_for(self.ctl.recv(np.zeros(1, np.uint8)), TIMEOUT_S)

    def close(self):
        async def abort():  # no EOS: looks like a P that died
            ucx.abort_endpoint(self.data)
            ucx.abort_endpoint(self.ctl)
            self.data = self.ctl = None

        self.run(abort())
        ucx.release_runtime(self.rt)
