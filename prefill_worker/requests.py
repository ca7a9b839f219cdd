"""Prefill-side request types: one request's state (PrefillRequest), how it ended when
not with its first token sent (Finish), and the errors its caller then gets."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine.block_pool import BlockHash
from ..engine.logprobs import TokenLogprobs
from ..engine.request import RequestState
from ..engine.sampling_params import SamplingParams
from ..kv_transfer import KVTransferError


class PrefillAborted(RuntimeError):
    """The request was aborted before its prefill finished."""


class PrefillFailed(RuntimeError):
    """The model step that computed the request's prompt raised (not a transfer
    failure: its KV was never complete)."""


class FinishCause(enum.Enum):
    """Why a prefill request ends without its KV and first token delivered, and the
    exception its prefill() call raises for it."""

    ABORTED = PrefillAborted          # abort(request_id), or a rank told to drop it
    MODEL_FAULT = PrefillFailed       # the step computing its prompt raised
    TRANSFER = KVTransferError        # its KV frames could not be sent


@dataclass(frozen=True, slots=True)
class Finish:
    cause: FinishCause
    message: str

    def error(self) -> Exception:
        """The exception the request's caller gets."""
        return self.cause.value(self.message)


def fail(req: Any, cause: FinishCause, message: str) -> None:
    """Set `req.finish` (a PrefillRequest, or a rank's RankRequest) unless it has one: the
    first cause stays, but a model fault outranks a transfer failure (the send thread
    may see a broken transfer of KV that was never complete)."""
    if req.finish is None or (cause is FinishCause.MODEL_FAULT
                              and req.finish.cause is FinishCause.TRANSFER):
        req.finish = Finish(cause, message)


@dataclass(slots=True, eq=False)
class PrefillRequest:
    """One prompt on a prefill worker (engine/outputs.py StepRequest). Compared by
    identity (it is mutable state). Its tokens are the prompt's: a prefill worker
    samples one token, sent with the done frame, and keeps none."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_address: tuple[str, int]          # decode worker's KV receiver
    epoch: int                           # decode worker's epoch, echoed in every frame
    future: Any = None                   # asyncio.Future on the actor loop: first token
    num_cached_blocks: int = 0           # leading prompt blocks D holds already: not sent
    kv_sent_blocks: int = 0              # block-table positions before this are queued to send
    kv_send_started: float | None = None  # perf_counter() of its first KV frame (metrics)
    kv_send_done: float | None = None    # perf_counter() once DONE went out (tracing)
    kv_bytes_sent: int = 0               # K/V payload bytes sent to D, every rank of it
    span: Any = None                     # its span when traced (pdserve/tracing.py)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0                  # leading prompt tokens found in P's prefix cache
    num_computed_tokens: int = 0         # tokens whose K/V is in the blocks (cached included)
    block_hashes: list[BlockHash] | None = None  # of its full blocks, computed once
    state: RequestState = RequestState.WAITING
    finish: Finish | None = None         # set once it fails or is aborted (fail())
    kv_rank_addresses: tuple = ()        # a tensor-parallel D's ranks 1..M-1 (messages.py)
    kv_source: Any = None                # D's actor handle: kv_pull reads D's cached blocks
    kv_peer: Any = None                  # or another prefill worker's, holding
    peer_blocks: int = 0                 # this many leading full blocks (the router's guess)
    logprobs: TokenLogprobs | None = None  # of the first token, when params.logprobs
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # grows per chunk
    arrived: float = field(default_factory=time.monotonic)   # schedule policy's clock
    scheduled: float | None = None       # when it first took blocks (time.monotonic())
    grammar: Any = None                  # params.structured_outputs compiled (xgrammar)
    matcher: Any = None                  # of its grammar, at its sampling

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    num_tokens = prompt_len              # the first token is sampled at the prompt's end

    @property
    def num_output_tokens(self) -> int:
        return 0

    def token_id(self, i: int) -> int:
        return self.prompt_token_ids[i]

    def token_ids(self, end: int) -> list[int]:
        return self.prompt_token_ids[:end]
