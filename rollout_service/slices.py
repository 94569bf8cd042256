"""Run a background thread's work in slices granted by another thread, not beside it (the staged swap).

The rollout worker stages pushed weights in a thread while the engine's thread keeps stepping; both are
Python, so they would fight for the GIL, and a thread that holds it for 5 ms (the interpreter's switch
interval) delays an engine step by as much. `SliceGate` hands the GIL over explicitly instead: the engine's
thread calls `grant(slice_s)` between two steps; the worker runs until the slice is over and parks itself
at the next function return (a profile hook on the worker thread), so each step is delayed by at most one
slice. A native call that releases the GIL (oneDNN weight packing, a large copy) may outlast the slice:
`grant` returns after the slice and a grace period, the call goes on beside the engine (on another core),
and the worker parks as soon as it returns.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any


class SliceGate:
    """Runs a background thread's work in slices granted by another thread (the engine's), not beside it: the
    one exception is a worker preempted by the OS mid-slice while holding the GIL, which the interpreter may
    switch out at a bytecode boundary; it then runs on to its next function return, where it parks.
    With `native_beside=True`, native calls that release the GIL may also run on beside the granting thread.

    `start(work, done)` runs `work` on a thread of its own in slices (or a thread calls `enter()` first, which
    waits for the first slice, and `leave()` last); in between, a
    profile hook on that thread (`sys.setprofile`, this thread only) parks it at the first function return after
    the slice's deadline, and `checkpoint()` may be called anywhere as well. `grant(slice_s)` (the engine's
    thread) starts a slice and returns when the worker parked or finished. A native call that released the
    GIL is waited for (the slice overruns by what is left of it) unless `native_beside`: then `grant` returns
    after `slice_s` + a grace period, the call runs on beside the engine and the worker parks when it returns.
    A slice that overran by `max_overrun_s` (a native call that does not return: a safety valve, so the engine
    is never held for good) returns as well, and is counted in `overruns`. The hook costs ~0.5 us per call (~10 ms
    per reload of the tiny model, spent in the background)."""

    GRACE_S = 0.0002

    def __init__(self, native_beside: bool = False, max_overrun_s: float = 0.1) -> None:
        self.native_beside = native_beside
        self.max_overrun_s = max_overrun_s
        self.overruns = 0  # slices given up after max_overrun_s (the worker then runs on beside the engine)
        self._cv = threading.Condition()
        self._granted = 0  # slices granted so far
        self._parked = 0  # the last slice the worker has parked in
        self._deadline = 0.0
        self._done = False
        self._parking = False  # the hook must not park again inside _park (called directly, it is profiled)

    def start(self, work: Callable[[], Any], done: Callable[[Any, BaseException | None], None],
              name: str = "slice-gate") -> threading.Thread:
        """Run `work()` on a new (daemon) thread in granted slices; then `done(result, error)` on that thread,
        after the gate let go of it (no slice needed, nothing parks it: publish the outcome there)."""

        def main() -> None:
            result, error = None, None
            self.enter()
            try:
                result = work()
            except BaseException as e:
                error = e
            finally:
                self.leave()
            done(result, error)

        thread = threading.Thread(target=main, name=name, daemon=True)
        thread.start()
        return thread

    # ---- the worker's side
    def enter(self) -> None:
        sys.setprofile(self._hook)
        self._park()

    def leave(self) -> None:
        sys.setprofile(None)
        with self._cv:
            self._done = True
            self._cv.notify_all()

    def checkpoint(self) -> None:
        if time.perf_counter() >= self._deadline:
            self._park()

    def _hook(self, frame: Any, event: str, arg: Any) -> None:  # noqa: ARG002 (the profile hook signature)
        if (event == "return" or event == "c_return") and not self._parking and time.perf_counter() >= self._deadline:
            self._park()

    def _park(self) -> None:
        self._parking = True
        try:
            with self._cv:
                self._parked = self._granted
                self._cv.notify_all()
                while self._granted == self._parked:
                    self._cv.wait()
        finally:
            self._parking = False

    # ---- the granting side
    def grant(self, slice_s: float) -> float:
        """Let the worker run for about `slice_s`; returns the seconds this thread was held."""
        start = time.perf_counter()
        with self._cv:
            if self._done:
                return 0.0
            self._granted += 1
            n = self._granted
            self._deadline = time.perf_counter() + slice_s
            self._cv.notify_all()
            extra = self.GRACE_S if self.native_beside else self.max_overrun_s
            if not self._cv.wait_for(lambda: self._parked >= n or self._done, timeout=slice_s + extra):
                self.overruns += not self.native_beside
        return time.perf_counter() - start

