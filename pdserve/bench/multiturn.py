"""`pdserve bench multiturn`: ShareGPT conversations replayed turn by turn, many users at
once, against vLLM's CPU build and pdserve with and without KV tiers, through one client.

Each user is one conversation: turn k's prompt is the chat template over the dataset's
first k user messages and the dataset's replies between them (so every server sees the
same prompts, whatever it answers). `clients` send at once, as vLLM's multi-turn
benchmark's clients do over its active conversations: each takes the user first in line,
sends that user's next turn, and once its answer (`max_tokens`, ignore_eos) is done puts
the user at the back of the line. With more users than clients, a user's next turn comes
after the other users' turns, and its history is still cached only if nothing evicted it
meanwhile. The KV is sized so the users' histories do not fit a worker's pool: the
prefill worker's pool `pool_gib`, the decode worker's `decode_pool_gib` (room for the
running requests), vLLM's one pool the two together.

Reported per arm: TTFT of each turn (mean, median), the prompt tokens the server computed
against those it took from a cache, and for pdserve the blocks each KV tier served;
`out_dir`/multiturn.json holds every turn, `out_dir`/ttft_per_turn.png the plot.
Arms:
- `vllm`: `vllm serve` with its prefix caching (on by default), KV space `pool_gib` +
  `decode_pool_gib`;
- `pdserve`: `pdserve serve` with those pools, no tiers, its placement defaults and
  `--local-prefill-max-tokens local_prefill_max_tokens`: a turn whose uncached part (after
  the decode worker's prefix cache) is at most that is prefilled on the decode worker;
- `tiers`: the same with `--kv-host-cache-gib host_gib` and a disk tier of `disk_gib`
  under each worker's pool;
- `pull`: `tiers` with `--kv-pull` and then `pull_args`: a turn sent to the prefill
  worker reads the history its decode worker holds (pool or tier) instead of computing
  it (prefill_worker/kv_pull.py).

Every arm runs on a fresh server (and a fresh disk tier).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

ARMS = ("vllm", "pdserve", "tiers", "pull")


@dataclass
class MultiTurnConfig:
    model: str = "default"
    users: int = 48                   # conversations
    clients: int = 16                 # turns in flight at most
    turns: int = 6
    max_tokens: int = 32              # each turn's answer (ignore_eos)
    temperature: float = 0.0          # 0: greedy; else sampled (unseeded: vLLM 0.32's
                                      # CPU engine dies on a request's seed when sampling)
    max_prompt_tokens: int = 3072     # a conversation's last turn at most this long
    seed: int = 1                     # which conversations (0 is the tuning sample)
    arms: tuple[str, ...] = ARMS
    pool_gib: float = 0.25            # the prefill worker's pool
    decode_pool_gib: float = 1.0      # the decode worker's; vLLM's KV space is both
    host_gib: float = 2.0             # the tiers arm's host tier under each pool
    disk_gib: float = 4.0             # ... and disk tier
    # pdserve's setting for this workload, tuned on seed 0's tiers arm (docs/kv_tiers.md):
    # turns the decode worker prefills itself (all, here: the prefill worker idles and
    # lends it its core), shortest first, in chunks of 256 tokens beside the streams
    local_prefill_max_tokens: int = 2048
    pdserve_args: str = "--schedule-policy sjf --chunked-prefill-size 256"
    # the pull arm's flags after those, tuned on seed 0 (docs/kv_tiers.md): placement's
    # defaults (a turn goes to the prefill worker, or to the decode worker when the
    # prefill worker is idle or backed up); the prefill worker reads the history the
    # decode worker holds
    pull_args: str = "--local-prefill-max-tokens 0"
    out_dir: str = "bench/results/multiturn"
    startup_timeout_s: float = 900.0


@dataclass
class TurnResult:
    user: int
    turn: int                         # 0-based
    prompt_tokens: int
    ttft_s: float | None              # None: failed
    error: str = ""


@dataclass
class ArmResult:
    arm: str
    turns: list[TurnResult] = field(default_factory=list)
    prompt_tokens: int = 0            # all turns' prompts
    computed_tokens: int | None = None   # of those, computed (the rest from a cache)
    tier_hit_blocks: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)   # the server's, over the run
    command: str = ""


def conversations(tokenizer, cfg: MultiTurnConfig) -> list[list[str]]:
    """`cfg.users` conversations of at least `cfg.turns` user messages, picked by
    `cfg.seed`, each as its turns' prompts (chat template text, generation prompt added),
    the last at most `cfg.max_prompt_tokens` tokens. Raises ValueError: too few."""
    from ..sharegpt import conversations as all_conversations

    pool = [c for c in all_conversations() if _messages(c, cfg.turns)]
    random.Random(cfg.seed).shuffle(pool)
    picked = []
    for conv in pool:
        msgs = _messages(conv, cfg.turns)
        prompts = [tokenizer.apply_chat_template(msgs[:2 * k + 1], tokenize=False,
                                                 add_generation_prompt=True)
                   for k in range(cfg.turns)]
        if len(tokenizer(prompts[-1])["input_ids"]) <= cfg.max_prompt_tokens:
            picked.append(prompts)
            if len(picked) == cfg.users:
                return picked
    raise ValueError(f"only {len(picked)} ShareGPT conversations have {cfg.turns} turns "
                     f"within {cfg.max_prompt_tokens} tokens")


def _messages(conv: dict, turns: int) -> list[dict] | None:
    """The first `turns` user messages and the replies between them, alternating, or
    None when the conversation has fewer or does not alternate."""
    roles = {"human": "user", "gpt": "assistant"}
    msgs = [{"role": roles.get(m.get("from")), "content": m.get("value", "")}
            for m in conv.get("conversations", [])][:2 * turns - 1]
    if len(msgs) < 2 * turns - 1 or any(
            m["role"] != ("user", "assistant")[i % 2] or not m["content"]
            for i, m in enumerate(msgs)):
        return None
    return msgs


def replay(url: str, prompts: list[list[str]], max_tokens: int, clients: int,
           temperature: float = 0.0) -> list[TurnResult]:
    """Every user's turns against the OpenAI-compatible server at `url`, each user's in
    order, `clients` turns in flight (see the module docstring); TTFT per turn (first
    streamed chunk)."""
    import openai

    results: list[TurnResult] = []
    line = deque((u, 0) for u in range(len(prompts)))    # (user, next turn), first in line
    cond = threading.Condition()
    left = sum(map(len, prompts))
    with openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="EMPTY", max_retries=0,
                       timeout=3600) as client:
        model = client.models.list().data[0].id

        def send() -> None:
            nonlocal left
            while True:
                with cond:
                    while not line and left:
                        cond.wait()
                    if not left:
                        return
                    u, k = line.popleft()
                r = _turn(client, model, prompts[u][k], max_tokens, u, k,
                          temperature=temperature)
                with cond:
                    results.append(r)
                    left -= 1
                    if k + 1 < len(prompts[u]):
                        line.append((u, k + 1))
                    cond.notify_all()

        threads = [threading.Thread(target=send) for _ in range(min(clients, len(prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return sorted(results, key=lambda r: (r.user, r.turn))


def _turn(client, model: str, prompt: str, max_tokens: int, u: int, k: int,
          temperature: float = 0.0) -> TurnResult:
    import openai

    t0, ttft, tokens = time.perf_counter(), None, 0
    try:
        for chunk in client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}):
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.prompt_tokens
    except openai.APIError as e:
        return TurnResult(u, k, tokens, None, str(e)[:200])
    return TurnResult(u, k, tokens, ttft)


def summary(arm: ArmResult, turns: int) -> dict:
    """Per turn: mean and median TTFT (ms) of the users' turns that succeeded."""
    out = {"arm": arm.arm, "failed": sum(r.ttft_s is None for r in arm.turns),
           "prompt_tokens": arm.prompt_tokens, "computed_tokens": arm.computed_tokens,
           "tier_hit_blocks": arm.tier_hit_blocks, "counters": arm.counters, "turns": []}
    for k in range(turns):
        ttfts = [r.ttft_s * 1e3 for r in arm.turns if r.turn == k and r.ttft_s is not None]
        out["turns"].append({"turn": k + 1, "n": len(ttfts),
                             "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else None,
                             "median_ttft_ms": statistics.median(ttfts) if ttfts else None})
    later = [r.ttft_s * 1e3 for r in arm.turns if r.turn >= 1 and r.ttft_s is not None]
    out["mean_ttft_ms_turns_2_on"] = statistics.fmean(later) if later else None
    return out


def table(summaries: list[dict]) -> str:
    head = ["arm", *(f"turn {t['turn']} ms" for t in summaries[0]["turns"]),
            "turns>=2 ms", "computed / prompt tokens", "tier hits (blocks)", "failed"]
    rows = [head]
    for s in summaries:
        comp = ("?" if s["computed_tokens"] is None
                else f"{s['computed_tokens']:,} / {s['prompt_tokens']:,}")
        rows.append([s["arm"], *(f"{t['mean_ttft_ms']:.0f}" if t["mean_ttft_ms"] else "-"
                                 for t in s["turns"]),
                     f"{s['mean_ttft_ms_turns_2_on']:.0f}" if s["mean_ttft_ms_turns_2_on"]
                     else "-", comp,
                     ", ".join(f"{k} {v}" for k, v in s["tier_hit_blocks"].items()) or "-",
                     str(s["failed"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def plot(summaries: list[dict], path: Path) -> None:
    """Mean TTFT per turn, one line per arm, into the PNG `path`."""
    from .plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        pts = [(t["turn"], t["mean_ttft_ms"]) for t in s["turns"] if t["mean_ttft_ms"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s["arm"])
    ax.set_xlabel("turn")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_xticks([t["turn"] for t in summaries[0]["turns"]])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: MultiTurnConfig, progress=print) -> list[dict]:
    """Every arm of `cfg` on a fresh server, in order; their summaries, also written to
    `cfg.out_dir`/multiturn.json with the per-turn results."""
    from transformers import AutoTokenizer

    from ..engine.loader import resolve_model
    from .multiturn_servers import start_arm

    model_dir = str(resolve_model(cfg.model))
    prompts = conversations(AutoTokenizer.from_pretrained(model_dir), cfg)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries, raw = [], []
    for arm in cfg.arms:
        progress(f"{arm}: starting the server ...")
        with tempfile.TemporaryDirectory(prefix="pdserve-tier-") as disk:
            server, counters = start_arm(arm, cfg, model_dir, Path(disk), out / f"{arm}.log")
            try:
                t0 = time.perf_counter()
                result = ArmResult(arm, command=" ".join(server.cmd))
                before = counters()
                result.turns = replay(server.url, prompts, cfg.max_tokens, cfg.clients,
                                      cfg.temperature)
                after = counters()
                result.prompt_tokens = sum(r.prompt_tokens for r in result.turns)
                result.computed_tokens = after.get("computed", 0) - before.get("computed", 0)
                result.tier_hit_blocks = {k: after[k] - before.get(k, 0) for k in after
                                          if k in ("host", "disk")}
                result.counters = {k: v - before.get(k, 0) for k, v in after.items()}
            finally:
                server.stop()
        summaries.append(summary(result, cfg.turns))
        raw.append(asdict(result))
        progress(f"{arm}: done in {time.perf_counter() - t0:.0f} s")
    (out / "multiturn.json").write_text(json.dumps(
        {"config": asdict(cfg), "summaries": summaries, "runs": raw}, indent=2))
    plot(summaries, out / "ttft_per_turn.png")
    return summaries


def add_parser(bsub) -> None:
    """`pdserve bench multiturn` on `bsub` (the bench subcommands' argparse subparsers)."""
    p = bsub.add_parser("multiturn", help="ShareGPT conversations turn by turn, many users "
                                          "at once: TTFT per turn and prompt tokens computed "
                                          "of vLLM and pdserve with and without KV tiers")
    d = MultiTurnConfig()
    p.add_argument("--model", default=d.model)
    p.add_argument("--users", type=int, default=d.users, help="conversations")
    p.add_argument("--clients", type=int, default=d.clients, help="turns in flight at most")
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="each turn's answer")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="0: greedy; else sampled")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--seed", type=int, default=d.seed, help="the conversations (0: tuning)")
    p.add_argument("--arms", default=",".join(d.arms))
    p.add_argument("--pool-gib", type=float, default=d.pool_gib,
                   help="the prefill worker's KV pool")
    p.add_argument("--decode-pool-gib", type=float, default=d.decode_pool_gib,
                   help="the decode worker's KV pool (vLLM's KV space: both pools)")
    p.add_argument("--host-gib", type=float, default=d.host_gib,
                   help="the tiers arm's host tier under each worker's pool")
    p.add_argument("--disk-gib", type=float, default=d.disk_gib)
    p.add_argument("--local-prefill-max-tokens", type=int,
                   default=d.local_prefill_max_tokens,
                   help="pdserve: a turn with at most this many uncached tokens is "
                        "prefilled on the decode worker")
    p.add_argument("--pdserve-args", default=d.pdserve_args,
                   help="more `pdserve serve` flags for the pdserve arms (one string)")
    p.add_argument("--pull-args", default=d.pull_args,
                   help="the pull arm's `pdserve serve` flags after --pdserve-args")
    p.add_argument("--out-dir", default=d.out_dir)
    p.set_defaults(fn=_command)


def _command(args) -> int:
    import sys

    cfg = MultiTurnConfig(model=args.model, users=args.users, clients=args.clients,
                          turns=args.turns, max_tokens=args.max_tokens,
                          temperature=args.temperature,
                          max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
                          arms=tuple(args.arms.split(",")), pool_gib=args.pool_gib,
                          decode_pool_gib=args.decode_pool_gib, host_gib=args.host_gib,
                          disk_gib=args.disk_gib,
                          local_prefill_max_tokens=args.local_prefill_max_tokens,
                          pdserve_args=args.pdserve_args, pull_args=args.pull_args,
                          out_dir=args.out_dir)
    try:
        summaries = run(cfg)
    except (ValueError, RuntimeError) as e:
        print(f"pdserve bench multiturn: {e}", file=sys.stderr)
        return 2
    print(table(summaries))
    return 0
