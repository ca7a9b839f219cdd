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


def test_the_cpu_controller_is_found_in_mountinfo(tmp_path):
    """cgroup v1's `cpu` hierarchy wins; else a cgroup2 root whose subtree_control
    enables cpu; else a clear error (runs without root: no cgroup is touched)."""
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.subtree_control").write_text("cpuset memory\n")
    lines = {
        "v1": f"30 25 0:26 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
              f"31 25 0:27 / {v2} rw - cgroup2 cgroup2 rw\n",
        "v2": f"31 25 0:27 / {v2} rw - cgroup2 cgroup2 rw\n"
              f"32 25 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
    }
    info = {k: tmp_path / f"mountinfo-{k}" for k in lines}
    for k, text in lines.items():
        info[k].write_text(text)
    assert cpu_limit._cpu_root(str(info["v1"])) == ("/sys/fs/cgroup/cpu", 1)
    with pytest.raises(cpu_limit.CpuLimitError, match="no v1 'cpu' hierarchy"):
        cpu_limit._cpu_root(str(info["v2"]))            # cpu not enabled in v2's root
    (v2 / "cgroup.subtree_control").write_text("cpuset cpu memory\n")
    assert cpu_limit._cpu_root(str(info["v2"])) == (str(v2), 2)
