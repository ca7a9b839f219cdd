"""When a stream is over: the one stop rule the decode worker's step and the router's
relay (and so its retry path) both apply, so a retried request can never resume a
stream that had already ended.

Token-level rules only. Stop *strings* need the detokenized text and are matched by the
router (router/detokenizer.py); a stream they end is over on the router first.
"""

from __future__ import annotations

from collections.abc import Container

from .request import RequestState
from .sampling_params import SamplingParams


def stop_state(token_id: int, num_output_tokens: int, num_tokens: int, params: SamplingParams,
               eos_token_ids: Container[int], max_model_len: int) -> RequestState | None:
    """The finished state a stream is in once `token_id` is appended, or None if it goes on.

    Args:
        token_id: the token just sampled (the stream's last).
        num_output_tokens: tokens generated under `params`, `token_id` included (on a
            retry, D counts only its attempt's tokens against the attempt's reduced
            max_tokens; the router counts all of them against the request's own).
        num_tokens: prompt + output tokens, `token_id` included.
        params: the request's sampling parameters.
        eos_token_ids: the model's end-of-sequence ids (ignored with params.ignore_eos).
        max_model_len: the model's context length, in tokens.

    Returns:
        FINISHED_STOPPED for EOS (unless ignore_eos) or one of params.stop_token_ids once
        params.min_tokens were generated (step_offset counts those of earlier attempts),
        FINISHED_LENGTH at max_tokens or the model's context length, else None.
    """
    if (params.step_offset + num_output_tokens >= params.min_tokens
            and ((not params.ignore_eos and token_id in eos_token_ids)
                 or token_id in params.stop_token_ids)):
        return RequestState.FINISHED_STOPPED
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return RequestState.FINISHED_LENGTH
    return None
