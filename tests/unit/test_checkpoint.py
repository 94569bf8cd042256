"""Atomic checkpoints: complete or absent, resumable optimizer state, no pickle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forkrl.weights import checkpoint as ck


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=17, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def _train_once(model, opt) -> None:
    loss = model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_once(model, opt)
    path = ck.save_checkpoint(tmp_path, ck.checkpoint_name(1), model, None, opt, {"step": 1, "data_cursor": 32})
    assert path.name == "step_000001"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "trainer_state", "trainer_state.json"} <= names
    # the only top-level safetensors file is the model: engines load every *.safetensors of the dir
    assert [p.name for p in path.glob("*.safetensors")] == ["model.safetensors"]
    assert (path / "trainer_state" / "optimizer.safetensors").is_file()
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in path.iterdir())  # nothing pickled
    expected_next = torch.rand(3)

    restored = LlamaForCausalLM.from_pretrained(path, use_safetensors=True)
    opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    torch.manual_seed(123)  # scramble the RNG: loading must restore it
    ck.load_optimizer_state(path, restored, opt2)
    assert torch.equal(torch.rand(3), expected_next)
    # one more identical step from both must give bit-identical weights
    _train_once(model, opt)
    _train_once(restored, opt2)
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert ck.read_state(path)["data_cursor"] == 32


def test_crash_mid_write_leaves_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path, "step_000002", model, None, None, {"step": 2, "data_cursor": 0})
    assert ck.latest_checkpoint(tmp_path) is None
    assert list((tmp_path / "checkpoints").iterdir()) == []  # temp dir cleaned up


def test_latest_ignores_incomplete_dirs_and_prefers_highest_step(tmp_path: Path) -> None:
    model = _model()
    for step in (2, 10):
        ck.save_checkpoint(tmp_path, ck.checkpoint_name(step), model, None, None, {"step": step, "data_cursor": 0})
    # a half-written dir from a kill -9 (no trainer_state.json) must not count
    (tmp_path / "checkpoints" / "step_000020").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step_000030-1-2").mkdir()
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 10]
    assert ck.latest_checkpoint(tmp_path).name == "step_000010"
    ck.save_checkpoint(tmp_path, "final", model, None, None, {"step": 12, "data_cursor": 0})
    assert ck.latest_checkpoint(tmp_path).name == "final"
    # overwriting final replaces it atomically
    ck.save_checkpoint(tmp_path, "final", model, None, None, {"step": 13, "data_cursor": 0})
    assert ck.read_state(tmp_path / "checkpoints" / "final")["step"] == 13
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
