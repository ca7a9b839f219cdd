"""pdserve/bench/peer.py's bookkeeping: cells never on a tune sample, ABBA pair order,
per-cell ratios with their spread, and the greedy agreement of the two servers'
outputs. No server: the client's results are made up."""

from __future__ import annotations

import pytest

from pdserve.bench.peer import PeerConfig, greedy_agreement, summarize, table


def test_cells_never_use_a_tune_sample():
    cfg = PeerConfig(temperatures=(0.0, 1.0), samples=3, tune_seed=0)
    assert cfg.tune_seeds() == [0, 100]
    assert cfg.seeds(0) == [1, 2, 3] and cfg.seeds(1) == [101, 102, 103]
    with pytest.raises(AssertionError):
        PeerConfig(samples=101).seeds(0)          # would reach seed 100


def _run(tok_s, ttft_ms, tpot_ms, texts=("a b c",)):
    return {"output_throughput": tok_s, "mean_ttft_ms": ttft_ms, "p99_ttft_ms": 2 * ttft_ms,
            "mean_tpot_ms": tpot_ms, "generated_texts": list(texts)}


def test_summary_is_the_median_of_pairs_with_its_spread():
    records = []
    for pair, (v, p) in enumerate(((400, 440), (380, 400), (420, 420))):
        records += [{"dtype": "fp32", "pair": pair, "system": "vllm",
                     "runs": {"t0_s1": _run(v, 100, 10)}},
                    {"dtype": "fp32", "pair": pair, "system": "pdserve",
                     "runs": {"t0_s1": _run(p, 50, 12)}}]
    s = summarize(records)
    c = s["cells"]["fp32 t0_s1"]["output_throughput"]
    assert c["median"] == pytest.approx(400 / 380) and c["n"] == 3
    assert c["min"] == pytest.approx(1.0) and c["max"] == pytest.approx(1.1)
    assert s["cells"]["fp32 t0_s1"]["mean_ttft"]["median"] == pytest.approx(0.5)
    assert s["groups"]["fp32 t0"]["mean_tpot"]["median"] == pytest.approx(1.2)
    assert "| **fp32 t0** | 400 | 420 | 1.05x (1.00-1.10)" in table(s)


def test_greedy_agreement_counts_identical_outputs_and_the_common_prefix():
    def tok(text):
        return {"input_ids": text.split()}

    by = {("fp32", "t0_s1", 0): {"vllm": _run(1, 1, 1, ["a b c d", "x y"]),
                                 "pdserve": _run(1, 1, 1, ["a b c d", "x z"])},
          ("fp32", "t1_s101", 0): {"vllm": _run(1, 1, 1, ["p"]), "pdserve": _run(1, 1, 1, ["q"])},
          ("bf16", "t0_s1", 0): {"vllm": _run(1, 1, 1, ["p"]), "pdserve": _run(1, 1, 1, ["q"])}}
    g = greedy_agreement(by, tok)
    assert g == {"requests": 2, "identical_share": 0.5, "mean_matching_prefix_share": 0.75}


def test_resume_keeps_a_complete_session_and_reruns_a_partial_one(tmp_path, monkeypatch):
    import json

    from pdserve.bench import peer

    cfg = PeerConfig(out_dir=str(tmp_path), resume=True)
    cells = [(0.0, 1), (1.0, 101)]
    d = tmp_path / "equal"
    (d / "logs").mkdir(parents=True)
    (d / "runs").mkdir()
    (d / "logs" / "pair0_vllm_fp32.config.json").write_text(json.dumps({"command": "x"}))
    for key in ("t0_s1", "t1_s101"):
        (d / "runs" / f"pair0_vllm_fp32_{key}.json").write_text(json.dumps(_run(400, 100, 10)))
    (d / "runs" / "pair0_pdserve_fp32_t0_s1.json").write_text(json.dumps(_run(1, 1, 1)))

    started = []

    def start(*args):
        started.append(args)
        raise RuntimeError("a server start")

    monkeypatch.setattr(peer, "start_vllm", start)
    monkeypatch.setattr(peer, "start_pdserve", start)
    got = peer.session(cfg, "m", "vllm", "fp32", "pair0", cells, None, lambda _: None, sub="equal")
    assert got["config"] == {"command": "x"} and set(got["runs"]) == {"t0_s1", "t1_s101"}
    assert not started
    with pytest.raises(RuntimeError, match="a server start"):   # no config: not complete
        peer.session(cfg, "m", "pdserve", "fp32", "pair0", cells, None, lambda _: None,
                     sub="equal")
    assert started
