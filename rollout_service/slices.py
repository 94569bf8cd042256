"""Run background work in slices granted between two steps of another thread, not beside it (the staged swap).

The rollout worker stages pushed weights while the engine's thread keeps stepping; both are Python, so on
two threads they would fight for the GIL, and a thread that holds it for 5 ms (the interpreter's switch
interval) delays an engine step by as much. Two ways to run the staging in slices, each granted by the
engine's thread (`grant(slice_s)`) between two steps:
- `InlineSlices` (the CPU default): no second thread. The work is a greenlet on the engine's thread, switched
  in by `grant` and back out at the first `checkpoint()` after the slice is over (between two tensors, two
  layers, before a layer's processing), or earlier at a checkpoint whose next stretch took longer than what is
  left of the slice the last time. A slice is exactly the work it ran; nothing waits for another thread to be
  woken or to park.
- `SliceGate`: the work runs on a thread of its own and parks itself at the next function return after its
  slice (a profile hook on that thread). A native call that releases the GIL (oneDNN weight packing, a large
  copy) may outlast the slice: by default the slice waits for it; with `native_beside` (a GPU) it goes on
  beside the engine and the worker parks as soon as it returns. Each slice hands the GIL between two threads,
  and on a loaded machine either may then wait for a core (bench/bench_swap.py measures both ways).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Hashable
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
        self._cpu = 0.0  # the worker's own CPU seconds (time.thread_time) when it last parked or left
        self.last_cpu_s = 0.0  # the worker's CPU seconds from its park before the last grant to its park after

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
        self._cpu = time.thread_time()
        with self._cv:
            self._done = True
            self._cv.notify_all()

    def checkpoint(self, label: Hashable = None) -> None:  # noqa: ARG002 (InlineSlices' interface)
        if time.perf_counter() >= self._deadline:
            self._park()

    def _hook(self, frame: Any, event: str, arg: Any) -> None:  # noqa: ARG002 (the profile hook signature)
        if (event == "return" or event == "c_return") and not self._parking and time.perf_counter() >= self._deadline:
            self._park()

    def _park(self) -> None:
        self._parking = True
        try:
            self._cpu = time.thread_time()
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
            cpu = self._cpu
            self._deadline = time.perf_counter() + slice_s
            self._cv.notify_all()
            extra = self.GRACE_S if self.native_beside else self.max_overrun_s
            if not self._cv.wait_for(lambda: self._parked >= n or self._done, timeout=slice_s + extra):
                self.overruns += not self.native_beside
            self.last_cpu_s = self._cpu - cpu  # a worker that did not park yet: counted in a later slice
        return time.perf_counter() - start



class InlineSlices:
    """Runs work on the granting thread itself, in slices, with no second thread: the work is a greenlet (its
    own stack on the same OS thread) that `grant` switches into and that switches back at the first
    `checkpoint()` after the slice's deadline.

    `SliceGate` hands the GIL between two threads; every slice is a wake-up of the worker and one of the
    granting thread, and on a loaded machine either may wait for a core while the other is parked (measured on
    the 2-core VM: 1-11 ms of such waits in slices of 1 ms). Here a switch is a stack swap inside one thread,
    so a slice holds the granting thread for exactly the work it ran: the slice plus the work up to the next
    checkpoint. Checkpoints are where the work calls `checkpoint()` (worker_ext: each tensor read, each layer
    prepared), so the longest slice is bounded by the longest stretch between two of them, native calls
    included (they run in the slice; on CPU that is where they belong: beside the engine they take its core).

    A checkpoint may name the stretch of work that follows it (`checkpoint(label)`: shadow.py names each tensor
    read and each of vLLM's layer steps after the step and the layer). The work then also switches out at a
    checkpoint whose stretch, as long as the longest seen after that label (its CPU time, kept in `history`
    across uses), would not end before the slice's deadline: a long stretch (a layer's processing, 0.1-3 ms on
    the tiny model) starts a slice of its own instead of running on after a slice of short ones. A label seen for
    the first time is not predicted.

    `swap_state=(get, set)`: thread-local state the work and the granting thread each keep for themselves
    (worker_ext: torch's grad mode), saved and restored at every switch.
    Use from one thread: `start` and every `grant` (the engine's thread); `checkpoint` inside the work."""

    def __init__(self, swap_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
                 history: dict[Hashable, float] | None = None) -> None:
        self.history: dict[Hashable, float] = {} if history is None else history  # label -> longest CPU s after it
        self.longest_stretch_s = 0.0  # the longest CPU time between two checkpoints (or a switch in and one)
        self.longest_stretch_label: Hashable = None  # ... the label of the checkpoint it started at
        self.lookahead_parks = 0  # switches out before the deadline: the next stretch would not have fit
        self.checkpoints: dict[Hashable, int] = {}  # checkpoints reached, by kind (a tuple label's first item)
        self._label: Hashable = None  # the label of the checkpoint the running stretch started at
        self._since_cpu = 0.0  # when (thread CPU time) the running stretch started
        self.overruns = 0  # SliceGate's interface: an inline slice cannot be given up, it ends at a checkpoint
        self._swap_state = swap_state
        self._work_state: Any = None
        self._glet: Any = None
        self._caller: Any = None
        self._thread = 0
        self._deadline = 0.0
        self.last_cpu_s = 0.0  # the CPU seconds (of this thread) the last grant's work took

    def start(self, work: Callable[[], Any], done: Callable[[Any, BaseException | None], None],
              name: str = "inline-slices") -> InlineSlices:  # noqa: ARG002 (SliceGate's interface)
        """Prepare `work()` to run in the slices `grant` gives; `done(result, error)` runs at its end (in the
        last slice). Returns self (`is_alive()`, as SliceGate's thread)."""
        import greenlet

        def main() -> None:
            result, error = None, None
            try:
                result = work()
            except greenlet.GreenletExit:  # dropped unfinished (the worker shut down): nothing to report
                raise
            except BaseException as e:
                error = e
            done(result, error)

        self._thread = threading.get_ident()
        self._glet = greenlet.greenlet(main)
        if self._swap_state is not None:
            self._work_state = self._swap_state[0]()  # the work starts in the state of the thread that started it
        return self

    def is_alive(self) -> bool:
        return self._glet is not None and not self._glet.dead

    def checkpoint(self, label: Hashable = None) -> None:
        """Inside the work: return to the granting thread if the slice is over, or if the stretch that follows
        (named `label`; None: unnamed) would not fit what is left of it (elsewhere: nothing)."""
        import greenlet

        if greenlet.getcurrent() is not self._glet:
            return
        kind = label[0] if isinstance(label, tuple) and label else label
        self.checkpoints[kind] = self.checkpoints.get(kind, 0) + 1
        cpu = time.thread_time()
        stretch = cpu - self._since_cpu
        if stretch > self.longest_stretch_s:
            self.longest_stretch_s, self.longest_stretch_label = stretch, self._label
        if self._label is not None and stretch > self.history.get(self._label, 0.0):
            self.history[self._label] = stretch
        self._label = label
        now = time.perf_counter()
        late = now >= self._deadline
        if late or (label is not None and now + self.history.get(label, 0.0) > self._deadline):
            self.lookahead_parks += not late
            self._caller.switch()
            cpu = time.thread_time()  # switched back in by a later grant: the next stretch starts now
        self._since_cpu = cpu

    def grant(self, slice_s: float) -> float:
        """Run the work until the first checkpoint after `slice_s` (or its end); returns the seconds it ran (wall;
        `last_cpu_s`: the CPU seconds of it, which on a VM leave out the time the hypervisor took the CPU)."""
        import greenlet

        start = time.perf_counter()
        if not self.is_alive():
            return 0.0
        if threading.get_ident() != self._thread:
            raise RuntimeError("InlineSlices.grant must be called from the thread that started the work")
        self._caller = greenlet.getcurrent()
        self._glet.parent = self._caller  # the work's end returns here too
        outer = None
        if self._swap_state is not None:
            outer = self._swap_state[0]()
            self._swap_state[1](self._work_state)
        cpu = time.thread_time()
        self._deadline = time.perf_counter() + slice_s
        if not self._glet:  # not started yet: its first stretch starts now (later ones when a checkpoint returns)
            self._since_cpu = cpu
        try:
            self._glet.switch()
        finally:
            if self._swap_state is not None:
                self._work_state = self._swap_state[0]()
                self._swap_state[1](outer)
            self.last_cpu_s = time.thread_time() - cpu
        return time.perf_counter() - start
