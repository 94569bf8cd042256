"""Receiving pushed weights: the chunk stream of UpdateWeights into a verified safetensors file in the staging dir.

The file is written as it arrives (header first, then the raw tensor bytes in stream order), hashed on the
way, and checked for size and sha256 before anything touches the engine; the engine then reloads from
it and it is deleted. By default it lives in /dev/shm, so the reload reads it from memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forkrl.weights.chunks import CHUNK_BYTES, TensorMeta
from forkrl.weights.safetensors import safetensors_prefix
from rollout_service.types import ChecksumMismatch, InvalidArgument, ResourceExhausted

log = logging.getLogger("rollout_service")


def default_staging_dir() -> Path:
    """/dev/shm/forkrl-rollout-<uid> (per user: the engine reloads what is in it), else <cache>/weights-staging."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"forkrl-rollout-{os.geteuid()}"
    from forkrl.runtime import cache_dir

    return cache_dir() / "weights-staging"


@dataclass
class Received:
    """A received and verified update, ready for the engine's reload."""

    path: Path
    bytes_received: int
    receive_s: float
    handed_over: bool = False

    def hand_over(self) -> Path:
        """Give the file to whoever reloads from it (they delete it); `received_weights` then leaves it alone."""
        self.handed_over = True
        return self.path


@contextlib.asynccontextmanager
async def received_weights(
    staging_dir: Path,
    target_version: int,
    metas: Sequence[TensorMeta],
    total_bytes: int,
    sha256: str,
    chunks: AsyncIterator[bytes],
) -> AsyncIterator[Received]:
    """Receive `chunks` into a staging file laid out by `metas` (already validated), check the byte count
    and the checksum, and yield the file; it is deleted when the block exits, whatever happened (a bad
    chunk, a mismatch, the caller's stream cancelled before the swap), unless it was handed over to the swap
    (`Received.hand_over`), which deletes it when the reload is over: a cancelled caller must not pull the file
    from under a reload that is still reading it."""
    t0 = time.perf_counter()
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256.lower()):
        raise InvalidArgument(f"header.sha256 must be 64 hex characters, got {sha256[:80]!r}")
    prefix = safetensors_prefix(metas)
    free = shutil.disk_usage(staging_dir).free
    if free < len(prefix) + total_bytes:
        raise ResourceExhausted(f"staging dir {staging_dir} has {free} bytes free, the weights need {total_bytes}")
    fd, name = tempfile.mkstemp(prefix=f"v{target_version}-", suffix=".safetensors", dir=staging_dir)
    path = Path(name)
    staged: Received | None = None
    try:
        received = 0
        writer = _Writer(os.fdopen(fd, "wb", buffering=0), prefix)
        try:
            async for chunk in chunks:
                if len(chunk) > CHUNK_BYTES:
                    raise InvalidArgument(f"chunk of {len(chunk)} bytes exceeds the 4 MiB limit")
                received += len(chunk)
                if received > total_bytes:
                    raise InvalidArgument(f"received more than header.total_bytes ({total_bytes}) bytes")
                await writer.put(chunk)
            got = await writer.finish()
        finally:
            writer.close()
        receive_s = time.perf_counter() - t0
        log.info("v%d: received %d bytes in %.3f s (%.3f s hashing and staging)", target_version, received,
                 receive_s, writer.busy_s)
        if received != total_bytes:
            raise InvalidArgument(f"the stream ended after {received} of header.total_bytes {total_bytes} bytes")
        if got != sha256.lower():
            raise ChecksumMismatch(f"sha256 of the received bytes is {got}, header.sha256 says {sha256}")
        staged = Received(path, received, receive_s)
        yield staged
    finally:
        if staged is None or not staged.handed_over:
            path.unlink(missing_ok=True)


class _Writer:
    """Hash and write received chunks in worker threads while the next ones arrive. sha256 and the
    tmpfs write release the GIL, so neither the event loop (health, generation) nor the receiving
    stalls; at most `depth` chunks (4 MiB each) wait in between."""

    def __init__(self, f: Any, prefix: bytes, depth: int = 8) -> None:
        self._f = f
        self._f.write(prefix)
        self._lock = threading.Lock()  # the file is closed under it: no write can race the close
        self._digest = hashlib.sha256()
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=depth)
        self._task = asyncio.create_task(self._run())
        self.busy_s = 0.0

    async def _run(self) -> None:
        while (chunk := await self._queue.get()) is not None:
            t = time.perf_counter()
            # hash and write the same chunk in two threads: each is a pass over memory, so with a free core
            # the staging costs one pass instead of two
            await asyncio.gather(asyncio.to_thread(self._digest.update, chunk), asyncio.to_thread(self._write, chunk))
            self.busy_s += time.perf_counter() - t

    def _write(self, chunk: bytes) -> None:
        with self._lock:
            if not self._f.closed:  # closed: the update was abandoned meanwhile
                self._f.write(chunk)

    async def put(self, chunk: bytes) -> None:
        if self._task.done():  # a write failed: surface it now
            self._task.result()
        await self._queue.put(chunk)

    async def finish(self) -> str:
        await self._queue.put(None)
        await self._task
        return self._digest.hexdigest()

    def close(self) -> None:
        self._task.cancel()
        with self._lock:
            self._f.close()
