"""Run the forkrl stack as local processes, from the same definition Docker uses (compose.yaml).

The compose file is read by clients/compose_file.py (commands, environment, depends_on, health checks,
`${VAR:-default}`, and FORKRL_DATA pointing the container data paths at a local directory, default
`<repo>/runs/stack`); each service runs as a clients/process.py Service. This module starts them in
dependency order, waits for each condition, watches them, and stops them all.

    from clients.stack import Stack
    with Stack() as stack:                 # starts in dependency order, waits for health
        print(stack.addresses)             # {'rollout': '127.0.0.1:50051', 'trainer': ..., 'probe': 'http://...'}
        stack.token                        # the services' token (FORKRL_TOKEN, else the one the stack created)
        subprocess.run([..., "clients/start_run.py"], env=stack.client_env())   # clients get it this way
        ...                                # leaving the block stops everything (no orphans)

Stopping follows Docker: dependents stop before their dependencies, each with SIGTERM, up to its
`stop_grace_period`, then SIGKILL to whatever is left of its process group (vLLM's workers) and
descendants (clients/process.py); Ctrl-C during the stop is deferred so it cannot leave orphans.
The CLI around this is clients/launch.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from clients.compose_file import (
    DATA_VAR,
    DEFAULT_DATA_DIR,
    REPO_ROOT,
    ServiceSpec,
    StackError,
    load_services,
    local_environment,
)
from clients.process import Service
from forkrl.security import TOKEN_ENV, TokenError, load_token, read_token_file

__all__ = ["Stack", "StackError"]

_COLORS = ("36", "33", "35", "32", "34", "31")


@dataclass
class Stack:
    """The services of compose.yaml as local processes. Use as a context manager, or start()/wait()/stop().

    services:      which services to run (their dependencies come along); default: all.
    compose_files: compose file and overrides, merged in order (default: the repo's compose.yaml).
    data_dir:      local directory for ${FORKRL_DATA} (default: $FORKRL_DATA, else <repo>/runs/stack).
    env:           extra variables for interpolation and for the services (ports, settings).
    python:        interpreter that replaces `python` in commands (default: this one).
    echo:          True: stream the services' logs, prefixed `[name] `, and the launcher's lines to `out`;
                   "launch": only the launcher's lines; False: nothing (the log files still get it all).
    log_dir:       also write each service's log to <log_dir>/<name>.log (default: <data_dir>/logs).
    timeout:       seconds for the whole stack to become ready.
    """

    services: Sequence[str] | None = None
    compose_files: Sequence[str | os.PathLike] | None = None
    data_dir: str | os.PathLike | None = None
    env: Mapping[str, str] | None = None
    python: str = sys.executable
    echo: bool | str = True
    log_dir: str | os.PathLike | None = None
    timeout: float = 900.0
    poll_s: float = 1.0
    grace_s: float | None = None
    out: IO[str] | None = None
    cwd: Path = REPO_ROOT

    specs: dict[str, ServiceSpec] = field(init=False, default_factory=dict)
    order: list[str] = field(init=False, default_factory=list)
    procs: dict[str, Service] = field(init=False, default_factory=dict)
    base_env: dict[str, str] = field(init=False, default_factory=dict)
    ready_s: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir or os.environ.get(DATA_VAR) or DEFAULT_DATA_DIR).resolve()
        self.base_env = local_environment(self.data_dir, self.env)
        self.specs = load_services(self.compose_files, self.base_env, self.services)
        self.order = list(self.specs)
        self.out = self.out or sys.stdout
        self._width = max(len(n) for n in self.order) + 2
        self._lock = threading.Lock()
        self._color = self.out.isatty() and os.environ.get("NO_COLOR") is None
        self._logs: dict[str, IO[str]] = {}
        self._stopped = False

    # -- info
    @property
    def token_file(self) -> Path:
        """Where compose.yaml's one-shot `token` service keeps the token (<data_dir>/secrets/token)."""
        return Path(self.base_env[DATA_VAR]) / "secrets" / "token"

    @property
    def token(self) -> str | None:
        """The services' bearer token: FORKRL_TOKEN when given, else the one the `token` service created
        (None before it ran)."""
        given = load_token({k: v for k, v in self.base_env.items() if k == TOKEN_ENV})
        if given:
            return given
        with contextlib.suppress(TokenError):
            return read_token_file(self.token_file)
        return None

    def client_env(self) -> dict[str, str]:
        """This process's environment with the services' token, for clients (start_run.py, curl, ...)."""
        token = self.token
        return {**os.environ, TOKEN_ENV: token} if token else dict(os.environ)

    @property
    def addresses(self) -> dict[str, str]:
        """service -> host:port (gRPC) or base URL (HTTP), as its health check reaches it."""
        return {n: s.health_target for n, s in self.specs.items() if s.health_target}

    def env_for(self, name: str) -> dict[str, str]:
        return self.specs[name].process_env(self.base_env)

    def commands(self) -> dict[str, list[str]]:
        return {n: s.argv(self.python) for n, s in self.specs.items()}

    def describe(self) -> str:
        lines = [f"data dir: {self.data_dir}  (FORKRL_DATA)"]
        for name, spec in self.specs.items():
            deps = ", ".join(f"{d} ({c.removeprefix('service_')})" for d, c in spec.depends_on.items())
            lines.append(f"{name}{' (one-shot)' if spec.oneshot else ''}:")
            lines.append(f"  command: {shlex.join(spec.argv(self.python))}")
            if spec.environment:
                env = " ".join(f"{k}={'<inherited>' if v is None else v}" for k, v in spec.environment.items())
                lines.append(f"  env:     {env}")
            if deps:
                lines.append(f"  after:   {deps}")
            if spec.health_test:
                lines.append(f"  health:  {shlex.join(spec.health_argv(self.python))}")
        return "\n".join(lines)

    def logs(self, name: str) -> list[str]:
        return list(self.procs[name].tail) if name in self.procs else []

    # -- output
    def say(self, name: str, line: str) -> None:
        prefix = f"[{name}]".ljust(self._width)
        if self._color:
            color = _COLORS[self.order.index(name) % len(_COLORS)] if name in self.order else "1"
            prefix = f"\033[{color}m{prefix}\033[0m"
        with self._lock:
            if self.echo is True or (self.echo == "launch" and name not in self.order):
                try:
                    self.out.write("".join(f"{prefix} {part}\n" for part in line.split("\n")))
                    self.out.flush()
                except (ValueError, OSError):
                    pass
            log = self._logs.get(name)
            if log is not None:
                with contextlib.suppress(ValueError, OSError):
                    log.write(line + "\n")
                    log.flush()

    # -- lifecycle
    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Stack:
        """Start everything in dependency order and wait until ready (healthy / completed)."""
        t0 = time.monotonic()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_dir = Path(self.log_dir) if self.log_dir else self.data_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._logs = {n: open(log_dir / f"{n}.log", "a", encoding="utf-8") for n in self.order}
        for n in self.order:
            self._logs[n].write(f"--- started by clients/stack.py at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        try:
            self._check_ports()
            self._start_all(t0)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def _check_ports(self) -> None:
        """Fail fast when something already listens where a service will (another stack, a test run)."""
        import socket

        for name, target in self.addresses.items():
            m = re.match(r"^(?:https?://)?\[?([^\]/]+?)\]?:(\d+)(?:/.*)?$", target)
            if not m:
                continue
            host, port = m.group(1), int(m.group(2))
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
                sock.settimeout(1.0)
                busy = sock.connect_ex((host, port)) == 0
            if busy:
                raise StackError(
                    f"{name}: {host}:{port} is already in use (another stack or test?); "
                    f"pick other ports, e.g. {name.upper()}_PORT=... (variables of compose.yaml)"
                )

    def _start_all(self, t0: float) -> None:
        deadline = t0 + self.timeout
        pending = list(self.order)
        state: dict[str, str] = {}  # name -> started | healthy | completed
        next_check: dict[str, float] = {}
        while True:
            for name in list(pending):
                spec = self.specs[name]
                if all(_satisfied(state.get(d), c) for d, c in spec.depends_on.items()):
                    pending.remove(name)
                    self.say("launch", f"starting {name}: {shlex.join(spec.argv(self.python))}")
                    svc = Service(spec, self.say)
                    self.procs[name] = svc
                    svc.start(self.python, self.env_for(name), self.cwd)
                    state[name] = "started"
                    next_check[name] = time.monotonic() + 0.5
            for name, svc in self.procs.items():
                if state[name] in ("healthy", "completed"):
                    continue
                rc = svc.returncode
                if rc is not None:
                    if svc.spec.oneshot and rc == 0:
                        state[name] = "completed"
                        svc.ready_at = time.monotonic()
                        self.say("launch", f"{name} completed in {svc.ready_at - svc.started_at:.1f} s")
                        continue
                    raise StackError(self._died(name, rc, "while starting"))
                if svc.spec.oneshot:
                    continue
                if time.monotonic() >= next_check[name]:
                    if svc.check_health(self.python, self.env_for(name), self.cwd):
                        state[name] = "healthy"
                        svc.healthy = True
                        svc.ready_at = time.monotonic()
                        what = "healthy" if svc.spec.health_test else "started (no healthcheck)"
                        self.say("launch", f"{name} {what} after {svc.ready_at - svc.started_at:.1f} s")
                    else:
                        next_check[name] = time.monotonic() + self.poll_s
            if not pending and all(state.get(n) in ("healthy", "completed") for n in self.order):
                return
            if time.monotonic() > deadline:
                waiting = [n for n in self.order if state.get(n) not in ("healthy", "completed")]
                raise StackError(f"not ready after {self.timeout:.0f} s: {', '.join(waiting)}")
            time.sleep(0.2)

    def _died(self, name: str, rc: int, when: str) -> str:
        sig = f" (signal {signal.Signals(-rc).name})" if rc < 0 and -rc in signal.Signals._value2member_map_ else ""
        tail = "\n".join(f"    {line}" for line in self.procs[name].last_lines(15))
        return f"{name} exited with code {rc}{sig} {when}; last lines:\n{tail}"

    def poll(self) -> tuple[str, int] | None:
        """(name, code) of a long-running service that has exited, else None."""
        for name, svc in self.procs.items():
            if svc.spec.oneshot:
                continue
            svc.remember_children()
            rc = svc.returncode
            if rc is not None:
                return name, rc
        return None

    def wait(self, health_every_s: float = 15.0) -> int:
        """Block until a long-running service exits; returns a non-zero exit status for the launcher.

        Meanwhile the health checks keep running every `health_every_s` and changes are logged (like
        Docker, an unhealthy service is reported, not restarted)."""
        next_health = time.monotonic() + health_every_s
        while True:
            dead = self.poll()
            if dead is not None:
                name, rc = dead
                report = self._died(name, rc, "unexpectedly")
                if self.echo is True:  # its last lines are on the screen already
                    report = report.split("; last lines:")[0]
                self.say("launch", report + "\n(stopping the stack)")
                return rc if rc > 0 else 1
            if health_every_s > 0 and time.monotonic() >= next_health:
                self.check_health()
                next_health = time.monotonic() + health_every_s
            time.sleep(0.5)

    def check_health(self) -> dict[str, bool]:
        """Run every long-running service's health check now; log the ones that changed."""
        result = {}
        for name, svc in self.procs.items():
            if svc.spec.oneshot or svc.spec.health_test is None or not svc.running:
                continue
            ok = svc.check_health(self.python, self.env_for(name), self.cwd)
            if ok != svc.healthy:
                self.say("launch", f"{name} is {'healthy again' if ok else 'UNHEALTHY'}")
            svc.healthy = result[name] = ok
        return result

    def stop(self) -> None:
        """Stop every started service, dependents first; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with _signals_deferred():
            for name in reversed(self.order):
                svc = self.procs.get(name)
                if svc is None or svc.proc is None:
                    continue
                was_running = svc.running
                if was_running:
                    self.say("launch", f"stopping {name}")
                t = time.monotonic()
                rc = svc.stop(self.grace_s)
                if was_running:
                    self.say("launch", f"{name} stopped (code {rc}) in {time.monotonic() - t:.1f} s")
        for log in self._logs.values():
            with contextlib.suppress(OSError):
                log.close()


def _satisfied(state: str | None, condition: str) -> bool:
    if condition == "service_started":
        return state in ("started", "healthy", "completed")
    if condition == "service_healthy":
        return state in ("healthy",)
    return state == "completed"


@contextlib.contextmanager
def _signals_deferred():
    """While stopping, Ctrl-C / SIGTERM must not interrupt the cleanup halfway (orphans)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
