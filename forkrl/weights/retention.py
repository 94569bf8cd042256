"""What a run keeps on disk: the checkpoints retained after a save (`keep_checkpoints`), and the free-space check
before one.

    check_free_space(run_dir, "step_000040", model)   # InsufficientSpace naming the folder, the bytes needed, free
    path = save_checkpoint(...)                        # atomic: the new checkpoint is complete, or absent
    prune_checkpoints(run_dir, keep=5, eval_every=20)  # only now: the older ones beyond the kept set are deleted

Retention: the latest `step_NNNNNN` checkpoint (what --resume reads) and the most recent checkpoints at eval steps
(multiples of eval_every: the steps whose eval accuracy the run reported, which a probe job compares), at most
`keep` in all; `final/` is never deleted. With eval_every 0 every saved step counts as an eval step. Old
checkpoints are deleted only after the new one is complete, so a failed save never costs the previous one.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from forkrl.weights.checkpoint import list_checkpoints

log = logging.getLogger(__name__)

__all__ = ["InsufficientSpace", "check_free_space", "checkpoint_bytes", "disk_free", "kept_steps", "prune_checkpoints"]

_EXTRA_BYTES = 16 << 20  # config, tokenizer files, trainer_state.json: a generous bound


class InsufficientSpace(OSError):
    """A checkpoint that would not fit: nothing was written, the previous checkpoints are untouched."""


def disk_free(path: Path) -> int:
    """Free bytes on the file system of `path` (for this user: shutil.disk_usage)."""
    return shutil.disk_usage(path).free


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def checkpoint_bytes(run_dir: Path, model: torch.nn.Module) -> int:
    """About how many bytes the next checkpoint takes: the size of the latest complete step checkpoint; before the
    first one, the model's fp32 weights plus AdamW's two moments (3 x the parameters' bytes) plus small files."""
    saved = list_checkpoints(run_dir)
    if saved:
        return _dir_bytes(saved[-1][1])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * params + _EXTRA_BYTES


def check_free_space(run_dir: Path, name: str, model: torch.nn.Module) -> int:
    """Raise InsufficientSpace (naming the folder, the bytes needed and free) when the checkpoint `name` would not
    fit in <run_dir>/checkpoints; returns the estimate. The atomic save writes the whole new checkpoint beside the
    old ones, so the estimate is the full size."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    need, free = checkpoint_bytes(run_dir, model), disk_free(root)
    if need > free:
        raise InsufficientSpace(
            f"not enough free space to save checkpoint {name} in {root}: it needs about {need:,} bytes (the size of "
            f"the last checkpoint, or of the model and its optimizer state), {free:,} are free. Nothing was written "
            "and the earlier checkpoints are kept; free space there or lower keep_checkpoints (--keep-checkpoints)")
    return need


def kept_steps(steps: list[int], keep: int, eval_every: int) -> set[int]:
    """Of the saved steps, those retention keeps: the latest, and the most recent eval steps (multiples of
    eval_every; every step when eval_every is 0), `keep` in all."""
    if not steps:
        return set()
    latest = max(steps)
    evals = sorted((s for s in steps if s != latest and (eval_every == 0 or s % eval_every == 0)), reverse=True)
    return {latest, *evals[: max(keep - 1, 0)]}


def prune_checkpoints(run_dir: Path, keep: int, eval_every: int) -> list[Path]:
    """Delete the complete step checkpoints retention does not keep (`kept_steps`); returns them. Call only after
    the new checkpoint is complete. `final/` and incomplete dirs are left alone (the next save clears debris)."""
    saved = list_checkpoints(run_dir)
    kept = kept_steps([s for s, _ in saved], keep, eval_every)
    gone = [p for s, p in saved if s not in kept]
    for p in gone:
        # renamed first: a crash while deleting leaves `.old-*` debris (cleared by the next save), never a
        # checkpoint with its trainer_state.json but not all of its weights
        doomed = p.with_name(f".old-{p.name}")
        p.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        log.info("checkpoint retention (keep_checkpoints %d, eval_every %d): deleted %s", keep, eval_every, p)
    return gone
