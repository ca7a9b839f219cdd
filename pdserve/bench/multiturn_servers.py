"""The servers of `pdserve bench multiturn` (multiturn.py) and the counters read from
them: prompt tokens computed, and for pdserve the blocks each KV tier served."""

from __future__ import annotations

import shlex
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
    if arm == "vllm":    # its one pool as much KV space as pdserve's two    # at its tuned setting (`pdserve bench peer --tune`), if any
        from .peer import load_tuning
        setting = load_tuning("bench/results/peer").get("fp32", VllmSetting())
        port = _free_port()
        cmd = [vllm_bin(), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory-bytes", _bytes(cfg.pool_gib + cfg.decode_pool_gib)]
        if setting.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(setting.max_num_batched_tokens)]
        env = {"VLLM_CPU_OMP_THREADS_BIND": setting.omp_bind}
        if setting.omp_bind != "auto":
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"     # both cores to the engine
        server = Server(cmd, _env(env), log, port, cfg.startup_timeout_s)
        return server, lambda: _vllm_counters(server.url)
    if arm not in ("pdserve", "tiers", "pull"):
        raise ValueError(f"arm {arm!r}: choose from vllm, pdserve, tiers, pull")
    # pdserve's placement defaults; a turn whose uncached part is at most
    # local_prefill_max_tokens (after the decode worker's pool and tiers) is prefilled there
    cmd = [_venv_bin("pdserve"), "serve", "--model", model_dir, "--host", "127.0.0.1",
           "--port", "0", "--metrics-port", "0", "--http-port", "0", "--dtype", "float32",
           "--prefill-kv-cache-memory-bytes", _bytes(cfg.pool_gib),
           "--kv-cache-memory-bytes", _bytes(cfg.decode_pool_gib),
           "--local-prefill-max-tokens", str(cfg.local_prefill_max_tokens),
           *shlex.split(cfg.pdserve_args)]
    if arm in ("tiers", "pull"):
        cmd += ["--kv-host-cache-gib", f"{cfg.host_gib:g}", "--kv-disk-cache-dir",
                str(disk_dir), "--kv-disk-cache-gib", f"{cfg.disk_gib:g}"]
    if arm == "pull":    # later flags win
        cmd += ["--kv-pull", *shlex.split(cfg.pull_args)]
    server = Server(cmd, _env({}), log, None, cfg.startup_timeout_s)
    return server, lambda: _pdserve_counters(grpc_address(log))


def _bytes(gib: float) -> str:
    return str(int(gib * 2**30))


def _vllm_counters(url: str) -> dict[str, int]:
    """vLLM's /metrics: prompt tokens less those its prefix cache served."""
    samples = _prometheus(url + "/metrics")

    def total(name: str) -> float:
        return sum(v for (n, _), v in samples.items() if n == name)

    return {"computed": int(total("vllm:prompt_tokens_total")
                            - total("vllm:prefix_cache_hits_total"))}


def _pdserve_counters(address: str) -> dict[str, int]:
    """The workers' prompt tokens computed (prefill workers' and decode workers' local
    prefills) and KV-tier hits, from ClusterStatus."""
    from ..client import Client

    client = Client(address, timeout_s=60)
    try:
        status = client.status()
    finally:
        client.close()
    workers = status.workers
    router = _prometheus(f"http://{status.metrics_address}/metrics")
    by_role = {role: [w for w in workers if w.role == role] for role in ("prefill", "decode")}
    return {"computed": sum(w.prefill_tokens_computed for w in workers),
            "host": sum(w.kv_tier_host_hit_blocks for w in workers),
            "disk": sum(w.kv_tier_disk_hit_blocks for w in workers),
            **{f"computed_{role}": sum(w.prefill_tokens_computed for w in ws)
               for role, ws in by_role.items()},
            **{f"tier_load_ms_{role}": int(sum(w.kv_tier_load_seconds for w in ws) * 1e3)
               for role, ws in by_role.items()},
            "local_prefills": sum(w.local_prefills for w in by_role["decode"]),
            **({f"computed_{w.worker_id}": w.prefill_tokens_computed for w in by_role["decode"]}
               if len(by_role["decode"]) > 1 else {}),
            "pulled_blocks": sum(w.kv_pulled_blocks for w in workers),
            "pull_ms": int(sum(w.kv_pull_seconds for w in workers) * 1e3),
            "pull_failures": sum(w.kv_pull_failures for w in workers),
            "decode_by_cache": int(router.get(("pdserve_decode_placements_total",
                                               (("by", "cache"),)), 0)),
            "decode_refusals": int(router.get(("pdserve_decode_refusals_total", ()), 0))}


def _prometheus(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus /metrics page, by (name, its labels as sorted
    (label, value) pairs)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}
