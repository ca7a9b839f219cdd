"""pdserve/bench/multiturn.py without servers: a conversation's turns alternate user and
assistant and stop at the asked count; per-turn TTFT summaries skip failed turns; the
table names every arm. (The servers' run is the benchmark itself.)"""

from pdserve.bench.multiturn import ArmResult, TurnResult, _messages, summary, table


def conv(*pairs):
    return {"conversations": [{"from": f, "value": v} for f, v in pairs]}


def test_messages_alternate_and_stop_at_the_turns_asked():
    c = conv(("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d"), ("human", "e"))
    assert [m["content"] for m in _messages(c, 2)] == ["a", "b", "c"]
    assert [m["role"] for m in _messages(c, 3)] == ["user", "assistant"] * 2 + ["user"]
    assert _messages(c, 4) is None                                   # too few turns
    assert _messages(conv(("gpt", "x"), ("human", "y"), ("gpt", "z")), 2) is None
    assert _messages(conv(("human", "a"), ("gpt", ""), ("human", "c")), 2) is None


def test_summary_per_turn_skips_failures():
    arm = ArmResult("tiers", [TurnResult(0, 0, 10, 1.0), TurnResult(1, 0, 10, 3.0),
                              TurnResult(0, 1, 20, 0.5), TurnResult(1, 1, 20, None, "boom")],
                    prompt_tokens=60, computed_tokens=30, tier_hit_blocks={"host": 2})
    s = summary(arm, 2)
    assert s["failed"] == 1
    assert [t["mean_ttft_ms"] for t in s["turns"]] == [2000.0, 500.0]
    assert [t["n"] for t in s["turns"]] == [2, 1]
    assert s["mean_ttft_ms_turns_2_on"] == 500.0
    text = table([s, summary(ArmResult("vllm", arm.turns, 60, None), 2)])
    assert "tiers" in text and "vllm" in text and "30 / 60" in text and "host 2" in text


def test_the_plot_is_written(tmp_path):
    from pdserve.bench.multiturn import plot
    arm = ArmResult("pdserve", [TurnResult(0, 0, 10, 1.0), TurnResult(0, 1, 20, 0.4)])
    plot([summary(arm, 2)], tmp_path / "ttft.png")
    assert (tmp_path / "ttft.png").read_bytes()[:4] == b"\x89PNG"


def test_replay_keeps_clients_in_flight_and_sends_a_users_next_turn_from_the_back(
        monkeypatch):
    """4 users of 3 turns, 2 clients: never more than 2 turns in flight; every user's
    turns in order; each user's next turn waits behind the users already in line, so
    every first turn is sent before any second one."""
    import threading
    import time
    from types import SimpleNamespace

    import openai

    from pdserve.bench import multiturn

    sent, in_flight, peak, lock = [], 0, 0, threading.Lock()

    def turn(client, model, prompt, max_tokens, u, k, temperature):
        nonlocal in_flight, peak
        with lock:
            sent.append((u, k))
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.01)
        with lock:
            in_flight -= 1
        return TurnResult(u, k, len(prompt), 0.01)

    class FakeOpenAI:
        def __init__(self, **kw):
            self.models = SimpleNamespace(list=lambda: SimpleNamespace(
                data=[SimpleNamespace(id="m")]))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(multiturn, "_turn", turn)
    monkeypatch.setattr(openai, "OpenAI", FakeOpenAI)
    prompts = [[f"u{u}t{k}" for k in range(3)] for u in range(4)]
    results = multiturn.replay("http://x", prompts, 8, clients=2)
    assert [(r.user, r.turn) for r in results] == [(u, k) for u in range(4) for k in range(3)]
    assert peak == 2
    assert sorted(sent[:4]) == [(u, 0) for u in range(4)]
    for u in range(4):
        assert [k for v, k in sent if v == u] == [0, 1, 2]


def test_the_pull_arm_is_the_tiers_arm_with_kv_pull_and_its_own_flags_last(
        monkeypatch, tmp_path):
    from pdserve.bench import multiturn_servers
    from pdserve.bench.multiturn import MultiTurnConfig

    started = {}
    monkeypatch.setattr(multiturn_servers, "Server",
                        lambda cmd, *a: started.setdefault("cmd", cmd))
    cfg = MultiTurnConfig(pull_args="--local-prefill-max-tokens 0")
    multiturn_servers.start_arm("pull", cfg, "m", tmp_path, tmp_path / "log")
    cmd = started["cmd"]
    assert "--kv-host-cache-gib" in cmd and "--kv-disk-cache-dir" in cmd
    assert cmd[-3:] == ["--kv-pull", "--local-prefill-max-tokens", "0"]
    # the later --local-prefill-max-tokens wins over the tiers arm's
    assert cmd.index("--local-prefill-max-tokens") < len(cmd) - 2


def test_the_servers_counters_are_read_from_their_prometheus_pages():
    """vLLM's computed tokens (prompt tokens less prefix-cache hits, summed over label
    sets) and the router's decode placement counters, from /metrics pages served here."""
    import http.server
    import threading

    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from pdserve.bench.multiturn_servers import _prometheus, _vllm_counters

    r = CollectorRegistry()
    prompt = Counter("vllm:prompt_tokens", "", ["model_name"], registry=r)
    prompt.labels(model_name="a").inc(100)
    prompt.labels(model_name="b").inc(20)
    Counter("vllm:prefix_cache_hits", "", registry=r).inc(30)
    Counter("pdserve_decode_placements", "", ["by"], registry=r).labels(by="cache").inc(3)
    page = generate_latest(r)

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert _vllm_counters(url) == {"computed": 90}
        got = _prometheus(url + "/metrics")
        assert got[("pdserve_decode_placements_total", (("by", "cache"),))] == 3
    finally:
        server.shutdown()
        server.server_close()
