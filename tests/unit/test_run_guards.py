"""The run's guards around the train step (forkrl/training/policy.py, forkrl/training/loop.py), on the embedded tiny
model: non-finite weights are never pushed or saved (also not by the failure's checkpoint) and the run's failure
says so in a sentence; steps whose every update was skipped fail the run after max_bad_steps in a row.

The loop's session is driven directly with a rollout client that refuses to be used (these tests check that
nothing is pushed); the real services run in tests/trainer/test_stops_and_guards.py.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from forkrl.data.order import DataOrder
from forkrl.training.config import RunConfig
from forkrl.training.loop import Diverged, _Session
from forkrl.training.metrics import MetricsSink
from forkrl.training.policy import NonFiniteWeights, load_policy
from forkrl.training.ranks import RankLink
from forkrl.weights.checkpoint import latest_checkpoint


class _Run:
    def __init__(self, run_dir: Path, cfg: RunConfig) -> None:
        self.run_id, self.run_dir, self.config, self.start_step, self.step = "run-1", run_dir, cfg, 0, 0
        self.stop_requested = threading.Event()
        self.items: list[dict[str, Any]] = []

    def emit(self, item: dict[str, Any]) -> None:
        self.items.append(item)

    def event(self, kind: str, message: str = "", step: int | None = None, values: dict | None = None,
              path: str = "") -> None:
        self.items.append({"kind": kind, "message": message, "step": step, "path": path})


class _NoRollouts:
    routes: list[str] = []

    def push(self, *args: Any, **kwargs: Any) -> float:
        raise AssertionError("non-finite weights reached a push")


def _session(tiny_model_dir: Path, tmp_path: Path, **cfg_kw: Any) -> _Session:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = RunConfig(model=str(tiny_model_dir), run_dir=str(run_dir), lr=1e308, **cfg_kw)
    policy = load_policy(cfg, run_dir, "cpu")
    return _Session(_Run(run_dir, cfg), cfg, policy, DataOrder([], 0), None, MetricsSink(run_dir, False),
                    _NoRollouts(), [], RankLink())  # type: ignore[arg-type]


def test_non_finite_weights_are_never_pushed_or_saved(tiny_model_dir: Path, tmp_path: Path) -> None:
    s = _session(tiny_model_dir, tmp_path)
    name, param = list(s.policy.model.named_parameters())[3]
    with torch.no_grad():
        param.view(-1)[5] = math.inf
    s.trained(1, {"loss": 0.5})  # step 1's update made them so
    with pytest.raises(NonFiniteWeights) as err:
        s.push_current()
    assert err.value.name == name
    with pytest.raises(NonFiniteWeights):
        s.policy.save(s.run.run_dir, "step_000001", {"step": 1})
    s.save_on_failure()  # the failure path of a run that fails for another reason writes nothing either
    assert latest_checkpoint(s.run.run_dir) is None
    assert not any((s.run.run_dir / "checkpoints").glob("*"))  # not even a temporary directory
    sentence = s.nonfinite_sentence(err.value)
    assert sentence == (f"the weights became non-finite in the update of step 1 (lr 1e+308, weight decay 0): {name} "
                        f"holds an inf or a NaN; they were not pushed or saved; the last good checkpoint is none "
                        f"(the run started from {tiny_model_dir})")


def test_steps_with_every_update_skipped_fail_the_run_after_max_bad_steps(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    s = _session(tiny_model_dir, tmp_path, max_bad_steps=2)
    skipped = {"n_updates": 0.0, "skipped_updates": 1.0}
    why = ["the gradient of lm_head.weight is non-finite (grad norm inf)"]
    s.trained(1, dict(skipped))
    s.guard(1, dict(skipped), why)
    s.trained(2, {"n_updates": 1.0, "skipped_updates": 1.0})  # one update applied: the count starts again
    s.guard(2, {"n_updates": 1.0, "skipped_updates": 1.0}, why)
    s.trained(3, dict(skipped))
    s.guard(3, dict(skipped), why)
    s.trained(4, dict(skipped))
    with pytest.raises(Diverged) as err:
        s.guard(4, dict(skipped), why)
    ckpt = latest_checkpoint(s.run.run_dir)
    assert ckpt is not None and ckpt.name == "step_000004"  # the last trained step: the last good weights
    assert str(err.value) == (f"2 steps in a row (3 to 4) skipped every update for a non-finite loss or gradient "
                              f"norm (the last: {why[0]}); the weights are those after step 2, and the last good "
                              f"checkpoint is {ckpt}")
    logs = [i["message"] for i in s.run.items if i.get("kind") == "LOG"]
    assert logs.count(f"step 3: an update was skipped, no optimizer step: {why[0]}") == 1
    assert len([m for m in logs if "an update was skipped" in m]) == 4


def test_max_bad_steps_0_trains_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    s = _session(tiny_model_dir, tmp_path, max_bad_steps=0)
    for step in range(1, 20):
        s.guard(step, {"n_updates": 0.0, "skipped_updates": 2.0}, [])
    assert s.bad_steps == 19
