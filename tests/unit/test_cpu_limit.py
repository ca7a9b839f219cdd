"""WorkerConfig.cpu_limit (pdserve/cpu_limit.py): a process joined to a worker's cgroup
is held to its quota (the kernel throttles it), and the group is removed once its
processes are gone. Skipped where no cgroup cpu controller is writable (no root)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve import cpu_limit
from pdserve.config import WorkerConfig


def _stat(path: str) -> dict[str, int]:
    with open(os.path.join(path, "cpu.stat")) as f:
        return {k: int(v) for k, v in (line.split() for line in f)}


def test_a_busy_process_is_throttled_at_its_quota_and_the_group_is_removed():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    group = cpu_limit.group_name()
    try:
        try:
            path = cpu_limit.join(group, "decode-0", 0.25, pid=busy.pid)
        except cpu_limit.CpuLimitError as e:
            pytest.skip(str(e))
        with open(os.path.join(path, "cgroup.procs")) as f:
            assert str(busy.pid) in f.read().split()
        if os.path.exists(os.path.join(path, "cpu.cfs_quota_us")):          # cgroup v1
            with open(os.path.join(path, "cpu.cfs_quota_us")) as f:
                assert int(f.read()) == cpu_limit.PERIOD_US // 4
        else:
            with open(os.path.join(path, "cpu.max")) as f:
                assert f.read().split() == [str(cpu_limit.PERIOD_US // 4), str(cpu_limit.PERIOD_US)]
        deadline = time.monotonic() + 10
        while _stat(path).get("nr_throttled", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _stat(path)["nr_throttled"] > 0         # it wanted a core and got a quarter
        # a second process of the same worker (a tensor-parallel rank) shares the cgroup
        assert cpu_limit.join(group, "decode-0", 0.25, pid=busy.pid) == path
    finally:
        busy.kill()
        busy.wait()
        cpu_limit.remove_group(group)
    root, _ = cpu_limit._cpu_root()
    assert not os.path.exists(os.path.join(root, group))


def test_cpu_limit_must_be_positive():
    with pytest.raises(ValueError, match="cpu_limit=0"):
        WorkerConfig(cpu_limit=0)
    with pytest.raises(ValueError, match="cpu_limit=-1"):
        cpu_limit.join("g", "w", -1)
