"""plan_probe: the one check-and-resolve step before a probe job runs (no model is loaded). Checkpoints come
in a fixed order with unique labels, every path is passed through `confine` before anything under it is
read, and each refusal is a typed error (what the service maps to 404 / 400)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forkrl.data.tasks import DEFAULT_TASK, get_task
from forkrl.probe.checkpoints import CheckpointNotFound, PathNotFound, ProbeInputError
from forkrl.probe.job import DATASET_MAX_NEW_TOKENS, plan_probe
from forkrl.probe.params import ProbeParams


def _ckpt(path: Path, layers: int = 2, weights: str = "model.safetensors") -> Path:
    """A directory that passes the checkpoint checks (nothing here loads it)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    (path / weights).write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run" / "checkpoints"
    for s in (20, 5, 80):
        _ckpt(root / f"step_{s:06d}")
    _ckpt(root / "final")
    (root / "step_000099.tmp").mkdir()  # not a step dir
    return root


def test_order_labels_and_paths(run: Path, tmp_path: Path):
    base = _ckpt(tmp_path / "base model")
    extra = _ckpt(tmp_path / "other" / "step_000005")  # same name as a step: label gets a suffix
    plan = plan_probe(ProbeParams(model=str(base), checkpoint_root=str(run), steps=[80, 5, 80], include_final=True,
                                  checkpoints=[str(extra)]))  # fmt: skip
    assert [c.label for c in plan.checkpoints] == ["base", "step_000005", "step_000080", "final", "step_000005-2"]
    assert [c.step for c in plan.checkpoints] == [None, 5, 80, None, None]
    assert plan.checkpoints[1].path == run.resolve() / "step_000005"
    assert plan.base_model == base.resolve()
    assert (plan.task, plan.dataset, plan.reward) == (DEFAULT_TASK, "", get_task(DEFAULT_TASK).reward)


def test_missing_steps_carry_the_available_ones(run: Path):
    with pytest.raises(CheckpointNotFound) as err:
        plan_probe(ProbeParams(checkpoint_root=str(run), steps=[5, 40], include_final=True))
    assert (err.value.missing, err.value.available, err.value.has_final) == ([40], [5, 20, 80], True)
    assert "[40]" in str(err.value) and "[5, 20, 80]" in str(err.value)
    (run / "final" / "config.json").unlink()
    (run / "final" / "model.safetensors").unlink()
    (run / "final" / "tokenizer.json").unlink()
    (run / "final").rmdir()
    with pytest.raises(CheckpointNotFound, match="final not found"):
        plan_probe(ProbeParams(checkpoint_root=str(run), include_final=True))


def test_every_path_is_confined_before_it_is_read(run: Path, tmp_path: Path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    seen: list[str] = []

    def confine(path: Path, what: str) -> Path:
        seen.append(str(path))
        return path.resolve()

    plan_probe(ProbeParams(checkpoint_root=str(run), steps=[20], dataset=str(data)), confine)
    step = run / "step_000020"
    assert str(run) in seen and str(step.resolve()) in seen and str(data) in seen
    assert {str(step / f) for f in ("config.json", "model.safetensors", "tokenizer.json")} <= set(seen)

    def refuse(path: Path, what: str) -> Path:
        raise PermissionError(f"{what} refused")

    with pytest.raises(PermissionError, match="checkpoint_root refused"):
        plan_probe(ProbeParams(checkpoint_root=str(run / "nope"), steps=[20]), refuse)  # before it is listed


@pytest.mark.parametrize(
    "make,kw,error,match",
    [
        (lambda t: t / "nope", {}, PathNotFound, "does not exist"),
        (lambda t: _ckpt(t / "pickled", weights="pytorch_model.bin"), {}, ProbeInputError, "refusing to load pickled"),
        (lambda t: (t / "empty").mkdir() or t / "empty", {}, ProbeInputError, "no config.json"),
        (lambda t: _ckpt(t / "c"), {"layers": [0, 7], "clamp_layers": False}, ProbeInputError,
         r"layers \[7\] out of range"),
        (lambda t: _ckpt(t / "c"), {"task": "nope"}, ProbeInputError, "unknown task 'nope'"),
        (lambda t: _ckpt(t / "c"), {"reward": "nope"}, ProbeInputError, "unknown reward"),
        (lambda t: _ckpt(t / "c"), {"dataset": "/nonexistent/d.jsonl"}, PathNotFound, "dataset"),
        (lambda t: _ckpt(t / "c"), {"dataset": "{tmp}"}, ProbeInputError, "neither .save_to_disk. wrote"),
    ],
)
def test_refusals_are_typed(tmp_path: Path, make, kw, error, match):
    path = make(tmp_path)
    kw = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in kw.items()}
    with pytest.raises(error, match=match):
        plan_probe(ProbeParams(checkpoints=[str(path)], **kw))


def test_prompt_source_and_max_new_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    c = str(_ckpt(tmp_path / "c"))
    for split in ("train", "eval"):
        (tmp_path / f"d_{split}.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    templ = str(tmp_path / "d_{split}.jsonl")
    plan = plan_probe(ProbeParams(checkpoints=[c], dataset=templ, split="eval"))
    assert (plan.dataset, plan.reward, plan.max_new_tokens) == (templ, "math_verify", DATASET_MAX_NEW_TOKENS)
    assert plan_probe(ProbeParams(checkpoints=[c], task="add2")).max_new_tokens == 4
    assert plan_probe(ProbeParams(checkpoints=[c], task="add2", max_new_tokens=9)).max_new_tokens == 9
    monkeypatch.setenv("RL_DATASET_PATH", str(tmp_path / "d_train.jsonl"))  # as training: the env's dataset
    plan = plan_probe(ProbeParams(checkpoints=[c]))
    assert (plan.task, plan.dataset) == ("", str(tmp_path / "d_train.jsonl"))
