"""SliceGate (rollout_service/slices.py): the staged swap's worker thread runs only inside granted slices.

Nothing here depends on timing. The invariant is observable state: the granting thread holds a flag up while
it is inside `grant` and down while it runs its own Python between two grants (the engine's step), and the
worker records the flag at each step of its (pure Python) work. The worker parks
at a function return once the slice is over, and `grant` cannot get the GIL back before it has: so no step may
ever see the flag down. A native call that releases the GIL (here: a blocking lock acquire) must not hold the
granting thread: `grant` has to return while the worker is still blocked in it, or this test hangs.
"""

from __future__ import annotations

import threading

from rollout_service.slices import SliceGate


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


def test_a_native_call_that_releases_the_gil_runs_beside_the_granting_thread():
    gate = SliceGate()
    release = threading.Lock()
    release.acquire()
    in_native = threading.Event()
    granting = [False]
    after: list[bool] = []

    def work() -> None:
        in_native.set()
        release.acquire()  # blocks in C with the GIL released, until the test lets it go
        for _ in range(100):
            after.append(granting[0])

    t = _run(gate, work)
    granting[0] = True
    while not in_native.is_set():  # slices until the worker is inside the blocking call
        gate.grant(0.001)
    gate.grant(0.001)  # returns although the worker is still blocked (else: this test hangs here)
    granting[0] = False
    assert t.is_alive() and not after
    release.release()  # the call returns; the worker must park before its next step (the slice is over)
    slices = 0
    while t.is_alive():
        granting[0] = True
        gate.grant(0.001)
        granting[0] = False
        slices += 1
    assert len(after) == 100
    assert after.count(False) <= slices  # as above: at most one step per slice after a forced switch

