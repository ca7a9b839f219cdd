"""The servers of `pdserve bench multiturn` (multiturn.py) and the counters read from
them: prompt tokens computed, and for pdserve the blocks each KV tier served."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path

from .servers import Server, VllmSetting, _env, _free_port, _venv_bin, grpc_address, vllm_bin

MAX_MODEL_LEN = 4096


def start_arm(arm: str, cfg, model_dir: str, disk_dir: Path, log: Path
              ) -> tuple[Server, Callable[[], dict[str, int]]]:
    """The server of `arm` (multiturn.ARMS) with its KV sized by `cfg`
    (MultiTurnConfig), logging to `log`, and a reader of its counters: "computed"
    (prompt tokens computed), and for pdserve "host" / "disk" (blocks the KV tiers
    served). Raises ValueError: an unknown arm; RuntimeError: the server did not start."""
    pool = str(int(cfg.pool_gib * 2**30))
    if arm == "vllm":    # at its tuned setting (`pdserve bench peer --tune`), if any
        from .peer import load_tuning
        setting = load_tuning("bench/results/peer").get("fp32", VllmSetting())
        port = _free_port()
        cmd = [vllm_bin(), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory-bytes", pool]
        if setting.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(setting.max_num_batched_tokens)]
        env = {"VLLM_CPU_OMP_THREADS_BIND": setting.omp_bind}
        if setting.omp_bind != "auto":
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"     # both cores to the engine
        server = Server(cmd, _env(env), log, port, cfg.startup_timeout_s)
        return server, lambda: _vllm_counters(server.url)
    if arm not in ("pdserve", "tiers"):
        raise ValueError(f"arm {arm!r}: choose from vllm, pdserve, tiers")
    # every prompt on the prefill worker, whose pool (and tiers) the arms compare
    cmd = [_venv_bin("pdserve"), "serve", "--model", model_dir, "--host", "127.0.0.1",
           "--port", "0", "--metrics-port", "0", "--http-port", "0", "--dtype", "float32",
           "--prefill-kv-cache-memory-bytes", pool, "--no-local-prefill-when-prefill-idle",
           "--max-prefill-queue-tokens", "0"]
    if arm == "tiers":
        cmd += ["--kv-host-cache-gib", f"{cfg.host_gib:g}", "--kv-disk-cache-dir",
                str(disk_dir), "--kv-disk-cache-gib", f"{cfg.disk_gib:g}"]
    server = Server(cmd, _env({}), log, None, cfg.startup_timeout_s)
    return server, lambda: _pdserve_counters(grpc_address(log))


def _vllm_counters(url: str) -> dict[str, int]:
    """vLLM's /metrics: prompt tokens less those its prefix cache served."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = {"vllm:prompt_tokens_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in total:
            total[name] += float(line.rsplit(" ", 1)[1])
    return {"computed": int(total["vllm:prompt_tokens_total"]
                            - total["vllm:prefix_cache_hits_total"])}


def _pdserve_counters(address: str) -> dict[str, int]:
    """The prefill workers' prompt tokens computed and KV-tier hits, from ClusterStatus
    (the arms send every prompt to a prefill worker)."""
    from ..client import Client

    client = Client(address, timeout_s=60)
    try:
        workers = client.status().workers
    finally:
        client.close()
    return {"computed": sum(w.prefill_tokens_computed for w in workers),
            "host": sum(w.kv_tier_host_hit_blocks for w in workers),
            "disk": sum(w.kv_tier_disk_hit_blocks for w in workers)}
