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

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forkrl.rl.options import LossName, MaskNorm, MaskScope, check_top_frac

if TYPE_CHECKING:
    from forkrl.rl.losses import LossConfig

WeightSync = Literal["auto", "stream", "path", "shm", "transfer"]
"""How the trainer pushes weights (forkrl/training/rollouts.py): through vLLM's weight-transfer API (transfer),
streamed over gRPC (UpdateWeights), through the run dir or a shared-memory file (LoadWeights), or auto (transfer
when every service offers it, else shm to services on this host and stream to the others)."""


class RunConfig(BaseModel):
    """A whole RL run. Unset optional fields take the loss's documented defaults."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    model: str = ""
    """Local HF checkpoint dir of the initial policy (the model the rollout service serves); empty = the embedded
    tiny model (FORKRL_MODEL_DIR or the committed forkrl/models/default)."""
    task: str = ""
    """Built-in task (used when no dataset is given); empty = default."""
    dataset: str = ""
    """JSONL dataset of prompts and answers; overrides --task. The client defaults it to $RL_DATASET_PATH."""
    reward: str = ""
    """Reward function: exact_match, countdown, math_verify or module:function; empty = the task's default
    (exact_match for sum3/add2, countdown for countdown, math_verify for a dataset)."""
    loss: LossName = "grpo"
    """Policy loss (advantage, per-token term, aggregation and default clip of each: forkrl/rl/losses.py)."""
    entropy_top_frac: float | None = None
    """Train only on this top fraction of response tokens by entropy, in (0, 1] (paper: 0.2); unset = all tokens.
    The client defaults it to $ENTROPY_TOP_FRAC."""
    mask_scope: MaskScope = "microbatch"
    """Where the top-k is taken: per micro-batch (paper) or per optimizer step."""
    mask_norm: MaskNorm = "kept"
    """Token normalizer under the mask: kept tokens (paper v2) or all tokens (TRL)."""
    num_steps: int = Field(100, ge=1)
    """Optimizer steps (one rollout batch each)."""
    prompts_per_step: int = Field(32, ge=1)
    """Prompts drawn per step."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt (G)."""
    max_new_tokens: int = Field(0, ge=0)
    """Max generated tokens; 0 = the task's default."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (also used for logp and entropy)."""
    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate (3e-4 suits the tiny model; ~1e-6 for LLMs)."""
    clip_low: float | None = Field(None, ge=0)
    """PPO clip epsilon low; unset = the loss's default."""
    clip_high: float | None = Field(None, ge=0)
    """PPO clip epsilon high; unset = the loss's default."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per micro-batch (gradient accumulation)."""
    mini_batch_prompts: int = Field(0, ge=0)
    """Prompts (whole groups) per optimizer update: the rollout batch is split into mini-batches of this many
    prompts, one AdamW step each, with pi_old = the weights before the first update (DAPO and the 80/20
    paper: 32 of 512); 0 = all prompts, one update per step."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the rollout batch's mini-batches per step (PPO epochs)."""
    max_staleness: int = Field(0, ge=0)
    """Async rollouts: sample up to this many steps ahead while the trainer trains; a trajectory is trained at
    most this many policy versions after it was sampled (pair it with --tis-cap); 0 = sync."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0 = only the final one)."""
    run_dir: str = ""
    """Run directory; empty = <runs root>/<run id>."""
    resume: bool = False
    """Continue from the latest checkpoint in --run-dir."""
    seed: int = Field(0, ge=0)
    """Seed for data order, sampling and tie-breaks."""
    rollout_addresses: list[str] = ["127.0.0.1:50051"]
    """Rollout service address(es), host:port; several as a comma-separated list or a repeated flag."""
    kl_beta: float = Field(0.0, ge=0)
    """k3 KL coefficient against the initial policy (0 = off)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping norm."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up steps."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: keep only groups of mixed correctness (0 < #correct < G, graded before the overlong
    penalty), refill the batch."""
    max_gen_batches: int = Field(3, ge=1)
    """Dynamic sampling: max generation rounds per step."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant c for A < 0 (off if unset)."""
    cispo_max_weight: float | None = Field(None, gt=0)
    """CISPO: absolute cap on the detached IS weight; unset = the loss default."""
    tis_cap: float | None = Field(None, ge=1)
    """Truncated importance sampling on the rollout engine's logprobs: weight each token's loss by
    min(pi_old / pi_rollout, C) (published: 2.0); for cispo: its IS weight becomes pi / pi_rollout, truncated at
    its own cap (cispo_max_weight); unset = off."""
    weight_sync: WeightSync = "auto"
    """Weight push route: transfer = vLLM's weight-transfer API, the model broadcast layer by layer into the rollout
    services' workers (gloo on CPU, nccl on a GPU; rendezvous at TRAINER_TRANSFER_ADDRESS, default 127.0.0.1);
    auto = transfer when every rollout service offers it, else a shared-memory file + LoadWeights for rollout
    services on this host that see it, streaming (UpdateWeights) for the others; stream; path (the run dir +
    LoadWeights, a shared volume); shm (/dev/shm, or FORKRL_SYNC_DIR, + LoadWeights)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate accuracy every N steps (0 = before and after only)."""
    eval_prompts: int = Field(128, ge=0)
    """Eval-split prompts per evaluation (0 = no eval)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""
    overlong_cache_len: int = Field(0, ge=0)
    """DAPO soft overlong punishment: length of the penalty ramp (0 = off)."""

    @field_validator("entropy_top_frac")
    @classmethod
    def _check_frac(cls, v: float | None) -> float | None:
        check_top_frac(v)
        return v

    @field_validator("rollout_addresses")
    @classmethod
    def _check_addresses(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("rollout_addresses must name at least one host:port")
        for addr in v:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"rollout_addresses: expected host:port, got {addr!r}")
        return v

    @model_validator(mode="after")
    def _check_combinations(self) -> RunConfig:
        if self.loss == "rloo" and self.group_size < 2:
            raise ValueError(f"loss rloo needs group_size >= 2 (leave-one-out baseline), got {self.group_size}")
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError("dynamic_sampling needs group_size >= 2 (it keeps groups of mixed correctness)")
        if self.clip_low is not None and self.clip_low >= 1:
            raise ValueError(f"clip_low must be < 1 (the ratio floor is 1 - clip_low), got {self.clip_low}")
        if self.mini_batch_prompts > self.prompts_per_step:
            raise ValueError(f"mini_batch_prompts ({self.mini_batch_prompts}) must be <= prompts_per_step "
                             f"({self.prompts_per_step}); 0 = all prompts in one update")
        if self.resume and not self.run_dir:
            raise ValueError("resume needs run_dir (the run to continue)")
        return self

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
        elif name == "rollout_addresses":
            msg.rollout_addresses.extend(value)
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
        elif name == "rollout_addresses":
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
