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

import pytest

pytestmark = pytest.mark.slow
PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_generate_status_and_sigint():
    port = _free_port()
    server = subprocess.Popen([*PDSERVE, "serve", "--port", str(port), "--decode-kv-blocks", "128",
                               "--prefill-kv-blocks", "128", "--max-queued-requests", "8"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        deadline, lines = time.monotonic() + 240, []
        while time.monotonic() < deadline:
            ready, _, _ = select.select([server.stdout], [], [], 1.0)
            if ready:
                line = server.stdout.readline()
                lines.append(line)
                if "ready" in line:
                    break
            assert server.poll() is None, "".join(lines)
        else:
            pytest.fail("serve never printed ready:\n" + "".join(lines))
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
        assert all(r[6] == r[7] == "128" for r in rows), st.stdout   # every block free
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
