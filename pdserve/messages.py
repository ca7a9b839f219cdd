"""What crosses a Ray call between the router and the workers, one frozen dataclass per
message: typed, immutable messages cross the process boundary, not dicts with magic keys,
so a misspelt field fails where the message is built (not where it is read) and type
checkers see every field.

    router ── ready() ──────────────────────▶ P, D   ◀── WorkerInfo
    router ── reserve(...) ─────────────────▶ D      ◀── DecodeReservation | None
    router ── prefill(PrefillOrder) ────────▶ P      ◀── first token (int)
    router ── events(epoch) ────────────────▶ D      ◀── [TokenEvent, ...] (engine/request.py)
    P      ── send_prompt_kv(KVPullOrder) ──▶ D, P   (kv_pull: their KV frames to P)
    router ── cache_events(since, ...) ─────▶ P      ◀── CacheEvents
    router ── status() ─────────────────────▶ P, D   ◀── WorkerStatus

One name per quantity on both sides: the leading prompt blocks D already holds in its
prefix cache are ``num_cached_blocks`` in D's reservation and in P's order (P computes
them, but does not send them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .engine.logprobs import TokenLogprobs
from .engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's answer to ready(), once its model is loaded and its KV port is up."""

    worker_id: str
    role: str                  # "prefill" | "decode"
    epoch: int                 # this incarnation of the process (new after a restart)
    num_blocks: int            # KV blocks in its pool
    block_size: int            # tokens per KV block
    node_ip: str
    kv_address: tuple[str, int] | None = None   # decode: where its KV receiver listens
    # decode, tensor-parallel: ranks 1..M-1's KV receivers (each holds its KV heads)
    kv_rank_addresses: tuple[tuple[str, int], ...] = ()
    draining: bool = False     # a router drained or is retiring it (drain()): every
                               # router replica sends it nothing new


@dataclass(frozen=True, slots=True)
class DecodeReservation:
    """D's blocks for one request's prompt KV (DecodeWorker.reserve), held under a lease.

    num_blocks: prompt blocks reserved, the cached ones included. num_cached_blocks: the
    leading ones D holds already (prefix cache): the prefill worker does not send them.
    local_prefill: D computes the prompt itself (no prefill worker is called; the first
    token comes on D's event stream). free_blocks: D's free pool after this reservation.
    kv_rank_addresses: a tensor-parallel D's ranks 1..M-1 (kv_address is rank 0's); each
    receives its own KV heads into the same blocks of its cache (kv_transfer/tp_plan.py).
    """

    kv_address: tuple[str, int]
    epoch: int
    num_blocks: int
    num_cached_blocks: int
    local_prefill: bool
    free_blocks: int
    kv_rank_addresses: tuple[tuple[str, int], ...] = ()
    num_requests: int = 0      # D's unfinished requests, this one included (replicas'
                               # load balance: router/workers.py Worker.reported)


@dataclass(frozen=True, slots=True)
class PrefillOrder:
    """What the router asks a prefill worker to do for one request: compute the KV of
    ``token_ids``, send the blocks past the first ``num_cached_blocks`` into D's
    reservation at ``kv_address`` (D's ``epoch``), and return the first sampled token.
    A tensor-parallel D's other ranks are ``kv_rank_addresses`` (DecodeReservation).
    ``kv_source``: D's actor handle when prefill workers pull KV (WorkerConfig.kv_pull):
    P may then read D's ``num_cached_blocks`` from D instead of computing them
    (prefill_worker/kv_pull.py); or, when ``kv_peer`` (another prefill worker's handle)
    holds more, the ``peer_blocks`` leading full blocks the router's mirror says that
    worker's prefix cache holds (routing.PrefillRouter.pull_peer)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    kv_address: tuple[str, int]
    epoch: int                 # D's epoch, carried by every KV frame
    num_cached_blocks: int = 0
    kv_rank_addresses: tuple[tuple[str, int], ...] = ()
    kv_source: object = None   # D's Ray actor handle (kv_pull), or None
    kv_peer: object = None     # another prefill worker's Ray actor handle (kv_pull), or None
    peer_blocks: int = 0
    trace_context: dict | None = None   # the router's prefill span (W3C traceparent) of a
                                        # traced request (pdserve/tracing.py), or None


@dataclass(frozen=True, slots=True)
class KVPullOrder:
    """What a prefill worker asks the worker holding a prompt's leading blocks to send
    it: positions ``first_block .. first_block + num_blocks - 1`` of the prompt, every
    layer, into P's pull receiver at ``kv_address`` (P's ``epoch``; a tensor-parallel P's
    ranks 1..N-1 at ``kv_rank_addresses``, each sent its KV heads) as the transfer
    ``pull_id``, then DONE with no token. A decode worker finds them in the block table
    of its request ``request_id`` (blocks of its prefix cache, or loaded from its tier,
    at reserve); another prefill worker in its prefix cache by ``block_hashes``, those
    blocks' hashes (16 bytes each; empty when asking a decode worker). P gives the pull
    up ``timeout_s`` seconds after it asked; the holder sends nothing more of it once
    that long passed since it got the order (0: no limit)."""

    request_id: str
    pull_id: str
    first_block: int
    num_blocks: int
    kv_address: tuple[str, int]
    epoch: int                 # P's epoch
    block_hashes: tuple[bytes, ...] = ()
    kv_rank_addresses: tuple = ()          # P ranks 1..N-1's pull receivers
    timeout_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prefill worker's answer to a PrefillOrder, once its KV is all sent: the first
    token it sampled, with its logprobs when the order's params ask (engine/logprobs.py),
    and with params.prompt_logprobs those of every prompt token after the first."""

    first_token: int
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    queued_tokens: int = 0     # prompt tokens of P's other unfinished requests (replicas'
                               # load balance: router/workers.py Worker.reported)


@dataclass(frozen=True, slots=True)
class CacheEvents:
    """A prefill worker's prefix-cache changes after event ``since`` (engine/block_pool.py)
    for the router's mirror (KV-aware routing): ``events`` as (stored, block_hash) in
    order, or, when ``since`` is too old, a full ``snapshot`` of its cached block hashes
    (16-byte digests of block_size-token blocks). The same for its KV tiers
    (engine/kv_tiers.py) after tier event ``tier_since``, each event or entry naming its
    tier ("host" or "disk"); none without tiers. A new ``epoch`` (the worker restarted)
    means the mirror starts over."""

    epoch: int
    seq: int                   # the worker's latest event number
    events: list[tuple[bool, bytes]] | None = None
    snapshot: list[bytes] | None = None
    tier_seq: int = 0          # the worker's latest tier event number
    tier_events: list[tuple[str, bool, bytes]] | None = None   # (tier, stored, hash)
    tier_snapshot: list[tuple[str, bytes]] | None = None       # (tier, hash)


@dataclass(frozen=True, slots=True)
class StepStats:
    """A worker's model steps so far, as the sums a least-squares line through
    (x, seconds) needs: x is the tokens a step computes (a prefill worker's prompt
    tokens; a decode worker's rows, of its steps with no prefill chunk in them). The SLO planner (router/planner.py) takes the difference of two
    readings to get one interval's steps, and fits `seconds = a + b * x` to them.

    `StepStats() + StepStats.of(x, t)` adds a step; `-` of two readings of one worker
    (one epoch) is the steps between them."""

    steps: int = 0
    x: float = 0.0                     # sum of x (tokens or rows)
    xx: float = 0.0                    # sum of x * x
    seconds: float = 0.0               # sum of step wall time (s)
    x_seconds: float = 0.0             # sum of x * seconds

    @classmethod
    def of(cls, x: float, seconds: float) -> "StepStats":
        return cls(1, x, x * x, seconds, x * seconds)

    def __add__(self, o: "StepStats") -> "StepStats":
        return StepStats(*(a + b for a, b in zip(self.astuple(), o.astuple())))

    def __sub__(self, o: "StepStats") -> "StepStats":
        return StepStats(*(a - b for a, b in zip(self.astuple(), o.astuple())))

    def astuple(self) -> tuple:
        return (self.steps, self.x, self.xx, self.seconds, self.x_seconds)

    def line(self) -> tuple[float, float] | None:
        """(a, b) of `seconds = a + b * x` by least squares, None without a step. When
        x hardly varied (every step the same size), the line through the origin and the
        mean: a = 0, b = mean seconds / mean x (an upper bound on the slope's share of
        a step, so the planner errs toward more workers)."""
        n = self.steps
        if n == 0 or self.x <= 0:
            return None
        var = n * self.xx - self.x * self.x
        if var > 1e-9 * n * self.xx and n >= 3:
            b = (n * self.x_seconds - self.x * self.seconds) / var
            a = (self.seconds - b * self.x) / n
            if b > 0 and a >= 0:
                return a, b
        return 0.0, self.seconds / self.x


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A worker's status() (pdserve status, Admin.ClusterStatus, tests). The fields the
    public WorkerStatus proto has go out through to_proto; the rest are for tests and
    the bench."""

    worker_id: str
    role: str                         # "prefill" | "decode"
    pid: int
    node_ip: str
    state: str                        # "ready"
    epoch: int
    kv_blocks_total: int
    kv_blocks_free: int
    running_requests: int
    waiting_requests: int
    metrics_address: str              # host:port of its Prometheus /metrics
    kv_address: str = ""              # decode: host:port of its KV receiver
    prefix_cache_hit_tokens: int = 0  # prompt tokens served from the prefix cache
    prefix_cache_blocks: int = 0      # blocks held by the prefix cache now
    tensor_parallel_size: int = 1     # ranks of this worker (rank 0's status)
    step_stats: StepStats = StepStats()   # this epoch's model steps (router/planner.py)
    # prefill
    queued_tokens: int = 0            # prompt tokens waiting or in progress
    prefill_tokens_computed: int = 0  # prompt tokens computed (decode: local prefills
                                      # and resumed preemptions)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_bytes_sent: int = 0            # K/V payload bytes sent to decode workers
    # KV tiers (engine/kv_tiers.py; D: local prefills): blocks loaded back from each tier, the bytes
    # and seconds of those loads, disk entries dropped by their checksum, blocks held now
    kv_tier_host_hit_blocks: int = 0
    kv_tier_disk_hit_blocks: int = 0
    kv_tier_bytes_loaded: int = 0
    kv_tier_load_seconds: float = 0.0
    kv_tier_dropped_blocks: int = 0
    kv_tier_disk_writes_dropped: int = 0   # blocks not moved to disk: it was behind or off
    kv_tier_loads_timed_out: int = 0       # loads cut at their budget (a disk read abandoned)
    kv_tier_host_blocks: int = 0
    kv_tier_disk_blocks: int = 0
    # decode
    kv_transport: str = ""            # "tcp" | "nixl"
    kv_one_sided_writes: int = 0      # NIXL writes whose notification D took
    peak_batch_size: int = 0
    step_threads: int = 0             # torch threads the latest step started on
    num_preemptions: int = 0
    kv_reservations_leased: int = 0
    kv_reservations_reclaimed: int = 0
    preempted_requests: int = 0       # waiting to resume by recompute
    local_prefills: int = 0           # prompts D prefilled itself
    kv_pulled_blocks: int = 0         # prefill: prompt blocks read from D (kv_pull)
    kv_pull_bytes: int = 0
    kv_pull_seconds: float = 0.0      # asked to done, summed over the pulls that succeeded
    kv_pull_failures: int = 0         # pulls failed or given up (their blocks computed)

    def to_proto(self):
        """The public pdserve.v1.WorkerStatus: the fields it has."""
        from .proto import pdserve_pb2 as pb

        names = set(pb.WorkerStatus.DESCRIPTOR.fields_by_name)
        return pb.WorkerStatus(**{f.name: getattr(self, f.name) for f in fields(self)
                                  if f.name in names})
