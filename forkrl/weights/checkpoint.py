"""Atomic HF checkpoints with resumable trainer state.

Layout (what the probe and `--resume` read):

    <run_dir>/checkpoints/step_000020/
        config.json, model.safetensors, tokenizer*   save_pretrained: transformers and vLLM load it as is
        trainer_state/optimizer.safetensors           AdamW moments ("<param>.exp_avg" / ".exp_avg_sq"), RNG
        trainer_state.json                            step, data cursor, optimizer scalars, RNG state, config
    <run_dir>/checkpoints/final/

That is a 1-process trainer's checkpoint. A multi-rank trainer writes the same HF files (gathered on rank 0)
and its AdamW state sharded with torch.distributed.checkpoint: forkrl/weights/sharded.py, which also
resumes either kind on any number of ranks.

A checkpoint is written into a hidden temp dir next to its final place and renamed when complete
(`forkrl.files.atomic_dir`), so a crash leaves either the whole checkpoint or an ignorable `.tmp-*` dir,
never a half checkpoint that looks whole.

Pickle: a 1-rank checkpoint holds none (safetensors and JSON). A multi-rank one keeps its AdamW state with
torch.distributed.checkpoint, whose `.metadata` file IS a pickle, unpickled on resume: resuming trusts the run
directory (whoever can write into it can run code in the trainer), as it trusts the model files. What a
checkpoint names is confined to it (`checkpoint_path`): the optimizer `dir` of trainer_state.json and every
shard file the DCP metadata lists must be relative paths without '..' that resolve, symlinks followed, inside the
checkpoint directory; anything else is refused (the `dir` before its pickle is read, each shard before it is:
an absolute `dir` once had resume unpickle a file anywhere on the machine).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from forkrl.files import atomic_dir, atomic_write_json

STATE_FILE = "trainer_state.json"
# In a subdirectory: engines load every top-level *.safetensors of a checkpoint dir as model weights.
OPTIM_FILE = "trainer_state/optimizer.safetensors"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(
    run_dir: Path,
    name: str,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    model_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `<run_dir>/checkpoints/<name>` atomically and return its path.

    `state` must be JSON-serializable (step, data cursor, config, ...). The torch RNG state is added here.
    `model_state`: the weights to write instead of `model.state_dict()` (the full state gathered from an
    FSDP2 model, forkrl/training/distributed.py).
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    # Debris of a writer that died mid-save (kill -9): never complete, safe to drop. One writer per run dir.
    for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    final = root / name
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        extra_tensors: dict[str, torch.Tensor] = {"__torch_rng_state__": torch.get_rng_state()}
        optim_meta: dict[str, Any] = {}
        if optimizer is not None:
            tensors, optim_meta = _optimizer_to_tensors(model, optimizer)
            extra_tensors.update(tensors)
        (tmp / OPTIM_FILE).parent.mkdir()
        save_file(extra_tensors, str(tmp / OPTIM_FILE))
        # trainer_state.json is written last: its presence marks a complete checkpoint.
        atomic_write_json(tmp / STATE_FILE, dict(state, optimizer=optim_meta, saved_at=time.time()), sort_keys=True)
    return final


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete `step_NNNNNN` checkpoints of a run, sorted by step."""
    root = Path(run_dir) / "checkpoints"
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step (`final/` counts with its recorded step)."""
    candidates = list_checkpoints(run_dir)
    final = Path(run_dir) / "checkpoints" / "final"
    if (final / STATE_FILE).is_file():
        candidates.append((read_state(final)["step"], final))
    if not candidates:
        return None
    # On equal steps prefer step_NNNNNN (it is the same weights; the name is stable).
    return max(candidates, key=lambda sp: (sp[0], sp[1].name != "final"))[1]


def read_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt) / STATE_FILE).read_text())


def checkpoint_path(ckpt: Path | str, name: Any, what: str) -> Path:
    """`ckpt / name` for a path a checkpoint names (its trainer_state.json's optimizer dir, a DCP shard file), when
    `name` is a relative path without '..' that resolves (symlinks followed) inside `ckpt`; ValueError naming
    `what`, the checkpoint and the path otherwise. Nothing is opened."""
    root = Path(ckpt).resolve()
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"checkpoint {str(ckpt)!r}: {what} must be a non-empty relative path, got {name!r:.200}")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"checkpoint {str(ckpt)!r}: {what} {name!r:.200} must be a path inside the checkpoint "
                         "(relative, no '..'): resume reads only what the checkpoint directory holds")
    real = (root / rel).resolve()
    if not real.is_relative_to(root):
        raise ValueError(f"checkpoint {str(ckpt)!r}: {what} {name!r:.200} links outside the checkpoint (to "
                         f"{str(real)!r:.200}): resume reads only what the checkpoint directory holds")
    return real


def load_optimizer_state(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore AdamW moments/step counts and the torch RNG state saved by `save_checkpoint`."""
    tensors = load_file(str(Path(ckpt) / OPTIM_FILE))
    torch.set_rng_state(tensors.pop("__torch_rng_state__"))
    meta = read_state(ckpt).get("optimizer") or {}
    if not meta:
        return
    names = {p: n for n, p in model.named_parameters()}
    sd = optimizer.state_dict()
    new_state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[p]
            if name in meta["steps"]:
                new_state[index] = {
                    "step": torch.tensor(float(meta["steps"][name])),
                    "exp_avg": tensors[f"{name}.exp_avg"],
                    "exp_avg_sq": tensors[f"{name}.exp_avg_sq"],
                }
            index += 1
    sd["state"] = new_state
    optimizer.load_state_dict(sd)


def _optimizer_to_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    names = {p: n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    steps: dict[str, float] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if not st:
                continue
            name = names[p]
            tensors[f"{name}.exp_avg"] = st["exp_avg"].detach().contiguous().clone()
            tensors[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].detach().contiguous().clone()
            steps[name] = float(st["step"])
    return tensors, {"steps": steps}
