"""vLLM's CPU build and pdserve as server processes, `vllm bench serve` run against one,
and what pdserve bench goodput asks of either (a rate point, the unloaded latency, who
prefilled)."""

from __future__ import annotations

import http.client
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .slo_attainment import latencies

if TYPE_CHECKING:
    from .peer import PeerConfig

TCMALLOC = "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class VllmSetting:
    """One vLLM CPU configuration of the sweep."""

    max_num_batched_tokens: int | None = None   # None: vLLM's default
    omp_bind: str = "0-1"                        # VLLM_CPU_OMP_THREADS_BIND
    tcmalloc: bool = False                       # LD_PRELOAD'ed

    def name(self) -> str:
        return (f"mnbt={self.max_num_batched_tokens or 'default'} bind={self.omp_bind}"
                + (" tcmalloc" if self.tcmalloc else ""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv_bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def vllm_bin() -> str:
    return os.environ.get("VLLM", ".venv-vllm/bin/vllm")


def sharegpt_json() -> Path:
    """vLLM's ShareGPT loader json.load()s the whole file; the packaged copy is cut
    mid-array, so its complete conversations are written once as a JSON array."""
    from ..engine.loader import cache_dir
    from ..sharegpt import conversations

    path = cache_dir() / "ShareGPT_V3_complete.json"
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(list(conversations())), encoding="utf-8")
        tmp.replace(path)
    return path


class Server:
    """A server in a session of its own (its pid is its process group), logging to
    `log`; stopped with SIGTERM to the group, then SIGKILL."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, port: int | None,
                 timeout_s: float, cwd: str | None = None):
        """`port` None: the server picks one and prints it in its ready line (pdserve
        serve --http-port 0), which closes the race of a port chosen free here and
        taken by another process (Ray's) before the server binds it."""
        self.cmd, self.env, self.log, self.port = cmd, env, log, port
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)
        while not ((self.port is not None or self._find_port()) and self._healthy()):
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited before /health answered: {log}")
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"no /health after {timeout_s:.0f} s: {log}")
            time.sleep(2)
        self.startup_s = time.monotonic() - t0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _find_port(self) -> bool:
        """Whether pdserve's ready line is printed; sets `port` from it."""
        for line in self.log.read_text().splitlines():
            if line.startswith("pdserve ready:") and "OpenAI HTTP on http://" in line:
                self.port = int(line.split("OpenAI HTTP on http://")[1].split("/")[0]
                                .rsplit(":", 1)[1])
                return True
        return False

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):  # not up, or not ours yet
            return False

    def complete(self, model: str, prompt: str, max_tokens: int) -> str:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["text"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._log.close()


def _env(extra: dict[str, str]) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", **extra)


def start_vllm(cfg: PeerConfig, model_dir: str, dtype: str, setting: VllmSetting,
               log: Path) -> Server:
    port = _free_port()
    cmd = [vllm_bin(), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", DTYPES[dtype], "--max-model-len", str(cfg.max_model_len)]
    if setting.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(setting.max_num_batched_tokens)]
    env = {"VLLM_CPU_OMP_THREADS_BIND": setting.omp_bind}
    if setting.omp_bind != "auto":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"     # both cores to the engine
    if cfg.kv == "equal":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{cfg.kv_gib:g}"
    elif cfg.vllm_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", f"{cfg.vllm_memory_utilization:g}"]
    if setting.tcmalloc:
        env["LD_PRELOAD"] = TCMALLOC
    return Server(cmd, _env(env), log, port, cfg.startup_timeout_s)


def start_pdserve(cfg: PeerConfig, model_dir: str, dtype: str, log: Path) -> Server:
    cmd = [cfg.pdserve_bin or _venv_bin("pdserve"), "serve", "--model", model_dir,
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--http-port", "0",
           "--dtype", DTYPES[dtype], *cfg.pdserve_args]
    if cfg.kv == "equal":
        cmd += ["--kv-cache-memory-bytes", f"{int(cfg.kv_gib * 2**30)}"]
    # another build runs where this checkout's packages are not on its path (`serve`
    # starts `python -m pdserve.cli` processes, which would import them from the cwd)
    cwd = str(Path(cfg.pdserve_bin).resolve().parent) if cfg.pdserve_bin else None
    return Server(cmd, _env({}), log, None, cfg.startup_timeout_s, cwd)


def resolved_config(system: str, server: Server) -> dict:
    """What the server resolved its settings to: vLLM's logged engine configuration and
    KV size; pdserve's workers from its status (KV blocks each)."""
    out = {"command": shlex.join(server.cmd), "startup_s": round(server.startup_s, 1),
           "env": {k: v for k, v in server.env.items()
                   if k.startswith(("VLLM_", "LD_PRELOAD", "OMP_"))}}
    if system == "vllm":
        keep = ("non-default args", "Initializing a V1 LLM engine", "KV cache", "Auto set",
                "Explicitly set", "max_num_batched_tokens", "OMP threads")
        out["log_lines"] = [line.strip() for line in server.log.read_text().splitlines()
                            if any(k in line for k in keep)][:20]
    else:
        status = subprocess.run([_venv_bin("pdserve"), "status", "--server",
                                 grpc_address(server.log)], capture_output=True, text=True,
                                timeout=60)
        out["status"] = status.stdout
    return out


def grpc_address(log: Path) -> str:
    """The gRPC address pdserve serve printed as ready (its --port 0 picks one)."""
    for line in log.read_text().splitlines():
        if line.startswith("pdserve ready: gRPC on "):
            return line.split("gRPC on ")[1].split(",")[0].split(" ")[0]
    raise RuntimeError(f"no ready line in {log}")


def run_client(cfg: PeerConfig, server: Server, model_dir: str, system: str, dtype: str,
               temperature: float, seed: int, out: Path) -> dict:
    """`vllm bench serve` against `server`: one cell's burst; returns its result JSON
    (per-request detail included)."""
    cmd = [vllm_bin(), "bench", "serve", "--backend", "openai", "--base-url", server.url,
           "--model", model_dir, "--dataset-name", "sharegpt",
           "--dataset-path", str(sharegpt_json()), "--num-prompts", str(cfg.num_prompts),
           "--sharegpt-output-len", str(cfg.output_len), "--ignore-eos",
           "--request-rate", "inf", "--seed", str(seed), "--temperature", f"{temperature:g}",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--disable-tqdm",
           "--result-dir", str(out.parent), "--result-filename", out.name,
           "--metadata", f"system={system}", f"dtype={dtype}", f"seed={seed}"]
    r = subprocess.run(cmd, env=_env({}), capture_output=True, text=True, timeout=3600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-2000:]}"
                           f"\n{r.stderr[-2000:]}")
    return json.loads(out.read_text())


def bench_serve(server: Server, model_dir: str, requests: list[dict], rate: float, seed: int,
            out: Path, temperature: float = 0.0, extra: tuple[str, ...] = ()) -> dict:
    """`vllm bench serve` of `requests` at `rate` (Poisson; inf: a burst) against
    `server`; returns its result with per-request detail."""
    data = out.with_suffix(".jsonl")
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "output_tokens": r["output_tokens"]})
                            + "\n" for r in requests))
    cmd = [vllm_bin(), "bench", "serve", "--backend", "openai", "--base-url", server.url,
           "--model", model_dir, "--dataset-name", "custom", "--dataset-path", str(data),
           "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle",
           "--num-prompts", str(len(requests)), "--ignore-eos", "--request-rate", f"{rate:g}",
           "--seed", str(seed), "--temperature", f"{temperature:g}", "--save-result",
           "--save-detailed", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--result-dir", str(out.parent), "--result-filename", out.name, *extra]
    r = subprocess.run(cmd, env=_env({}), capture_output=True, text=True, timeout=3600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-2000:]}"
                           f"\n{r.stderr[-2000:]}")
    return json.loads(out.read_text())


def prefills(server: Server) -> dict[str, float]:
    """A pdserve server's count of request attempts by who prefilled them
    (pdserve_prefills_total: {"prefill_worker": n, "decode_worker": m})."""
    import urllib.request

    from ..client import Client  # grpc, only where a pdserve server is asked

    with Client(grpc_address(server.log), timeout_s=30) as c:
        address = c.status().metrics_address
    out = {"prefill_worker": 0.0, "decode_worker": 0.0}
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("pdserve_prefills_total{"):
                on = line.split('on="')[1].split('"')[0]
                out[on] = float(line.rsplit(" ", 1)[1])
    return out


def unloaded(server: Server, model_dir: str, pool: list[dict], spare: list[dict],
             out: Path) -> dict:
    """TTFT and TPOT (medians, seconds) of lone requests of the workload's median prompt
    length: the five prompts of `spare` (sent at no rate point) nearest `pool`'s
    median, one at a time."""
    median = statistics.median(r["prompt_tokens"] for r in pool)
    lone = sorted(spare, key=lambda r: abs(r["prompt_tokens"] - median))[:5]
    res = bench_serve(server, model_dir, lone, math.inf, 0, out, extra=("--max-concurrency", "1"))
    lat = [x for x in latencies(res) if x is not None]
    if not lat:
        raise RuntimeError(f"every lone request failed ({out}): no unloaded latency")
    return {"prompt_tokens": median, "ttft_s": statistics.median(x[0] for x in lat),
            "tpot_s": statistics.median(x[1] for x in lat)}
