"""The probe job's parameters: one pydantic model for the HTTP body, the job and (issue 14) the CLI.

    from forkrl.probe.params import ProbeParams
    params = ProbeParams(checkpoint_root="runs/x/checkpoints", steps=[20, 80], include_final=True)

Each field's docstring is its documentation (the service's /docs, later the CLI's --help); ranges,
allowed values and the rules between fields are enforced here, once, so an invalid value fails at the
boundary (HTTP 422 naming the field) and nothing downstream re-checks them. What needs the filesystem or
the task registry (does the step exist, is it a safetensors checkpoint, is the task known) is checked by
`forkrl.probe.job.plan_probe`. Where the job runs (device) and what it may read (allowed roots) are
settings of the process that runs it, not of the job, so they are not here.

Field names are snake_case and map 1:1 to kebab-case flags (`max_positions_per_group` <->
`--max-positions-per-group`): a pydantic-settings CLI can subclass this model as it is. Imports nothing
heavy, so such a CLI answers --help at once.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forkrl.data.tasks import SPLITS

__all__ = [
    "GRAD_METHODS",
    "MODULE_PATHS",
    "ROW_SPEC_PATTERN",
    "GradMethod",
    "ModuleName",
    "ProbeParams",
    "WeightsDtype",
]

# short module name -> path inside a decoder layer (Llama/Qwen2/Mistral naming); lm_head sits on the model
MODULE_PATHS: dict[str, str] = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
    "lm_head": "lm_head",
}
ModuleName = Literal[tuple(MODULE_PATHS)]  # type: ignore[valid-type]  # the keys above, one definition
GradMethod = Literal["vmap", "replicate", "loop"]
GRAD_METHODS: tuple[str, ...] = GradMethod.__args__
WeightsDtype = Literal["float32", "float64", "bfloat16"]
Split = Literal[SPLITS]  # type: ignore[valid-type]
ROW_SPEC_PATTERN = r"^(start|mid|last|random:[1-9]\d*|-?\d+(,-?\d+)*)$"
RowSpec = Annotated[
    str, Field(pattern=ROW_SPEC_PATTERN, description="start, mid, last, random:N or comma-separated row indices")
]


class ProbeParams(BaseModel):
    """One probe job: which checkpoints, how to sample, what to differentiate. Defaults: algorithms.md §4."""

    # list defaults are plain values (pydantic copies them per instance), so /docs and --help show them
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    # ---- what to probe
    checkpoint_root: str | None = None
    """A run's checkpoints dir (<run_dir>/checkpoints) holding step_NNNNNN/ and final/."""
    steps: list[Annotated[int, Field(ge=0)]] = Field(default=[], max_length=1000)
    """Steps to probe under checkpoint_root, e.g. [20, 80]."""
    include_final: bool = False
    """Also probe checkpoint_root/final."""
    checkpoints: list[str] = Field(default=[], max_length=64)
    """Explicit checkpoint directories (in addition to steps)."""
    model: str | None = None
    """Base model directory, probed first under the label 'base' (optional)."""

    # ---- prompts and sampling
    task: str = ""
    """Built-in task; empty = the default task (or $RL_DATASET_PATH)."""
    dataset: str = ""
    """JSONL dataset of prompts and answers (instead of task); '{split}' in the path is replaced by split."""
    split: Split = "train"
    """Which split the prompts come from."""
    reward: str = ""
    """exact_match, countdown or math_verify; empty = the task's default (as in training)."""
    num_prompts: int = Field(default=16, ge=1, le=4096)
    """Prompts sampled per checkpoint."""
    group_size: int = Field(default=8, ge=1, le=512)
    """Responses per prompt (G)."""
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature; also the T of logp and entropy."""
    max_new_tokens: int = Field(default=0, ge=0, le=32768)
    """Max response tokens; 0 = the task's (1024 for a dataset)."""
    seed: int = Field(default=0, ge=0, le=2**62)
    """Seed of sampling, tie-breaks, selection, rows."""

    # ---- bins and positions
    entropy_bins: int = Field(default=5, ge=1, le=100)
    """Entropy bins, by rank of (H, seeded tie-break)."""
    max_positions_per_group: int = Field(default=64, ge=1, le=100_000)
    """Positions drawn per (entropy bin x correct/incorrect) cell."""
    max_positions_per_trajectory: int = Field(default=4, ge=1, le=10_000)
    """Positions one trajectory may give to one cell."""
    exclude_degenerate_groups: bool = False
    """Leave out prompts whose responses are all correct or all wrong (advantage 0)."""
    entropy_at_t1: bool = False
    """Also record each token's entropy at T = 1."""

    # ---- gradient targets and statistics
    modules: list[ModuleName] = Field(default=["k_proj", "down_proj"], min_length=1, max_length=8)
    """Linear weights to differentiate (lm_head is probed once, not per layer)."""
    layers: list[Annotated[int, Field(ge=-1024, le=1023)]] = Field(
        default=[0, -1], min_length=1, max_length=256
    )
    """Decoder layers; negative counts from the end."""
    row_specs: list[RowSpec] = Field(default=["random:32"], min_length=1, max_length=8)
    """Row sets of each weight: start, mid, last, random:N (seeded) or '0,5,9'."""
    whole_kv_heads: bool = True
    """k_proj/v_proj row sets are whole KV heads (head_dim consecutive rows)."""
    proj_k: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default=[1, 4, 16], min_length=1, max_length=16
    )
    """k of the cross-fitted projection energy fraction (reported only where k < n)."""
    erank_draws: int = Field(default=20, ge=1, le=1000)
    """Subsamples for effective rank at a common n."""

    # ---- how it is computed
    grad_chunk_size: int = Field(default=16, ge=1, le=256)
    """Positions per batched backward (bounds memory)."""
    grad_method: GradMethod = "vmap"
    """Exact gradient method: vmap (one is_grads_batched backward per trajectory, §4.2), replicate (one row
    per position, one plain backward per chunk; fastest on CPU), loop (reference speed)."""
    sample_batch_size: int = Field(default=64, ge=1, le=4096)
    """Sequences per sampling/entropy batch."""
    dtype: WeightsDtype = "float32"
    """Model weights dtype; gradient statistics are always fp32/fp64."""

    @model_validator(mode="after")
    def _something_to_probe(self) -> ProbeParams:
        if (self.steps or self.include_final) and not self.checkpoint_root:
            raise ValueError("steps and include_final need checkpoint_root")
        if not (self.steps or self.include_final or self.checkpoints or self.model):
            raise ValueError(
                "nothing to probe: give checkpoint_root with steps and/or include_final, checkpoints, or model"
            )
        if self.task and self.dataset:
            raise ValueError("task and dataset are mutually exclusive: give one")
        return self
