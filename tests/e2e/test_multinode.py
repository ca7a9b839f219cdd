"""Multi-node for real: three network namespaces joined by a bridge act as three hosts
on a private subnet that this test creates and deletes. Host 1 runs the Ray head and
`pdserve serve --address` (the router), host 2 a Ray node with the `pdserve_prefill`
resource, host 3 one with `pdserve_decode`. The model is a random-weight Llama of 4
query / 2 KV heads (SmolLM2's tokenizer; the default model's 9 heads do not split in
two). The prefill worker is tensor-parallel over 2 ranks (`--prefill-tp 2`), which sit
on host 2 (a STRICT_PACK placement group; they
join over host 2's loopback, which only a rank on host 2 can reach), and each rank
sends its KV heads over TCP across the bridge to the decode worker's node address;
greedy outputs must equal HF's (or differ first at a near-tie the test shows), the
workers must sit on their own hosts, and every KV pool must be free at the end.

Needs root and `ip netns` (iproute2); skipped with the reason otherwise. Every process
this test starts runs inside its namespaces and is killed by pid, the namespaces are
deleted, even on failure. Ray on each host uses its own temp dir and never `ray stop`
(which would stop every Ray instance on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from serving import assert_greedy_equals_hf
from tiny_models import tiny_model_dir

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
SUBNET = "10.213.77"                 # private test subnet: .1 head, .2 prefill, .3 decode
RAY_PORT = 6379
GRPC_PORT = 50051
PROMPTS = ["Write a long essay about the sea.", "The history of the railway begins",
           "Here is a list of fruits:"]
MAX_TOKENS = 12

CLIENT = """
import json, os, sys, time
import grpc
from pdserve.client import Client, make_request
prompts, n = json.loads(sys.argv[2]), int(sys.argv[3])
with Client(sys.argv[1], timeout_s=120) as c:    # no admin key: Drain refused
    try:
        c.drain(sys.argv[4], 10)
        refused = None
    except grpc.RpcError as e:
        refused = e.code().name
with Client(sys.argv[1], timeout_s=120,
            admin_api_key=os.environ["PDSERVE_ADMIN_API_KEY"]) as c:
    out = [c.generate(make_request(p, max_tokens=n, temperature=0))[0] for p in prompts]
    for _ in range(100):     # frees land asynchronously
        st = c.status()
        if all(w.kv_blocks_free == w.kv_blocks_total and not w.running_requests
               for w in st.workers):
            break
        time.sleep(0.05)
    workers = [{"id": w.worker_id, "role": w.role, "node_ip": w.node_ip, "state": w.state,
                "kv_address": w.kv_address, "free": w.kv_blocks_free,
                "total": w.kv_blocks_total, "running": w.running_requests,
                "tp": w.tensor_parallel_size} for w in st.workers]
    drain = c.drain(sys.argv[4], 10)     # what a Kubernetes preStop hook does
print(json.dumps({"tokens": out, "workers": workers, "refused": refused,
                  "drain": {"workers": list(drain.worker_ids), "drained": drain.drained}}))
"""


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"pdprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Namespaces `<tag>h1..h3` on SUBNET.0/24, bridged in a fourth (`<tag>sw`)."""

    def __init__(self, n: int = 3):
        self.tag = f"pd{uuid.uuid4().hex[:6]}"
        self.names = [f"{self.tag}h{i + 1}" for i in range(n)]
        self.switch = f"{self.tag}sw"
        self.ips = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Hosts":
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, (ns, addr) in enumerate(zip(self.names, self.ips)):
                _ip("netns", "add", ns)
                host_end, sw_end = f"{self.tag}e{i}", f"{self.tag}s{i}"
                _ip("link", "add", host_end, "type", "veth", "peer", "name", sw_end)
                _ip("link", "set", host_end, "netns", ns)
                _ip("link", "set", sw_end, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", sw_end, "master", "br0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", host_end)
                _ip("-n", ns, "link", "set", host_end, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def run(self, host: int, cmd: list[str], **kw) -> subprocess.Popen:
        """Start `cmd` on host `host` (0-based), in its own process group."""
        p = subprocess.Popen(["ip", "netns", "exec", self.names[host], *cmd],
                             start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):           # graceful first: Ray cleans its children
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.names, self.switch]:    # whatever is left in our namespaces
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_fidelity_across_three_hosts(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model("default"))   # converts once, shared
    model = str(tiny_model_dir("llama"))          # the tiny models share that tokenizer
    temp = Path(tempfile.mkdtemp(prefix="pdmn-", dir="/tmp"))        # short: socket paths
    head = f"{SUBNET}.1:{RAY_PORT}"
    # This cluster's own Ray auth token, shared by its nodes (never ~/.ray/auth_token)
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
                        "RAY_AUTH_TOKEN": secrets.token_hex(32),
                        # the router serves a non-loopback address: Drain needs the admin key
                        "PDSERVE_ADMIN_API_KEY": secrets.token_hex(16)}
    ray_common = ["--block", "--num-cpus=1", "--object-store-memory=100000000"]
    with Hosts() as hosts:
        try:
            logs = {name: open(tmp_path / f"{name}.log", "w") for name in
                    ("head", "prefill", "decode", "serve")}
            hosts.run(0, [str(BIN / "ray"), "start", "--head", f"--node-ip-address={SUBNET}.1",
                          f"--port={RAY_PORT}", f"--temp-dir={temp / 'h1'}", "--include-dashboard=false",
                          *ray_common],
                      env=env, stdout=logs["head"], stderr=subprocess.STDOUT)
            _wait_for_port(hosts, 0, f"{SUBNET}.1", RAY_PORT, 60, tmp_path / "head.log")
            for i, (name, res) in enumerate((("prefill", "pdserve_prefill"),
                                             ("decode", "pdserve_decode")), start=1):
                hosts.run(i, [str(BIN / "ray"), "start", f"--address={head}",
                              f"--node-ip-address={hosts.ips[i]}",
                              f"--resources={json.dumps({res: 1})}",
                              # per node: on one machine, nodes sharing a temp dir would
                              # share socket paths
                              f"--temp-dir={temp / f'h{i + 1}'}", *ray_common],
                          env=env, stdout=logs[name], stderr=subprocess.STDOUT)
            hosts.run(0, [str(BIN / "pdserve"), "serve", f"--address={head}", f"--model={model}",
                          f"--host={SUBNET}.1", f"--port={GRPC_PORT}", "--kv-host=auto",
                          "--metrics-port=0", "--transport=tcp",
                          "--prefill-resources", '{"pdserve_prefill": 1}',
                          "--decode-resources", '{"pdserve_decode": 1}',
                          "--prefill-kv-blocks=128", "--decode-kv-blocks=128",
                          "--prefill-tp=2",
                          "--threads-per-worker=1"],
                      env=env, stdout=logs["serve"], stderr=subprocess.STDOUT)
            _wait_for_ready(hosts.procs, 240, tmp_path / "serve.log")
            client = hosts.run(0, [sys.executable, "-c", CLIENT, f"{SUBNET}.1:{GRPC_PORT}",
                                   json.dumps(PROMPTS), str(MAX_TOKENS), f"{SUBNET}.3"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
            out, err = client.communicate(timeout=180)
            assert client.returncode == 0, err[-3000:]
            got = json.loads(out.strip().splitlines()[-1])
        except BaseException:
            for f in [*tmp_path.glob("*.log"),     # what each host said, for the failure
                      *temp.glob("h*/session_*/logs/raylet.*"),
                      *temp.glob("h*/session_*/logs/gcs_server.*")]:
                print(f"--- {f} ---\n{f.read_text(errors='replace')[-3000:]}")
            raise
        finally:
            shutil.rmtree(temp, ignore_errors=True)

    for p, ids in zip(PROMPTS, got["tokens"]):
        assert_greedy_equals_hf(model, tok(p)["input_ids"], ids)
    by_role = {w["role"]: w for w in got["workers"]}
    assert (by_role["prefill"]["tp"], by_role["decode"]["tp"]) == (2, 1), got["workers"]
    assert by_role["prefill"]["node_ip"] == f"{SUBNET}.2", got["workers"]
    assert by_role["decode"]["node_ip"] == f"{SUBNET}.3", got["workers"]
    assert by_role["decode"]["kv_address"].startswith(f"{SUBNET}.3:")   # the node's address
    for w in got["workers"]:
        assert w["state"] == "ready" and w["free"] == w["total"] and not w["running"], w
    assert got["refused"] == "PERMISSION_DENIED"
    assert got["drain"] == {"workers": ["decode-0"], "drained": True}


def _wait_for_port(hosts: Hosts, host: int, addr: str, port: int, timeout_s: float,
                   log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = subprocess.run(["ip", "netns", "exec", hosts.names[host], sys.executable, "-c",
                            f"import socket; socket.create_connection(('{addr}', {port}), 1)"],
                           capture_output=True)
        if r.returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{addr}:{port} did not open in {timeout_s} s:\n{log.read_text()[-3000:]}")


def _wait_for_ready(procs: list[subprocess.Popen], timeout_s: float, log: Path) -> None:
    """Wait for `pdserve serve`'s ready line in its log; fail at once when it or a Ray
    node (`ray start --block` runs until killed) exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if "pdserve ready" in log.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"serve not ready (exit codes {[p.poll() for p in procs]}):\n"
                         f"{log.read_text()[-3000:]}")
