"""The metric loggers beside metrics.jsonl: TensorBoard and Weights & Biases, one interface
(`scalars`, `table`, `close`), built by `forkrl.training.metrics.MetricsSink` from `--log-to`.

    log = WandbLog(run_dir, project="forkrl", name="my-run", run_id="20261201-...", config=cfg.model_dump())
    log.scalars(3, "train", {"reward_mean": 0.31})       # W&B key train/reward_mean, x axis "step"
    log.table("eval/benchmarks", ["benchmark", "base", "final"], [["aime24", 0.1, 0.2]])
    log.close()

W&B: the optional extra `wandb` (pip install 'forkrl[wandb]'). WANDB_MODE=offline (or `wandb offline`) writes
the run under <run_dir>/wandb/offline-run-* with no network; `wandb sync` uploads it later. Every value is logged
against the metric "step" (define_metric), not W&B's own step counter, so the lines of a resumed run (steps after
its checkpoint run again) and the evaluations at a step already logged are kept, not dropped as out of order.
The run id is the forkrl run's id (kept across resumes), so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Protocol


class Logger(Protocol):
    def scalars(self, step: int, kind: str, values: dict[str, Any]) -> None: ...

    def table(self, name: str, columns: list[str], rows: list[list[Any]], step: int | None = None) -> None: ...

    def close(self) -> None: ...


def _finite(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardLog:
    """Scalars `<kind>/<name>` at `step`; a table as a markdown text summary. `purge_step` (a resumed run: the first
    step it runs again): a reader drops the events of that step and later ones that earlier writers logged, so each
    step shows once, as in metrics.jsonl."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def scalars(self, step: int, kind: str, values: dict[str, Any]) -> None:
        for k, v in _finite(values).items():
            self.writer.add_scalar(f"{kind}/{k}", v, step)
        self.writer.flush()

    def table(self, name: str, columns: list[str], rows: list[list[Any]], step: int | None = None) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), step or 0)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """One W&B run: scalars `<kind>/<name>` against the metric "step"; tables as wandb.Table."""

    def __init__(self, run_dir: Path, *, project: str = "", name: str = "", run_id: str = "",
                 config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError("log_to wandb needs the wandb package (pip install 'forkrl[wandb]')") from None
        self.wandb = wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or "forkrl", name=name or None,
            id=_wandb_id(run_id) if run_id else None, dir=str(run_dir), config=config or {}, resume="allow",
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def scalars(self, step: int, kind: str, values: dict[str, Any]) -> None:
        self.run.log({**{f"{kind}/{k}": v for k, v in _finite(values).items()}, "step": step})

    def table(self, name: str, columns: list[str], rows: list[list[Any]], step: int | None = None) -> None:
        data: dict[str, Any] = {name: self.wandb.Table(columns=columns, data=rows)}
        if step is not None:
            data["step"] = step
        self.run.log(data)

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_id: str) -> str:
    """W&B run ids allow letters, digits, '-' and '_' only."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_id)[:128]
