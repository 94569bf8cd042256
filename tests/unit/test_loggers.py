"""--log-to: metrics.jsonl always, TensorBoard and Weights & Biases beside it through one sink (forkrl/training/
metrics.py, loggers.py). W&B runs offline here (WANDB_MODE=offline): no network, the run is written under the
run dir, named after it, with the run's id."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from forkrl.training.config import RunConfig
from forkrl.training.loggers import WandbLog
from forkrl.training.metrics import MetricsSink, per_set_means
from tests.service_fixtures import wait_until


@pytest.fixture()
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


@pytest.mark.slow  # W&B starts its own service process
def test_wandb_offline_writes_a_run_dir_beside_jsonl_and_tensorboard(tmp_path: Path, offline: None) -> None:
    pytest.importorskip("wandb")
    run_dir = tmp_path / "my-run"
    cfg = RunConfig(log_to=["jsonl", "tensorboard", "wandb"], wandb_project="forkrl-test", seed=7)
    sink = MetricsSink.for_run(run_dir, cfg, run_id="20261201-120000-abc")
    sink.write(0, {"eval_accuracy": 0.25}, kind="eval")
    sink.write(1, {"reward_mean": 0.5, "loss": float("nan")})
    sink.write(1, {"eval_accuracy": 0.375, "eval_accuracy_aime24": 0.125}, kind="eval")  # the same step again
    sink.write_table("eval/avg@4", ["benchmark", "base", "final"], [["aime24", 0.1, 0.2]])
    sink.write_benchmarks(1, {"eval_accuracy_aime24": 0.125, "eval_greedy_accuracy_aime24": 0.5}, ["aime24"])
    sink.close()

    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["kind"]) for m in lines] == [(0, "eval"), (1, "train"), (1, "eval")]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*-20261201-120000-abc")  # the run's id
    (log,) = wandb_run.glob("run-20261201-120000-abc.wandb")
    # W&B's own service process writes the records after finish() returns: wait for the last one (the table)
    def written() -> bytes | None:
        data = log.read_bytes()
        return data if b"eval/avg@4" in data else None

    data = wait_until(written, 120, "the W&B run file")
    for key in (b"train/reward_mean", b"eval/eval_accuracy", b"eval/eval_accuracy_aime24", b"forkrl-test",
                b"my-run"):  # the metrics, the project, the run's name (its dir)
        assert key in data, key
    assert b"train/loss" not in data  # a NaN is not logged (as TensorBoard)
    (table,) = wandb_run.glob("files/media/table/eval/avg@4_*.table.json")
    assert json.loads(table.read_text())["data"] == [["aime24", 0.1, 0.2]]
    (bench,) = wandb_run.glob("files/media/table/eval/benchmarks_*.table.json")  # the in-training eval's table
    assert json.loads(bench.read_text())["data"] == [["aime24", 0.125, 0.5]]


def test_the_sink_builds_the_loggers_log_to_names(tmp_path: Path) -> None:
    sink = MetricsSink.for_run(tmp_path / "a", RunConfig(log_to=["jsonl"]), run_id="r")
    assert sink.loggers == []
    sink = MetricsSink.for_run(tmp_path / "b", RunConfig(), run_id="r", tensorboard=False)  # the service said no
    assert sink.loggers == []
    (tmp_path / "b").mkdir()
    sink.write(3, {"x": 1.0})
    assert json.loads((tmp_path / "b" / "metrics.jsonl").read_text()) == {"step": 3, "kind": "train", "x": 1.0}


def test_wandb_without_the_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ValueError, match=r"log_to wandb needs the wandb package \(pip install 'forkrl\[wandb\]'\)"):
        WandbLog(tmp_path)


def test_per_benchmark_means_slice_the_per_prompt_values() -> None:
    per_prompt = {"eval_accuracy": [1.0, 0.5, 0.0, 0.25, 0.75], "eval_greedy_accuracy": [1.0, 1.0, 0.0, 0.0, 1.0]}
    assert per_set_means([("a", 2), ("b", 3)], per_prompt) == {
        "eval_accuracy_a": 0.75, "eval_accuracy_b": 1.0 / 3, "eval_greedy_accuracy_a": 1.0,
        "eval_greedy_accuracy_b": 1.0 / 3}
    assert per_set_means([("", 5)], per_prompt) == {}  # the eval split: no names, nothing extra


def test_a_resumed_sink_shows_each_step_once_in_tensorboard(tmp_path: Path) -> None:
    """A run logged steps 1..5, was killed, and resumes from its checkpoint of step 3: steps 4 and 5 run again. A
    TensorBoard reader must see 1..6 once each (the soak's "every step once in the logger"), as metrics.jsonl does
    after drop_after. Before the fix the second writer appended, and 4 and 5 showed twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsSink(tmp_path, tensorboard=True)
    for step in range(1, 6):
        first.write(step, {"policy_version": float(step)})
    first.close()
    resumed = MetricsSink(tmp_path, tensorboard=True, resumed_at=3)
    resumed.drop_after(3)
    for step in range(4, 7):
        resumed.write(step, {"policy_version": 10.0 + step})
    resumed.close()

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("train/policy_version")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in events] == [1.0, 2.0, 3.0, 14.0, 15.0, 16.0]  # the resumed run's values
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [1, 2, 3, 4, 5, 6]
