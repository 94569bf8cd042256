"""Atomic checkpoints: complete or absent, resumable optimizer state, no pickle (1 rank); what a checkpoint names
stays inside it."""

from __future__ import annotations

import re
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


# ---- what a checkpoint names stays inside it (issue 42 item 3) ----------------------------------------------------
class _Payload:
    """Unpickled, it creates `marker`: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _dcp_checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    """A checkpoint whose AdamW state is in DCP (what N > 1 ranks write), written by this one process."""
    import json

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from forkrl.weights.sharded import DCP_DIR

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ckpt = tmp_path / "checkpoints" / "step_000001"
    (ckpt / "trainer_state").mkdir(parents=True)
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt / DCP_DIR)
    save_file({"__torch_rng_state__": torch.get_rng_state()}, str(ckpt / ck.OPTIM_FILE))
    (ckpt / ck.STATE_FILE).write_text(json.dumps({"step": 1, "optimizer": {"format": "dcp", "dir": DCP_DIR,
                                                                            "world_size": 2}}))
    return ckpt, model, opt


def _set_dir(ckpt: Path, name: str) -> None:
    import json

    state = json.loads((ckpt / ck.STATE_FILE).read_text())
    state["optimizer"]["dir"] = name
    (ckpt / ck.STATE_FILE).write_text(json.dumps(state))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_unpickles_nothing_outside_the_checkpoint(tmp_path: Path) -> None:
    """With optimizer format dcp, resume reads <ckpt>/<dir>/.metadata with pickle; `dir` came from
    trainer_state.json unchecked, so an absolute path (or '..', or a symlink out) had resume unpickle any file."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from forkrl.weights.sharded import gathered_optimizer_state, load_optimizer_any

    ckpt, model, opt = _dcp_checkpoint(tmp_path)
    expected = gathered_optimizer_state(model, opt)
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_optimizer_any(ckpt, fresh, fresh_opt)  # the genuine layout resumes
    got = gathered_optimizer_state(fresh, fresh_opt)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)

    evil, marker = tmp_path / "evil", tmp_path / "pwned"
    evil.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    (ckpt / "trainer_state" / "out").symlink_to(evil, target_is_directory=True)
    (ckpt / "trainer_state" / "meta_out").mkdir()
    (ckpt / "trainer_state" / "meta_out" / ".metadata").symlink_to(evil / ".metadata")
    for name, why in [(str(evil), "must be a path inside the checkpoint"),
                      ("../../../evil", "must be a path inside the checkpoint"),
                      ("trainer_state/out", "links outside the checkpoint"),
                      ("trainer_state/meta_out", "the DCP .metadata file .* links outside the checkpoint"),
                      ("", "must be a non-empty relative path")]:
        _set_dir(ckpt, name)
        try:
            load_optimizer_any(ckpt, fresh, fresh_opt)
            error = None
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - which error, second: was a pickle loaded?
            error = err
        assert not marker.exists(), f"dir {name!r}: a pickle outside the checkpoint was loaded"
        assert isinstance(error, ValueError) and re.search(f"checkpoint '.*step_000001': .*{why}", str(error)), error


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_reads_no_dcp_shard_outside_the_checkpoint(tmp_path: Path) -> None:
    import pickle

    from forkrl.weights.sharded import DCP_DIR, load_optimizer_any

    ckpt, model, opt = _dcp_checkpoint(tmp_path)
    meta_file = ckpt / DCP_DIR / ".metadata"
    meta = pickle.loads(meta_file.read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = "../../../../elsewhere.distcp"
    meta_file.write_bytes(pickle.dumps(meta))
    with pytest.raises(ValueError, match=r"a DCP shard file '\.\./\.\./\.\./\.\./elsewhere\.distcp' must be a path "
                                         "inside the checkpoint"):
        load_optimizer_any(ckpt, torch.nn.Linear(4, 3), torch.optim.AdamW(model.parameters()))
