"""Checkpoint retention and the free-space check before a save (issue 42 item 9: save_every >= 1 over a long run
filled any disk, and a save into a full disk was not refused up front). Through Policy.save / check_space, the
calls the training loop makes, on a tiny random Llama with its AdamW state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forkrl.training.config import RunConfig
from forkrl.training.policy import Policy
from forkrl.weights import retention
from forkrl.weights.checkpoint import checkpoint_name, list_checkpoints, load_optimizer_state, read_state
from forkrl.weights.retention import InsufficientSpace, kept_steps
from tests.service_fixtures import build_random_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_llama(tmp_path_factory.mktemp("m") / "model", hidden_size=16, num_layers=1, num_heads=2,
                              num_kv_heads=1, head_dim=8)


def _policy(model_dir: Path, **cfg: object) -> Policy:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()  # AdamW state to save
    return Policy(RunConfig(model=str(model_dir), **cfg), model, AutoTokenizer.from_pretrained(model_dir), opt,
                  None, torch.device("cpu"), 0, 0, False)


def _save(policy: Policy, run_dir: Path, step: int) -> Path:
    policy.check_space(run_dir, checkpoint_name(step))
    return policy.save(run_dir, checkpoint_name(step), {"step": step, "data_cursor": step})


def test_kept_steps_rule():
    assert kept_steps([], 3, 4) == set()
    assert kept_steps([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, 4) == {9, 8, 4}
    assert kept_steps([4, 8, 12, 13], 3, 4) == {13, 12, 8}
    assert kept_steps([10, 20, 30, 40], 2, 0) == {40, 30}  # eval_every 0: every saved step counts
    assert kept_steps([10, 20, 30], 1, 10) == {30}


def test_retention_keeps_exactly_the_latest_and_the_recent_eval_steps(model_dir, tmp_path):
    policy = _policy(model_dir, keep_checkpoints=3, eval_every=4, num_steps=20)
    expected = {1: {1}, 2: {2}, 3: {3}, 4: {4}, 5: {5, 4}, 6: {6, 4}, 7: {7, 4}, 8: {8, 4}, 9: {9, 8, 4},
                10: {10, 8, 4}, 12: {12, 8, 4}, 13: {13, 12, 8}}
    for step, kept in expected.items():
        _save(policy, tmp_path, step)
        assert {s for s, _ in list_checkpoints(tmp_path)} == kept, f"after the save of step {step}"
    policy.save(tmp_path, "final", {"step": 20, "data_cursor": 20})
    _save(policy, tmp_path, 16)
    assert {s for s, _ in list_checkpoints(tmp_path)} == {16, 12, 8} and (tmp_path / "checkpoints/final").is_dir()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "final", "step_000008", "step_000012", "step_000016"]  # no debris of the deleted ones


def test_a_full_disk_fails_the_save_clearly_and_keeps_the_previous_checkpoint(model_dir, tmp_path, monkeypatch):
    policy = _policy(model_dir, keep_checkpoints=1)
    prev = _save(policy, tmp_path, 1)
    size = sum(f.stat().st_size for f in prev.rglob("*") if f.is_file())
    monkeypatch.setattr(retention, "disk_free", lambda path: size - 1)  # one byte short of another checkpoint
    with pytest.raises(InsufficientSpace) as err:
        _save(policy, tmp_path, 2)
    msg = str(err.value)
    assert str(tmp_path / "checkpoints") in msg and f"{size:,} bytes" in msg and f"{size - 1:,} are free" in msg
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    # the previous checkpoint is whole: weights and optimizer state load
    fresh = _policy(model_dir)
    load_optimizer_state(prev, fresh.model, fresh.optimizer)
    assert read_state(prev)["step"] == 1
    monkeypatch.setattr(retention, "disk_free", lambda path: size)  # room again: the save goes through
    _save(policy, tmp_path, 2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]  # and only then is step 1 deleted


def test_the_first_save_is_estimated_from_the_model_and_optimizer(model_dir, tmp_path, monkeypatch):
    policy = _policy(model_dir)
    params = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    monkeypatch.setattr(retention, "disk_free", lambda path: 3 * params)
    with pytest.raises(InsufficientSpace, match="needs about"):
        _save(policy, tmp_path, 1)
    assert list_checkpoints(tmp_path) == []
