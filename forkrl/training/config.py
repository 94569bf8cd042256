"""The training-run configuration: one pydantic model shared by the client and the trainer service.

Every field's docstring is its `--help` line in `clients/start_run.py` (flags are the field names in
kebab-case, generated from this model) and its meaning in `RunConfig` of `proto/forkrl/trainer/v1/trainer.proto`.
The client validates with this model before sending anything; the service validates the received message
again with the same model and answers INVALID_ARGUMENT with the same message. `loss_config()` turns a
validated config into the loss's own `LossConfig`.

Imports nothing heavy (no torch): the client's `--help` must answer at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from forkrl.cli import shown
from forkrl.data.prompts import PromptFormat, check_format_options
from forkrl.rl.options import (
    LossName,
    MaskNorm,
    MaskScope,
    check_budget_scope,
    check_pack_budget,
    check_top_frac,
    mask_is_on,
)

if TYPE_CHECKING:
    from forkrl.rl.losses import LossConfig

# Ranges of the fields (each said in its docstring). Bounds no real run needs to exceed; every int fits the proto's
# int32 (int64 for seed), so the client's to_proto can never overflow.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_STEPS = 10**7  # num_steps, save_every, eval_every, warmup_steps
MAX_BATCH = 2**20  # prompts_per_step, micro_batch_size, mini_batch_prompts, eval_prompts
MAX_GROUP = 1024  # group_size
MAX_TOKENS = 2**20  # max_new_tokens, overlong_cache_len
MAX_EPOCHS = 64  # ppo_epochs
MAX_STALENESS = 64  # max_staleness
MAX_GEN_BATCHES = 1024  # max_gen_batches
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 2.0  # vLLM's range (rollout_service/engine.py: validate_sampling)
MAX_CLIP = 10.0  # clip_high
MAX_COEF = 10.0  # kl_beta, weight_decay
MAX_GRAD_NORM = 1e9  # max_grad_norm
MAX_WEIGHT = 1000.0  # dual_clip_c, cispo_max_weight, tis_cap
MAX_PATH_CHARS = 4096  # model, dataset, run_dir: characters, and bytes of UTF-8 (Linux PATH_MAX)
MAX_NAME_BYTES = 255  # one component of such a path (NAME_MAX): longer ones fail every file system call
MAX_NAME_CHARS = 256  # task, reward
MAX_ADDRESSES = 64  # rollout_addresses
MAX_ADDRESS_CHARS = 300  # one host:port (a DNS name is at most 253 characters)


LogTarget = Literal["jsonl", "tensorboard", "wandb"]
"""Where the metrics go (forkrl/training/metrics.py: MetricsSink)."""
WeightSync = Literal["auto", "stream", "path", "shm", "transfer"]
"""How the trainer pushes weights (forkrl/training/rollouts.py): through vLLM's weight-transfer API (transfer),
streamed over gRPC (UpdateWeights), through the run dir or a shared-memory file (LoadWeights), or auto (transfer
when every service offers it, else shm to services on this host and stream to the others)."""


class RunConfig(BaseModel):
    """A whole RL run. Unset optional fields take the loss's documented defaults. Every field has a range (said in
    its docstring, checked here, so by the client and again by the service): ints fit the proto's int32/int64,
    floats are finite, strings and lists are bounded."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    model: str = Field("", max_length=MAX_PATH_CHARS)
    """Local HF checkpoint dir of the initial policy (the model the rollout service serves); empty = the embedded
    tiny model (FORKRL_MODEL_DIR or the committed forkrl/models/default). At most 4096 bytes, 255 per name in it."""
    task: str = Field("", max_length=MAX_NAME_CHARS)
    """Built-in task (used when no dataset is given); empty = default. At most 256 characters."""
    dataset: str = Field("", max_length=MAX_PATH_CHARS)
    """Dataset of prompts and answers: a JSONL or Parquet file or a `datasets` folder (forkrl/data/datasets.py);
    overrides --task. The client defaults it to $RL_DATASET_PATH. At most 4096 bytes, 255 per name in it."""
    reward: str = Field("", max_length=MAX_NAME_CHARS)
    """Reward function: exact_match, countdown, math_verify or module:function; empty = the task's default
    (exact_match for sum3/add2, countdown for countdown, math_verify for a dataset). At most 256 characters."""
    loss: LossName = "grpo"
    """Policy loss (advantage, per-token term, aggregation and default clip of each: forkrl/rl/losses.py)."""
    entropy_top_frac: float | None = None
    """Train only on this top fraction of response tokens by entropy, in (0, 1] (paper: 0.2); unset = all tokens.
    The client defaults it to $ENTROPY_TOP_FRAC."""
    mask_scope: MaskScope = "microbatch"
    """Where the top-k is taken: per micro-batch (paper) or per optimizer step (step is required when
    max_tokens_per_micro_batch is set and entropy_top_frac < 1)."""
    mask_norm: MaskNorm = "kept"
    """Token normalizer under the mask: kept tokens (paper v2) or all tokens (TRL)."""
    num_steps: int = Field(100, ge=1, le=MAX_STEPS)
    """Optimizer steps (one rollout batch each), 1 to 10,000,000."""
    prompts_per_step: int = Field(32, ge=1, le=MAX_BATCH)
    """Prompts drawn per step, 1 to 1,048,576 (and the trainer's max_step_samples caps prompts x group_size)."""
    group_size: int = Field(8, ge=1, le=MAX_GROUP)
    """Samples per prompt (G), 1 to 1024."""
    max_new_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    """Max generated tokens, up to 1,048,576 (and the model's context); 0 = the task's default."""
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE)
    """Sampling temperature (also used for logp and entropy), 0.01 to 2 (vLLM's range)."""
    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate, any finite value > 0 (3e-4 suits the tiny model; ~1e-6 for LLMs)."""
    clip_low: float | None = Field(None, ge=0, lt=1)
    """PPO clip epsilon low, in [0, 1) (the ratio floor is 1 - clip_low); unset = the loss's default."""
    clip_high: float | None = Field(None, ge=0, le=MAX_CLIP)
    """PPO clip epsilon high, 0 to 10; unset = the loss's default."""
    micro_batch_size: int = Field(64, ge=1, le=MAX_BATCH)
    """Sequences per micro-batch (gradient accumulation), 1 to 1,048,576."""
    max_tokens_per_micro_batch: int = Field(0, ge=0, le=INT32_MAX)
    """Micro-batches by tokens instead of micro_batch_size: each mini-batch's sequences are grouped by length into
    micro-batches of at most this many padded tokens (rows x longest row; a single longer sequence is one on
    its own) and dealt to the ranks balanced by tokens; the update is the same. With
    entropy_top_frac < 1 it needs --mask-scope step. 0 = off (micro_batch_size sequences); at most 2^31 - 1."""
    pack_sequences: bool = False
    """Packed sequences (needs max_tokens_per_micro_batch): each micro-batch is one row holding its sequences end to
    end, at most max_tokens_per_micro_batch tokens, position ids restarting per sequence, no padding at all; the
    update is the same. For the model types forkrl checked (forkrl/rl/head.py: the sdpa, eager and flash-attention
    implementations); the trainer refuses others at StartRun."""
    mini_batch_prompts: int = Field(0, ge=0, le=MAX_BATCH)
    """Prompts (whole groups) per optimizer update: the rollout batch is split into mini-batches of this many
    prompts, one AdamW step each, with pi_old = the weights before the first update (DAPO and the 80/20
    paper: 32 of 512); at most prompts_per_step; 0 = all prompts, one update per step."""
    ppo_epochs: int = Field(1, ge=1, le=MAX_EPOCHS)
    """Passes over the rollout batch's mini-batches per step (PPO epochs), 1 to 64."""
    max_staleness: int = Field(0, ge=0, le=MAX_STALENESS)
    """Async rollouts: sample up to this many steps ahead while the trainer trains; a trajectory is trained at
    most this many policy versions after it was sampled (pair it with --tis-cap); 0 = sync; at most 64."""
    save_every: int = Field(0, ge=0, le=MAX_STEPS)
    """Checkpoint every N steps (0 = only the final one), at most 10,000,000."""
    keep_checkpoints: int = Field(5, ge=1, le=MAX_STEPS)
    """Step checkpoints kept: after each save, the latest (what --resume needs) and the most recent ones at eval
    steps (multiples of eval_every, the steps a probe compares; every saved step when eval_every is 0), this many
    in all; older ones are deleted once the new one is complete; final/ is always kept. 1 to 10,000,000."""
    run_dir: str = Field("", max_length=MAX_PATH_CHARS)
    """Run directory; empty = <runs root>/<run id>. At most 4096 bytes, 255 per name in it."""
    resume: bool = False
    """Continue from the latest checkpoint in --run-dir. The resumed run keeps the run id of the run it continues
    (kept in <run-dir>/run_id): GetRun, WatchRun, checkpoints and the rollout lease all use that one id."""
    seed: int = Field(0, ge=0, le=INT64_MAX)
    """Seed for data order, sampling and tie-breaks, 0 to 2^63 - 1."""
    rollout_addresses: list[str] = Field(["127.0.0.1:50051"], max_length=MAX_ADDRESSES)
    """Rollout service address(es), host:port; several as a comma-separated list or a repeated flag (at most 64,
    each at most 300 characters)."""
    kl_beta: float = Field(0.0, ge=0, le=MAX_COEF)
    """k3 KL coefficient against the initial policy (0 = off), at most 10."""
    max_grad_norm: float = Field(1.0, gt=0, le=MAX_GRAD_NORM)
    """Gradient clipping norm, > 0 and at most 1e9."""
    weight_decay: float = Field(0.0, ge=0, le=MAX_COEF)
    """AdamW weight decay, 0 to 10."""
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)
    """Linear learning-rate warm-up steps, at most 10,000,000."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: keep only groups of mixed correctness (0 < #correct < G, graded before the overlong
    penalty), refill the batch."""
    max_gen_batches: int = Field(3, ge=1, le=MAX_GEN_BATCHES)
    """Dynamic sampling: max generation rounds per step, 1 to 1024."""
    dual_clip_c: float | None = Field(None, gt=1, le=MAX_WEIGHT)
    """Dual-clip constant c for A < 0, in (1, 1000] (off if unset)."""
    cispo_max_weight: float | None = Field(None, gt=0, le=MAX_WEIGHT)
    """CISPO: absolute cap on the detached IS weight, in (0, 1000]; unset = the loss default."""
    tis_cap: float | None = Field(None, ge=1, le=MAX_WEIGHT)
    """Truncated importance sampling on the rollout engine's logprobs: weight each token's loss by
    min(pi_old / pi_rollout, C) (published: 2.0), C in [1, 1000]; for cispo: its IS weight becomes
    pi / pi_rollout, truncated at its own cap (cispo_max_weight); unset = off."""
    weight_sync: WeightSync = "auto"
    """Weight push route: transfer = vLLM's weight-transfer API, the model broadcast layer by layer into the rollout
    services' workers (gloo on CPU, nccl on a GPU; rendezvous at TRAINER_TRANSFER_ADDRESS, default 127.0.0.1);
    auto = transfer when every rollout service offers it, else a shared-memory file + LoadWeights for rollout
    services on this host that see it, streaming (UpdateWeights) for the others; stream; path (the run dir +
    LoadWeights, a shared volume); shm (/dev/shm, or FORKRL_SYNC_DIR, + LoadWeights)."""
    eval_every: int = Field(0, ge=0, le=MAX_STEPS)
    """Evaluate accuracy every N steps (0 = before and after only), at most 10,000,000."""
    eval_prompts: int = Field(128, ge=0, le=MAX_BATCH)
    """Eval prompts per evaluation: of the eval split, or of each --eval-dataset file (0 = no eval), at most
    1,048,576 (and the trainer's max_eval_tokens caps eval_prompts x files x max_new_tokens)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1, in [0, 1)."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2, in [0, 1)."""
    overlong_cache_len: int = Field(0, ge=0, le=MAX_TOKENS)
    """DAPO soft overlong punishment: length of the penalty ramp (0 = off), at most max_new_tokens (1,048,576)."""
    max_bad_steps: int = Field(3, ge=0, le=MAX_STEPS)
    """Fail the run after this many steps in a row whose every update was skipped for a non-finite loss or gradient
    norm (each skip is logged with the tensor; the last good checkpoint is kept); 0 = never fail, train on; at most
    10,000,000."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (HF non-reentrant
    checkpointing, on 1 or N ranks): per layer only its input is kept, for about one more forward of compute; the
    numbers do not change. Needed for long responses (recipes/dapo_paper.toml turns it on: docs/scaling.md
    "Memory plan"); off by default (the short rows of the tiny default do not need it)."""
    kl_pass: bool = False
    """One more no-grad forward over the batch after the last update, for approx_kl / approx_kl_all = the k3 estimate
    of KL(π_old ‖ π_new) on the kept / all response tokens (algorithms.md §3.8). Off by default: it is telemetry only
    and costs one more forward; every step logs approx_kl_start, the KL from π_old to the weights each update starts
    from, from the loss pass itself (0 with one update per batch)."""
    prompt_format: PromptFormat = "raw"
    """How a problem becomes the model's prompt (forkrl/data/prompts.py): raw (the text as is), chat (the
    tokenizer's chat template; a row's own message list is kept), dapo (DAPO's math prompt in the chat template,
    the answer on a last 'Answer:' line: the 80/20 paper's), boxed (a \\boxed{} instruction in the chat template),
    dapo_plain / boxed_plain (those texts without a chat template). math_verify reads the answer where the
    format puts it."""
    system_prompt: str = Field("", max_length=65536)
    """System message of the chat formats (chat, dapo, boxed); empty = none (a row's own system turn is kept)."""
    prompt_field: str = Field("", max_length=256)
    """Dataset field of the prompt, dotted for a nested one (extra_info.question); empty = the first of prompt,
    question, problem."""
    answer_field: str = Field("", max_length=256)
    """Dataset field of the gold answer, dotted for a nested one (reward_model.ground_truth); empty = the first
    of answer, solution, ground_truth, reward_model.ground_truth."""
    eval_dataset: list[str] = Field([], max_length=32)
    """Benchmark file(s) or folder(s) for the in-training eval instead of the eval split (same kinds as
    --dataset, read whole, the first eval_prompts problems of each); several as a comma-separated list or a
    repeated flag. eval_accuracy is over all of them, eval_accuracy_<name> per file. At most 32, each at most 4096
    bytes, 255 per name in it."""
    log_to: list[LogTarget] = ["jsonl", "tensorboard"]
    """Where the step and eval metrics go: jsonl (metrics.jsonl, always written: resume and the curves read it),
    tensorboard (<run_dir>/tb), wandb (Weights & Biases: the optional extra `wandb`; WANDB_MODE=offline writes
    <run_dir>/wandb without a network)."""
    wandb_project: str = Field("", max_length=128)
    """W&B project (log_to wandb); empty = $WANDB_PROJECT of the trainer, else forkrl. The W&B run is named
    after the run dir and keeps its id across resumes."""

    @field_validator("entropy_top_frac")
    @classmethod
    def _check_frac(cls, v: float | None) -> float | None:
        check_top_frac(v)
        return v

    @field_validator("model", "dataset", "run_dir", "eval_dataset")
    @classmethod
    def _check_path(cls, v: str | list[str], info: ValidationInfo) -> str | list[str]:
        for path in [v] if isinstance(v, str) else v:  # eval_dataset: each path
            longest = max(len(part.encode()) for part in path.split("/"))
            if len(path.encode()) > MAX_PATH_CHARS or longest > MAX_NAME_BYTES:
                raise ValueError(f"{info.field_name} must have at most {MAX_PATH_CHARS} bytes (UTF-8), at most "
                                 f"{MAX_NAME_BYTES} per name in it, got {len(path.encode()):,} bytes, the longest "
                                 f"name {longest:,}")
        return v

    @field_validator("rollout_addresses")
    @classmethod
    def _check_addresses(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("rollout_addresses must name at least one host:port")
        for addr in v:
            if len(addr) > MAX_ADDRESS_CHARS:
                raise ValueError(f"rollout_addresses: an address has at most {MAX_ADDRESS_CHARS} characters, got "
                                 f"{shown(addr)}")
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"rollout_addresses: expected host:port (port 0 to 65535), got {shown(addr)}")
        return v

    @model_validator(mode="after")
    def _check_combinations(self) -> RunConfig:
        if self.loss == "rloo" and self.group_size < 2:
            raise ValueError(f"loss rloo needs group_size >= 2 (leave-one-out baseline), got {self.group_size}")
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError("dynamic_sampling needs group_size >= 2 (it keeps groups of mixed correctness)")
        if self.mini_batch_prompts > self.prompts_per_step:
            raise ValueError(f"mini_batch_prompts ({self.mini_batch_prompts}) must be <= prompts_per_step "
                             f"({self.prompts_per_step}); 0 = all prompts in one update")
        check_budget_scope(self.max_tokens_per_micro_batch, mask_is_on(self.entropy_top_frac), self.mask_scope)
        check_pack_budget(self.pack_sequences, self.max_tokens_per_micro_batch)
        if self.resume and not self.run_dir:
            raise ValueError("resume needs run_dir (the run to continue)")
        if self.max_new_tokens:
            self.check_overlong()
        check_format_options(self.prompt_format, self.system_prompt)
        return self

    def check_overlong(self) -> None:
        """ValueError unless overlong_cache_len <= max_new_tokens (the ramp lies inside the length budget); call
        it on a resolved config too (max_new_tokens 0 = the task's default, known only then)."""
        if self.overlong_cache_len > self.max_new_tokens:
            raise ValueError(f"overlong_cache_len ({self.overlong_cache_len}) must be <= max_new_tokens "
                             f"({self.max_new_tokens}): the penalty ramp lies inside the length budget")

    def loss_config(self) -> LossConfig:
        """The loss settings of this run. Call it on a resolved config (max_new_tokens filled in: it is L_max
        of dr_grpo's constant normalizer). Raises ValueError for a combination the loss cannot honour."""
        from forkrl.rl.losses import LossConfig  # torch: only where the loss is built, never for the CLI

        return LossConfig(
            name=self.loss, clip_low=self.clip_low, clip_high=self.clip_high, dual_clip_c=self.dual_clip_c,
            kl_beta=self.kl_beta, cispo_max_weight=self.cispo_max_weight, max_len=self.max_new_tokens,
            mask_norm=self.mask_norm, entropy_top_frac=self.entropy_top_frac, mask_scope=self.mask_scope,
            tis_cap=self.tis_cap,
        )


# ---- proto conversion (pb2 modules are plain protobuf messages: no grpc import) ----
# Derived from the message descriptor by name, never from a hand-kept table: a Literal field maps to the
# proto enum of the same field (value "dr_grpo" <-> LOSS_DR_GRPO, the prefix taken from *_UNSPECIFIED), and
# proto3 `optional` fields carry presence (unset -> None where the model allows None, else the model default).


def _enum_prefix(enum_type: Any) -> str:
    return enum_type.values_by_number[0].name.removesuffix("UNSPECIFIED")


def to_proto(cfg: RunConfig) -> Any:
    from forkrl.wire.trainer.v1 import trainer_pb2

    msg = trainer_pb2.RunConfig()
    fields = msg.DESCRIPTOR.fields_by_name
    for name, value in cfg.model_dump().items():
        if fields[name].enum_type is not None:
            enum_type = fields[name].enum_type
            setattr(msg, name, enum_type.values_by_name[_enum_prefix(enum_type) + value.upper()].number)
        elif isinstance(value, list):  # repeated string fields
            getattr(msg, name).extend(value)
        elif value is not None:
            setattr(msg, name, value)
    return msg


def from_proto(msg: Any) -> RunConfig:
    """Proto → validated RunConfig. Unset enums/zero scalars take the model defaults."""
    defaults = RunConfig.model_construct()
    fields = msg.DESCRIPTOR.fields_by_name
    data: dict[str, Any] = {}
    for name, info in RunConfig.model_fields.items():
        field = fields[name]
        value = getattr(msg, name)
        if field.enum_type is not None:
            if value != 0:  # an unknown number goes through as is: the Literal check names the field
                known = field.enum_type.values_by_number.get(value)
                data[name] = known.name.removeprefix(_enum_prefix(field.enum_type)).lower() if known else value
        elif field.is_repeated:  # empty = the default
            if value:
                data[name] = list(value)
        elif field.has_presence:
            if msg.HasField(name):
                data[name] = value
            elif info.default is None:
                data[name] = None
        # proto3 scalars cannot say "unset": a zero means "use the default" for fields whose default is not
        # zero (for all of them 0 is invalid); fields where 0 is valid and the default is not are `optional`.
        elif isinstance(value, str) or value or getattr(defaults, name, None) in (0, 0.0, False):
            data[name] = value
    return RunConfig(**data)
