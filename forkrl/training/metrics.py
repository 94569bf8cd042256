"""Where a run's numbers go: one `metrics.jsonl` line per step or evaluation (always), and the loggers of
`--log-to` beside it: TensorBoard scalars (<run_dir>/tb) and Weights & Biases (forkrl/training/loggers.py).
Lines are flushed per step, so nothing is lost when the trainer dies mid-run.

    sink = MetricsSink(run_dir, tensorboard=True)              # or MetricsSink.for_run(run_dir, cfg, run_id)
    sink.write(step, {"reward_mean": 0.31, ...})            # kind "train"
    sink.write(step, {"eval_accuracy": 0.37}, kind="eval")
    sink.write_eval_prompts(step, {"eval_accuracy": [0.25, 1.0, ...]})   # eval_prompts.jsonl: per prompt
    sink.write_table("eval/benchmarks", ["benchmark", "accuracy"], [["aime24", 0.1]], step)   # loggers only
    sink.close()

    class_breakdown(labels, kept, classes)   # what the forking-token mask keeps, by answer-token class
    # the same averaged over a run's steps: forkrl.report.data.mean_class_breakdown (demo, report, benchmark)

The breakdown (when the task labels its answer tokens, forkrl/data/tasks.py:token_classes), per class c:
`kept_share_<c>` = kept tokens of class c / all kept tokens, `all_share_<c>` = tokens of class c / all
response tokens (the same shares without the mask), and `kept_rate_<c>` = kept tokens of class c / tokens
of class c (only for classes present in the step). Without a mask the two shares are equal.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forkrl.training.loggers import Logger, TensorBoardLog, WandbLog

EVAL_PROMPTS_FILE = "eval_prompts.jsonl"


class MetricsSink:
    """metrics.jsonl (always) + the loggers (TensorBoard, W&B). Lines are flushed per step: nothing lost on a
    crash."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, loggers: Sequence[Logger] = (),
                 resumed_at: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        # a resume from step k runs k + 1.. again: TensorBoard drops what earlier writers logged from there on
        purge = None if resumed_at is None else resumed_at + 1
        self.loggers: list[Logger] = [TensorBoardLog(run_dir / "tb", purge)] if tensorboard else []
        self.loggers += list(loggers)

    @classmethod
    def for_run(cls, run_dir: Path, cfg: Any, run_id: str, tensorboard: bool = True,
                resumed_at: int | None = None) -> MetricsSink:
        """The sink of a run's `log_to` (a RunConfig); `tensorboard` False: the service allows no TensorBoard.
        The W&B run is named after the run dir and has the run's id (the same across resumes). `resumed_at`: the
        step of the checkpoint a resume starts from (TensorBoard purges the later steps logged before)."""
        loggers: list[Logger] = []
        if "wandb" in cfg.log_to:
            loggers.append(WandbLog(run_dir, project=cfg.wandb_project, name=run_dir.name, run_id=run_id,
                                    config=cfg.model_dump()))
        return cls(run_dir, tensorboard and "tensorboard" in cfg.log_to, loggers, resumed_at)

    def write(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        line = (json.dumps({"step": step, "kind": kind, **values}, sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            size = os.fstat(fd).st_size
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
            except OSError:  # a full disk took part of the line: cut it, or every later read of the file fails
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
        for log in self.loggers:
            log.scalars(step, kind, values)

    def write_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int | None = None) -> None:
        """A table (an eval's benchmark x checkpoint results) to the loggers: W&B as a wandb.Table, TensorBoard
        as markdown text. metrics.jsonl holds the numbers as scalars already."""
        for log in self.loggers:
            log.table(name, columns, rows, step)

    def write_benchmarks(self, step: int, values: dict[str, float], names: Sequence[str]) -> None:
        """The in-training eval over benchmark files as a table (benchmark x accuracy at T, greedy accuracy) to the
        loggers, from the `eval_accuracy_<name>` values (per_set_means); nothing without named benchmarks."""
        rows = [[n, values.get(f"eval_accuracy_{n}"), values.get(f"eval_greedy_accuracy_{n}")] for n in names if n]
        if rows:
            self.write_table("eval/benchmarks", ["benchmark", "eval_accuracy", "eval_greedy_accuracy"], rows, step)

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
            # a last line torn by a full disk (before write cut its failures): a step that runs again
            whole = lines[:-1] if lines and not lines[-1].endswith("\n") else lines
            keep = [ln for ln in whole if not ln.strip() or json.loads(ln).get("step", 0) <= step]
            if len(keep) != len(lines):
                atomic_write(path, "".join(keep).encode())
            if path == self.path:
                removed = len(lines) - len(keep)
        return removed

    def close(self) -> None:
        for log in self.loggers:
            log.close()


def per_set_means(sets: Sequence[tuple[str, int]], per_prompt: dict[str, list[float]]) -> dict[str, float]:
    """`<key>_<name>`: the mean over each named set's prompts of every per-prompt value list (an evaluation over
    several benchmark files: `sets` holds (name, prompt count) in the order the prompts were evaluated); {} when
    the sets have no names (the eval split)."""
    out: dict[str, float] = {}
    if not any(name for name, _ in sets):
        return out
    for key, values in per_prompt.items():
        start = 0
        for name, size in sets:
            part = values[start:start + size]
            start += size
            if part:
                out[f"{key}_{name}"] = sum(part) / len(part)
    return out


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


