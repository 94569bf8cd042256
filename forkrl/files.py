"""Files that are either whole or absent: atomic writes, atomic directories, and file hashes.

Everything forkrl writes for someone else to read (checkpoints, the tiny build, probe outputs, job
records, staged weights) goes through here: written under a hidden temporary name in the same directory,
flushed and fsynced, then renamed into place. A reader never sees half a file; a crash leaves at most a
hidden `.tmp-*` entry that the next writer may drop.

    atomic_write(path, b"...")                       # bytes, str, or a callable writing to the open file
    atomic_write_json(path, {"a": 1})
    with atomic_file(path) as f: ...                 # stream into it; renamed when the block succeeds
    with atomic_dir(final_dir) as tmp: ...           # fill tmp; it replaces final_dir when the block succeeds
    sha256_file(path)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_dir", "atomic_file", "atomic_write", "atomic_write_json", "fsync_dir", "sha256_file"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", *, perms: int = 0o644) -> Iterator[IO[Any]]:
    """Open a hidden temp file beside `path`; on a clean exit fsync it and rename it to `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, perms)  # mkstemp creates 0600: outputs are meant to be read by other users/containers
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[IO[Any]], None], *,
                 binary: bool | None = None, perms: int = 0o644) -> None:
    """Write `data` to `path` atomically: bytes, text, or a function that writes to the open file (text
    mode unless `binary=True`)."""
    if callable(data):
        with atomic_file(path, "wb" if binary else "w", perms=perms) as f:
            data(f)
        return
    is_bytes = isinstance(data, (bytes, bytearray, memoryview))
    with atomic_file(path, "wb" if is_bytes else "w", perms=perms) as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any, **dump_kwargs: Any) -> None:
    dump_kwargs.setdefault("indent", 2)
    atomic_write(path, lambda f: json.dump(obj, f, **dump_kwargs))


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, perms: int = 0o755) -> Iterator[Path]:
    """Yield a fresh hidden directory beside `final`; when the block succeeds it replaces `final`.

    An existing `final` is moved aside first (a directory cannot replace a non-empty one in one rename),
    then removed; in between, readers see either the old or the new directory under `final`, never a mix.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        tmp.chmod(perms)
        if final.exists():
            old = final.parent / f".old-{final.name}-{time.monotonic_ns()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: str | os.PathLike, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()
