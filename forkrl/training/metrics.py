"""Where a run's numbers go: one `metrics.jsonl` line per step or evaluation (always) and TensorBoard scalars
(optional). Lines are flushed per step, so nothing is lost when the trainer dies mid-run.

    sink = MetricsSink(run_dir, tensorboard=True)
    sink.write(step, {"reward_mean": 0.31, ...})            # kind "train"
    sink.write(step, {"eval_accuracy": 0.37}, kind="eval")
    sink.write_eval_prompts(step, {"eval_accuracy": [0.25, 1.0, ...]})   # eval_prompts.jsonl: per prompt
    sink.close()

    class_breakdown(labels, kept, classes)   # what the forking-token mask keeps, by answer-token class
    mean_class_breakdown(train_lines)        # the same averaged over a run's steps (demo, benchmark)

The breakdown (when the task labels its answer tokens, forkrl/data/tasks.py:token_classes), per class c:
`kept_share_<c>` = kept tokens of class c / all kept tokens, `all_share_<c>` = tokens of class c / all
response tokens (the same shares without the mask), and `kept_rate_<c>` = kept tokens of class c / tokens
of class c (only for classes present in the step). Without a mask the two shares are equal.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from forkrl.data.problem import TOKEN_CLASSES

EVAL_PROMPTS_FILE = "eval_prompts.jsonl"


class MetricsSink:
    """metrics.jsonl (always) + TensorBoard (optional). Lines are flushed per step: nothing lost on a crash."""

    def __init__(self, run_dir: Path, tensorboard: bool) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tb"))

    def write(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "kind": kind, **values}, sort_keys=True) + "\n")
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(f"{kind}/{k}", v, step)
            self.writer.flush()

    def write_eval_prompts(self, step: int, per_prompt: dict[str, list[float]]) -> None:
        """One line of `eval_prompts.jsonl`: each eval prompt's accuracy (same prompt order at every eval), what
        the paired bootstrap of the gain before -> after resamples (forkrl/training/curves.py)."""
        if per_prompt:
            with open(self.path.with_name(EVAL_PROMPTS_FILE), "a") as f:
                f.write(json.dumps({"step": step, **per_prompt}, sort_keys=True) + "\n")

    def drop_after(self, step: int) -> int:
        """Remove the lines of steps after `step` from metrics.jsonl and eval_prompts.jsonl (a resume from its
        checkpoint runs them again, so each step keeps one line); returns how many metrics lines were removed."""
        from forkrl.files import atomic_write

        removed = 0
        for path in (self.path, self.path.with_name(EVAL_PROMPTS_FILE)):
            if not path.is_file():
                continue
            lines = path.read_text().splitlines(keepends=True)
            keep = [ln for ln in lines if not ln.strip() or json.loads(ln).get("step", 0) <= step]
            if len(keep) != len(lines):
                atomic_write(path, "".join(keep).encode())
            if path == self.path:
                removed = len(lines) - len(keep)
        return removed

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def class_breakdown(labels: Sequence[Sequence[str]], kept: Sequence[Sequence[bool]],
                    classes: Sequence[str]) -> dict[str, float]:
    """Shares of kept and of all response tokens per class (module docstring). labels[i][k] is the class of
    completion token k of sequence i, kept[i][k] whether the mask kept it. Every class in `classes` gets both
    shares (0.0 when absent); a label outside `classes` raises."""
    if len(labels) != len(kept) or any(len(a) != len(b) for a, b in zip(labels, kept, strict=False)):
        raise ValueError("class_breakdown: labels and kept flags must have the same shape")
    unknown = {c for seq in labels for c in seq} - set(classes)
    if unknown:
        raise ValueError(f"class_breakdown: labels {sorted(unknown)} are not among the classes {list(classes)}")
    n_all = Counter(c for seq in labels for c in seq)
    n_kept = Counter(c for seq, flags in zip(labels, kept, strict=True) for c, k in zip(seq, flags, strict=True) if k)
    total_all, total_kept = sum(n_all.values()), sum(n_kept.values())
    out: dict[str, float] = {}
    for c in classes:
        out[f"kept_share_{c}"] = n_kept[c] / total_kept if total_kept else 0.0
        out[f"all_share_{c}"] = n_all[c] / total_all if total_all else 0.0
        if n_all[c]:
            out[f"kept_rate_{c}"] = n_kept[c] / n_all[c]
    return out


def mean_class_breakdown(lines: Sequence[dict]) -> dict[str, dict[str, float | None]]:
    """{class: {"all", "kept", "rate"}}: the breakdown's shares averaged over the metrics lines that have them
    (train steps of metrics.jsonl), the rate over the steps where the class occurred (None: never). {} without a
    breakdown."""
    out: dict[str, dict[str, float]] = {}
    present = [k.removeprefix("all_share_") for k in (lines[0] if lines else {}) if k.startswith("all_share_")]
    order = {c: i for i, c in enumerate(TOKEN_CLASSES)}  # metrics.jsonl sorts its keys: back to the class order
    classes = sorted(present, key=lambda c: (order.get(c, len(order)), c))
    for c in classes:
        rows = [m for m in lines if f"all_share_{c}" in m]
        rates = [m[f"kept_rate_{c}"] for m in rows if f"kept_rate_{c}" in m]
        out[c] = {"all": sum(m[f"all_share_{c}"] for m in rows) / len(rows),
                  "kept": sum(m[f"kept_share_{c}"] for m in rows) / len(rows),
                  "rate": sum(rates) / len(rates) if rates else None}
    return out
