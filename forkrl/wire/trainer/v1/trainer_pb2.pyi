from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Loss(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_UNSPECIFIED: _ClassVar[Loss]
    LOSS_GRPO: _ClassVar[Loss]
    LOSS_DR_GRPO: _ClassVar[Loss]
    LOSS_DAPO: _ClassVar[Loss]
    LOSS_REINFORCE: _ClassVar[Loss]
    LOSS_RLOO: _ClassVar[Loss]
    LOSS_GSPO: _ClassVar[Loss]
    LOSS_CISPO: _ClassVar[Loss]

class MaskScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MASK_SCOPE_UNSPECIFIED: _ClassVar[MaskScope]
    MASK_SCOPE_MICROBATCH: _ClassVar[MaskScope]
    MASK_SCOPE_STEP: _ClassVar[MaskScope]

class MaskNorm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MASK_NORM_UNSPECIFIED: _ClassVar[MaskNorm]
    MASK_NORM_KEPT: _ClassVar[MaskNorm]
    MASK_NORM_ALL: _ClassVar[MaskNorm]

class WeightSync(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_SYNC_UNSPECIFIED: _ClassVar[WeightSync]
    WEIGHT_SYNC_STREAM: _ClassVar[WeightSync]
    WEIGHT_SYNC_PATH: _ClassVar[WeightSync]
    WEIGHT_SYNC_AUTO: _ClassVar[WeightSync]
    WEIGHT_SYNC_SHM: _ClassVar[WeightSync]
    WEIGHT_SYNC_TRANSFER: _ClassVar[WeightSync]

class PromptFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROMPT_FORMAT_UNSPECIFIED: _ClassVar[PromptFormat]
    PROMPT_FORMAT_RAW: _ClassVar[PromptFormat]
    PROMPT_FORMAT_CHAT: _ClassVar[PromptFormat]
    PROMPT_FORMAT_DAPO: _ClassVar[PromptFormat]
    PROMPT_FORMAT_DAPO_PLAIN: _ClassVar[PromptFormat]
    PROMPT_FORMAT_BOXED: _ClassVar[PromptFormat]
    PROMPT_FORMAT_BOXED_PLAIN: _ClassVar[PromptFormat]

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_STARTING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_STOPPING: _ClassVar[RunState]
    RUN_STATE_SUCCEEDED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_STARTED: _ClassVar[EventKind]
    EVENT_KIND_CHECKPOINT: _ClassVar[EventKind]
    EVENT_KIND_EVAL: _ClassVar[EventKind]
    EVENT_KIND_LOG: _ClassVar[EventKind]
    EVENT_KIND_FINISHED: _ClassVar[EventKind]
LOSS_UNSPECIFIED: Loss
LOSS_GRPO: Loss
LOSS_DR_GRPO: Loss
LOSS_DAPO: Loss
LOSS_REINFORCE: Loss
LOSS_RLOO: Loss
LOSS_GSPO: Loss
LOSS_CISPO: Loss
MASK_SCOPE_UNSPECIFIED: MaskScope
MASK_SCOPE_MICROBATCH: MaskScope
MASK_SCOPE_STEP: MaskScope
MASK_NORM_UNSPECIFIED: MaskNorm
MASK_NORM_KEPT: MaskNorm
MASK_NORM_ALL: MaskNorm
WEIGHT_SYNC_UNSPECIFIED: WeightSync
WEIGHT_SYNC_STREAM: WeightSync
WEIGHT_SYNC_PATH: WeightSync
WEIGHT_SYNC_AUTO: WeightSync
WEIGHT_SYNC_SHM: WeightSync
WEIGHT_SYNC_TRANSFER: WeightSync
PROMPT_FORMAT_UNSPECIFIED: PromptFormat
PROMPT_FORMAT_RAW: PromptFormat
PROMPT_FORMAT_CHAT: PromptFormat
PROMPT_FORMAT_DAPO: PromptFormat
PROMPT_FORMAT_DAPO_PLAIN: PromptFormat
PROMPT_FORMAT_BOXED: PromptFormat
PROMPT_FORMAT_BOXED_PLAIN: PromptFormat
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_STARTING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_STOPPING: RunState
RUN_STATE_SUCCEEDED: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_FAILED: RunState
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_STARTED: EventKind
EVENT_KIND_CHECKPOINT: EventKind
EVENT_KIND_EVAL: EventKind
EVENT_KIND_LOG: EventKind
EVENT_KIND_FINISHED: EventKind

class RunConfig(_message.Message):
    __slots__ = ("model", "task", "dataset", "reward", "loss", "entropy_top_frac", "mask_scope", "mask_norm", "num_steps", "prompts_per_step", "group_size", "max_new_tokens", "temperature", "lr", "clip_low", "clip_high", "micro_batch_size", "save_every", "keep_checkpoints", "run_dir", "resume", "seed", "rollout_addresses", "kl_beta", "max_grad_norm", "weight_decay", "warmup_steps", "dynamic_sampling", "max_gen_batches", "dual_clip_c", "cispo_max_weight", "weight_sync", "eval_every", "eval_prompts", "adam_beta1", "adam_beta2", "overlong_cache_len", "mini_batch_prompts", "ppo_epochs", "tis_cap", "max_staleness", "max_bad_steps", "activation_checkpointing", "kl_pass", "max_tokens_per_micro_batch", "pack_sequences", "prompt_format", "system_prompt", "prompt_field", "answer_field", "eval_dataset", "log_to", "wandb_project")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_TOP_FRAC_FIELD_NUMBER: _ClassVar[int]
    MASK_SCOPE_FIELD_NUMBER: _ClassVar[int]
    MASK_NORM_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAVE_EVERY_FIELD_NUMBER: _ClassVar[int]
    KEEP_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    KL_BETA_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_GEN_BATCHES_FIELD_NUMBER: _ClassVar[int]
    DUAL_CLIP_C_FIELD_NUMBER: _ClassVar[int]
    CISPO_MAX_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    ADAM_BETA1_FIELD_NUMBER: _ClassVar[int]
    ADAM_BETA2_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    MINI_BATCH_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PPO_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_BAD_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    KL_PASS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    PACK_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_FIELD_NUMBER: _ClassVar[int]
    EVAL_DATASET_FIELD_NUMBER: _ClassVar[int]
    LOG_TO_FIELD_NUMBER: _ClassVar[int]
    WANDB_PROJECT_FIELD_NUMBER: _ClassVar[int]
    model: str
    task: str
    dataset: str
    reward: str
    loss: Loss
    entropy_top_frac: float
    mask_scope: MaskScope
    mask_norm: MaskNorm
    num_steps: int
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float
    lr: float
    clip_low: float
    clip_high: float
    micro_batch_size: int
    save_every: int
    keep_checkpoints: int
    run_dir: str
    resume: bool
    seed: int
    rollout_addresses: _containers.RepeatedScalarFieldContainer[str]
    kl_beta: float
    max_grad_norm: float
    weight_decay: float
    warmup_steps: int
    dynamic_sampling: bool
    max_gen_batches: int
    dual_clip_c: float
    cispo_max_weight: float
    weight_sync: WeightSync
    eval_every: int
    eval_prompts: int
    adam_beta1: float
    adam_beta2: float
    overlong_cache_len: int
    mini_batch_prompts: int
    ppo_epochs: int
    tis_cap: float
    max_staleness: int
    max_bad_steps: int
    activation_checkpointing: bool
    kl_pass: bool
    max_tokens_per_micro_batch: int
    pack_sequences: bool
    prompt_format: PromptFormat
    system_prompt: str
    prompt_field: str
    answer_field: str
    eval_dataset: _containers.RepeatedScalarFieldContainer[str]
    log_to: _containers.RepeatedScalarFieldContainer[str]
    wandb_project: str
    def __init__(self, model: _Optional[str] = ..., task: _Optional[str] = ..., dataset: _Optional[str] = ..., reward: _Optional[str] = ..., loss: _Optional[_Union[Loss, str]] = ..., entropy_top_frac: _Optional[float] = ..., mask_scope: _Optional[_Union[MaskScope, str]] = ..., mask_norm: _Optional[_Union[MaskNorm, str]] = ..., num_steps: _Optional[int] = ..., prompts_per_step: _Optional[int] = ..., group_size: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., lr: _Optional[float] = ..., clip_low: _Optional[float] = ..., clip_high: _Optional[float] = ..., micro_batch_size: _Optional[int] = ..., save_every: _Optional[int] = ..., keep_checkpoints: _Optional[int] = ..., run_dir: _Optional[str] = ..., resume: _Optional[bool] = ..., seed: _Optional[int] = ..., rollout_addresses: _Optional[_Iterable[str]] = ..., kl_beta: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., weight_decay: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., dynamic_sampling: _Optional[bool] = ..., max_gen_batches: _Optional[int] = ..., dual_clip_c: _Optional[float] = ..., cispo_max_weight: _Optional[float] = ..., weight_sync: _Optional[_Union[WeightSync, str]] = ..., eval_every: _Optional[int] = ..., eval_prompts: _Optional[int] = ..., adam_beta1: _Optional[float] = ..., adam_beta2: _Optional[float] = ..., overlong_cache_len: _Optional[int] = ..., mini_batch_prompts: _Optional[int] = ..., ppo_epochs: _Optional[int] = ..., tis_cap: _Optional[float] = ..., max_staleness: _Optional[int] = ..., max_bad_steps: _Optional[int] = ..., activation_checkpointing: _Optional[bool] = ..., kl_pass: _Optional[bool] = ..., max_tokens_per_micro_batch: _Optional[int] = ..., pack_sequences: _Optional[bool] = ..., prompt_format: _Optional[_Union[PromptFormat, str]] = ..., system_prompt: _Optional[str] = ..., prompt_field: _Optional[str] = ..., answer_field: _Optional[str] = ..., eval_dataset: _Optional[_Iterable[str]] = ..., log_to: _Optional[_Iterable[str]] = ..., wandb_project: _Optional[str] = ...) -> None: ...

class StartRunRequest(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: RunConfig
    def __init__(self, config: _Optional[_Union[RunConfig, _Mapping]] = ...) -> None: ...

class StartRunResponse(_message.Message):
    __slots__ = ("run_id", "run_dir", "start_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    run_dir: str
    start_step: int
    def __init__(self, run_id: _Optional[str] = ..., run_dir: _Optional[str] = ..., start_step: _Optional[int] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    step: int
    values: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("kind", "step", "message", "state", "values", "path")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    step: int
    message: str
    state: RunState
    values: _containers.ScalarMap[str, float]
    path: str
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., step: _Optional[int] = ..., message: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., values: _Optional[_Mapping[str, float]] = ..., path: _Optional[str] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WatchRunResponse(_message.Message):
    __slots__ = ("metrics", "event")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    metrics: StepMetrics
    event: RunEvent
    def __init__(self, metrics: _Optional[_Union[StepMetrics, _Mapping]] = ..., event: _Optional[_Union[RunEvent, _Mapping]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run_id", "state", "step", "num_steps", "config", "error", "run_dir", "last_metrics")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    step: int
    num_steps: int
    config: RunConfig
    error: str
    run_dir: str
    last_metrics: StepMetrics
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., step: _Optional[int] = ..., num_steps: _Optional[int] = ..., config: _Optional[_Union[RunConfig, _Mapping]] = ..., error: _Optional[str] = ..., run_dir: _Optional[str] = ..., last_metrics: _Optional[_Union[StepMetrics, _Mapping]] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StopRunResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    def __init__(self, state: _Optional[_Union[RunState, str]] = ...) -> None: ...
