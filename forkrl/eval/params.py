"""The benchmark eval's parameters: one pydantic model, whose field docstrings are `python -m forkrl.eval --help`.

Settings left unset (None) come from the run: its config.json (`<checkpoint_root>/../config.json`, or --run-config:
a run's config.json or a recipe TOML), else the defaults named in each field. What the run decides (prompt format,
reward, sampling temperature, response length, the benchmarks of its --eval-dataset) is therefore the same in the
eval as in training unless a flag says otherwise. Imports nothing heavy (--help answers at once).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from forkrl.data.prompts import PromptFormat

Sampler = Literal["auto", "vllm", "transformers", "rollout"]
LogTarget = Literal["jsonl", "tensorboard", "wandb"]
DEFAULT_MAX_NEW_TOKENS = 1024  # as training's for a dataset (forkrl/training/preflight.py)


class EvalParams(BaseModel):
    """avg@n, pass@k and maj@k of a base model and checkpoints on benchmark files (forkrl/eval/)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    # ---- what to evaluate
    checkpoint_root: str | None = None
    """A run's checkpoints dir (<run_dir>/checkpoints) holding step_NNNNNN/ and final/."""
    steps: list[Annotated[int, Field(ge=0)]] = Field(default=[], max_length=1000)
    """Steps to evaluate under checkpoint_root, e.g. 20,80."""
    include_final: bool = False
    """Also evaluate checkpoint_root/final."""
    checkpoints: list[str] = Field(default=[], max_length=64)
    """Explicit checkpoint directories (in addition to steps)."""
    model: str | None = None
    """Base model directory, evaluated first under the label 'base' (step 0 of the plot)."""
    run_config: str = ""
    """The run's settings to default from: a run's config.json or a recipe TOML; empty = the config.json beside
    checkpoint_root (<run_dir>/config.json) when there is one."""

    # ---- benchmarks and grading
    benchmarks: list[str] = Field(default=[], max_length=64)
    """Benchmark files or folders (JSONL, Parquet, a `datasets` folder; the whole file, in file order), or a built-in
    task's name (countdown, sum3, add2: its held-out eval split, the problems the run's own evaluation drew); empty =
    the run's eval_dataset, else the run's built-in task."""
    prompt_field: str | None = None
    """Benchmark field of the prompt, dotted for a nested one; unset = the run's (auto-detection)."""
    answer_field: str | None = None
    """Benchmark field of the gold answer, dotted for a nested one; unset = the run's (auto-detection)."""
    prompt_format: PromptFormat | None = None
    """raw, chat, dapo, dapo_plain, boxed, boxed_plain (forkrl/data/prompts.py); unset = the run's, else raw."""
    system_prompt: str | None = None
    """System message of the chat formats; unset = the run's, else none."""
    reward: str = ""
    """The grader, as in training (math_verify reads the answer where the prompt format puts it); empty = the
    run's, else math_verify."""
    max_problems: int = Field(default=0, ge=0)
    """The first N problems of each benchmark (a quick look); 0 = all."""

    # ---- sampling
    num_samples: int = Field(default=16, ge=1, le=1024)
    """Samples per problem (n of avg@n; the paper reports avg@16)."""
    pass_k: list[Annotated[int, Field(ge=1)]] = Field(default=[1, 4, 16], min_length=1, max_length=16)
    """k of pass@k and maj@k; each at most num_samples (larger ones are left out with a note)."""
    temperature: float | None = Field(default=None, ge=0, le=10)
    """Sampling temperature; unset = the run's, else 1.0 (0 = greedy: then num_samples 1 is enough)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling top-p (1 = off, as in training)."""
    max_new_tokens: int = Field(default=0, ge=0, le=1 << 20)
    """Max response tokens; 0 = the run's, else 1024."""
    seed: int = Field(default=0, ge=0, le=2**62)
    """Sampling seed (sample g of problem i is seeded from (seed, i, g), as in the rollout service)."""
    sampler: Sampler = "auto"
    """Who samples: vllm (in-process, float32, per checkpoint), transformers (forkrl's KV-cache sampler; top_p 1
    only), rollout (a running rollout service at rollout_address: it serves ONE model, so exactly one
    checkpoint), auto (vllm when importable, else transformers)."""
    rollout_address: str = ""
    """host:port of the rollout service (sampler rollout only)."""

    # ---- where the numbers go
    log_to: list[LogTarget] = Field(default=[], max_length=3)
    """Also log the results (metrics.jsonl in output_dir, TensorBoard, W&B: a benchmark x checkpoint table and
    avg@n per step); empty = only eval_results.json and the plot."""
    wandb_project: str = ""
    """W&B project (log_to wandb); empty = $WANDB_PROJECT, else forkrl."""

    @model_validator(mode="after")
    def _check(self) -> EvalParams:
        if (self.steps or self.include_final) and not self.checkpoint_root:
            raise ValueError("steps and include_final need checkpoint_root")
        n_ckpt = len(self.steps) + self.include_final + len(self.checkpoints) + bool(self.model)
        if not n_ckpt:
            raise ValueError("nothing to evaluate: give model, checkpoint_root with steps and/or include_final, "
                             "or checkpoints")
        if self.sampler == "rollout":
            if not self.rollout_address or n_ckpt != 1:
                raise ValueError("sampler rollout needs rollout_address and exactly one checkpoint (the model the "
                                 f"service serves); got {n_ckpt} checkpoints")
        elif self.rollout_address:
            raise ValueError("rollout_address is only used with sampler rollout")
        if self.sampler == "transformers" and self.top_p < 1:
            raise ValueError("top_p < 1 needs sampler vllm or rollout (the transformers sampler has no top-p)")
        return self
