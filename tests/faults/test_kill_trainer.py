"""kill -9 of the trainer service in the middle of a run; a new trainer resumes it (resume=True): the run ends
SUCCEEDED with every step in metrics.jsonl exactly once (nothing lost, nothing repeated), the resumed run keeps
the run id of the killed one (StartRun, GetRun, every checkpoint, <run_dir>/run_id) and so its rollout lease (the
same run, so its pushes are accepted at once), and releases the lease at the end.
Real processes: the vLLM rollout service and two trainer services."""

from __future__ import annotations

import os
import signal

import pytest

from forkrl.remote.rollout import RolloutClient
from forkrl.training.config import RunConfig, to_proto
from forkrl.weights.checkpoint import latest_checkpoint, read_state
from forkrl.wire.trainer.v1 import trainer_pb2
from tests.service_fixtures import start_rollout_service, start_trainer_service, wait_until
from tests.trainer.helpers import SMALL, metric_lines, run_to_end, trainer_stub

pytestmark = [pytest.mark.slow, pytest.mark.isolated]
STEPS = 6


def saved_step(run_dir) -> int:
    path = latest_checkpoint(run_dir)
    return 0 if path is None else read_state(path)["step"]


def test_a_trainer_killed_mid_run_resumes_without_losing_or_repeating_a_step(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "runs" / "run"
    base = dict(model=str(tiny_model_dir), num_steps=STEPS, save_every=1, run_dir=str(run_dir), **SMALL)
    with start_rollout_service(tiny_model_dir, log_path=tmp_path / "rollout.log", kv_cache_gib=1, seed=0,
                               staging_dir=tmp_path / "staging") as rollout, RolloutClient(rollout) as c:
        cfg = RunConfig(rollout_addresses=[rollout], **base)
        with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "a.log") as trainer:
            with trainer_stub(trainer) as stub:
                run_id = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60).run_id
                # the checkpoint of step 2, not GetRun's step: that counts a step before its checkpoint is written
                wait_until(lambda: saved_step(run_dir) >= 2, 300, "the checkpoint of step 2", every_s=0.05)
            os.killpg(trainer.process.pid, signal.SIGKILL)
            trainer.process.wait(10)
        killed_at = read_state(latest_checkpoint(run_dir))["step"]
        assert 2 <= killed_at < STEPS and not (run_dir / "checkpoints" / "final").exists(), "the kill came too late"
        assert c.info().lease_run_id == run_id  # the killed run still holds the rollout

        with start_trainer_service(tmp_path / "runs", log_path=tmp_path / "b.log") as trainer:
            resumed_id, items, run = run_to_end(trainer, cfg.model_copy(update={"resume": True}))
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        assert resumed_id == run.run_id == run_id  # one id across the resume
        # the lease (900 s, held by the killed run) refuses any other run's push: the resumed run pushed as run_id
        assert f"lease of run {run_id} released" in rollout.log_path.read_text()
        assert [i.metrics.step for i in items if i.HasField("metrics")] == list(range(killed_at + 1, STEPS + 1))
        assert c.info().lease_run_id == ""
    assert [m["step"] for m in metric_lines(run_dir)] == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoints" / "final").is_dir()
    saved = [p for p in (run_dir / "checkpoints").iterdir() if (p / "trainer_state.json").is_file()]
    assert {read_state(p)["run_id"] for p in saved} == {run_id} and len(saved) >= 2
    assert (run_dir / "run_id").read_text().strip() == run_id
