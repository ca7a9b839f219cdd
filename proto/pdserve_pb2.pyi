from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScaleRequest(_message.Message):
    __slots__ = ("num_prefill_workers", "num_decode_workers", "timeout_s")
    NUM_PREFILL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    num_prefill_workers: int
    num_decode_workers: int
    timeout_s: float
    def __init__(self, num_prefill_workers: _Optional[int] = ..., num_decode_workers: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("started", "retired", "migrated", "num_prefill_workers", "num_decode_workers")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    RETIRED_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    started: _containers.RepeatedScalarFieldContainer[str]
    retired: _containers.RepeatedScalarFieldContainer[str]
    migrated: _containers.RepeatedScalarFieldContainer[str]
    num_prefill_workers: int
    num_decode_workers: int
    def __init__(self, started: _Optional[_Iterable[str]] = ..., retired: _Optional[_Iterable[str]] = ..., migrated: _Optional[_Iterable[str]] = ..., num_prefill_workers: _Optional[int] = ..., num_decode_workers: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_ip", "timeout_s")
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    node_ip: str
    timeout_s: float
    def __init__(self, node_ip: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("worker_ids", "drained", "running_requests")
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    drained: bool
    running_requests: int
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ..., drained: _Optional[bool] = ..., running_requests: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "logprobs", "prompt_logprobs", "structured_outputs", "n", "best_of")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    prompt_logprobs: int
    structured_outputs: StructuredOutputs
    n: int
    best_of: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "messages", "sampling", "resume_token_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "token", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    token: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., token: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "logprobs", "prompt_logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "pid", "node_ip", "state", "kv_blocks_total", "kv_blocks_free", "running_requests", "waiting_requests", "epoch", "kv_address", "metrics_address", "kv_reservations_leased", "kv_reservations_reclaimed", "tensor_parallel_size", "kv_tier_host_hit_blocks", "kv_tier_disk_hit_blocks", "kv_tier_bytes_loaded", "kv_tier_load_seconds", "kv_tier_dropped_blocks", "kv_tier_host_blocks", "kv_tier_disk_blocks", "prefill_tokens_computed", "prefix_cache_hit_tokens", "local_prefills", "kv_pulled_blocks", "kv_pull_bytes", "kv_pull_seconds", "kv_pull_failures", "kv_tier_disk_writes_dropped", "kv_tier_loads_timed_out")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVATIONS_LEASED_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVATIONS_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_HOST_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_DISK_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    KV_PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_DISK_WRITES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOADS_TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    pid: int
    node_ip: str
    state: str
    kv_blocks_total: int
    kv_blocks_free: int
    running_requests: int
    waiting_requests: int
    epoch: int
    kv_address: str
    metrics_address: str
    kv_reservations_leased: int
    kv_reservations_reclaimed: int
    tensor_parallel_size: int
    kv_tier_host_hit_blocks: int
    kv_tier_disk_hit_blocks: int
    kv_tier_bytes_loaded: int
    kv_tier_load_seconds: float
    kv_tier_dropped_blocks: int
    kv_tier_host_blocks: int
    kv_tier_disk_blocks: int
    prefill_tokens_computed: int
    prefix_cache_hit_tokens: int
    local_prefills: int
    kv_pulled_blocks: int
    kv_pull_bytes: int
    kv_pull_seconds: float
    kv_pull_failures: int
    kv_tier_disk_writes_dropped: int
    kv_tier_loads_timed_out: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., pid: _Optional[int] = ..., node_ip: _Optional[str] = ..., state: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., epoch: _Optional[int] = ..., kv_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., kv_reservations_leased: _Optional[int] = ..., kv_reservations_reclaimed: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., kv_tier_host_hit_blocks: _Optional[int] = ..., kv_tier_disk_hit_blocks: _Optional[int] = ..., kv_tier_bytes_loaded: _Optional[int] = ..., kv_tier_load_seconds: _Optional[float] = ..., kv_tier_dropped_blocks: _Optional[int] = ..., kv_tier_host_blocks: _Optional[int] = ..., kv_tier_disk_blocks: _Optional[int] = ..., prefill_tokens_computed: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., local_prefills: _Optional[int] = ..., kv_pulled_blocks: _Optional[int] = ..., kv_pull_bytes: _Optional[int] = ..., kv_pull_seconds: _Optional[float] = ..., kv_pull_failures: _Optional[int] = ..., kv_tier_disk_writes_dropped: _Optional[int] = ..., kv_tier_loads_timed_out: _Optional[int] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("model", "workers", "queued_requests", "queued_tokens", "metrics_address", "http_address")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    model: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    queued_requests: int
    queued_tokens: int
    metrics_address: str
    http_address: str
    def __init__(self, model: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., queued_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., metrics_address: _Optional[str] = ..., http_address: _Optional[str] = ...) -> None: ...
