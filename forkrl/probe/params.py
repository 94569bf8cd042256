"""The probe job's parameters: one pydantic model for the HTTP body, the job and the CLI (`python -m forkrl.probe`).

    from forkrl.probe.params import ProbeParams
    params = ProbeParams(checkpoint_root="runs/x/checkpoints", steps=[20, 80], include_final=True)

Each field's docstring is its documentation (the service's /docs and the CLI's --help); ranges,
allowed values and the rules between fields are enforced here, once, so an invalid value fails at the
boundary (HTTP 422 naming the field) and nothing downstream re-checks them. What needs the filesystem or
the task registry (does the step exist, is it a safetensors checkpoint, is the task known) is checked by
`forkrl.probe.job.plan_probe`. Where the job runs (device) and what it may read (allowed roots) are
settings of the process that runs it, not of the job, so they are not here.

Field names are snake_case and map 1:1 to kebab-case flags (`max_positions_per_group` <->
`--max-positions-per-group`); they are the seed script's names (num_samples, layer_indices, row_spec), and
the names this model had before (group_size, layers, row_specs) are accepted as aliases, in JSON and as
flags. The CLI subclasses this model as it is. Imports nothing heavy, so the CLI answers --help at once.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from forkrl.data.prompts import PromptFormat, check_format_options
from forkrl.data.tasks import SPLITS

__all__ = [
    "CAVEAT",
    "DATASET_MAX_NEW_TOKENS",
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
RowMode = Literal["row", "block"]
RecordGrain = Literal["row", "token"]
Sampler = Literal["auto", "vllm", "transformers", "rollout"]
Split = Literal[SPLITS]  # type: ignore[valid-type]
ROW_SPEC_PATTERN = r"^(start|mid|last|random:[1-9]\d*|-?\d+(,-?\d+)*)$"
RowSpec = Annotated[
    str, Field(pattern=ROW_SPEC_PATTERN, description="start, mid, last, random:N or comma-separated row indices")
]


DATASET_MAX_NEW_TOKENS = 2048  # the seed's: 512 cut most math answers off

CAVEAT = (
    "This probes per-token log-prob gradients under teacher forcing (d logp(token) / d W rows for sampled "
    "responses); it is not the token's exact contribution to the trainer's aggregated DAPO/GRPO objective, "
    "which also weighs each token by its advantage, clip mask and loss normalization and sums over the batch."
)


def _alias(*names: str) -> AliasChoices:
    """The field's own name first (the documented one), then the names it is also accepted under."""
    return AliasChoices(*names)


class ProbeParams(BaseModel):
    """One probe job: which checkpoints, how to sample, what to differentiate. Defaults: the seed script's
    (num_prompts 24, num_samples 2, 5 entropy bins, 12 positions per cell, rows start,mid,last, max_new_tokens
    2048 for a dataset) except three, each with its reason in its field (and in docs/probe.md): frozen bin edges
    (freeze_bins_from), layer_indices 0,-1 clamped to the model's depth (clamp_layers), max_new_tokens of a
    built-in task. Field names are the seed's flags, the older names are accepted as aliases."""

    # list defaults are plain values (pydantic copies them per instance), so /docs and --help show them
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)

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
    """Dataset of prompts and answers (instead of task): a JSONL or Parquet file or a `datasets` folder, as in
    training; '{split}' in the path is replaced by split."""
    prompt_field: str = Field(default="", max_length=256)
    """Dataset field of the prompt, dotted for a nested one; empty = auto-detection (as in training)."""
    answer_field: str = Field(default="", max_length=256)
    """Dataset field of the gold answer, dotted for a nested one; empty = auto-detection (as in training)."""
    split: Split = "train"
    """Which split the prompts come from."""
    reward: str = ""
    """exact_match, countdown or math_verify; empty = the task's default (as in training)."""
    num_prompts: int = Field(default=24, ge=1, le=4096)
    """Prompts sampled per checkpoint."""
    num_samples: int = Field(default=2, ge=1, le=512, validation_alias=_alias("num_samples", "group_size"))
    """Responses per prompt (G); also accepted as group_size."""
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature; also the T of logp and entropy."""
    max_new_tokens: int = Field(default=0, ge=0, le=32768)
    """Max response tokens; 0 = the built-in task's limit, 2048 for a dataset (the seed's). Differs from the
    seed's script (2048 always) on a built-in task: its answers take a handful of tokens (countdown 16), and
    2048 would only let a response that misses its EOS run on, at the cost of time."""
    seed: int = Field(default=0, ge=0, le=2**62)
    """Seed of sampling, tie-breaks, selection, rows."""
    sampler: Sampler = "auto"
    """Who samples the responses: vllm (in-process vLLM on the checkpoint, float32, one seed per sample as in
    the rollout service), transformers (forkrl's KV-cache sampler; batches prompts of equal length only),
    rollout (a running rollout service at rollout_address: it serves ONE model, so the job must probe
    exactly that checkpoint), auto (vllm when importable, else transformers: the one rule of the CLI and the
    service alike, so one body gives one summary through either). Entropy and gradients are always
    teacher-forced in fp32 by the trainer's math, whichever samples."""
    rollout_address: str = ""
    """host:port of the rollout service (sampler rollout only)."""
    prompt_format: PromptFormat = "raw"
    """How a problem becomes the prompt, as in training (forkrl/data/prompts.py): raw, chat (the tokenizer's
    chat template), dapo / boxed (a math template in the chat template), dapo_plain / boxed_plain; use the
    run's own."""
    system_prompt: str = Field(default="", max_length=65536)
    """System message of the chat formats; empty = none."""
    chat_template: bool = False
    """The older name of prompt_format chat: wrap each prompt as one user message with the tokenizer's chat
    template (generation prompt added)."""

    # ---- bins and positions
    entropy_bins: int = Field(default=5, ge=1, le=100)
    """Entropy bins: equal-count bins by rank of (H, seeded tie-break) on the reference checkpoint, whose edges
    the other checkpoints use (see freeze_bins_from)."""
    max_positions_per_group: int = Field(default=12, ge=1, le=100_000)
    """Positions drawn per (entropy bin x correct/incorrect) cell."""
    max_positions_per_trajectory: int = Field(default=0, ge=0, le=10_000)
    """Positions one trajectory may give to one cell; 0 = no cap (the seed's)."""
    freeze_bins_from: str = ""
    """Entropy bin edges of every checkpoint are those of this reference checkpoint (its step number or label;
    empty = the first checkpoint probed), so a bin means the same entropy range across checkpoints; 'none' =
    rank bins per checkpoint (equal counts, edges move: the seed script's binning, where bin 4 of two
    checkpoints can hold different entropies, so a change across training mixes the bins' drift in)."""
    exclude_degenerate_groups: bool = False
    """Leave out prompts whose responses are all correct or all wrong (advantage 0)."""
    entropy_at_t1: bool = False
    """Also record each token's entropy at T = 1."""

    # ---- gradient targets and statistics
    modules: list[ModuleName] = Field(default=["k_proj", "down_proj"], min_length=1, max_length=8)
    """Linear weights to differentiate (lm_head is probed once, not per layer)."""
    layer_indices: list[Annotated[int, Field(ge=-1024, le=1023)]] = Field(
        default=[0, -1], min_length=1, max_length=256, validation_alias=_alias("layer_indices", "layers")
    )
    """Decoder layers; negative counts from the end (also accepted as layers). The seed used 0,14,27 (first,
    middle, last of its 28-layer model); the default 0,-1 (first and last) means the same on a model of any
    depth."""
    clamp_layers: bool = True
    """A layer index past the model's depth probes its nearest layer (so the seed's 0,14,27 runs on any model,
    the embedded 2-layer one included; the job warns in summary.json); off = such an index is an error."""
    row_spec: list[RowSpec] = Field(
        default=["start", "mid", "last"], min_length=1, max_length=8, validation_alias=_alias("row_spec", "row_specs")
    )
    """Rows of each weight: start, mid, last, random:N (seeded) or '0,5,9' (also accepted as row_specs)."""
    row_mode: RowMode = "row"
    """start/mid/last are single rows (row: the seed's grain) or blocks (block: 32 rows, or one whole KV head
    of k_proj/v_proj with whole_kv_heads)."""
    whole_kv_heads: bool = True
    """In block mode, k_proj/v_proj row sets are whole KV heads (head_dim consecutive rows)."""
    proj_k: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default=[1, 4, 16], min_length=1, max_length=16
    )
    """k of the cross-fitted projection energy fraction (reported only where k < n)."""
    erank_draws: int = Field(default=20, ge=1, le=1000)
    """Subsamples for effective rank at a common n (one n for all checkpoints of the job)."""
    bootstrap: int = Field(default=200, ge=0, le=10_000)
    """Cluster-bootstrap resamples (trajectories drawn with replacement) for the 95% intervals of the summary
    metrics; 0 = no intervals."""

    # ---- outputs
    record_grain: RecordGrain = "row"
    """token_probe_records.jsonl: one line per token x parameter x row (row: the seed's) or per token with
    every grad norm in it (token)."""

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

    @field_validator("freeze_bins_from", mode="before")
    @classmethod
    def _step_as_text(cls, v: object) -> object:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _something_to_probe(self) -> ProbeParams:
        if (self.steps or self.include_final) and not self.checkpoint_root:
            raise ValueError("steps and include_final need checkpoint_root")
        if not (self.steps or self.include_final or self.checkpoints or self.model):
            raise ValueError(
                "nothing to probe: give checkpoint_root with steps and/or include_final, checkpoints, or model"
            )
        if self.sampler == "rollout":
            n_ckpt = len(self.steps) + self.include_final + len(self.checkpoints) + bool(self.model)
            if not self.rollout_address or n_ckpt != 1:
                raise ValueError(
                    "sampler rollout needs rollout_address and exactly one checkpoint (the model the service "
                    f"serves); got {n_ckpt} checkpoints"
                )
        elif self.rollout_address:
            raise ValueError("rollout_address is only used with sampler rollout")
        if self.task and self.dataset:
            raise ValueError("task and dataset are mutually exclusive: give one")
        if self.chat_template:  # the older flag: the same as prompt_format chat
            if self.prompt_format not in ("raw", "chat"):
                raise ValueError(f"chat_template is prompt_format chat; it contradicts prompt_format "
                                 f"{self.prompt_format!r}: give one")
            self.prompt_format = "chat"
        check_format_options(self.prompt_format, self.system_prompt)
        return self
