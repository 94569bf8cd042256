"""Run bookkeeping: one active run at a time, its thread, its event history and its state.

The training loop (forkrl/training/loop.py: run_training, which sees a Run through its RunHandle protocol)
runs in its own thread so the gRPC event loop (health, WatchRun, GetRun) stays responsive. Watchers read the
run's history from any index: joining late replays everything.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkrl.training.config import RunConfig

log = logging.getLogger("trainer_service")

# States (strings here; the server maps them to the proto enum).
STARTING, RUNNING, STOPPING, SUCCEEDED, STOPPED, FAILED = (
    "STARTING", "RUNNING", "STOPPING", "SUCCEEDED", "STOPPED", "FAILED")
TERMINAL = (SUCCEEDED, STOPPED, FAILED)


class RunConflict(Exception):
    """A run is already active."""


class UnknownRun(Exception):
    pass


@dataclass
class Run:
    run_id: str
    config: RunConfig
    run_dir: Path
    state: str = STARTING
    step: int = 0
    start_step: int = 0
    error: str = ""
    last_metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    stop_requested: threading.Event = field(default_factory=threading.Event)
    cond: threading.Condition = field(default_factory=threading.Condition)
    thread: threading.Thread | None = None

    def emit(self, item: dict[str, Any]) -> None:
        with self.cond:
            if item.get("type") == "metrics":
                self.step = int(item["step"])
                self.last_metrics = dict(item["values"])
            self.history.append(item)
            self.cond.notify_all()

    def event(self, kind: str, message: str = "", step: int | None = None, values: dict | None = None,
              path: str = "", state: str = "") -> None:
        self.emit({"type": "event", "kind": kind, "message": message, "step": self.step if step is None else step,
                   "values": values or {}, "path": path, "state": state, "time": time.time()})

    def wait_history(self, index: int, timeout_s: float) -> tuple[list[dict[str, Any]], bool]:
        """Items from `index` on (waiting up to timeout_s for new ones) and whether the run is over."""
        with self.cond:
            if len(self.history) <= index and self.state not in TERMINAL:
                self.cond.wait(timeout_s)
            return self.history[index:], self.state in TERMINAL


# The loop: Run -> None (forkrl.training.loop.run_training); raises on failure. Injected so tests can drive
# the manager.
LoopFn = Callable[[Run], None]


class RunManager:
    def __init__(self, runs_root: Path, loop_fn: LoopFn) -> None:
        self.runs_root = Path(runs_root)
        self.loop_fn = loop_fn
        self._lock = threading.Lock()
        self._runs: dict[str, Run] = {}
        self._latest: str | None = None

    def active(self) -> Run | None:
        with self._lock:
            for run in self._runs.values():
                if run.state not in TERMINAL:
                    return run
        return None

    def start(self, config: RunConfig) -> Run:
        with self._lock:
            for run in self._runs.values():
                if run.state not in TERMINAL:
                    raise RunConflict(f"run {run.run_id} is still {run.state.lower()} (step {run.step}); "
                                      "stop it first or wait for it to finish")
            run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
            run_dir = Path(config.run_dir) if config.run_dir else self.runs_root / run_id
            run = Run(run_id=run_id, config=config, run_dir=run_dir.resolve())
            self._runs[run_id] = run
            self._latest = run_id
        run.thread = threading.Thread(target=self._run_thread, args=(run,), name=f"run-{run_id}", daemon=True)
        run.thread.start()
        return run

    def get(self, run_id: str = "") -> Run:
        with self._lock:
            key = run_id or self._latest
            if key is None or key not in self._runs:
                raise UnknownRun(f"no run {run_id!r}" if run_id else "no run has been started")
            return self._runs[key]

    def stop(self, run_id: str = "") -> Run:
        run = self.get(run_id)
        if run.state not in TERMINAL:
            with run.cond:
                run.state = STOPPING
                run.cond.notify_all()
            run.stop_requested.set()
            run.event("LOG", "stop requested: finishing the current step and writing a checkpoint")
        return run

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the active run (it checkpoints) and wait for its thread."""
        run = self.active()
        if run is not None:
            self.stop(run.run_id)
            if run.thread is not None:
                run.thread.join(timeout_s)

    def _run_thread(self, run: Run) -> None:
        try:
            with run.cond:
                if run.state == STARTING:
                    run.state = RUNNING
            self.loop_fn(run)
            final = STOPPED if run.stop_requested.is_set() else SUCCEEDED
            run.error = ""
        except Exception as exc:  # the service must survive a failed run and report why
            log.error("run %s failed:\n%s", run.run_id, traceback.format_exc())
            final = FAILED
            run.error = f"{type(exc).__name__}: {exc}"
        with run.cond:
            run.state = final
        run.event("FINISHED", run.error or f"run {final.lower()} at step {run.step}", state=final)
