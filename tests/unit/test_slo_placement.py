"""router/placement.py under SLOs: the router learns each prefill worker's time to first
token against the prompt tokens queued on it (FirstTokenTimes), and the decode worker's
for its own prefills (on its own cores, and on the idle prefill workers' lent cores);
with both SLOs a prompt a prefill worker alone is too slow for goes to the decode worker
(colocated), and of the others those a prefill worker would answer late, unless the
decode worker would answer later still. Fakes of tests/admission_fakes.py (no model, no
Ray); every test that serves requests ends with the router's queue empty."""

import asyncio
from dataclasses import replace

import pytest

from admission_fakes import FakeDecode, FakePrefill, collect, generate, make_router, queue
from pdserve.router.placement import FirstTokenTimes, Placement


def test_first_token_times_fit_a_line_after_a_few_observations():
    t = FirstTokenTimes()
    for k, tokens in enumerate((500, 1500, 1000)):
        t.observe("prefill-0", tokens, 0.2 + 0.001 * tokens)
        assert t.predict("prefill-0", 2000) is None           # fewer than LEARN so far
    t.observe("prefill-0", 3000, 0.2 + 0.001 * 3000)
    assert t.predict("prefill-0", 2000) == pytest.approx(2.2)
    assert t.predict("prefill-1", 2000) is None              # another worker: its own line
    for _ in range(40):                                       # the worker slowed down 2x:
        t.observe("prefill-0", 1000, 2.4)                     # old points fade
        t.observe("prefill-0", 2000, 4.4)
    assert t.predict("prefill-0", 1500) == pytest.approx(3.4, rel=0.05)
    t.forget("prefill-0")
    assert t.predict("prefill-0", 1500) is None


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
                                        0.05 + seconds_per_token * tokens)


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


def test_with_both_slos_the_decode_worker_takes_the_prompts_a_prefill_worker_would_answer_late():
    r, d, p = lending_router(slo_tpot_ms=40.0, slo_ttft_ms=4000.0)
    assert not r.placement.prefill_on_decode(d, 1000)         # nothing learned yet: P
    teach(r, p, 0.001)                                        # ~1,000 tokens a second
    teach(r, d, 0.0005, lent=True)                            # D on lent cores: faster,
    assert not r.placement.prefill_on_decode(d, 1000)         # but 1.05 s <= 0.9 x 4 s: P
    p.queued_tokens = 2000
    assert not r.placement.prefill_on_decode(d, 1000)         # 3.05 s: still in time
    p.queued_tokens = 3000                                    # 4.05 s > 3.6 s: late on P;
    assert r.placement.prefill_on_decode(d, 1000)             # D's own line unknown: the
    d.queued_tokens = 4000                                    # queue rule splits the burst,
    assert not r.placement.prefill_on_decode(d, 1000)         # unless D's queue is longer
    d.queued_tokens = 0
    teach(r, d, 0.01)                                         # D on its own cores, under a
    assert not r.placement.prefill_on_decode(d, 1000)         # tight budget: 10 s: P
    r.placement.first_token.forget(d.worker_id)
    teach(r, d, 0.002)                                        # a looser one: 2.05 s on D,
    assert r.placement.prefill_on_decode(d, 1000)             # 4.05 s on P: the queue rule
    p.alive = False                                           # no live P: D
    assert r.placement.prefill_on_decode(d, 1000)


def test_a_prompt_a_prefill_worker_alone_answers_in_over_a_third_of_the_ttft_slo_is_colocated():
    """P on its own cores computes it in more than COLOCATE_SHARE (a third) of the TTFT
    SLO, idle: it goes to D (with the idle P's lent cores), however D's line stands."""
    assert Placement.COLOCATE_SHARE == pytest.approx(1 / 3)
    r, d, p = lending_router(slo_tpot_ms=40.0, slo_ttft_ms=4000.0)
    teach(r, p, 0.002)                                        # ~500 tokens a second
    teach(r, d, 0.01)                                         # D on its own: 100/s
    teach(r, d, 0.01, lent=True)
    p.queued_tokens = 500                                     # busy: D lent nothing
    assert not r.placement.prefill_on_decode(d, 500)          # 1.05 s idle <= 1.33 s: P
    assert not r.placement.prefill_on_decode(d, 640)          # 1.33 s: P
    assert r.placement.prefill_on_decode(d, 660)              # 1.37 s idle > 1.33 s: D
    assert r.placement.prefill_on_decode(d, 1000)


def test_first_token_lines_of_lent_and_own_cores_are_apart_and_forgotten_together():
    r, d, p = lending_router()
    teach(r, d, 0.001)
    assert r.placement.first_token.predict(FirstTokenTimes.line(d, True), 1000) is None
    teach(r, d, 0.0005, lent=True)
    assert r.placement.first_token.predict(FirstTokenTimes.line(d, True), 1000) == \
        pytest.approx(0.55)
    assert r.placement.first_token.predict(FirstTokenTimes.line(d), 1000) == pytest.approx(1.05)
    r.placement.first_token.forget(d.worker_id)
    assert r.placement.first_token.predict(FirstTokenTimes.line(d, True), 1000) is None
    assert r.placement.first_token.predict(FirstTokenTimes.line(d), 1000) is None


def test_the_router_learns_the_decode_worker_s_own_first_token_times():
    async def main():
        d = FakeDecode(local=True)
        r = make_router(d, FakePrefill(), slo_tpot_ms=40.0, slo_ttft_ms=4000.0)
        for _ in range(FirstTokenTimes.LEARN):
            assert await asyncio.wait_for(collect(generate(r)), 10) == [11, 12]
        predicted = r.placement.first_token.predict(r.decode[0].worker_id, 4)
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
        predicted = r.placement.first_token.predict(r.prefill[0].worker_id, 4)
        assert predicted is not None and 0 <= predicted < 5.0
        return r

    assert queue(asyncio.run(main())) == (0, 0)
