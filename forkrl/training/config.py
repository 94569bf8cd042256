"""The training-run configuration: one pydantic model shared by the client and the trainer service.

Every field's docstring is its `--help` line in `clients/start_run.py` (flags are the field names in
kebab-case) and its meaning in `RunConfig` of `proto/forkrl/trainer/v1/trainer.proto`. The client validates
with this model before sending anything; the service validates the received message again with the same
model and answers INVALID_ARGUMENT with the same message.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

LOSSES = ("grpo", "dr_grpo", "dapo", "reinforce", "rloo", "gspo", "cispo")
LossName = Literal["grpo", "dr_grpo", "dapo", "reinforce", "rloo", "gspo", "cispo"]


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    return float(raw) if raw else None


class RunConfig(BaseModel):
    """A whole RL run. Unset optional fields take the loss's documented defaults."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = Field(
        default="",
        description="Local HF checkpoint dir of the initial policy (the model the rollout service serves); "
        "empty = the embedded tiny model (FORKRL_MODEL_DIR or models/tiny).",
    )
    task: str = Field(default="", description="Built-in task (used when no dataset is given); empty = default.")
    dataset: str = Field(
        default_factory=lambda: os.environ.get("RL_DATASET_PATH", ""),
        description="JSONL dataset of prompts and answers (default: $RL_DATASET_PATH); overrides --task.",
    )
    reward: str = Field(
        default="",
        description="Reward function: exact_match, math_verify or module:function; empty = the task's default "
        "(exact_match for the built-in task, math_verify for a dataset).",
    )
    loss: LossName = Field(default="grpo", description="Policy loss: " + ", ".join(LOSSES) + ".")
    entropy_top_frac: float | None = Field(
        default_factory=lambda: _env_float("ENTROPY_TOP_FRAC"),
        description="Train only on this top fraction of response tokens by entropy, in (0, 1] (paper: 0.2); "
        "default $ENTROPY_TOP_FRAC, unset = all tokens.",
    )
    mask_scope: Literal["microbatch", "step"] = Field(
        default="microbatch", description="Where the top-k is taken: per micro-batch (paper) or per optimizer step."
    )
    mask_norm: Literal["kept", "all"] = Field(
        default="kept", description="Token normalizer under the mask: kept tokens (paper v2) or all tokens (TRL)."
    )
    num_steps: int = Field(default=100, ge=1, description="Optimizer steps (one rollout batch each).")
    prompts_per_step: int = Field(default=32, ge=1, description="Prompts drawn per step.")
    group_size: int = Field(default=8, ge=1, description="Samples per prompt (G).")
    max_new_tokens: int = Field(default=0, ge=0, description="Max generated tokens; 0 = the task's default.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature (also used for logp and entropy).")
    lr: float = Field(
        default=3e-4, gt=0, description="AdamW learning rate (3e-4 suits the tiny model; ~1e-6 for LLMs).",
    )
    clip_low: float | None = Field(default=None, ge=0, description="PPO clip epsilon low; unset = the loss's default.")
    clip_high: float | None = Field(
        default=None, ge=0, description="PPO clip epsilon high; unset = the loss's default."
    )
    micro_batch_size: int = Field(default=64, ge=1, description="Sequences per micro-batch (gradient accumulation).")
    save_every: int = Field(default=0, ge=0, description="Checkpoint every N steps (0 = only the final one).")
    run_dir: str = Field(default="", description="Run directory; empty = <runs root>/<run id>.")
    resume: bool = Field(default=False, description="Continue from the latest checkpoint in --run-dir.")
    seed: int = Field(default=0, ge=0, description="Seed for data order, sampling and tie-breaks.")
    rollout_addresses: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:50051"], description="Rollout service address(es), host:port."
    )
    kl_beta: float = Field(default=0.0, ge=0, description="k3 KL coefficient against the initial policy (0 = off).")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warm-up steps.")
    dynamic_sampling: bool = Field(
        default=False, description="DAPO dynamic sampling: keep only groups with mixed rewards, refill the batch."
    )
    max_gen_batches: int = Field(default=3, ge=1, description="Dynamic sampling: max generation rounds per step.")
    dual_clip_c: float | None = Field(default=None, gt=1, description="Dual-clip constant c for A < 0 (off if unset).")
    cispo_max_weight: float | None = Field(
        default=None, gt=0, description="CISPO: absolute cap on the detached IS weight; unset = the loss default."
    )
    weight_sync: Literal["stream", "path"] = Field(
        default="stream", description="Push weights by streaming (UpdateWeights) or through the run dir (LoadWeights)."
    )
    eval_every: int = Field(default=0, ge=0, description="Evaluate accuracy every N steps (0 = before and after only).")
    eval_prompts: int = Field(default=128, ge=0, description="Eval-split prompts per evaluation (0 = no eval).")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1, description="AdamW beta2.")
    overlong_cache_len: int = Field(
        default=0, ge=0, description="DAPO soft overlong punishment: length of the penalty ramp (0 = off)."
    )

    @field_validator("entropy_top_frac")
    @classmethod
    def _check_frac(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 < v <= 1.0):
            raise ValueError(f"entropy_top_frac must be in (0, 1], got {v}")
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
            raise ValueError("dynamic_sampling needs group_size >= 2 (it keeps groups with mixed rewards)")
        if self.clip_low is not None and self.clip_low >= 1:
            raise ValueError(f"clip_low must be < 1 (the ratio floor is 1 - clip_low), got {self.clip_low}")
        if self.resume and not self.run_dir:
            raise ValueError("resume needs run_dir (the run to continue)")
        return self


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem, naming the field: 'entropy_top_frac: entropy_top_frac must be in (0, 1], got 1.5'."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(msg if "got" in msg else f"{loc}: {msg}, got {e.get('input')!r}")
    return "; ".join(lines)


# ---- proto conversion (pb2 modules are plain protobuf messages: no grpc import) ----

_ENUMS = {
    "loss": ("Loss", "LOSS_"),
    "mask_scope": ("MaskScope", "MASK_SCOPE_"),
    "mask_norm": ("MaskNorm", "MASK_NORM_"),
    "weight_sync": ("WeightSync", "WEIGHT_SYNC_"),
}
# proto3 `optional` fields: presence is explicit. Nullable ones map unset → None; the others (where 0 is a
# valid value) map unset → the model default.
_OPTIONAL = ("entropy_top_frac", "clip_low", "clip_high", "dual_clip_c", "cispo_max_weight")
_PRESENCE = ("eval_prompts", "adam_beta1", "adam_beta2")


def to_proto(cfg: RunConfig) -> Any:
    from forkrl.wire.trainer.v1 import trainer_pb2

    msg = trainer_pb2.RunConfig()
    for name, value in cfg.model_dump().items():
        if name in _ENUMS:
            enum_name, prefix = _ENUMS[name]
            setattr(msg, name, getattr(trainer_pb2, enum_name).Value(prefix + value.upper()))
        elif name == "rollout_addresses":
            msg.rollout_addresses.extend(value)
        elif value is None:
            continue
        else:
            setattr(msg, name, value)
    return msg


def from_proto(msg: Any) -> RunConfig:
    """Proto → validated RunConfig. Unset enums/zero scalars take the model defaults."""
    from forkrl.wire.trainer.v1 import trainer_pb2

    defaults = RunConfig.model_construct()
    data: dict[str, Any] = {}
    for name in RunConfig.model_fields:
        if name in _ENUMS:
            enum_name, prefix = _ENUMS[name]
            value = getattr(msg, name)
            if value != 0:
                data[name] = getattr(trainer_pb2, enum_name).Name(value).removeprefix(prefix).lower()
        elif name in _OPTIONAL:
            data[name] = getattr(msg, name) if msg.HasField(name) else None
        elif name in _PRESENCE:
            if msg.HasField(name):
                data[name] = getattr(msg, name)
        elif name == "rollout_addresses":
            if msg.rollout_addresses:
                data[name] = list(msg.rollout_addresses)
        else:
            value = getattr(msg, name)
            # proto3 scalars cannot say "unset": a zero means "use the default" for fields whose default
            # is not zero (for all of them 0 is invalid); fields where 0 is valid are in _PRESENCE.
            if isinstance(value, str) or value or getattr(defaults, name, None) in (0, 0.0, False):
                data[name] = value
    return RunConfig(**data)
