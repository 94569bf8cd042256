"""SliceGate and InlineSlices (rollout_service/slices.py): the staged swap's work runs only inside granted slices.

Nothing here depends on timing. The invariant is observable state: the granting thread holds a flag up while
it is inside `grant` and down while it runs its own Python between two grants (the engine's step), and the
worker records the flag at each step of its (pure Python) work. The worker parks
at a function return once the slice is over, and `grant` cannot get the GIL back before it has: so no step may
ever see the flag down. A native call that releases the GIL (here: a blocking lock acquire) holds `grant` until
it returns and the worker parked (the default: the worker never runs beside the granting thread, not even in native
code), up to `max_overrun_s` (counted); with `native_beside=True` it does not hold the granting thread: `grant`
returns while the worker is still blocked in it, or that test hangs.
InlineSlices runs the work on the granting thread itself (a greenlet) and switches back at a checkpoint once the
slice is over: with slices that are over before they start, each grant runs exactly one checkpoint-to-checkpoint
stretch, which pins down its behaviour with no timing at all.
"""

from __future__ import annotations

import threading
import time

from rollout_service.slices import InlineSlices, SliceGate


def _run(gate: SliceGate, work) -> threading.Thread:  # noqa: ANN001
    def main() -> None:
        gate.enter()
        try:
            work()
        finally:
            gate.leave()

    t = threading.Thread(target=main, daemon=True)
    t.start()
    return t


def test_pure_python_work_runs_only_inside_granted_slices():
    gate = SliceGate()
    granting = [False]
    seen: list[bool] = []

    def step(k: int) -> int:
        return sum(range(k % 50))

    def work() -> None:
        for k in range(5_000):
            step(k)
            seen.append(granting[0])

    t = _run(gate, work)
    slices = 0
    while t.is_alive():
        granting[0] = True
        gate.grant(0.0005)
        granting[0] = False
        slices += 1
        for k in range(20_000):  # the engine's step: Python longer than the interpreter's switch interval
            step(k)  # (5 ms): a worker not parked would get the GIL in it and see the flag down
    assert len(seen) == 5_000
    # The worker parks at the first return after its slice. The one way it runs outside a slice: preempted by the
    # OS mid-slice while holding the GIL, it is switched out by the interpreter at a bytecode boundary, and when it
    # gets the GIL back it runs on to its next return: at most one recorded step per slice. Without the hook it
    # runs thousands of steps in each of the granting thread's steps.
    outside = seen.count(False)
    assert outside <= slices, f"{outside} steps ran outside a slice ({slices} slices)"
    assert slices >= 2  # the work did not fit one half-millisecond slice: it was cut and resumed
    assert gate.grant(0.001) == 0.0  # after leave(): nothing to grant


def test_start_runs_work_in_slices_and_reports_after_letting_go():
    """`done` runs after the gate let go of the thread: the thread ends without another slice, even when the
    slice was over when the work returned (publishing "ready" before letting go once left the staging thread
    parked for good, and the next push found a staging "in progress")."""
    gate = SliceGate()
    out: list = []
    reported = threading.Event()

    def work() -> int:
        return sum(sum(range(k % 50)) for k in range(5_000))

    def done(result, error) -> None:  # noqa: ANN001
        out.append((result, error))
        reported.set()

    t = gate.start(work, done)
    while not reported.is_set():
        gate.grant(0.0001)  # slices so short that the deadline has always passed when the work returns
    t.join(30)
    assert not t.is_alive()
    assert out == [(sum(sum(range(k % 50)) for k in range(5_000)), None)]

    failing = SliceGate()
    errors: list = []
    t = failing.start(lambda: 1 / 0, lambda r, e: errors.append((r, type(e))))
    while t.is_alive():
        failing.grant(0.0001)
    assert errors == [(None, ZeroDivisionError)]


class _Blocked:
    """A worker that enters a native call releasing the GIL (a blocking lock acquire) until `release()`, then
    records the granting thread's flag at each of 100 steps."""

    def __init__(self, gate: SliceGate) -> None:
        self.gate = gate
        self.lock = threading.Lock()
        self.lock.acquire()
        self.in_native = threading.Event()
        self.granting = [False]
        self.after: list[bool] = []
        self.thread = _run(gate, self._work)

    def _work(self) -> None:
        self.in_native.set()
        self.lock.acquire()  # blocks in C with the GIL released, until the test lets it go
        for _ in range(100):
            self.after.append(self.granting[0])

    def release(self) -> None:
        self.lock.release()

    def finish(self) -> None:
        """Slices until the work is done; at most one step per slice outside it (after a forced switch)."""
        slices = 0
        while self.thread.is_alive():
            self.granting[0] = True
            self.gate.grant(0.001)
            self.granting[0] = False
            slices += 1
        assert len(self.after) == 100 and self.after.count(False) <= slices


def test_a_native_call_that_releases_the_gil_holds_the_slice_until_it_returns():
    gate = SliceGate(max_overrun_s=600.0)  # the safety valve out of reach: only the call's return ends the slice
    w = _Blocked(gate)
    returned = threading.Event()
    granter = threading.Thread(target=lambda: (gate.grant(0.001), returned.set()), daemon=True)
    w.granting[0] = True
    granter.start()  # the first slice: the worker enters the blocking call in it
    assert w.in_native.wait(60)
    # the slice is long over; a grant that let the call run on beside would have returned by now
    assert not returned.wait(0.2)
    w.release()  # the call returns, the worker parks at its return (the slice is over): grant returns
    assert returned.wait(60)
    w.granting[0] = False
    assert not w.after  # parked before its first step: the rest runs in later slices
    w.finish()
    assert gate.overruns == 0

    # the safety valve: a call that does not return gives up the slice after max_overrun_s, counted
    valve = SliceGate(max_overrun_s=0.01)
    w = _Blocked(valve)
    while not w.in_native.is_set():  # slices until the worker is inside the blocking call
        valve.grant(0.001)
    given_up = valve.overruns
    valve.grant(0.001)  # returns although the worker is still blocked
    assert w.thread.is_alive() and valve.overruns == given_up + 1
    w.release()
    w.finish()


def test_with_native_beside_a_native_call_runs_beside_the_granting_thread():
    gate = SliceGate(native_beside=True)
    w = _Blocked(gate)
    while not w.in_native.is_set():  # slices until the worker is inside the blocking call
        gate.grant(0.001)
    gate.grant(0.001)  # returns although the worker is still blocked (else: this test hangs here)
    assert w.thread.is_alive() and not w.after
    w.release()  # the call returns; the worker must park before its next step (the slice is over)
    w.finish()


def test_inline_work_runs_on_the_granting_thread_one_stretch_per_expired_slice():
    gate = InlineSlices()
    granting = [False]
    seen: list[tuple[int, bool]] = []
    out: list = []

    def work() -> str:
        for _ in range(5):
            seen.append((threading.get_ident(), granting[0]))
            gate.checkpoint()  # the slice is over: back to the granting thread
        return "done"

    handle = gate.start(work, lambda r, e: out.append((r, e)))
    assert handle is gate and gate.is_alive() and not seen  # nothing runs before the first grant
    gate.checkpoint()  # outside the work: nothing happens
    for k in range(1, 6):
        granting[0] = True
        gate.grant(0.0)
        granting[0] = False
        assert len(seen) == k and gate.is_alive()  # exactly one stretch per grant
    assert not out
    gate.grant(0.0)  # the last stretch: from the fifth checkpoint to the end, then `done`
    assert not gate.is_alive() and out == [("done", None)]
    assert seen == [(threading.get_ident(), True)] * 5  # on this thread, and only inside grant
    assert gate.grant(0.0) == 0.0 and gate.overruns == 0  # after the end: nothing to grant


def test_inline_work_runs_to_its_checkpoint_after_the_deadline_and_reports_errors():
    gate = InlineSlices()
    steps = [0]

    def work() -> None:
        while steps[0] < 3:
            steps[0] += 1
            gate.checkpoint()

    gate.start(work, lambda r, e: None)
    gate.grant(600.0)  # a slice that cannot expire: the work runs to its end in it
    assert steps == [3] and not gate.is_alive()

    errors: list = []
    failing = InlineSlices()

    def fail() -> None:
        failing.checkpoint()
        raise ZeroDivisionError

    failing.start(fail, lambda r, e: errors.append((r, type(e))))
    failing.grant(0.0)
    assert errors == [] and failing.is_alive()  # parked at its checkpoint, before the error
    failing.grant(0.0)  # the error reaches `done`, not the granting thread
    assert errors == [(None, ZeroDivisionError)] and not failing.is_alive()


def test_inline_swap_state_keeps_each_side_its_own_value():
    """worker_ext passes torch's grad mode: the staging runs under no_grad, the engine keeps its own mode."""
    state = ["engine"]
    gate = InlineSlices(swap_state=(lambda: state[0], lambda v: state.__setitem__(0, v)))
    inside: list[str] = []

    def work() -> None:
        inside.append(state[0])  # starts in the state of the thread that started it
        state[0] = "staging"
        gate.checkpoint()
        inside.append(state[0])  # its own again after the granting side changed it in between

    gate.start(work, lambda r, e: None)
    state[0] = "engine, later"
    gate.grant(0.0)
    assert state == ["engine, later"]  # the granting side's own value back after the slice
    state[0] = "engine, step 2"
    gate.grant(0.0)
    assert inside == ["engine", "staging"] and state == ["engine, step 2"]


def test_inline_grant_from_another_thread_is_refused():
    gate = InlineSlices()
    gate.start(lambda: None, lambda r, e: None)
    errors: list = []

    def other() -> None:
        try:
            gate.grant(0.0)
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert len(errors) == 1 and gate.is_alive()
    gate.grant(0.0)
    assert not gate.is_alive()


def _burn(n: int = 200_000) -> float:
    """Pure Python work; returns its own CPU seconds (time.thread_time of the thread it ran on)."""
    c0 = time.thread_time()
    sum(k * k for k in range(n))
    return time.thread_time() - c0


def test_each_gate_reports_the_cpu_time_of_the_work_in_the_last_slice():
    """`last_cpu_s` (bench_swap's "the swap's work") holds at least the CPU time the work measured for itself
    inside that slice: a monotone clock of the thread that ran it, so no timing is assumed."""
    inline = InlineSlices()
    inside: list[float] = []

    def work() -> None:
        inside.append(_burn())
        inline.checkpoint()

    inline.start(work, lambda r, e: None)
    inline.grant(0.0)
    assert inside and inline.last_cpu_s >= inside[0] > 0

    gate = SliceGate()
    burnt: list[float] = []
    t = gate.start(lambda: burnt.append(_burn()), lambda r, e: None)
    gate.grant(600.0)  # a slice that cannot expire: the work runs to its end in it
    t.join(60)
    assert burnt and gate.last_cpu_s >= burnt[0] > 0


def test_inline_parks_before_a_named_stretch_that_would_not_fit_and_learns_each_stretch():
    """Lookahead: `history` says the stretch after checkpoint "long" takes longer than any slice, so the work
    switches out there although its slice (600 s) is far from over, and that stretch starts a slice of its own;
    a label with no history does not park. What each stretch took is learnt from its CPU time: at least what the
    work measured for itself inside it (one monotone clock of this thread: no timing assumed)."""
    history: dict = {"long": 1e9}
    gate = InlineSlices(history=history)
    seen: list[str] = []
    burnt: dict[str, float] = {}

    def work() -> None:
        seen.append("a")
        gate.checkpoint("long")  # predicted not to fit: back to the granting thread
        seen.append("b")
        burnt["long"] = _burn()
        gate.checkpoint("short")  # never seen: no prediction, the slice goes on
        seen.append("c")
        burnt["short"] = _burn()
        gate.checkpoint(("step", 7))  # a tuple label is counted by its kind
        seen.append("d")

    gate.start(work, lambda r, e: None)
    gate.grant(600.0)
    assert seen == ["a"] and gate.is_alive() and gate.lookahead_parks == 1
    gate.grant(600.0)
    assert seen == ["a", "b", "c", "d"] and not gate.is_alive() and gate.lookahead_parks == 1
    assert history["long"] == 1e9  # the longest seen is kept
    assert history["short"] >= burnt["short"] > 0 and ("step", 7) not in history  # the last stretch had no end
    assert gate.longest_stretch_s >= max(burnt.values())
    assert gate.longest_stretch_label in ("long", "short")
    assert gate.checkpoints == {"long": 1, "short": 1, "step": 1}

    # the history is shared (worker_ext keeps one across pushes); a label it has no record of never parks early
    later = InlineSlices(history=history)
    order: list[str] = []

    def again() -> None:
        order.append("x")
        later.checkpoint("new")
        order.append("y")

    later.start(again, lambda r, e: None)
    later.grant(600.0)
    assert order == ["x", "y"] and later.lookahead_parks == 0
