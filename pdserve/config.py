"""Cluster configuration: one frozen dataclass per component, composed in ClusterConfig.
The router's and the planner's live in router/config.py and are re-exported here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from .engine.config import CacheConfig, torch_dtype
from .engine.schedule_policy import POLICIES
from .router.config import PlannerConfig, RouterConfig  # noqa: F401  (re-exported)

DTYPES = ("float32", "bfloat16", "float16")     # WorkerConfig.dtype's choices


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one prefill or decode worker process."""

    model: str = "default"           # HF dir, .gguf file, or "default" (SmolLM2-135M-Instruct)
    device: str = "cpu"
    dtype: str = "float32"           # the CPU reference (HF fp32) is what fidelity is checked on
    num_kv_blocks: int | None = None  # KV pool in blocks (SmolLM2 fp32: 0.7 MiB each);
                                     # None: from kv_cache_memory_bytes, else from
                                     # memory_utilization (pdserve/kv_memory.py), when
                                     # the worker starts
    kv_cache_memory_bytes: int | None = None  # vLLM's flag: the KV pool's bytes (all
                                     # TP ranks), overriding memory_utilization
    memory_utilization: float = 0.92  # the share of its node's memory (a GPU's: its
                                     # device's) this worker uses in all, KV pool
                                     # included; vLLM's --gpu-memory-utilization for one
                                     # engine. ClusterConfig.local divides it among the
                                     # workers of a node
    block_size: int = 16             # tokens per KV block
    num_threads: int = 1             # torch intra-op threads (pin compute to the cores it owns)
    cpus: tuple[int, ...] | None = None  # CPU ids the worker process is pinned to (Linux
                                         # sched_setaffinity); None: wherever the OS runs it
    cpu_limit: float | None = None   # cores the worker's processes may use in all: a CFS
                                     # quota on a cgroup of its own, as a Kubernetes pod's
                                     # limits.cpu (pdserve/cpu_limit.py); one fixed-size
                                     # "device" per worker on a shared box. None: no cap
    cpu_limit_group: str | None = None  # set by Cluster.start when cpu_limit is: the cgroup
                                     # its workers' cgroups go under
    tensor_parallel_size: int = 1    # ranks of one worker (engine/parallel.py; tp_group.py)
    transport: str = "tcp"
    host: str = "127.0.0.1"          # address the KV transport and /metrics bind and advertise;
                                     # "auto": this node's IP as Ray knows it (multi-node)
    kv_checksum: bool = True         # CRC32C per KV frame payload; TCP only (a flipped bit
                                     # fails that request instead of corrupting its cache)
    kv_secret: str | None = field(default=None, repr=False)  # KV ports pair only with peers
                                     # proving it (HMAC, kv_transfer/auth.py); Cluster.start
                                     # makes one when None; repr=False: never logged
    max_batch_size: int = 256        # decode: running requests per step
    enforce_eager: bool = False      # vLLM's flag: no torch.compile, no CUDA graphs, whatever
                                     # compile / cuda_graphs say
    compile: bool = False            # CPU: the decoder layers run one torch.compile'd graph
                                     # (engine/compile.py), compiled at start (~4 s, cached on
                                     # disk). Off: measured no faster than the eager step over
                                     # the same C++ kernels here (docs/performance.md)
    cuda_graphs: bool = False        # decode on CUDA replays CUDA graphs captured per batch
                                     # size up to max_batch_size (engine/cuda_graphs.py); off
                                     # until measured on a device (`pdserve bench gpu`)
    max_num_batched_tokens: int | None = None  # prefill: prompt tokens per step (varlen
                                     # batch). None: 512 on CPU (its GEMMs reach the per-core
                                     # peak from M=512, and a prompt's first token waits for
                                     # its whole step: 2048 made mean TTFT under a burst
                                     # ~15% longer at the same throughput, docs/performance.md),
                                     # 2048 on CUDA
    lease_s: float = 60.0            # decode: how long a reservation waits for prefill's KV
    enable_prefix_caching: bool = True  # share cached prompt-prefix blocks (P and D)
    kv_host_cache_gib: float = 0.0   # a host-memory KV tier below the pool, GiB (P: every
                                     # prompt; D: its local prefills; engine/kv_tiers.py;
                                     # 0: none)
    kv_disk_cache_dir: str | None = None  # a disk KV tier's directory (with the host
                                     # tier), kept across restarts
    kv_disk_cache_gib: float = 0.0   # ... and its size, GiB: the directory's bound, every
                                     # live worker (TP rank) using it an equal share
    kv_disk_reclaim_after_s: float = 60.0  # a slab whose worker is gone is kept this long
                                     # for a new worker of its model to adopt (a scale-out
                                     # starts warm), then reclaimed (engine/kv_disk_files.py)
    kv_tier_load_timeout_s: float = 2.0  # a tier load's budget: what a slow or hung disk
                                     # has not read by then is computed (engine/kv_tiers.py)
    otlp_traces_endpoint: str | None = None  # this worker's spans of traced requests go
                                     # to this OTLP collector (pdserve/tracing.py); set
                                     # from RouterConfig.otlp_traces_endpoint by ClusterConfig
    kv_pull: bool = False            # prefill: a prompt's leading blocks its decode worker
                                     # holds (pool, or a tier loaded at reserve) are read
                                     # from there over the KV transport when the cost model
                                     # says that beats computing them (prefill_worker/kv_pull.py)
    slo_tpot_ms: float | None = None  # decode: a step with running streams computes no
                                     # more tokens than keep it within this TPOT SLO
                                     # (decode_worker/step_budget.py); None: chunks of
                                     # prefill_chunk_size. ClusterConfig.local sets it
                                     # from the router's
    local_prefill_max_tokens: int = 0   # decode: prefill on D when the uncached prompt is <= this
                                        # (0 = off: what `pdserve bench local-prefill` picks here)
    prefill_chunk_size: int | None = 512  # prefill: most tokens of one prompt per step
    schedule_policy: str = "fcfs"    # order of waiting prompts' prefills (P, and D's local
                                     # ones): fcfs, or sjf shortest first (bounded wait);
                                     # engine/schedule_policy.py
    metrics_port: int = 0            # Prometheus /metrics on `host`; 0: a free port (in status)
    log_level: str = "WARNING"
    core_share_dir: str | None = None  # set by Cluster.start (ClusterConfig.lend_idle_prefill_cores):
                                     # where prefill workers publish when they are idle, so a
                                     # decode worker of their node borrows their threads
                                     # (pdserve/core_share.py); None: no lending

    def __post_init__(self):
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens",
                               2048 if self.device.startswith("cuda") else 512)
        if (self.prefill_chunk_size is not None and self.max_num_batched_tokens >= self.block_size
                and self.prefill_chunk_size > self.max_num_batched_tokens):
            # a chunk is at most one step (e.g. --max-num-batched-tokens 256)
            object.__setattr__(self, "prefill_chunk_size",
                               self.max_num_batched_tokens // self.block_size * self.block_size)
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy={self.schedule_policy!r}: choose one of "
                             f"{', '.join(POLICIES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.host in ("0.0.0.0", "::", ""):
            raise ValueError(f"host={self.host!r}: the KV port binds to the worker's own "
                             "cluster address, never every interface; give that address or "
                             "'auto' (this node's IP as Ray knows it)")
        if self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads}: need at least 1")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if self.cpus is not None and (not self.cpus or min(self.cpus) < 0):
            raise ValueError(f"cpus={self.cpus}: give CPU ids >= 0 (or None: not pinned)")
        if self.cpu_limit is not None and not self.cpu_limit > 0:
            raise ValueError(f"cpu_limit={self.cpu_limit}: must be > 0 cores (or None: no cap)")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be "
                             f">= block_size={self.block_size}")
        from .kv_transfer import SENDERS
        if self.transport not in SENDERS:
            raise ValueError(f"transport={self.transport!r}: choose one of {sorted(SENDERS)} "
                             "(resolve 'auto' with kv_transfer.resolve_transport first)")
        if self.prefill_chunk_size is not None and (
                self.prefill_chunk_size % self.block_size
                or not self.block_size <= self.prefill_chunk_size <= self.max_num_batched_tokens):
            raise ValueError(f"prefill_chunk_size={self.prefill_chunk_size} must be a multiple "
                             f"of block_size={self.block_size} in [block_size, "
                             f"max_num_batched_tokens={self.max_num_batched_tokens}] (or None)")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens={self.local_prefill_max_tokens}: "
                             "must be >= 0 tokens (0 disables local prefill)")
        if self.kv_host_cache_gib < 0 or self.kv_disk_cache_gib < 0:
            raise ValueError(f"kv_host_cache_gib={self.kv_host_cache_gib}, kv_disk_cache_gib="
                             f"{self.kv_disk_cache_gib}: must be >= 0 GiB")
        if not self.kv_disk_reclaim_after_s >= 0:
            raise ValueError(f"kv_disk_reclaim_after_s={self.kv_disk_reclaim_after_s}: must "
                             "be >= 0 seconds")
        if not self.kv_tier_load_timeout_s > 0:
            raise ValueError(f"kv_tier_load_timeout_s={self.kv_tier_load_timeout_s}: must be "
                             "> 0 seconds")
        if self.kv_disk_cache_dir is not None and not (self.kv_host_cache_gib > 0
                                                       and self.kv_disk_cache_gib > 0):
            raise ValueError("kv_disk_cache_dir needs kv_disk_cache_gib > 0 and a host tier "
                             "(kv_host_cache_gib > 0): blocks reach the disk through it")
        if self.kv_pull and not self.enable_prefix_caching:
            raise ValueError("kv_pull needs enable_prefix_caching: pulled blocks enter the "
                             "prefix cache")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s={self.lease_s}: must be > 0 seconds")
        if self.slo_tpot_ms is not None and not self.slo_tpot_ms > 0:
            raise ValueError(f"slo_tpot_ms={self.slo_tpot_ms}: must be > 0 milliseconds "
                             "(or None)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks}: need at least 1 (or None: "
                             "from the memory budget)")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes}: must be > 0")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization={self.memory_utilization}: a share of the "
                             "node's memory in (0, 1]")

    def node_host(self) -> str:
        """The address to bind and advertise: `host`, or for "auto" this node's IP as Ray
        knows it (call inside the worker process)."""
        if self.host != "auto":
            return self.host
        import ray
        return ray.util.get_node_ip_address()

    def cache_config(self) -> CacheConfig:
        """The KV cache's geometry; num_kv_blocks must be resolved first
        (kv_memory.resolve_kv_blocks)."""
        assert self.num_kv_blocks is not None, "num_kv_blocks unresolved: resolve_kv_blocks"
        return CacheConfig(self.num_kv_blocks, self.block_size, torch_dtype(self.dtype),
                           self.device)


@dataclass(frozen=True)
class ClusterConfig:
    prefill: WorkerConfig = field(default_factory=WorkerConfig)
    decode: WorkerConfig = field(default_factory=WorkerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    ray_address: str | None = None   # None: start a local Ray instance; "auto": join one
    max_worker_restarts: int = 4     # Ray restarts a dead worker this often (-1: always)
    max_router_restarts: int = -1    # Ray restarts a dead router this often (-1: always);
                                     # `serve` then starts it on the same ports
    num_routers: int = 1             # router replicas serving the same gRPC and HTTP ports
                                     # (SO_REUSEPORT: the kernel spreads connections over
                                     # the live ones); each its own /metrics port
    # Placement on a multi-node Ray cluster: Ray resources each worker actor requests, e.g.
    # {"pdserve_prefill": 1} to land only on nodes started with that custom resource
    # (deploy/ray/*.yaml, the Helm chart), and GPUs per worker.
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    gpus_per_worker: float = 0.0
    # CPU workers not pinned to cores: an idle prefill worker's threads run the decode
    # steps of the decode workers on its node (pdserve/core_share.py)
    lend_idle_prefill_cores: bool = True
    planner: PlannerConfig | None = None   # serve --planner slo; None: fixed pools

    def lends_idle_prefill_cores(self) -> bool:
        """Core lending applies: asked for, CPU workers, none pinned to CPUs."""
        return (self.lend_idle_prefill_cores and self.gpus_per_worker == 0
                and all(w.device == "cpu" and w.cpus is None
                        for w in (self.prefill, self.decode)))

    def __post_init__(self):
        endpoint = self.router.otlp_traces_endpoint     # the workers trace where it does
        for role in ("prefill", "decode"):
            if getattr(self, role).otlp_traces_endpoint != endpoint:
                object.__setattr__(self, role, replace(getattr(self, role),
                                                       otlp_traces_endpoint=endpoint))
        if self.num_prefill_workers < 1 or self.num_decode_workers < 1:
            raise ValueError("need at least one prefill and one decode worker "
                             f"(got {self.num_prefill_workers} and {self.num_decode_workers})")
        for name in ("prefill_resources", "decode_resources"):
            for k, v in getattr(self, name).items():
                if not isinstance(k, str) or k in ("CPU", "GPU", "memory") or not v > 0:
                    raise ValueError(f"{name}: {k!r}={v!r}: give custom resource names with "
                                     "amounts > 0 (CPU/GPU/memory are set otherwise)")
        if self.gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker={self.gpus_per_worker}: must be >= 0")
        if not isinstance(self.num_routers, int) or self.num_routers < 1:
            raise ValueError(f"num_routers={self.num_routers}: must be >= 1")
        if self.max_router_restarts < -1:
            raise ValueError(f"max_router_restarts={self.max_router_restarts}: must be >= -1 "
                             "(-1: always)")
        if self.max_worker_restarts < -1:
            raise ValueError(f"max_worker_restarts={self.max_worker_restarts}: must be >= -1 "
                             "(-1: unlimited)")
        if self.prefill.model != self.decode.model:
            raise ValueError("prefill and decode workers must serve the same model")
        if (pl := self.planner) is not None:
            for role in ("prefill", "decode"):
                n, lo, hi = (getattr(self, f"num_{role}_workers"),
                             getattr(pl, f"min_{role}_workers"), getattr(pl, f"max_{role}_workers"))
                if not lo <= n <= hi:
                    raise ValueError(f"{role} workers at start ({n}) outside the planner's "
                                     f"bounds [{lo}, {hi}]")
            if self.num_prefill_workers + self.num_decode_workers > pl.budget:
                raise ValueError(f"{self.num_prefill_workers} prefill + "
                                 f"{self.num_decode_workers} decode workers at start exceed "
                                 f"the planner's max_workers={pl.budget}")
            if pl.budget > self.router.max_workers:
                raise ValueError(f"the planner's max_workers={pl.budget} exceeds "
                                 f"router.max_workers={self.router.max_workers} "
                                 "(serve --max-workers)")

        if self.num_prefill_workers + self.num_decode_workers > self.router.max_workers:
            raise ValueError(f"{self.num_prefill_workers} prefill + {self.num_decode_workers} "
                             f"decode workers at start exceed router.max_workers="
                             f"{self.router.max_workers} (serve --max-workers)")

    @classmethod
    def local(cls, model: str = "default", *, prefill_workers: int = 1, decode_workers: int = 1,
              transport: str = "tcp", host: str = "127.0.0.1", port: int = 50051,
              prefill_blocks: int | None = None, decode_blocks: int | None = None,
              gpu_memory_utilization: float = 0.92, kv_cache_memory_bytes: int | None = None,
              prefill_kv_cache_memory_bytes: int | None = None,
              threads_per_worker: int | None = None, router_kw: dict | None = None,
              kv_host: str | None = None, prefill_tp: int = 1, decode_tp: int = 1,
              planner: PlannerConfig | None = None, **worker_kw) -> "ClusterConfig":
        """A one-box cluster: cores split evenly among workers unless told otherwise.

        KV pools: `prefill_blocks` / `decode_blocks` blocks each when given; else
        `prefill_kv_cache_memory_bytes` / `kv_cache_memory_bytes` bytes each (vLLM's
        flag names the decode side: its pool bounds the batch); else each worker's share
        of `gpu_memory_utilization` of the box's memory (vLLM's default, 0.92), a decode
        worker getting kv_memory.DECODE_WEIGHT times a prefill worker's, over the most
        workers the box holds (the planner's bounds when it sizes the pools); on CUDA
        the workers share the one device's memory the same way.
        `router_kw` sets other RouterConfig fields (e.g. max_queued_requests); the rest of
        the keywords go to both WorkerConfigs. `host` is where the router serves;
        workers bind and advertise `kv_host` (default: `host`; "auto": their node's IP).
        `port=0` (tests) picks free ports for the router's metrics too, unless router_kw
        names one. `prefill_tp` / `decode_tp`: tensor-parallel ranks per worker (each
        rank gets its share of the cores). `planner`: size the pools at runtime.
        Raises:
            ValueError: a setting out of range (the message names it).
        """
        from .kv_memory import DECODE_WEIGHT
        from .kv_transfer import resolve_transport
        transport = resolve_transport(transport)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: a share of "
                             "the node's memory in (0, 1]")
        n = prefill_workers * prefill_tp + decode_workers * decode_tp    # processes
        threads = threads_per_worker or max(1, (os.cpu_count() or 1) // n)
        # the heaviest mix of workers the box may hold, in prefill workers' shares
        mixes = ([(p, d) for p in range(planner.min_prefill_workers, planner.max_prefill_workers + 1)
                  for d in range(planner.min_decode_workers, planner.max_decode_workers + 1)
                  if p + d <= planner.budget] if planner is not None
                 else [(prefill_workers, decode_workers)])
        unit = gpu_memory_utilization / max(p + DECODE_WEIGHT * d for p, d in mixes)
        base = WorkerConfig(model=model, transport=transport, host=kv_host or host,
                            num_threads=threads, **worker_kw)
        return cls(prefill=replace(base, num_kv_blocks=prefill_blocks,
                                   kv_cache_memory_bytes=prefill_kv_cache_memory_bytes,
                                   memory_utilization=unit, tensor_parallel_size=prefill_tp),
                   decode=replace(base, num_kv_blocks=decode_blocks,
                                  kv_cache_memory_bytes=kv_cache_memory_bytes,
                                  memory_utilization=unit * DECODE_WEIGHT,
                                  tensor_parallel_size=decode_tp,
                                  slo_tpot_ms=(router_kw or {}).get("slo_tpot_ms")),
                   router=RouterConfig(host=host, port=port, **({"metrics_port": 0} if port == 0
                                                                 else {}) | (router_kw or {})),
                   num_prefill_workers=prefill_workers, num_decode_workers=decode_workers,
                   planner=planner)
