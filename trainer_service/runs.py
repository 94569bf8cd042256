"""Run bookkeeping: one active run at a time, its thread, its event history and its state.

The training loop (forkrl/training/loop.py: run_training, which sees a Run through its RunHandle protocol)
runs in its own thread so the gRPC event loop (health, WatchRun, GetRun) stays responsive. Watchers read the
run's history from any index: joining late replays everything.

Run ids: a new run gets `<date>-<time>-<6 hex>`; a resumed run keeps the id of the run it continues, read from
`<run_dir>/run_id` (the loop writes it there), so GetRun, WatchRun, metrics, checkpoints and the rollout lease
use one id across resumes. The table keeps the latest run of each id: a resume replaces the finished run it
continues. A run's error is one sentence; a gRPC error reads "<who> answered <CODE>: <details>".
"""

from __future__ import annotations

import errno
import logging
import re
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from forkrl.runtime import release_memory
from forkrl.training.config import RunConfig

log = logging.getLogger("trainer_service")

# States (strings here; the server maps them to the proto enum).
STARTING, RUNNING, STOPPING, SUCCEEDED, STOPPED, FAILED = (
    "STARTING", "RUNNING", "STOPPING", "SUCCEEDED", "STOPPED", "FAILED")
TERMINAL = (SUCCEEDED, STOPPED, FAILED)


MAX_RUN_ID_CHARS = 64  # ids the manager gives are 22 characters; a request's run_id beyond this is refused
RUN_ID_FILE = "run_id"  # in the run dir: the id a resume takes over (forkrl/training/loop.py writes it)
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_ERROR_CHARS = 2000  # of a run's error sentence (GetRun, the FINISHED event)


class RunConflict(Exception):
    """A run is already active."""


class UnknownRun(Exception):
    pass


def check_run_id(run_id: str) -> None:
    """ValueError (INVALID_ARGUMENT) for a run id no run can have: longer than MAX_RUN_ID_CHARS. The message
    says the length, never the id."""
    if len(run_id) > MAX_RUN_ID_CHARS:
        raise ValueError(f"run_id has at most {MAX_RUN_ID_CHARS} characters, got {len(run_id):,}")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def resumed_run_id(run_dir: Path) -> str | None:
    """The id of the run that `run_dir` holds (its run_id file), if it is one a run can have."""
    try:
        run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return run_id if len(run_id) <= MAX_RUN_ID_CHARS and _RUN_ID.fullmatch(run_id) else None


def describe_failure(exc: BaseException, rollout_addresses: list[str], run_dir: str | Path = "") -> str:
    """The sentence a failed run reports. A gRPC error (raised, or the cause of the error raised) reads
    "<who> answered <CODE>: <details>", never the call object's repr; the run's gRPC calls all go to its rollout
    services. A full disk (ENOSPC, often raised by a writer thread that names no file) names the run dir and
    what to do."""
    rpc = next((e for e in _chain(exc) if isinstance(e, grpc.RpcError) and hasattr(e, "code")), None)
    full = next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno == errno.ENOSPC), None)
    if full is not None and rpc is None:
        text = (f"the disk of the run dir {run_dir or '(unknown)'} is full ({type(exc).__name__}: {exc}); the "
                "checkpoints written before are kept: free space there, then resume the run (resume=True)")
    elif rpc is None:
        text = f"{type(exc).__name__}: {exc}"
    else:
        who = (f"the rollout service at {rollout_addresses[0]}" if len(rollout_addresses) == 1
               else f"a rollout service (one of {', '.join(rollout_addresses)})")
        code = rpc.code()
        said = f"{who} answered {code.name if code is not None else 'UNKNOWN'}: {rpc.details() or 'no details'}"
        outer = str(exc)
        if rpc is exc:
            text = said
        elif str(rpc) in outer:  # a wrapper that put the call's repr in its message: its words, with ours
            text = outer.replace(str(rpc), said)
        else:  # an error of its own, raised on the way out of the gRPC error
            text = f"{type(exc).__name__}: {outer} (after: {said})"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " [cut]"


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


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
        """Start a run in its thread. A resume (config.resume, a run_dir with a run_id file) takes over the id of
        the run it continues; a finished run of that id in the table is replaced by the new one."""
        with self._lock:
            for run in self._runs.values():
                if run.state not in TERMINAL:
                    raise RunConflict(f"run {run.run_id} is still {run.state.lower()} (step {run.step}); "
                                      "stop it first or wait for it to finish")
            run_id = (resumed_run_id(Path(config.run_dir)) if config.resume and config.run_dir else None) \
                or new_run_id()
            run_dir = Path(config.run_dir) if config.run_dir else self.runs_root / run_id
            run = Run(run_id=run_id, config=config, run_dir=run_dir.resolve())
            self._runs[run_id] = run
            self._latest = run_id
        run.thread = threading.Thread(target=self._run_thread, args=(run,), name=f"run-{run_id}", daemon=True)
        run.thread.start()
        return run

    def get(self, run_id: str = "") -> Run:
        """The run of that id ("" = the latest); UnknownRun, or ValueError for an id longer than any run's."""
        check_run_id(run_id)
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
            run.event("LOG", "stop requested: the run stops before its next micro-batch or Generate call and "
                               "checkpoints its last trained step")
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
            run.error = describe_failure(exc, run.config.rollout_addresses, run.run_dir)
        release_memory()  # the run's model and optimizer state, before the next run loads its own
        with run.cond:
            run.state = final
        run.event("FINISHED", run.error or f"run {final.lower()} at step {run.step}", state=final)
