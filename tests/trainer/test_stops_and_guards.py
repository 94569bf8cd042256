"""Stops that stop and non-finite weights that never leave the trainer, through the real services (issue 25).

- StopRun and SIGTERM with a step in flight whose updates take long (32 prompts x 8 samples, one prompt per
  mini-batch, 64 PPO epochs: 2048 optimizer updates in one step): the run ends STOPPED with a
  checkpoint of its last trained step, and the service exits 0. No wall-clock budget: the waits are bounded by
  120 s only so that a hang fails instead of blocking; the proof that the stop landed inside the step is in the
  numbers (no step with all of its 2048 updates).
- `--lr 1e308` on a resumed run: the first update makes the weights non-finite; the run ends FAILED with the
  sentence naming the step, nothing non-finite is pushed (the rollout's version stays at the resume's push and it
  still samples finite log-probs) or saved (every checkpoint on disk holds finite tensors).
"""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest
import torch

from forkrl.remote.rollout import RolloutClient
from forkrl.training.config import RunConfig, to_proto
from forkrl.weights.checkpoint import latest_checkpoint, read_state
from forkrl.wire.trainer.v1 import trainer_pb2
from tests.service_fixtures import start_trainer_service, wait_until
from tests.trainer.helpers import SMALL, metric_lines, run_to_end, stop_and_wait, trainer_stub

pytestmark = pytest.mark.slow
HANG_S = 120  # only a stop that does not stop takes this long
PROMPTS, G, EPOCHS = 32, 8, 64  # 64: the largest ppo_epochs a RunConfig takes
UPDATES = PROMPTS * EPOCHS  # one prompt's group per mini-batch


def _samples(rollout: str) -> int:
    with RolloutClient(rollout) as client:
        return int(client.info().counters.samples)


def _start_long_run(address: str, rollout: str, model: Path, run_dir: Path) -> str:
    """Start a run whose first step takes 2048 updates; return once its batch is sampled (the rollout served
    its PROMPTS x G samples), i.e. when the trainer is scoring or training it."""
    cfg = RunConfig(model=str(model), rollout_addresses=[rollout], num_steps=3, run_dir=str(run_dir),
                    prompts_per_step=PROMPTS, group_size=G, eval_prompts=0, micro_batch_size=G, mini_batch_prompts=1,
                    ppo_epochs=EPOCHS)
    before = _samples(rollout)
    with trainer_stub(address) as stub:
        run_id = stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60).run_id
    wait_until(lambda: _samples(rollout) >= before + PROMPTS * G, HANG_S, "the first step's samples", every_s=0.05)
    return run_id


def _assert_stopped_inside_the_first_update(run_dir: Path) -> None:
    lines = metric_lines(run_dir) if (run_dir / "metrics.jsonl").exists() else []  # none: no step was trained
    # stopped in step 1's pi_old pass or first update (nothing kept: the checkpoint is step 0), or after some of
    # its updates (step 1 kept with fewer than all of its updates, marked stopped)
    assert len(lines) <= 1
    if lines:
        assert lines[0]["step"] == 1 and lines[0]["stopped"] == 1.0 and 1 <= lines[0]["n_updates"] < UPDATES
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    state = read_state(ckpt)
    last = lines[-1]["step"] if lines else 0
    assert state["step"] == last and state["data_cursor"] == PROMPTS * last  # the last trained step, its cursor
    assert not (run_dir / "checkpoints" / "final").exists()


def test_stop_run_and_sigterm_take_effect_inside_a_long_update(rollout_address, tiny_model_dir, tmp_path) -> None:
    with start_trainer_service(tmp_path, log_path=tmp_path / "trainer.log") as address:
        run_id = _start_long_run(address, rollout_address, tiny_model_dir, tmp_path / "stoprun")
        run = stop_and_wait(address, run_id, timeout_s=HANG_S)
        assert run.state == trainer_pb2.RUN_STATE_STOPPED, run.error
        _assert_stopped_inside_the_first_update(tmp_path / "stoprun")

        _start_long_run(address, rollout_address, tiny_model_dir, tmp_path / "sigterm")
        address.process.send_signal(signal.SIGTERM)
        assert address.process.wait(timeout=HANG_S) == 0  # within the service's grace, a clean exit
    _assert_stopped_inside_the_first_update(tmp_path / "sigterm")
    assert "terminate called" not in (tmp_path / "trainer.log").read_text()


def test_lr_1e308_fails_the_run_and_never_pushes_or_saves_non_finite_weights(
    rollout_address, trainer, tiny_model_dir, tmp_path
) -> None:
    address, _ = trainer
    run_dir = tmp_path / "run"
    base = dict(model=str(tiny_model_dir), rollout_addresses=[rollout_address], run_dir=str(run_dir), save_every=1,
                **SMALL)
    _, _, first = run_to_end(address, RunConfig(num_steps=2, **base))
    assert first.state == trainer_pb2.RUN_STATE_SUCCEEDED, first.error
    with RolloutClient(rollout_address) as client:
        v_good = client.info().version

    _, _, run = run_to_end(address, RunConfig(num_steps=4, resume=True, lr=1e308, **base))
    assert run.state == trainer_pb2.RUN_STATE_FAILED
    assert "the weights became non-finite in the update of step 3 (lr 1e+308" in run.error
    assert "they were not pushed or saved; the last good checkpoint is" in run.error
    assert str(latest_checkpoint(run_dir)) in run.error

    from safetensors.torch import load_file

    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["final", "step_000001", "step_000002"]  # nothing of step 3
    for ckpt in ckpts:
        for name, t in load_file(str(ckpt / "model.safetensors")).items():
            assert bool(torch.isfinite(t).all()), (ckpt.name, name)
    with RolloutClient(rollout_address) as client:
        assert client.info().version == v_good + 1  # the resume's push of step 2's weights, nothing after it
        trajs = list(client.generate(["12+7="], n=4, temperature=1.0, max_new_tokens=8, seed=3))
    assert len(trajs) == 4 and all(math.isfinite(lp) for t in trajs for lp in t.logprobs)
