"""The swap gate: how a weight update waits for the samples in flight ("drain, then swap", `--swap-mode drain`).

A weight update first closes the gate for new samples, waits until every sample already submitted to the
engine has finished, reloads, and reopens the gate. Every trajectory is therefore produced by one set of
weights and reports that version. New Generate calls wait at the gate (they are not rejected).
The default swap mode, "inplace" (engine.py), pauses vLLM between two engine steps instead ("keep" mode):
it never waits for samples, and a sample in flight then mixes two versions, which it reports (first and
last) and which the trainer's behaviour correction handles with the per-token log-probs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class SwapGate:
    """Samples enter and leave; a swap closes the gate, waits for zero samples inside, and reopens."""

    def __init__(self) -> None:
        self._active = 0
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()

    @property
    def active(self) -> int:
        return self._active

    async def enter(self, k: int) -> None:
        while not self._open.is_set():
            await self._open.wait()
        self._active += k
        if self._active:
            self._drained.clear()

    def leave(self, k: int) -> None:  # sync: called from task done-callbacks
        self._active -= k
        if self._active == 0:
            self._drained.set()

    async def wait_drained(self) -> None:
        await self._drained.wait()

    @contextlib.asynccontextmanager
    async def closed(self, timeout_s: float | None = None) -> AsyncIterator[bool]:
        """Close the gate and wait for zero samples inside, at most `timeout_s` (None: no limit); yields whether
        it drained (False: the caller must end the samples still inside, then `wait_drained`)."""
        self._open.clear()
        try:
            try:
                await asyncio.wait_for(self._drained.wait(), timeout_s)
                drained = True
            except asyncio.TimeoutError:
                drained = False
            yield drained
        finally:
            self._open.set()
