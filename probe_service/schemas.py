"""Request and response models of the probe API. Every field carries its description and range, so /docs
documents it and an out-of-range value is a 422 whose `loc` names the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ModuleName = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
RowSpec = Annotated[
    str,
    Field(
        pattern=r"^(start|mid|last|random:[1-9]\d*|-?\d+(,-?\d+)*)$",
        description="start, mid, last, random:N or comma-separated row indices",
    ),
]


class ProbeRequest(BaseModel):
    """One probe job: which checkpoints, how to sample, what to differentiate. Defaults: algorithms.md §4."""

    model_config = ConfigDict(extra="forbid")

    checkpoint_root: str | None = Field(
        default=None, description="A run's checkpoints dir (<run_dir>/checkpoints) holding step_NNNNNN/ and final/."
    )
    steps: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=1000, description="Steps to probe under checkpoint_root, e.g. [20, 80]."
    )
    include_final: bool = Field(default=False, description="Also probe checkpoint_root/final.")
    checkpoints: list[str] = Field(
        default_factory=list, max_length=64, description="Explicit checkpoint directories (in addition to steps)."
    )
    model: str | None = Field(
        default=None, description="Base model directory, probed first under the label 'base' (optional)."
    )
    task: str = Field(default="", description="Built-in task; empty = the default task (or $RL_DATASET_PATH).")
    dataset: str = Field(default="", description="JSONL dataset of prompts and answers (overrides task).")
    split: Literal["train", "eval"] = Field(default="train", description="Which split the prompts come from.")
    reward: str = Field(
        default="", description="exact_match or math_verify; empty = the task's default (as in training)."
    )
    num_prompts: int = Field(default=16, ge=1, le=4096, description="Prompts sampled per checkpoint.")
    group_size: int = Field(default=8, ge=1, le=512, description="Responses per prompt (G).")
    temperature: float = Field(
        default=1.0, gt=0, le=10, description="Sampling temperature; also the T of logp and entropy."
    )
    max_new_tokens: int = Field(default=0, ge=0, le=32768, description="Max response tokens; 0 = the task's.")
    seed: int = Field(default=0, ge=0, le=2**62, description="Seed of sampling, tie-breaks, selection, rows.")
    entropy_bins: int = Field(default=5, ge=1, le=100, description="Entropy bins, by rank of (H, seeded tie-break).")
    max_positions_per_group: int = Field(
        default=64, ge=1, le=100_000, description="Positions drawn per (entropy bin x correct/incorrect) cell."
    )
    max_positions_per_trajectory: int = Field(
        default=4, ge=1, le=10_000, description="Positions one trajectory may give to one cell."
    )
    exclude_degenerate_groups: bool = Field(
        default=False, description="Leave out prompts whose responses are all correct or all wrong (advantage 0)."
    )
    entropy_at_t1: bool = Field(default=False, description="Also record each token's entropy at T = 1.")
    modules: list[ModuleName] = Field(
        default_factory=lambda: ["k_proj", "down_proj"],
        min_length=1,
        max_length=8,
        description="Linear weights to differentiate (lm_head is probed once, not per layer).",
    )
    layers: list[Annotated[int, Field(ge=-1024, le=1023)]] = Field(
        default_factory=lambda: [0, -1],
        min_length=1,
        max_length=256,
        description="Decoder layers; negative counts from the end.",
    )
    row_specs: list[RowSpec] = Field(
        default_factory=lambda: ["random:32"],
        min_length=1,
        max_length=8,
        description="Row sets of each weight: start, mid, last, random:N (seeded) or '0,5,9'.",
    )
    whole_kv_heads: bool = Field(
        default=True, description="k_proj/v_proj row sets are whole KV heads (head_dim consecutive rows)."
    )
    proj_k: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=lambda: [1, 4, 16],
        min_length=1,
        max_length=16,
        description="k of the cross-fitted projection energy fraction (reported only where k < n).",
    )
    erank_draws: int = Field(default=20, ge=1, le=1000, description="Subsamples for effective rank at a common n.")
    grad_chunk_size: int = Field(
        default=16, ge=1, le=256, description="Positions per batched backward (bounds memory)."
    )
    grad_method: Literal["vmap", "replicate", "loop"] = Field(
        default="vmap",
        description="Exact gradient method: vmap (one is_grads_batched backward per trajectory, §4.2), "
        "replicate (one row per position, one plain backward per chunk; fastest on CPU), loop (reference speed).",
    )
    sample_batch_size: int = Field(default=64, ge=1, le=4096, description="Sequences per sampling/entropy batch.")
    dtype: Literal["float32", "float64", "bfloat16"] = Field(
        default="float32", description="Model weights dtype; gradient statistics are always fp32/fp64."
    )

    @model_validator(mode="after")
    def _some_checkpoint(self) -> ProbeRequest:
        if (self.steps or self.include_final) and not self.checkpoint_root:
            raise ValueError("steps and include_final need checkpoint_root")
        if not (self.steps or self.include_final or self.checkpoints or self.model):
            raise ValueError(
                "nothing to probe: give checkpoint_root with steps and/or include_final, checkpoints, or model"
            )
        if self.task and self.dataset:
            raise ValueError("task and dataset are mutually exclusive: give one")
        return self


class Progress(BaseModel):
    done: int = Field(description="Work units finished (sampling, entropy pass, one per probed position).")
    total: int = Field(description="Work units planned; refined once positions are selected.")
    stage: str = Field(description="What the job is doing now.")


class Timings(BaseModel):
    created_at: float = Field(description="Unix time the job was accepted.")
    started_at: float | None = Field(default=None, description="Unix time a worker started it.")
    finished_at: float | None = Field(default=None, description="Unix time it ended (any final state).")
    queued_s: float | None = Field(default=None, description="Seconds spent waiting for a worker.")
    run_s: float | None = Field(default=None, description="Seconds spent running (so far, while running).")


JobStateName = Literal["queued", "running", "done", "failed", "cancelled"]


class JobStatus(BaseModel):
    id: str = Field(description="Job id.")
    state: JobStateName = Field(description="queued, running, done, failed or cancelled.")
    cancel_requested: bool = Field(description="DELETE was called; the job stops at its next check.")
    progress: Progress
    timings: Timings
    error: str | None = Field(default=None, description="Why the job failed.")
    links: dict[str, str] = Field(description="URLs of the job's outputs (valid once it is done).")
    summary: dict[str, Any] | None = Field(default=None, description="summary.json, once done.")


class JobCreated(BaseModel):
    id: str = Field(description="Job id.")
    state: JobStateName
    location: str = Field(description="Poll this URL for status (also in the Location header).")


class JobList(BaseModel):
    jobs: list[JobStatus]
