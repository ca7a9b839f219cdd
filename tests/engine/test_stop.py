"""engine/stop.py: the stop rule the decode step and the router's relay share."""

import pytest

from pdserve.engine.request import RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stop import stop_state

EOS = (2,)
STOPPED, LENGTH = RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH


@pytest.mark.parametrize("token, n_out, n_all, params, want", [
    (2, 1, 10, SamplingParams(max_tokens=8), STOPPED),                     # EOS first
    (2, 1, 10, SamplingParams(max_tokens=8, ignore_eos=True), None),
    (2, 8, 17, SamplingParams(max_tokens=8, ignore_eos=True), LENGTH),
    (7, 3, 12, SamplingParams(max_tokens=8, stop_token_ids=(7,)), STOPPED),
    (7, 3, 12, SamplingParams(max_tokens=8, stop_token_ids=(7,), ignore_eos=True), STOPPED),
    (5, 7, 16, SamplingParams(max_tokens=8), None),
    (5, 8, 17, SamplingParams(max_tokens=8), LENGTH),
    (2, 8, 17, SamplingParams(max_tokens=8), STOPPED),                     # EOS wins
    (5, 3, 64, SamplingParams(max_tokens=8), LENGTH),                      # context full
])
def test_stop_state(token, n_out, n_all, params, want):
    assert stop_state(token, n_out, n_all, params, frozenset(EOS), max_model_len=64) == want
