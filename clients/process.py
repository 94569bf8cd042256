"""One compose service as a local process: start, health check, logs, and a stop that leaves no orphans.

Each service runs in its own process group (vLLM spawns workers). Stopping follows Docker: SIGTERM to the
service's main process (what tini forwards with `init: true`), up to its `stop_grace_period`, then SIGKILL
to whatever is left of its process group and descendants. If the launcher itself dies without stopping
it (SIGKILL), the kernel SIGTERMs the service (PR_SET_PDEATHSIG). clients/stack.py runs a set of these.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from clients.compose_file import ServiceSpec

_libc: Any = None


def _child_setup() -> None:  # runs in the child between fork and exec
    # Ask the kernel to SIGTERM the service if the launcher dies without stopping it (e.g. SIGKILL).
    if _libc is not None:
        _libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _descendants(pid: int) -> list[Any]:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or process gone
        return []


class Service:
    """A running service process with its log pump."""

    def __init__(self, spec: ServiceSpec, sink: Callable[[str, str], None], keep_lines: int = 200):
        self.spec = spec
        self.name = spec.name
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_at: float | None = None
        self.healthy = False
        self.tail: deque[str] = deque(maxlen=keep_lines)
        self._sink = sink
        self._pump: threading.Thread | None = None
        self._known_children: list[Any] = []

    # -- lifecycle
    def start(self, python: str, env: Mapping[str, str], cwd: Path) -> None:
        global _libc
        if _libc is None and sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):
                _libc = ctypes.CDLL(None, use_errno=True)
        argv = self.spec.argv(python)
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: vLLM's workers go with it
            preexec_fn=_child_setup if _libc is not None else None,
        )
        self.started_at = time.monotonic()
        self._pump = threading.Thread(target=self._pump_logs, name=f"logs-{self.name}", daemon=True)
        self._pump.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def check_health(self, python: str, env: Mapping[str, str], cwd: Path) -> bool:
        if self.spec.health_test is None:
            return self.running
        try:
            done = subprocess.run(
                self.spec.health_argv(python),
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=self.spec.health_timeout,
            )
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def stop(self, grace: float | None = None) -> int | None:
        """SIGTERM the main process, wait up to the grace period, then SIGKILL the rest. Returns its code."""
        proc = self.proc
        if proc is None:
            return None
        grace = self.spec.stop_grace if grace is None else grace
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        self._known_children = _descendants(proc.pid) or self._known_children
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._sink(self.name, f"(no exit {grace:.0f} s after SIGTERM: SIGKILL)")
        # Whatever is left: the process group (workers) and descendants that left it.
        deadline = time.monotonic() + min(3.0, grace)
        while _group_alive(pgid) and time.monotonic() < deadline and proc.poll() is not None:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        for child in self._known_children:
            with contextlib.suppress(Exception):
                if child.is_running():
                    child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if self._pump is not None:
            self._pump.join(timeout=2)
        return proc.returncode

    def last_lines(self, n: int) -> list[str]:
        """The last n lines of its output, once the log pump has read what a dead process left."""
        if self._pump is not None:
            self._pump.join(timeout=2)
        return list(self.tail)[-n:]

    def remember_children(self) -> None:
        """Snapshot descendants (so ones that leave the process group can still be killed at stop)."""
        if self.running:
            kids = _descendants(self.proc.pid)  # type: ignore[union-attr]
            if kids:
                self._known_children = kids

    # -- logs
    def _pump_logs(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            # \r too: progress bars redraw with it; each redraw becomes a line.
            *lines, buf = re.split(rb"\r\n|\n|\r", buf)
            for raw in lines:
                if raw.strip():
                    self._emit(raw)
        if buf.strip():
            self._emit(buf)
        with contextlib.suppress(OSError):
            self.proc.stdout.close()

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip()
        self.tail.append(line)
        self._sink(self.name, line)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
