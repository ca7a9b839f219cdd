"""The router's settings (RouterConfig) and the SLO planner's (PlannerConfig); the
cluster's (ClusterConfig) and the workers' (WorkerConfig) are in pdserve/config.py, which
re-exports these."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouterConfig:
    """Settings of the router (gRPC front end, and the OpenAI-compatible HTTP one when
    http_port is set). "Queued" requests are admitted ones still
    waiting for their first token (decode reservation or prefill); beyond either
    max_queued_* bound, Generate fails at once with RESOURCE_EXHAUSTED (router/admission.py)."""

    host: str = "127.0.0.1"
    port: int = 50051                # 0 picks a free port (tests)
    reserve_timeout_s: float | None = None  # how long a request waits for decode KV
                                     # space before RESOURCE_EXHAUSTED; None: until its
                                     # deadline, queued in arrival order as vLLM's waiting
                                     # queue holds it (bounded by max_queued_*)
    request_timeout_s: float = 600.0  # a request's longest life: the client's gRPC
                                     # deadline, when set, counts only if shorter
    stream_stall_timeout_s: float = 30.0  # a stream whose client takes nothing for this
                                     # long (the response waits for it to read) is
                                     # aborted: its KV freed on P and D, its status an error
    max_queued_requests: int = 256   # requests queued at once; more fail fast, not wait unbounded
    max_queued_tokens: int = 262144  # prompt tokens queued at once: 256 requests x 1024 tokens
    max_concurrent_calls: int = 4096  # gRPC calls and HTTP connections open at once per
                                     # router replica; more: gRPC RESOURCE_EXHAUSTED, HTTP 503
    max_tokenize_queue_chars: int = 1 << 20  # characters of prompts waiting for the router's
                                     # tokenizer thread at once (shortest first); more fail
                                     # fast (router/tokenize_queue.py): 8 of the largest
                                     # prompts an 8k-token context takes
    routing_policy: str = "kv_aware"  # prefill worker choice: round_robin | least_loaded | kv_aware
    kv_load_weight: float = 1.0      # kv_aware: cost = uncached tokens + weight * queued tokens
    kv_host_load_cost: float = 0.01  # kv_aware: a prompt token a prefill worker loads from
                                     # its host KV tier, in computed tokens (2-core CPU, fp32:
                                     # 0.16 ms a 16-token block loaded vs ~17 ms computed;
                                     # higher on a GPU, where compute is far faster)
    kv_disk_load_cost: float = 0.05  # kv_aware: the same from its disk tier (0.7-1.3 ms a
                                     # block here)
    kv_pull_load_cost: float = 0.15  # kv_aware with kv_pull: the same read from another
                                     # prefill worker's prefix cache (under a multi-turn
                                     # load here, 7 ms a block against ~44 ms computed)
    max_prefill_queue_tokens: int | None = None  # conditional disaggregation: a prompt is
                                     # prefilled on its decode worker instead when every
                                     # prefill worker has more prompt tokens queued than this
                                     # and than that decode worker has queued for its own
                                     # prefills (0: always a prefill worker). None: one prefill
                                     # step (the prefill workers' max_num_batched_tokens: 512 on
                                     # CPU); under load a prompt then waits for no more than a
                                     # step (2 req/s, 2 cores: mean TTFT 595 -> ~400 ms at a
                                     # 2048 limit, docs/performance.md)
    local_prefill_when_prefill_idle: bool = True  # a decode worker prefills a prompt
                                     # itself when the prefill workers of its node (at least
                                     # as many as its decode workers) have no prompt queued
                                     # and it has no prefill of its own queued: with core
                                     # lending (ClusterConfig.lend_idle_prefill_cores) the
                                     # idle workers' threads compute it too, so a lone prompt
                                     # gets both cores of a 2-core box (0.5 req/s fp32: mean
                                     # TTFT 316 -> 188 ms, docs/performance.md section 15).
                                     # No effect without lending (pinned, GPU, other nodes)
    decode_routing_policy: str = "least_loaded"  # decode worker choice: least_loaded
                                     # (fewest streams, then most free KV blocks) |
                                     # cache_aware (SGLang's cache-aware rule over the decode
                                     # workers' mirrored prefix caches and KV tiers: the one
                                     # holding the longest run of the prompt's leading
                                     # blocks, while the loads are balanced; needs decode
                                     # prefix caching). Measured slower than least_loaded
                                     # on two decode workers here (docs/kv_tiers.md)
    cache_threshold: float = 0.3     # cache_aware: least share of the prompt's blocks the
                                     # best decode worker must hold for the prefix to choose
                                     # (SGLang's --cache-threshold)
    balance_abs_threshold: int = 64  # cache_aware: the loads are unbalanced, and the least
    balance_rel_threshold: float = 1.5  # loaded decode worker is chosen, when the most
                                     # streams exceed the fewest by more than the first and
                                     # more than this many times (SGLang's --balance-*)
    cache_sync_interval_s: float = 0.1  # kv_aware, kv_pull, cache_aware: how often the
                                     # workers' prefix caches are mirrored
    max_migrations: int = 3          # retries of a request after a worker died or its KV
                                     # transfer failed (each resumes after the tokens sent)
    rebalance_on_scale_up: bool = False  # decode workers that join (Admin.Scale, the
                                     # planner) take the busier ones' streams above the
                                     # mean at once, moved by recompute (router/scaling.py).
                                     # Off: the recompute prefills queue before new
                                     # prompts; in `pdserve bench planner` (one 0.6-core
                                     # prefill worker) moving 21 streams cut the
                                     # decode-heavy phase's goodput from 1.99 to 0.27 req/s
                                     # (docs/planner.md)
    worker_probe_interval_s: float = 0.5  # how often a worker found dead is asked if it is back
    worker_ready_timeout_s: float = 30.0  # a restarted router waits this long for each
                                     # worker's ready(); one slower is left out for now
                                     # and probed like a dead one
    metrics_port: int = 9464         # Prometheus /metrics; 0: a free port
    metrics_host: str | None = None  # where /metrics binds; None: `host`, or for a
                                     # wildcard `host` this node's own address
    slo_ttft_ms: float | None = None  # goodput: TTFT bound (None: unconstrained)
    slo_tpot_ms: float | None = None  # goodput: TPOT bound (None: unconstrained). Set,
                                     # a prompt goes to a decode worker only when no prefill
                                     # worker would give its first token within slo_ttft_ms
                                     # (router/placement.py, prefill_on_decode)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces of requests to this
                                     # OTLP collector (host:port for gRPC, or a URL;
                                     # pdserve/tracing.py); None: off
    otlp_traces_sample_ratio: float = 1.0  # share of requests traced that arrive without
                                     # a trace context (a W3C traceparent)
    otlp_traces_client_sample_ratio: float = 1.0  # share of requests traced whose
                                     # traceparent says sampled: 1.0 follows the client, as
                                     # OpenTelemetry's ParentBased sampler; lower it so a
                                     # client cannot force tracing (pdserve/trace_export.py)
    cache_salt_from_user: bool = False  # the OpenAI API's `user` field salts the prompt's
                                     # KV (as cache_salt) when the request has no cache_salt:
                                     # users share prefix cache only with themselves
    # Security of the gRPC front (router/security.py). Paths are read where the router
    # runs, when it builds its server, so they are checked there, not here.
    tls_cert_file: str | None = None  # PEM server certificate (chain); with tls_key_file
    tls_key_file: str | None = None   # PEM private key of tls_cert_file
    tls_client_ca_file: str | None = None  # mTLS: require client certs signed by this CA
    api_key: str | None = field(default=None, repr=False)  # every RPC but Health needs
                                      # `authorization: Bearer <key>`; repr=False: never logged
    admin_api_key: str | None = field(default=None, repr=False)  # Admin Drain and Scale
                                      # need it (the api key does not pass); None: they are
                                      # served only when `host` is loopback
    max_workers: int = 16             # Admin.Scale's bound on workers of both roles together
    max_request_bytes: int = 8 << 20  # gRPC refuses a larger request (RESOURCE_EXHAUSTED);
                                      # the HTTP API a larger body (413)
    # OpenAI-compatible HTTP API (router/http_api.py) on `host`, beside gRPC, behind the
    # same TLS, api key and admission control. None: off; 0: a free port (tests).
    http_port: int | None = None

    def __post_init__(self):
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s}: must be > 0 seconds")
        for name in ("max_queued_requests", "max_queued_tokens", "max_tokenize_queue_chars",
                     "max_concurrent_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if not self.stream_stall_timeout_s > 0:
            raise ValueError(f"stream_stall_timeout_s={self.stream_stall_timeout_s}: must be "
                             "> 0 seconds")
        from .routing import DECODE_POLICIES, POLICIES
        if self.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy={self.routing_policy!r}: choose one of "
                             f"{list(POLICIES)}")
        if self.decode_routing_policy not in DECODE_POLICIES:
            raise ValueError(f"decode_routing_policy={self.decode_routing_policy!r}: choose "
                             f"one of {list(DECODE_POLICIES)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold={self.cache_threshold}: must be in [0, 1]")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold={self.balance_abs_threshold}: must be "
                             ">= 0 streams")
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold={self.balance_rel_threshold}: must be "
                             ">= 1")
        for name in ("kv_load_weight", "kv_host_load_cost", "kv_disk_load_cost",
                     "kv_pull_load_cost"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.max_prefill_queue_tokens is not None and self.max_prefill_queue_tokens < 0:
            raise ValueError(f"max_prefill_queue_tokens={self.max_prefill_queue_tokens}: "
                             "must be >= 0 tokens (0: always prefill on a prefill worker)")
        for name in ("otlp_traces_sample_ratio", "otlp_traces_client_sample_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: must be in [0, 1]")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}={v}: must be > 0 milliseconds (or unset)")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port={self.metrics_port}: must be in [0, 65535]")
        if self.reserve_timeout_s is not None and not self.reserve_timeout_s > 0:
            raise ValueError(f"reserve_timeout_s={self.reserve_timeout_s}: must be > 0 seconds "
                             "(or None: until the request's deadline)")
        if self.cache_sync_interval_s <= 0:
            raise ValueError(f"cache_sync_interval_s={self.cache_sync_interval_s}: must be > 0")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations={self.max_migrations}: must be >= 0")
        if self.worker_probe_interval_s <= 0:
            raise ValueError(f"worker_probe_interval_s={self.worker_probe_interval_s}: "
                             "must be > 0 seconds")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            have, missing = (("tls_cert_file", "tls_key_file") if self.tls_key_file is None
                             else ("tls_key_file", "tls_cert_file"))
            raise ValueError(f"{missing} is unset but {have} is set: give both for TLS, "
                             "or neither for plaintext")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs TLS: set tls_cert_file and tls_key_file "
                             "too")
        for name in ("api_key", "admin_api_key"):
            key = getattr(self, name)
            if key is not None and not (key and key.isascii() and key.isprintable()
                                        and " " not in key):
                # The key itself is never put in a message: it may end up in logs.
                raise ValueError(f"{name}: must be non-empty printable ASCII without spaces "
                                 "(it travels as gRPC metadata), or None for no key")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("admin_api_key equals api_key: give the admin role a key of "
                             "its own, or whoever may generate may also drain and scale")
        if not 2 <= self.max_workers <= 512:
            raise ValueError(f"max_workers={self.max_workers}: must be in [2, 512] (workers "
                             "of both roles together)")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes={self.max_request_bytes}: must be >= 1024")
        if self.http_port is not None:
            if not 0 <= self.http_port < 65536:
                raise ValueError(f"http_port={self.http_port}: must be in [0, 65535] (0: a free "
                                 "port), or None for no HTTP API")
            for name in ("port", "metrics_port"):
                if self.http_port and self.http_port == getattr(self, name):
                    raise ValueError(f"http_port={self.http_port} is also {name}: give the "
                                     "HTTP API a port of its own")

    def deadline(self, deadline_s: float | None) -> float:
        """The time.monotonic() by which a request must end: `deadline_s` (seconds the
        client's gRPC deadline leaves; None: it set none) capped at request_timeout_s."""
        return time.monotonic() + min(deadline_s or math.inf, self.request_timeout_s)


@dataclass(frozen=True)
class PlannerConfig:
    """`serve --planner slo` (router/planner.py): every adjustment_interval_s the router
    sizes the prefill and decode pools to the TTFT and ITL targets, within the bounds."""

    slo_ttft_ms: float               # target mean time to first token
    slo_itl_ms: float                # target mean inter-token latency
    min_prefill_workers: int = 1
    max_prefill_workers: int = 4
    min_decode_workers: int = 1
    max_decode_workers: int = 4
    max_workers: int | None = None   # both roles together (Dynamo's --max-gpu-budget);
                                     # None: max_prefill_workers + max_decode_workers
    adjustment_interval_s: float = 30.0  # Dynamo's adjustment_interval; a worker starts in
                                     # ~5-10 s here (model load), a decision needs a few
                                     # hundred steps behind it
    scale_down_intervals: int = 2    # hysteresis: fewer workers only after this many
                                     # intervals in a row ask for fewer (more: at once)
    drain_timeout_s: float = 60.0    # a retired worker's requests finish within this, or
                                     # move on (Admin.Scale's timeout_s)

    def __post_init__(self):
        for name in ("slo_ttft_ms", "slo_itl_ms", "adjustment_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}_workers"), getattr(self, f"max_{role}_workers")
            if not 1 <= lo <= hi <= 256:      # 256: router/scaling.py MAX_WORKERS
                raise ValueError(f"min_{role}_workers={lo}, max_{role}_workers={hi}: need "
                                 "1 <= min <= max <= 256")
        if self.max_workers is not None and self.max_workers < (self.min_prefill_workers
                                                                + self.min_decode_workers):
            raise ValueError(f"max_workers={self.max_workers}: must be >= min_prefill_workers"
                             " + min_decode_workers")
        if self.scale_down_intervals < 1:
            raise ValueError(f"scale_down_intervals={self.scale_down_intervals}: must be >= 1")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s}: must be >= 0")

    @property
    def budget(self) -> int:
        """Most workers of both roles together."""
        return (self.max_workers if self.max_workers is not None
                else self.max_prefill_workers + self.max_decode_workers)
