"""Checkpoints of a sharded (FSDP2) policy: HF weights gathered on rank 0, AdamW state sharded with
torch.distributed.checkpoint (DCP), and resume onto any number of ranks.

    save_sharded_checkpoint(run_dir, name, model, tokenizer, optimizer, state)   # every rank calls it
    load_optimizer_any(ckpt, model, optimizer)                                   # every rank, after sharding

Layout of a checkpoint written by N > 1 ranks (forkrl/weights/checkpoint.py has the 1-rank one):

    <run_dir>/checkpoints/step_000020/
        config.json, model.safetensors, tokenizer*   save_pretrained of the gathered fp32 state (rank 0):
                                                     transformers and vLLM load it as is
        trainer_state/optimizer.safetensors           the torch RNG state of rank 0 (no moments)
        trainer_state/optimizer_dcp/                  DCP: .metadata + one __<rank>_0.distcp per rank, each
                                                      rank's shards of exp_avg / exp_avg_sq (+ step, groups),
                                                      keyed by parameter name (FQN)
        trainer_state.json                            step, cursor, ..., world_size N, optimizer_saved true,
                                                      optimizer {"format": "dcp", "dir": ..., "world_size": N}

Resume (`load_optimizer_any`): the weights come from the HF files on every rank (then sharded as usual); the
optimizer state is loaded into this run's layout whatever wrote it. DCP reshards by itself: the .metadata
records each shard's offsets in the global tensor, and each rank reads the pieces that overlap its own
shards, so N ranks resume on M ranks (M = 1 included: plain tensors are read whole). A 1-rank checkpoint
(`optimizer.safetensors` with full moments) resumes on 1 rank as before, and on M > 1 ranks through
`set_optimizer_state_dict(full_state_dict=True)`, which cuts the full tensors into this rank's shards.

The DCP folder is written by every rank into rank 0's temporary checkpoint dir (its path is broadcast), so
on several hosts the run dir must be on a filesystem they all share (rank 0 checks that every shard file
the .metadata names is there before it publishes the checkpoint). The checkpoint is published atomically
by rank 0 (`forkrl.files.atomic_dir`) after every rank's shards are written.

The DCP `.metadata` is a pickle, unpickled on resume: resuming trusts the run directory. The optimizer `dir` that
trainer_state.json names and every shard file the metadata lists must lie inside the checkpoint (relative, no
'..', no symlink out: forkrl/weights/checkpoint.py `checkpoint_path`); the `dir` is checked before the pickle
is read.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from forkrl.files import atomic_dir, atomic_write_json
from forkrl.weights.checkpoint import OPTIM_FILE, STATE_FILE, checkpoint_path, load_optimizer_state, read_state

__all__ = ["DCP_DIR", "gathered_optimizer_state", "load_optimizer_any", "save_sharded_checkpoint"]

DCP_DIR = "trainer_state/optimizer_dcp"  # inside trainer_state/: engines load every top-level *.safetensors


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_sharded_checkpoint(run_dir: Path | str, name: str, model: torch.nn.Module, tokenizer: Any,
                            optimizer: torch.optim.Optimizer, state: dict[str, Any] | None) -> Path | None:
    """Write `<run_dir>/checkpoints/<name>` from every rank (a collective); the path on rank 0, None elsewhere.

    `state` (JSON, rank 0's; ignored elsewhere): step, data cursor, config... as for `save_checkpoint`.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    rank, world = _rank_world()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # no optimizer step yet (the same on every rank): nothing to shard, and get_optimizer_state_dict would
    # initialize the state with a step of lr 0 (a step count of 1 that the next real step would inherit)
    stepped = bool(optimizer.state)
    osd = get_optimizer_state_dict(model, optimizer) if stepped else {}  # this rank's shards (DTensors), by FQN
    if rank != 0:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            raise RuntimeError(f"rank {rank}: rank 0 could not create the checkpoint dir for {name}")
        if stepped:
            dcp.save({"optimizer": osd}, checkpoint_id=Path(box[0]) / DCP_DIR)
        dist.barrier()  # rank 0 publishes after this
        return None
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in [*root.glob(".tmp-*"), *root.glob(".old-*")]:  # debris of a writer killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    told = False
    try:
        with atomic_dir(root / name) as tmp:
            dist.broadcast_object_list([str(tmp)], src=0)
            told = True
            if stepped:
                dcp.save({"optimizer": osd}, checkpoint_id=tmp / DCP_DIR)
            dist.barrier()
            if stepped:
                _check_shards_present(tmp / DCP_DIR)
            else:
                (tmp / OPTIM_FILE).parent.mkdir()
            model.save_pretrained(tmp, safe_serialization=True, state_dict=full)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            save_file({"__torch_rng_state__": torch.get_rng_state()}, str(tmp / OPTIM_FILE))
            meta = {"format": "dcp", "dir": DCP_DIR, "world_size": world} if stepped else {}
            atomic_write_json(tmp / STATE_FILE, dict(state or {}, optimizer=meta, optimizer_saved=True,
                                                     world_size=world, saved_at=time.time()), sort_keys=True)
    except BaseException:
        if not told:
            dist.broadcast_object_list([None], src=0)
        raise
    return root / name


def _check_shards_present(path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata()
    files = {info.relative_path for info in (meta.storage_data or {}).values()}
    missing = sorted(f for f in files if not (path / f).is_file())
    if missing:
        raise RuntimeError(f"optimizer shards {missing} are missing under {path}: with ranks on several hosts the "
                           "run dir must be on a filesystem every host shares")


def _dcp_dir(ckpt: Path, meta: dict[str, Any]) -> Path:
    """The DCP folder trainer_state.json names, confined to the checkpoint (checkpoint_path) before its `.metadata`
    (a pickle) is read; then every shard file that metadata lists, confined the same way."""
    from torch.distributed.checkpoint import FileSystemReader

    path = checkpoint_path(ckpt, meta.get("dir", DCP_DIR), "trainer_state.json's optimizer dir")
    checkpoint_path(ckpt, str(path.relative_to(ckpt.resolve()) / ".metadata"), "the DCP .metadata file")
    storage = FileSystemReader(str(path)).read_metadata().storage_data or {}
    for info in storage.values():
        checkpoint_path(path, getattr(info, "relative_path", None), "a DCP shard file")
    return path


def load_optimizer_any(ckpt: Path | str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore the AdamW state and torch RNG state of any checkpoint into this run's model and optimizer.

    Every rank calls it (a collective when sharded), after `shard_model` and after building the optimizer.
    1-rank checkpoint on 1 rank: `load_optimizer_state`, unchanged.
    """
    ckpt = Path(ckpt)
    meta = read_state(ckpt).get("optimizer") or {}
    _, world = _rank_world()
    if meta.get("format") != "dcp" and world == 1:
        load_optimizer_state(ckpt, model, optimizer)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    dcp_dir = _dcp_dir(ckpt, meta) if meta.get("format") == "dcp" else None  # refused before anything is loaded
    tensors = load_file(str(ckpt / OPTIM_FILE))
    torch.set_rng_state(tensors.pop("__torch_rng_state__"))
    if dcp_dir is not None:
        import torch.distributed.checkpoint as dcp

        # the template: this run's layout (state initialized with zero moments, then overwritten in place)
        osd = get_optimizer_state_dict(model, optimizer)
        dcp.load({"optimizer": osd}, checkpoint_id=dcp_dir)
        set_optimizer_state_dict(model, optimizer, osd)
        return
    if not meta:  # a checkpoint of a run that had taken no optimizer step
        return
    # a 1-rank checkpoint (full moments per parameter name) onto N > 1 ranks: cut into this rank's shards
    template = get_optimizer_state_dict(model, optimizer)
    full = {"state": {name: {"step": torch.tensor(float(step)), "exp_avg": tensors[f"{name}.exp_avg"],
                             "exp_avg_sq": tensors[f"{name}.exp_avg_sq"]}
                      for name, step in meta["steps"].items()},
            "param_groups": template["param_groups"]}
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))


def gathered_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole AdamW state as flat CPU tensors `<param>.exp_avg` / `.exp_avg_sq` / `.step`, on every rank
    (a collective when sharded): what tests compare across layouts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    out = {}
    for name, st in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            v = st[key].full_tensor() if hasattr(st[key], "full_tensor") else st[key]
            out[f"{name}.{key}"] = torch.as_tensor(v).detach().to("cpu", copy=True)
    return out
