from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "max_new_tokens", "stop", "seed")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "request_tag", "prompt_offsets")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TAG_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    request_tag: str
    prompt_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_tag: _Optional[str] = ..., prompt_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("prompt_index", "sample_index", "prompt_token_ids", "completion_token_ids", "completion_text", "logprobs", "finish_reason", "policy_version", "last_policy_version")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    sample_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    policy_version: int
    last_policy_version: int
    def __init__(self, prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., completion_text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., policy_version: _Optional[int] = ..., last_policy_version: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("trajectory", "trajectories")
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    trajectory: Trajectory
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, trajectory: _Optional[_Union[Trajectory, _Mapping]] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("target_version", "tensors", "total_bytes", "sha256", "run_id")
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    target_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    total_bytes: int
    sha256: str
    run_id: str
    def __init__(self, target_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "receive_s", "apply_s", "bytes_received", "drain_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_S_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    receive_s: float
    apply_s: float
    bytes_received: int
    drain_s: float
    def __init__(self, version: _Optional[int] = ..., receive_s: _Optional[float] = ..., apply_s: _Optional[float] = ..., bytes_received: _Optional[int] = ..., drain_s: _Optional[float] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("path", "target_version", "run_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    target_version: int
    run_id: str
    def __init__(self, path: _Optional[str] = ..., target_version: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("version", "apply_s", "drain_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    apply_s: float
    drain_s: float
    def __init__(self, version: _Optional[int] = ..., apply_s: _Optional[float] = ..., drain_s: _Optional[float] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineSettings(_message.Message):
    __slots__ = ("dtype", "max_model_len", "enforce_eager", "logprobs_mode", "kv_cache_gib", "device", "vllm_version", "engine_mode", "weight_transfer_backend", "weight_transfer_workers", "backend", "gpu_uuids", "gpu_memory_utilization")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ENFORCE_EAGER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GIB_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MODE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_WORKERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    max_model_len: int
    enforce_eager: bool
    logprobs_mode: str
    kv_cache_gib: float
    device: str
    vllm_version: str
    engine_mode: str
    weight_transfer_backend: str
    weight_transfer_workers: int
    backend: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    gpu_memory_utilization: float
    def __init__(self, dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., enforce_eager: _Optional[bool] = ..., logprobs_mode: _Optional[str] = ..., kv_cache_gib: _Optional[float] = ..., device: _Optional[str] = ..., vllm_version: _Optional[str] = ..., engine_mode: _Optional[str] = ..., weight_transfer_backend: _Optional[str] = ..., weight_transfer_workers: _Optional[int] = ..., backend: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., gpu_memory_utilization: _Optional[float] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("requests", "samples", "prompt_tokens", "generated_tokens", "aborted_requests", "weight_reloads", "rejected_weight_updates", "running_requests")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_RELOADS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_WEIGHT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    samples: int
    prompt_tokens: int
    generated_tokens: int
    aborted_requests: int
    weight_reloads: int
    rejected_weight_updates: int
    running_requests: int
    def __init__(self, requests: _Optional[int] = ..., samples: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., aborted_requests: _Optional[int] = ..., weight_reloads: _Optional[int] = ..., rejected_weight_updates: _Optional[int] = ..., running_requests: _Optional[int] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model", "version", "engine", "counters", "vocab_size", "eos_token_id", "lease_run_id", "lease_expires_in_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    engine: EngineSettings
    counters: Counters
    vocab_size: int
    eos_token_id: int
    lease_run_id: str
    lease_expires_in_s: float
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., engine: _Optional[_Union[EngineSettings, _Mapping]] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., vocab_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., lease_run_id: _Optional[str] = ..., lease_expires_in_s: _Optional[float] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("run_id", "force")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    force: bool
    def __init__(self, run_id: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released_run_id",)
    RELEASED_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    released_run_id: str
    def __init__(self, released_run_id: _Optional[str] = ...) -> None: ...

class InitWeightTransferRequest(_message.Message):
    __slots__ = ("run_id", "backend", "master_address", "master_port", "world_size", "rank_offset", "packed", "packed_buffer_size_bytes", "packed_num_buffers", "secret")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    PACKED_BUFFER_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    backend: str
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    packed: bool
    packed_buffer_size_bytes: int
    packed_num_buffers: int
    secret: str
    def __init__(self, run_id: _Optional[str] = ..., backend: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., packed: _Optional[bool] = ..., packed_buffer_size_bytes: _Optional[int] = ..., packed_num_buffers: _Optional[int] = ..., secret: _Optional[str] = ...) -> None: ...

class InitWeightTransferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartWeightUpdateRequest(_message.Message):
    __slots__ = ("run_id", "target_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    target_version: int
    def __init__(self, run_id: _Optional[str] = ..., target_version: _Optional[int] = ...) -> None: ...

class StartWeightUpdateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightChunkRequest(_message.Message):
    __slots__ = ("run_id", "target_version", "names", "dtype_names", "shapes", "next_names", "next_dtype_names", "next_shapes", "digest")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_NAMES_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    NEXT_NAMES_FIELD_NUMBER: _ClassVar[int]
    NEXT_DTYPE_NAMES_FIELD_NUMBER: _ClassVar[int]
    NEXT_SHAPES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    target_version: int
    names: _containers.RepeatedScalarFieldContainer[str]
    dtype_names: _containers.RepeatedScalarFieldContainer[str]
    shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    next_names: _containers.RepeatedScalarFieldContainer[str]
    next_dtype_names: _containers.RepeatedScalarFieldContainer[str]
    next_shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    digest: str
    def __init__(self, run_id: _Optional[str] = ..., target_version: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., dtype_names: _Optional[_Iterable[str]] = ..., shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., next_names: _Optional[_Iterable[str]] = ..., next_dtype_names: _Optional[_Iterable[str]] = ..., next_shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., digest: _Optional[str] = ...) -> None: ...

class UpdateWeightChunkResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishWeightUpdateRequest(_message.Message):
    __slots__ = ("run_id", "target_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    target_version: int
    def __init__(self, run_id: _Optional[str] = ..., target_version: _Optional[int] = ...) -> None: ...

class FinishWeightUpdateResponse(_message.Message):
    __slots__ = ("version", "apply_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    apply_s: float
    def __init__(self, version: _Optional[int] = ..., apply_s: _Optional[float] = ...) -> None: ...

class AbortWeightUpdateRequest(_message.Message):
    __slots__ = ("run_id", "target_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    target_version: int
    def __init__(self, run_id: _Optional[str] = ..., target_version: _Optional[int] = ...) -> None: ...

class AbortWeightUpdateResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class ShutdownWeightTransferRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ShutdownWeightTransferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
