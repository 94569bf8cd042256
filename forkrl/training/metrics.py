"""Where a run's numbers go: one `metrics.jsonl` line per step or evaluation (always) and TensorBoard scalars
(optional). Lines are flushed per step, so nothing is lost when the trainer dies mid-run.

    sink = MetricsSink(run_dir, tensorboard=True)
    sink.write(step, {"reward_mean": 0.31, ...})            # kind "train"
    sink.write(step, {"eval_accuracy": 0.37}, kind="eval")
    sink.close()
"""

from __future__ import annotations

import json
import math
from pathlib import Path


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

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
