"""Benchmark evaluation of a base model and a run's checkpoints: avg@n, pass@k, maj@k (`python -m forkrl.eval`).

    from forkrl.eval import EvalParams, plan_eval, run_eval

Imports nothing heavy here; the names are loaded when used.
"""

from __future__ import annotations

from typing import Any

from forkrl.eval.params import EvalParams

__all__ = ["EvalParams", "plan_eval", "run_eval"]


def __getattr__(name: str) -> Any:
    if name in ("plan_eval", "run_eval"):
        from forkrl.eval import run

        return getattr(run, name)
    raise AttributeError(name)
