"""The committed embedded default: the tiny model's files, tracked in git, the same bytes on every machine.

    forkrl/models/default/        config.json, model.safetensors, tokenizer files, generation_config.json,
                                  forkrl_build.json (the build record) and SHA256SUMS (this manifest)

The builder (`python -m forkrl.models.tiny build`) is deterministic only on one machine: CPU float kernels
differ between machines, so a build elsewhere stops SFT at another step and writes other bytes. Every
default (services, tests, the demo, compose) therefore uses these committed files instead of building.
SHA256SUMS lists every other file of the directory with its sha256, in `sha256sum` format
(`cd forkrl/models/default && sha256sum -c SHA256SUMS` checks it); a unit test checks it too.

Re-blessing (a deliberate change of the default, e.g. after a builder change):

    python -m forkrl.models.tiny build --out forkrl/models/default --force   # rebuilds, rewrites SHA256SUMS
    # then update the sha256 and the numbers in docs/embedded-default.md and commit the directory

`install_default(out)` copies the committed files into another directory (compose's one-shot `model` service
puts them into the data volume, `python -m forkrl.models.tiny install --out DIR`; with $FORKRL_MODEL_DIR set
that build is the source instead); it returns at once when `out` already holds the same bytes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from forkrl.files import atomic_dir, sha256_file

COMMITTED_DIR = Path(__file__).resolve().parent / "default"
MANIFEST = "SHA256SUMS"


def manifest_entries(model_dir: str | os.PathLike) -> dict[str, str]:
    """{file name: sha256} as the directory's SHA256SUMS lists them ({} when there is none)."""
    try:
        text = (Path(model_dir) / MANIFEST).read_text()
    except OSError:
        return {}
    entries = {}
    for line in text.splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            entries[name.lstrip("*")] = digest
    return entries


def write_manifest(model_dir: str | os.PathLike) -> Path:
    """Write SHA256SUMS listing every other plain file of `model_dir`, sorted by name."""
    model_dir = Path(model_dir)
    names = sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    path = model_dir / MANIFEST
    path.write_text("".join(f"{sha256_file(model_dir / n)}  {n}\n" for n in names))
    return path


def manifest_problems(model_dir: str | os.PathLike) -> list[str]:
    """What disagrees with the manifest: missing manifest, missing, changed or unlisted files ([] = all good)."""
    model_dir = Path(model_dir)
    entries = manifest_entries(model_dir)
    if not entries:
        return [f"{model_dir / MANIFEST}: missing or empty"]
    problems = []
    for name, digest in entries.items():
        path = model_dir / name
        if not path.is_file():
            problems.append(f"{name}: listed in {MANIFEST} but missing")
        elif sha256_file(path) != digest:
            problems.append(f"{name}: sha256 {sha256_file(path)} != {digest} in {MANIFEST}")
    unlisted = sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.name != MANIFEST
                      and p.name not in entries)
    problems += [f"{name}: not listed in {MANIFEST}" for name in unlisted]
    return problems


def _digests(model_dir: Path) -> dict[str, str]:
    """{name: sha256}: the verified manifest, or for a directory without one (an older or FORKRL_MODEL_DIR build)
    every plain, non-hidden file hashed now."""
    if not (model_dir / MANIFEST).is_file():
        return {p.name: sha256_file(p) for p in sorted(model_dir.iterdir()) if p.is_file()
                and not p.name.startswith(".")}
    problems = manifest_problems(model_dir)
    if problems:
        raise ValueError(f"{model_dir} does not match its manifest: " + "; ".join(problems))
    return manifest_entries(model_dir)


def install_default(out: str | os.PathLike, source: str | os.PathLike = COMMITTED_DIR) -> Path:
    """Copy a tiny-model build (default: the committed one, verified against its manifest) into `out`,
    atomically, with a manifest; returns `out`. Nothing is written when `out` already holds the same files.
    A directory that is not a forkrl tiny build (no forkrl_build.json) is never replaced."""
    source, out = Path(source).resolve(), Path(out).absolute()
    if not (source / "forkrl_build.json").is_file():
        raise ValueError(f"{source} is not a forkrl tiny build (no forkrl_build.json)")
    digests = _digests(source)
    if out.resolve() == source:
        return out
    if out.is_dir() and not manifest_problems(out) and manifest_entries(out) == digests:
        return out
    if out.is_symlink():  # never write through a link into another directory
        raise ValueError(f"{out} is a symbolic link to a different build; remove it or pass another --out")
    if out.is_dir() and any(out.iterdir()) and not (out / "forkrl_build.json").is_file():
        raise ValueError(f"{out} exists and is not a forkrl tiny build (no forkrl_build.json); refusing to replace it")
    with atomic_dir(out) as tmp:
        for name in digests:
            shutil.copyfile(source / name, tmp / name)
            if sha256_file(tmp / name) != digests[name]:
                raise ValueError(f"{source / name} changed while it was copied")
        write_manifest(tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)
    return out
