"""router/placement.py under SLOs: the router learns each prefill worker's time to first
token against the prompt tokens queued on it (FirstTokenTimes), and the decode worker's
for its own prefills (on its own cores, and on the idle prefill workers' lent cores);
and the queue each one's arrival rate builds (Pollaczek-Khinchine). With both SLOs a
prompt goes where it is answered first while D has no streams, else to a prefill worker
in time, else to D in time, else where it is answered first; before the lines are
learned the untold rules place it. Fakes of tests/admission_fakes.py (no model, no
Ray); every test that serves requests ends with the router's queue empty."""

import asyncio
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from admission_fakes import FakeDecode, FakePrefill, collect, generate, make_router, queue
from router_fakes import fake_router
from pdserve.router.first_token import FirstTokenTimes
from pdserve.router.placement import Placement


def test_first_token_times_are_seconds_per_queued_token_after_a_few_observations():
    t = FirstTokenTimes()
    for tokens in (500, 1500, 1000):
        t.observe("prefill-0", tokens, 0.001 * tokens)
        assert predict(t, "prefill-0", 2000) is None           # fewer than LEARN so far
    t.observe("prefill-0", 3000, 0.001 * 3000)
    assert predict(t, "prefill-0", 2000) == pytest.approx(2.0)
    assert predict(t, "prefill-1", 2000) is None              # another worker: its own line
    for _ in range(40):                                       # the worker slowed down 2x:
        t.observe("prefill-0", 1000, 2.0)                     # old points fade
        t.observe("prefill-0", 2000, 4.0)
    assert predict(t, "prefill-0", 1500) == pytest.approx(3.0, rel=0.05)
    t.forget("prefill-0")
    assert predict(t, "prefill-0", 1500) is None


def test_a_narrow_band_of_long_queues_gives_the_worker_s_rate_not_a_line_s_intercept():
    """Observations under load: 8,000-12,000 tokens queued, ~7 ms a token plus noise.
    A least-squares line through them has its slope at the noise's mercy; the ratio
    is the rate."""
    t = FirstTokenTimes()
    for tokens, noise in ((8000, 9.0), (12000, -9.0), (9000, 6.0), (11000, -6.0),
                          (10000, 0.0), (8500, 4.0)):
        t.observe("prefill-0", tokens, 0.007 * tokens + noise)
    assert t.seconds_per_token("prefill-0") == pytest.approx(0.007, rel=0.05)


def predict(t: FirstTokenTimes, key: str, tokens: int) -> float | None:
    """Seconds to a first token with `tokens` queued on line `key`; None unlearned."""
    b = t.seconds_per_token(key)
    return None if b is None else b * tokens


def lending_router(**router_kw):
    """One P and one D on one node, core lending on (D prefills while P idles)."""
    r = make_router(FakeDecode(), FakePrefill(), **router_kw)
    d, p = r.decode[0], r.prefill[0]
    d.node_ip = p.node_ip = "10.0.0.1"
    lending = replace(r.config, decode=replace(r.config.decode, core_share_dir="/dev/shm/x"))
    r.config = r.placement.config = lending
    return r, d, p


def teach(r, w, seconds_per_token: float, lent: bool = False) -> None:
    for tokens in (200, 800, 1400, 2000):
        r.placement.first_token.observe(FirstTokenTimes.line(w, lent), tokens,
                                        seconds_per_token * tokens)


def test_without_slos_the_idle_and_queue_rules_decide():
    r, d, p = lending_router()
    assert r.placement.prefill_on_decode(d, 1000)             # P idle: D prefills on lent cores
    d.queued_tokens, p.queued_tokens = 1000, 5000
    assert r.placement.prefill_on_decode(d, 1000)             # P's queue over a step's budget


def test_a_tpot_slo_alone_keeps_every_prompt_on_the_prefill_worker():
    """No TTFT SLO: every first token is in time, so none costs D's streams TPOT."""
    r, d, p = lending_router(slo_tpot_ms=40.0)
    teach(r, d, 0.0001, lent=True)
    assert not r.placement.prefill_on_decode(d, 1000)         # P idle
    p.queued_tokens = 50_000
    assert not r.placement.prefill_on_decode(d, 1000)         # P far behind
    p.alive = False                                           # no live P
    assert not r.placement.prefill_on_decode(d, 1000)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def arrive(r, w, rate: float, tokens: int, seconds: float = 120.0) -> None:
    """Prompts of `tokens` tokens sent to `w` at `rate` a second for `seconds`, on the
    router's clock (a Clock): FirstTokenTimes' arrival rate settles at `rate`."""
    clock = r.placement.first_token._clock
    for k in range(int(rate * seconds)):
        clock.t += 1 / rate
        r.placement.first_token.sent(w.worker_id, tokens)


def slo_router(**router_kw):
    r, d, p = lending_router(slo_tpot_ms=40.0, slo_ttft_ms=4000.0, **router_kw)
    r.placement.first_token = FirstTokenTimes(clock=Clock())
    return r, d, p


def test_the_queue_model_is_pollaczek_khinchine_s_mean_wait():
    t = FirstTokenTimes(clock=Clock())
    for tokens in (200, 800, 1400, 2000):
        t.observe("prefill-0", tokens, 0.002 * tokens)
    assert t.eta("prefill-0", "prefill-0", 0, 1200).steady == pytest.approx(2.4)  # no arrivals
    for _ in range(400):                              # 0.2 prompts a second of 1,200 tokens
        t._clock.t += 5.0
        t.sent("prefill-0", 1200)
    rate, mean, mean_sq = t.arrivals("prefill-0")
    assert (rate, mean, mean_sq) == pytest.approx((0.2, 1200, 1200 ** 2), rel=0.1)
    e = t.eta("prefill-0", "prefill-0", 600, 1200)
    rho = rate * 0.002 * 1200                             # ~0.48
    assert e.rho == pytest.approx(rho)
    assert e.now == pytest.approx(0.002 * 1800)
    assert e.steady == pytest.approx(2.4 + rate * 2.4 ** 2 / (2 * (1 - rho)))
    assert e.seconds == max(e.now, e.steady)
    for _ in range(400):                              # 0.5 a second: 1.2 s of work a second
        t._clock.t += 2.0
        t.sent("prefill-0", 1200)
    assert t.eta("prefill-0", "prefill-0", 0, 1200).steady == math.inf
    t._clock.t += 3600                                # an hour without prompts: idle again
    assert t.eta("prefill-0", "prefill-0", 0, 1200).steady == pytest.approx(2.4)
    t.forget("prefill-0")
    assert t.eta("prefill-0", "prefill-0", 0, 1200) is None


def test_before_the_lines_are_learned_the_untold_rules_place_so_a_lone_prompt_is_as_fast():
    """Told its SLOs or not, a lone prompt goes to D on the idle P's lent cores until
    the lines are learned: the unloaded TTFT is the untold server's."""
    r, d, p = slo_router()
    assert r.placement.prefill_on_decode(d, 1000)             # P idle: D on lent cores
    teach(r, p, 0.002)
    assert r.placement.prefill_on_decode(d, 1000)             # D's line unknown: still
    d.queued_tokens = 1000                                    # D busy, P idle: P
    assert not r.placement.prefill_on_decode(d, 1000)


def test_with_no_streams_on_d_the_prompt_goes_where_it_is_answered_first():
    r, d, p = slo_router()
    teach(r, p, 0.002)                                        # 2 s for 1,000 tokens
    teach(r, d, 0.001, lent=True)                             # 1 s on lent cores
    teach(r, d, 0.003)                                        # 3 s on D's own
    assert r.placement.prefill_on_decode(d, 1000)             # lent: D
    p.queued_tokens = 100                                     # P busy: D's own cores
    assert not r.placement.prefill_on_decode(d, 1000)         # are slower than P's queue
    p.queued_tokens = 1500
    assert r.placement.prefill_on_decode(d, 1000)             # 5 s on P: D


def test_with_streams_on_d_a_prefill_worker_in_time_takes_the_prompt():
    """D's prefills cost its streams TPOT: a P in time gets the prompt even where D on
    lent cores would answer it sooner; a late P passes it to D if D is in time, else
    it goes where it is answered first."""
    r, d, p = slo_router()
    teach(r, p, 0.002)
    teach(r, d, 0.001, lent=True)
    teach(r, d, 0.003)
    d.streams = 3
    assert not r.placement.prefill_on_decode(d, 1000)         # 2 s <= 3.6 s: P
    p.queued_tokens = 800                                     # 3.6 s: P still
    assert not r.placement.prefill_on_decode(d, 1000)
    p.queued_tokens = 900                                     # 3.8 s: late; D on its
    assert r.placement.prefill_on_decode(d, 1000)             # own cores: 3 s, in time
    d.queued_tokens = 500                                     # both late, 4.5 s on D:
    assert not r.placement.prefill_on_decode(d, 1000)         # P answers it first
    p.queued_tokens = 1500                                    # 5 s on P: D
    assert r.placement.prefill_on_decode(d, 1000)


def test_a_saturated_prefill_worker_is_never_in_time_however_short_its_queue_now():
    """Recorded: ~1,200-token summarization prompts at 0.5 a second, P computing one in
    ~2.3 s on its one core (rho ~1.15), TTFT SLO 3.9 s (4x unloaded). P's queue is empty
    at this moment, so its line alone says 2.3 s, in time; at its arrival rate the
    queue grows without bound, so the prompt goes to D, which is in time (on the idle
    P's lent cores)."""
    r, d, p = slo_router()
    r.config = r.placement.config = replace(
        r.config, router=replace(r.config.router, slo_ttft_ms=3900.0))
    teach(r, p, 0.0019)                                       # 2.28 s for 1,200 tokens
    teach(r, d, 0.0017)                                       # 2.04 s on D's own cores
    teach(r, d, 0.0011, lent=True)                            # 1.32 s on lent ones
    d.streams, d.queued_tokens, p.queued_tokens = 4, 0, 0
    p.num_blocks = d.num_blocks = 1024                        # the pools hold the prompts
    assert not r.placement.prefill_on_decode(d, 1200)         # no arrivals yet: P, 2.3 s
    arrive(r, p, 0.5, 1200)
    e = r.placement.prefill_eta(1200)
    assert e.now == pytest.approx(2.28) and e.rho > 1 and e.seconds == math.inf
    assert r.placement.prefill_on_decode(d, 1200)             # saturated: D (1.32 s)
    p.queued_tokens = 300                                     # P busy: D on its own cores
    assert r.placement.prefill_on_decode(d, 1200)             # (2.04 s) still
    p.queued_tokens = 0
    arrive(r, d, 0.3, 1200)                                   # D takes a share: at 0.2
    arrive(r, p, 0.2, 1200, seconds=300)                      # a second P's rho is ~0.45
    e = r.placement.prefill_eta(1200)                         # and its mean wait ~0.9 s
    assert 0.4 < e.rho < 0.5 and e.seconds < 0.9 * 3.9
    assert not r.placement.prefill_on_decode(d, 1200)         # in time again: P


def test_first_token_lines_of_lent_and_own_cores_are_apart_and_forgotten_together():
    r, d, p = lending_router()
    teach(r, d, 0.001)
    assert predict(r.placement.first_token, FirstTokenTimes.line(d, True), 1000) is None
    teach(r, d, 0.0005, lent=True)
    assert predict(r.placement.first_token, FirstTokenTimes.line(d, True), 1000) == \
        pytest.approx(0.5)
    assert predict(r.placement.first_token, FirstTokenTimes.line(d), 1000) == pytest.approx(1.0)
    r.placement.first_token.forget(d.worker_id)
    assert predict(r.placement.first_token, FirstTokenTimes.line(d, True), 1000) is None
    assert predict(r.placement.first_token, FirstTokenTimes.line(d), 1000) is None


def test_the_router_learns_the_decode_worker_s_own_first_token_times():
    async def main():
        d = FakeDecode(local=True)
        r = make_router(d, FakePrefill(), slo_tpot_ms=40.0, slo_ttft_ms=4000.0)
        for _ in range(FirstTokenTimes.LEARN):
            assert await asyncio.wait_for(collect(generate(r)), 10) == [11, 12]
        predicted = predict(r.placement.first_token, r.decode[0].worker_id, 4)
        assert predicted is not None and 0 <= predicted < 5.0
        return r

    assert queue(asyncio.run(main())) == (0, 0)


def test_the_router_learns_a_prefill_worker_s_first_token_times_from_its_requests():
    async def main():
        d, p = FakeDecode(), FakePrefill()
        r = make_router(d, p, slo_tpot_ms=40.0, slo_ttft_ms=4000.0)
        p.go.set()
        for _ in range(FirstTokenTimes.LEARN):
            assert await asyncio.wait_for(collect(generate(r)), 10) == [10, 11, 12]
        predicted = predict(r.placement.first_token, r.prefill[0].worker_id, 4)
        assert predicted is not None and 0 <= predicted < 5.0
        return r

    assert queue(asyncio.run(main())) == (0, 0)


def test_the_prefill_worker_judged_is_the_one_the_routing_policy_picked():
    """Two prefill workers: the one the policy picks is judged, so a saturated one is
    not sent a prompt because the other is in time, and one not learned yet (just
    scaled up) leaves only its own prompts to the untold rules."""
    r = fake_router([FakePrefill(), FakePrefill()], [FakeDecode()], slo_tpot_ms=40.0,
                    slo_ttft_ms=4000.0)
    r.placement.first_token = FirstTokenTimes(clock=Clock())
    d, (p0, p1) = r.placement.decode[0], r.placement.prefill
    teach(r, p0, 0.002)
    teach(r, d, 0.003)
    d.streams, p0.queued_tokens = 2, 500
    assert r.placement.prefill_eta(1000, p1) is None           # p1 has learned nothing
    assert r.placement.slo_choice(d, 1000, lent=False, p=p1) is None
    assert r.placement.slo_choice(d, 1000, lent=False, p=p0) is False   # 3 s, in time
    teach(r, p1, 0.002)
    arrive(r, p1, 0.6, 1000)                                   # p1 saturated (rho 1.2):
    assert r.placement.slo_choice(d, 1000, lent=False, p=p1) is True    # D, 3 s
    assert r.placement.slo_choice(d, 1000, lent=False, p=p0) is False
    assert r.placement.slo_choice(d, 1000, lent=False) is False          # p0 answers first


STATES = Path(__file__).parent / "data" / "slo_placement_states.jsonl"


def replay(state: dict):
    """(slo_choice, P's Eta, D's Eta) on a router whose one P and one D, their queues
    and FirstTokenTimes are as `state` recorded (Placement.slo_state)."""
    r, d, p = slo_router()
    r.config = r.placement.config = replace(
        r.config, router=replace(r.config.router, slo_ttft_ms=state["slo_ttft_ms"]))
    (rp,) = state["p"]
    d.streams, d.queued_tokens, p.queued_tokens = (state["d_streams"], state["d"]["queued"],
                                                   rp["queued"])
    p.num_blocks = d.num_blocks = 4096
    key = FirstTokenTimes.line(d, state["lent"])
    r.placement.first_token = FirstTokenTimes.from_states(
        {(key, d.worker_id): state["d"], (p.worker_id, p.worker_id): rp})
    return (r.placement.slo_choice(d, state["prompt_len"], state["lent"]),
            r.placement.prefill_eta(state["prompt_len"]),
            r.placement.first_token.eta(key, d.worker_id, d.queued_tokens, state["prompt_len"]))


def test_recorded_queue_states_replay_to_their_choices_and_a_saturated_prefill_worker_is_passed():
    """States recorded from the router's `slo placement` debug log of a told server
    (TTFT SLO 15.8 s, TPOT 321 ms: 4x vLLM's unloaded latency that day) serving
    ShareGPT summarization prompts (seed 7) at 0.25 req/s, past what its one-core
    prefill worker computes. Each replays to the choice recorded; where the prefill
    worker was saturated (its arrivals' rho >= 1), no prompt went to it unless the
    decode worker was late too and the prefill worker answered first; before the lines
    were learned the untold rules placed (None)."""
    states = [json.loads(line) for line in STATES.read_text().splitlines()]
    saturated = 0
    for s in states:
        choice, on_p, on_d = replay(s)
        assert choice == s["choice"], s
        if choice is None:
            assert on_p is None or on_d is None
            continue
        if on_p.rho >= 1 and s["d_streams"]:
            saturated += 1
            in_time = Placement.SLO_MARGIN * s["slo_ttft_ms"] / 1e3
            assert choice or (on_d.seconds > in_time and on_p.now <= on_d.now), s
    assert saturated >= 1 and any(s["choice"] is None for s in states)
