"""The co-located weight push: a safetensors file in shared memory that the trainer rewrites in place.

When a rollout service runs on the trainer's host and sees the same /dev/shm, the fastest push is no
transport at all: the trainer copies each tensor once into a memory-mapped safetensors file under the sync
dir (one tensor at a time, straight from the device for GPU tensors) and calls LoadWeights on it; the engine
reloads from a memory map of the same pages. The file is created once and rewritten in place for every
later push of the same layout, so its pages are allocated and mapped once (a fresh tmpfs file costs a page
fault per 4 KiB on both sides).

    sync = SharedWeightsFile(default_sync_dir())
    path = sync.write(state)          # -> /dev/shm/forkrl-sync-<uid>/<pid>-<id>.safetensors (a valid file)
    client.load_weights(str(path), version)
    sync.discard()                    # after a failed push: a reload may still read the old file

The rollout service accepts LoadWeights paths under the same default sync dir (FORKRL_SYNC_DIR overrides
it on both sides; the rollout's allowed roots include it). The push must be synchronous: the file is
rewritten by the next push, so the trainer waits for every LoadWeights answer first, and drops the file
(`discard`) when any push failed or timed out rather than write into pages a reload may still read.

The sync dir is a LoadWeights root, so nobody but this user may write into it: it is per user
(`/dev/shm/forkrl-sync-<uid>`), created 0700, and an existing one is used only when `private_dir` finds it a real
directory (no symlink) owned by this user that nobody else could write into (no group/other write bit). Another
local user who creates the folder first cannot swap a weights file: the push refuses the folder, naming it (the
rollout service also leaves such a folder out of its LoadWeights roots).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from forkrl.weights.chunks import TensorMeta, tensor_metas
from forkrl.weights.safetensors import safetensors_prefix

SYNC_DIR_ENV = "FORKRL_SYNC_DIR"


class UnsafeDirectory(PermissionError):
    """A staging folder another user could write into (or swap): not used; the message names it and why."""


def private_dir(path: str | os.PathLike) -> Path:
    """`path` as a folder only this user can use: created 0700 (its parents as usual) when missing; an existing
    one must be a directory, not a symlink, owned by this process's uid, and nobody else may have been able to
    write into it (no group/other write bit; lstat). UnsafeDirectory otherwise, naming the path and why. An own
    folder that others could only read or list (e.g. 0755, made by an older forkrl) is narrowed to 0700."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    uid = os.geteuid()
    why = ("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory" if not stat.S_ISDIR(st.st_mode)
           else f"is owned by uid {st.st_uid}, not this user (uid {uid})" if st.st_uid != uid
           else f"has mode {stat.S_IMODE(st.st_mode):04o}: group/other may write into it" if st.st_mode & 0o022
           else "")
    if not why and st.st_mode & 0o077:  # through a descriptor of that very directory (O_NOFOLLOW): no race
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_ino == st.st_ino:
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    if why:
        raise UnsafeDirectory(f"staging folder {path} {why}; another local user could replace the weights in it. "
                              f"Remove it (it is recreated 0700), or set {SYNC_DIR_ENV} / the staging dir to a "
                              "folder of your own with mode 0700")
    return path


def is_private_dir(path: str | os.PathLike) -> bool:
    """`path` is a directory (not a symlink) owned by this user with no group/other bits, as `private_dir`
    leaves it (nothing is created or changed)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def default_sync_dir() -> Path | None:
    """FORKRL_SYNC_DIR ("" = no co-located sync), else /dev/shm/forkrl-sync-<uid> when /dev/shm is writable."""
    env = os.environ.get(SYNC_DIR_ENV)
    if env is not None:
        return Path(env) if env else None
    shm = Path("/dev/shm")
    return shm / f"forkrl-sync-{os.geteuid()}" if shm.is_dir() and os.access(shm, os.W_OK) else None


class SharedWeightsFile:
    """One safetensors file in `directory`, rewritten in place by `write` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / f"{os.getpid()}-{uuid.uuid4().hex[:12]}.safetensors"
        self._layout: list[TensorMeta] | None = None
        self._map: mmap.mmap | None = None
        self._buf: torch.Tensor | None = None
        self._data_start = 0

    def _create(self, metas: list[TensorMeta]) -> None:
        self.discard()
        private_dir(self.directory)  # UnsafeDirectory: a folder another user could write into
        prefix = safetensors_prefix(metas)
        size = len(prefix) + sum(int(m["nbytes"]) for m in metas)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        if self._map is not None:
            self._map[: len(prefix)] = prefix
            self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        self._layout, self._data_start = metas, len(prefix)

    def write(self, state: Mapping[str, torch.Tensor]) -> Path:
        """Copy `state` (tensors on any device; tied duplicates already dropped) into the file, tensor by
        tensor; returns the file's path. No copy of the whole state is made: each tensor goes straight into
        the mapped pages (a non-contiguous one is made contiguous first, alone)."""
        metas = tensor_metas(state)
        if metas != self._layout or not self.path.exists():
            self._create(metas)
        offset = self._data_start
        for (name, t), m in zip(state.items(), metas, strict=True):
            n = int(m["nbytes"])
            if n:
                assert self._buf is not None, name
                src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                self._buf[offset : offset + n].copy_(src)
            offset += n
        return self.path

    def discard(self) -> None:
        """Unmap and delete the file (a reload that still maps it keeps its pages until it is done)."""
        self._buf = None
        if self._map is not None:
            self._map.close()
            self._map = None
        self._layout = None
        with contextlib.suppress(OSError):  # best effort: gone already, or its folder is not a folder
            self.path.unlink()

    close = discard
