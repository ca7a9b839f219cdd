"""decode_worker/step_budget.py: a step's token budget under a TPOT SLO, learned from
the steps' times per thread count."""

import pytest

from pdserve.decode_worker.step_budget import BORROW_TOKENS, LEARN_STEPS, MARGIN, StepBudget


def test_no_budget_until_a_line_is_learned_per_thread_count():
    b = StepBudget(0.1)
    for k in range(LEARN_STEPS - 1):
        b.observe(1, 10 + k, 0.01 + 0.001 * (10 + k))
        assert b.tokens(1) is None
    b.observe(1, 30, 0.04)
    assert b.tokens(1) is not None and b.tokens(2) is None


def test_the_budget_fits_the_target_on_a_linear_step_cost():
    b = StepBudget(0.1)                      # steps: 20 ms + 1 ms a token
    for x in (8, 64, 16, 100, 32, 80, 4, 50):
        b.observe(2, x, 0.02 + 0.001 * x)
    assert b.tokens(2) == pytest.approx((MARGIN * 0.1 - 0.02) / 0.001, abs=1)


def test_it_follows_steps_that_grow_slower():
    """Recent steps weigh more: when the same step sizes take twice as long (the
    batch's context grew, the box got busy), the budget about halves."""
    b = StepBudget(0.2)
    for _ in range(40):
        for x in (10, 60):
            b.observe(1, x, 0.001 * x)
    before = b.tokens(1)
    for _ in range(80):
        for x in (10, 60):
            b.observe(1, x, 0.002 * x)
    assert before == pytest.approx(180, abs=3)
    assert b.tokens(1) == pytest.approx(before / 2, rel=0.1)


def test_a_step_slower_than_the_target_still_gets_one_token():
    b = StepBudget(0.01)
    for x in range(1, LEARN_STEPS + 1):
        b.observe(1, x * 10, 0.5 + 0.01 * x)
    assert b.tokens(1) == 1


def test_refuses_a_non_positive_slo():
    with pytest.raises(ValueError, match="slo_tpot_s"):
        StepBudget(0)


def test_streams_that_ran_fast_bank_time_for_a_longer_step():
    """A stream of k tokens whose gaps took itl_s allows target x k - itl_s seconds:
    the least allowance of the step's streams sizes it; a new stream allows a target."""
    b = StepBudget(0.1)                      # target 90 ms; steps: 20 ms + 1 ms a token
    for x in (8, 64, 16, 100, 32, 80, 4, 50):
        b.observe(1, x, 0.02 + 0.001 * x)
    target = MARGIN * 0.1
    assert b.tokens(1, [(1, 0.0, 0)]) == b.tokens(1) == pytest.approx((target - 0.02) / 0.001,
                                                                      abs=1)
    fast = (11, 10 * 0.03, 0)                # 10 gaps of 30 ms: 600 ms banked
    assert b.tokens(1, [fast]) == pytest.approx((11 * target - 0.3 - 0.02) / 0.001, abs=1)
    late = (11, 10 * target, 0)              # at the target already: one target
    assert b.tokens(1, [fast, late]) == pytest.approx((target - 0.02) / 0.001, abs=2)


def test_a_stream_lends_the_slack_of_its_next_tokens():
    """A stream that will make h more tokens lends h x (target - decode step): its mean
    TPOT at its last token stays within the target if each of those takes a decode step.
    Never more than BORROW_TOKENS of them, nor beyond its max_tokens; nothing when a
    decode step alone takes the target."""
    b = StepBudget(0.1)                      # target 90 ms; steps: 20 ms + 1 ms a token
    for x in (8, 64, 16, 100, 32, 80, 4, 50):
        b.observe(1, x, 0.02 + 0.001 * x)
    target, step = MARGIN * 0.1, 0.02 + 0.001 * 2        # 2 decode rows: 22 ms a step
    fresh, old = (1, 0.0, 10), (30, 29 * target, 500)
    lent = lambda k, itl, h: target * k - itl + min(h, BORROW_TOKENS) * (target - step)
    assert b.tokens(1, [fresh, old]) == pytest.approx(
        (min(lent(*fresh), lent(*old)) - 0.02) / 0.001, abs=2)
    assert lent(*fresh) < lent(*old)         # 10 tokens left lend less than 500 do,
    assert lent(*old) == pytest.approx(target + BORROW_TOKENS * (target - step))  # capped
    # the step's time in the allowance: a stream with h tokens left never plans past
    # target x (k + h) over its life
    k, itl, h = fresh
    x = b.tokens(1, [fresh])
    alone = 0.02 + 0.001 * 1                 # its decode step, one row
    assert itl + (0.02 + 0.001 * x) + h * alone <= target * (k + h) + 0.002
    slow = StepBudget(0.01)                  # a decode step alone past the target
    for x in range(1, LEARN_STEPS + 1):
        slow.observe(1, x * 10, 0.5 + 0.01 * x)
    assert slow.tokens(1, [(1, 0.0, 100)]) == 1
