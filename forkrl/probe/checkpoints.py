"""Which checkpoints a probe job reads, checked before it starts, and how one is loaded.

    refs = resolve_checkpoints(params)          # base model, steps ascending, final, explicit paths
    model, tok = load_checkpoint(refs[0].path, torch.float32, torch.device("cpu"))

Every path the job will read goes through `confine(path, what) -> real path` first: by default it only
resolves symlinks; the probe service passes one that refuses paths outside its allowed roots. Only then
is anything under the path read, so a refused path is never even listed.

Errors are typed so a caller can answer them precisely: `CheckpointNotFound` (requested steps that do not
exist, with the ones that do) and `PathNotFound` are "not found"; `ProbeInputError` is everything else
that is wrong with the request (not a HF checkpoint, pickled weights only, a layer the model does not have).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from forkrl.probe.params import ProbeParams
from forkrl.weights.safetensors import checkpoint_files

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointNotFound",
    "CheckpointRef",
    "Confine",
    "PathNotFound",
    "ProbeInputError",
    "check_checkpoint_dir",
    "eos_and_pad",
    "list_steps",
    "load_checkpoint",
    "real_path",
    "resolve_checkpoints",
    "weight_files",
]

STEP_RE = re.compile(r"^step_(\d{6,})$")
Confine = Callable[[Path, str], Path]


class ProbeInputError(ValueError):
    """A job that cannot run as asked, found before it starts (the service answers 400)."""


class PathNotFound(FileNotFoundError):
    """A path the job names does not exist (the service answers 404)."""


class CheckpointNotFound(PathNotFound):
    """Requested steps that do not exist; carries what does."""

    def __init__(self, root: Path, missing: list[int], available: list[int], has_final: bool, final_missing: bool):
        self.root, self.missing, self.available, self.has_final = root, missing, available, has_final
        what = ([f"steps {missing}"] if missing else []) + (["final"] if final_missing else [])
        super().__init__(
            f"{' and '.join(what)} not found under {root}; available steps: {available}"
            + (" (and final)" if has_final else " (no final)")
        )


@dataclass
class CheckpointRef:
    label: str
    path: Path
    step: int | None = None


def real_path(path: Path, what: str) -> Path:
    """The default `confine`: any path, symlinks resolved."""
    return Path(path).expanduser().resolve()


def list_steps(root: Path) -> tuple[dict[int, Path], bool]:
    """`step_NNNNNN` dirs under a checkpoint root (by step) and whether `final/` exists."""
    steps: dict[int, Path] = {}
    if root.is_dir():
        for p in root.iterdir():
            m = STEP_RE.match(p.name)
            if m and p.is_dir():
                steps[int(m.group(1))] = p
    return dict(sorted(steps.items())), (root / "final").is_dir()


def weight_files(path: Path) -> list[Path]:
    """The model's safetensors weight files (plus a shard index, if any); never the optimizer state."""
    return checkpoint_files(path) + sorted(path.glob("*.safetensors.index.json"))


def check_checkpoint_dir(path: Path) -> None:
    """A HF checkpoint directory with safetensors weights. .bin/.pt weights would be unpickled on load, which
    can run arbitrary code, so a checkpoint with only those is refused."""
    if not (path / "config.json").is_file():
        raise ProbeInputError(f"{path} has no config.json: not a HF checkpoint directory")
    if not any(p.suffix == ".safetensors" for p in weight_files(path)):
        raise ProbeInputError(f"{path} has no *.safetensors weights; refusing to load pickled (.bin/.pt) weights")


def _check_layers(path: Path, layers: list[int]) -> None:
    """Layer indices against the checkpoint's config, so a typo fails at submission, not after sampling."""
    try:
        n = int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # an unusual config: loading the model reports it
    bad = [x for x in layers if not -n <= x < n]
    if bad:
        raise ProbeInputError(f"layers {bad} out of range for {path.name} with {n} layers (use -{n}..{n - 1})")


def _existing_dir(path: str | Path, what: str, confine: Confine) -> Path:
    real = confine(Path(path), what)
    if not real.exists():
        raise PathNotFound(f"{what} {str(path)!r} does not exist")
    if not real.is_dir():
        raise ProbeInputError(f"{what} {str(path)!r} is not a directory")
    return real


def resolve_checkpoints(params: ProbeParams, confine: Confine = real_path) -> list[CheckpointRef]:
    """Base model (if any), then the requested steps ascending, then final, then explicit paths; each one a
    safetensors HF checkpoint with the requested layers, every file in it passed through `confine`."""
    refs: list[CheckpointRef] = []
    if params.model:
        refs.append(CheckpointRef("base", _existing_dir(params.model, "model", confine)))
    if params.checkpoint_root:
        root = _existing_dir(params.checkpoint_root, "checkpoint_root", confine)
        available, has_final = list_steps(root)
        missing = [s for s in params.steps if s not in available]
        final_missing = params.include_final and not has_final
        if missing or final_missing:
            raise CheckpointNotFound(root, missing, list(available), has_final, final_missing)
        for s in sorted(set(params.steps)):  # a step dir may itself be a symlink: confine what it points to
            _existing_dir(available[s], f"step {s}", confine)
            refs.append(CheckpointRef(available[s].name, available[s], s))
        if params.include_final:
            _existing_dir(root / "final", "final", confine)
            refs.append(CheckpointRef("final", root / "final"))
    for p in params.checkpoints:
        real = _existing_dir(p, "checkpoint", confine)
        refs.append(CheckpointRef(real.name or "checkpoint", real))
    for ref in refs:
        for f in sorted(ref.path.iterdir()):  # the loader reads any of them (tokenizer files, shards)
            confine(f, f"{ref.label} file")
        check_checkpoint_dir(ref.path)
        if not params.clamp_layers:
            _check_layers(ref.path, params.layer_indices)
    seen: dict[str, int] = {}
    for r in refs:  # unique, filesystem-safe labels (they name the plot files)
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", r.label)
        seen[base] = seen.get(base, 0) + 1
        r.label = base if seen[base] == 1 else f"{base}-{seen[base]}"
    return refs


def load_checkpoint(path: Path, dtype: torch.dtype, device: torch.device, tokenizer_fallback: Path | None = None):
    """Model and tokenizer of a HF checkpoint dir (safetensors only, eager attention, eval, no grads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_checkpoint_dir(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, use_safetensors=True, dtype=dtype, attn_implementation="eager", trust_remote_code=False
    )
    model.to(device).eval().requires_grad_(False)
    if getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()  # recomputation would fire the probe's hooks twice
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        if tokenizer_fallback is None:
            raise
        tok = AutoTokenizer.from_pretrained(tokenizer_fallback)
    return model, tok


def eos_and_pad(model, tok) -> tuple[list[int], int]:
    """Every EOS id the tokenizer, generation config and model config name, and the pad id (else min EOS)."""
    eos: set[int] = set()
    for src in (tok.eos_token_id, getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id):
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, (list, tuple)):
            eos.update(int(x) for x in src)
    if not eos:
        raise ValueError("the checkpoint defines no EOS token")
    return sorted(eos), int(tok.pad_token_id if tok.pad_token_id is not None else min(eos))
