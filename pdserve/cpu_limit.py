"""A CPU cap per worker: its processes in a cgroup of their own with a CFS bandwidth
quota, the mechanism a Kubernetes container's `resources.limits.cpu` uses (the kubelet
writes such a quota, over a 100 ms period; kubernetes.io, "Resource Management for Pods
and Containers").

`WorkerConfig.cpu_limit` cores: every process of the worker (its actor, and a
tensor-parallel worker's other ranks) joins `<cpu controller>/<group>/<worker_id>`,
whose quota is `cpu_limit` x the period, so together they run at most that many cores'
time however many threads they have. On one box this makes each worker one fixed-size
"device", as a GPU or a CPU-limited pod is, where an uncapped worker would use the
cores an idle neighbour leaves (the planner bench, `pdserve bench planner`, sizes pools
of such workers). Cgroup v1 (the `cpu` controller's `cpu.cfs_quota_us`) or v2
(`cpu.max`, under the hierarchy's root, whose subtree_control must enable `cpu`).
Writing there needs root or a delegated hierarchy; `Cluster.start` makes the group's
name and `Cluster.stop` removes it (`remove_group`) on its own node: it is meant for one
box (benchmarks); on other nodes the empty cgroups stay until removed by hand. A quota
below 1 ms per period (0.1 core) is raised to it, the kernel's least.
"""

from __future__ import annotations

import errno
import os
import time
import uuid

PERIOD_US = 10_000   # CFS period: a 10 ms quota window keeps a capped worker's steps
                     # even (the kernel's default 100 ms throttles a 0.6-core worker for
                     # 40 ms at a time, longer than a decode step here)


class CpuLimitError(RuntimeError):
    """No writable cgroup cpu controller; the message says what was found."""


def _cpu_root(mountinfo: str = "/proc/self/mountinfo") -> tuple[str, int]:
    """(mount point, cgroup version) of this machine's cpu controller, from `mountinfo`
    (proc(5)'s format).

    Raises:
        CpuLimitError: neither a v1 `cpu` hierarchy nor a v2 root with `cpu` enabled.
    """
    v2 = None
    with open(mountinfo) as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fstype, _, options = post.split()[:3]
            mount = pre.split()[4]
            if fstype == "cgroup" and "cpu" in options.split(","):
                return mount, 1
            if fstype == "cgroup2":
                v2 = mount
    if v2 is not None:
        try:
            with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                if "cpu" in f.read().split():
                    return v2, 2
        except OSError:
            pass
    raise CpuLimitError("cpu_limit needs a cgroup cpu controller: no v1 'cpu' hierarchy "
                        "is mounted and no cgroup2 root enables 'cpu' in subtree_control")


def writable() -> str:
    """The cpu controller's mount point, if this process may make cgroups there.

    Raises:
        CpuLimitError: no cpu controller, or it is not writable (no root).
    """
    root, _ = _cpu_root()
    if not os.access(root, os.W_OK):
        raise CpuLimitError(f"cpu_limit: {root} is not writable here; it needs root or a "
                            "delegated cgroup hierarchy")
    return root


def group_name() -> str:
    """A fresh name for one cluster start's group (Cluster.start)."""
    return f"pdserve-{uuid.uuid4().hex[:12]}"


def join(group: str, worker_id: str, cores: float, pid: int | None = None) -> str:
    """Put process `pid` (default: this one, all its threads) into worker `worker_id`'s
    cgroup under `group`, capped at `cores` cores (a quota of cores x PERIOD_US per
    period); the cgroup is made on first use and shared by the worker's other
    processes. Returns its path.

    Raises:
        ValueError: cores <= 0.
        CpuLimitError: no cpu controller, or it is not writable here (the message says
            which path and why).
    """
    if not cores > 0:
        raise ValueError(f"cpu_limit={cores}: must be > 0 cores")
    root, version = _cpu_root()
    parent = os.path.join(root, group)
    path = os.path.join(parent, worker_id)
    quota = max(1000, round(cores * PERIOD_US))     # the kernel's least quota is 1 ms
    try:
        os.makedirs(path, exist_ok=True)
        if version == 2:
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+cpu")
            with open(os.path.join(path, "cpu.max"), "w") as f:
                f.write(f"{quota} {PERIOD_US}")
        else:
            with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                f.write(str(PERIOD_US))
            with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(quota))
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(pid or os.getpid()))
    except OSError as e:
        raise CpuLimitError(f"cpu_limit={cores}: cannot cap this worker in {path} ({e}); "
                            "it needs root or a delegated cgroup hierarchy") from e
    return path


def remove_group(group: str, wait_s: float = 5.0) -> None:
    """Remove `group`'s cgroups once their processes have exited (a stopped worker's
    process takes a moment to go), waiting up to `wait_s` seconds; one still in use
    after that is left, as is everything when there is no cpu controller."""
    try:
        root, _ = _cpu_root()
    except CpuLimitError:
        return
    parent = os.path.join(root, group)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            children = [os.path.join(parent, c) for c in os.listdir(parent)]
        except FileNotFoundError:             # gone (never made: no worker started)
            return
        busy = False
        for d in [*filter(os.path.isdir, children), parent]:
            try:
                os.rmdir(d)
            except OSError as e:
                if e.errno != errno.EBUSY:
                    return
                busy = True
        if not busy or time.monotonic() > deadline:
            return
        time.sleep(0.1)
