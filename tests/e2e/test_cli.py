"""The CLI as a user runs it: `pdserve serve` in its own process (own Ray instance),
`pdserve generate` and `pdserve status` against it, then SIGINT shuts it all down."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.slow
PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_serve(*args: str) -> tuple[subprocess.Popen, list[str]]:
    """`pdserve serve ARGS` in a process group of its own, once it printed ready; returns
    it and the lines it printed."""
    server = subprocess.Popen([*PDSERVE, "serve", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline, lines = time.monotonic() + 240, []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([server.stdout], [], [], 1.0)
        if ready:
            line = server.stdout.readline()
            lines.append(line)
            if "ready" in line:
                return server, lines
        if server.poll() is not None:
            break
    os.killpg(server.pid, signal.SIGKILL)
    pytest.fail("serve never printed ready:\n" + "".join(lines))


def test_serve_generate_status_and_sigint():
    port = _free_port()
    # the decode pool in bytes (vLLM's flag), the prefill pool its share of the box
    server, _ = _start_serve("--port", str(port), "--kv-cache-memory-bytes", "64MiB",
                             "--max-queued-requests", "8")
    try:
        addr = f"127.0.0.1:{port}"
        gen = subprocess.run([*PDSERVE, "generate", "--server", addr, "--max-tokens", "8",
                              "--temperature", "0", "The capital of France is"],
                             capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, gen.stderr
        assert "Paris" in gen.stdout
        assert "finish_reason=length" in gen.stderr and "completion_tokens=8" in gen.stderr
        bad = subprocess.run([*PDSERVE, "generate", "--server", addr, "--temperature", "-1", "x"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "INVALID_ARGUMENT: sampling.temperature" in bad.stderr
        st = subprocess.run([*PDSERVE, "status", "--server", addr], capture_output=True,
                            text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        rows = [line.split() for line in st.stdout.splitlines()[2:]]
        assert {r[1] for r in rows} == {"prefill", "decode"}
        assert all(r[6] == r[7] for r in rows), st.stdout           # every block free
        blocks = {r[1]: int(r[7]) for r in rows}
        per_block = 30 * 2 * 16 * 3 * 64 * 4     # layers, K/V, tokens, KV heads, head_dim, fp32
        assert blocks["decode"] == (64 << 20) // per_block, st.stdout
        assert blocks["prefill"] > 1024, st.stdout     # 0.92 / 4 of the box, less weights
        assert "queued for prefill: 0 requests, 0 prompt tokens" in st.stdout.splitlines()[0]
    finally:
        os.killpg(server.pid, signal.SIGINT) if server.poll() is None else None
        try:
            out, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
    assert server.returncode == 0, out
    assert "shutting down" in out


def test_sigterm_to_the_whole_process_group_exits_0_and_leaves_no_process():
    """`kill -TERM -PGID` (what a supervisor stopping a process tree sends)
    reaches every process of `serve` at once. It exits 0 with no traceback, and nothing
    it started (the driver, GCS, raylet, the actors) is left 30 s later."""
    server, lines = _start_serve("--port", "0", "--prefill-kv-blocks", "64",
                                 "--decode-kv-blocks", "64")
    started = psutil.Process(server.pid).children(recursive=True)
    assert any("raylet" in p.name() for p in started), [p.name() for p in started]
    os.killpg(server.pid, signal.SIGTERM)
    try:
        out, _ = server.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        raise
    out = "".join(lines) + out
    assert server.returncode == 0, out
    assert "shutting down" in out
    for mark in ("Traceback", "SIGTERM received", "Error", "failed"):
        assert mark not in out, out
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
