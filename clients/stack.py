"""Run the forkrl stack as local processes, from the same definition Docker uses (compose.yaml).

compose.yaml is the one source of truth for how each service starts: its `command`, `environment`,
`depends_on` and `healthcheck.test` are read here, `${VAR:-default}` is interpolated from the environment,
and container data paths become local ones through one variable: compose writes every data path as
`${FORKRL_DATA:-/data}/...`, and this module sets FORKRL_DATA to a local directory (default
`<repo>/runs/stack`; the probe's job outputs, a volume of their own there, go to its probe_jobs/ here).
Commands run from the repository root (the image's working directory holds the same tree), with
`python` replaced by this interpreter.

    from clients.stack import Stack
    with Stack() as stack:                 # starts in dependency order, waits for health
        print(stack.addresses)             # {'rollout': '127.0.0.1:50051', 'trainer': ..., 'probe': 'http://...'}
        ...                                # leaving the block stops everything (no orphans)

Each service runs in its own process group (vLLM spawns workers). Stopping follows Docker: SIGTERM to the
service's main process (what tini forwards with `init: true`), up to its `stop_grace_period`, then SIGKILL
to whatever is left of its process group and descendants. Dependents stop before their dependencies.
The CLI around this is clients/launch.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_COMPOSE = REPO_ROOT / "compose.yaml"
DEFAULT_DATA_DIR = REPO_ROOT / "runs" / "stack"
DATA_VAR = "FORKRL_DATA"
# Other container paths, as (variable, default below the data dir).
LOCAL_PATH_VARS = {"FORKRL_PROBE_JOBS": "probe_jobs"}

CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")


class StackError(RuntimeError):
    """A service failed to start, became unhealthy, or died."""


# ---------------------------------------------------------------------------------------------------
# compose file: loading, merging, interpolation


_VAR = re.compile(
    r"\$(?:(?P<esc>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose-style variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR-default},
    ${VAR:?error}, ${VAR?error}, ${VAR:+alt}, ${VAR+alt}, and $$ for a literal $. No nesting (compose
    v1.29 has none either)."""

    def sub(m: re.Match) -> str:
        if m.group("esc"):
            return "$"
        name = m.group("braced") or m.group("named")
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        if op is None:
            return value or ""
        unset_or_empty = value is None or (op.startswith(":") and value == "")
        kind = op[-1]
        if kind == "-":
            return arg if unset_or_empty else value
        if kind == "?":
            if unset_or_empty:
                raise StackError(f"required variable {name} is missing: {arg or 'set it'}")
            return value
        return "" if unset_or_empty else arg  # "+"

    return _VAR.sub(sub, text)


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    return node


def _merge(base: Any, over: Any) -> Any:
    """Override-file merge: mappings merge key by key, everything else is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return over


def load_compose(files: Sequence[str | os.PathLike] | None, env: Mapping[str, str]) -> dict[str, Any]:
    """The merged, interpolated compose model (top-level mapping)."""
    import yaml  # PyYAML: comes with the project's environment (vLLM depends on it)

    model: dict[str, Any] = {}
    for f in files or [DEFAULT_COMPOSE]:
        with open(f, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh) or {}
        model = _merge(model, doc)
    services = {k: v for k, v in (model.get("services") or {}).items()}
    model["services"] = _interpolate_tree(services, env)
    return model


def parse_duration(value: Any, default: float) -> float:
    """Compose durations: '1m30s', '20s', '500ms', or a number of seconds."""
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return float(value)
    total, ok = 0.0, False
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", str(value)):
        total += float(num) * {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}[unit]
        ok = True
    return total if ok else default


# ---------------------------------------------------------------------------------------------------
# one service


@dataclass
class ServiceSpec:
    """What the launcher takes from one compose service."""

    name: str
    command: list[str]
    environment: dict[str, str | None]
    depends_on: dict[str, str]  # dependency -> condition
    health_test: list[str] | None  # argv, or None without a healthcheck
    health_timeout: float = 5.0
    stop_grace: float = 10.0
    oneshot: bool = False  # something waits for it with service_completed_successfully

    @classmethod
    def from_compose(cls, name: str, svc: Mapping[str, Any]) -> ServiceSpec:
        command = svc.get("command")
        if command is None:
            raise StackError(f"service {name}: no command (the launcher cannot use the image's default)")
        command = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]

        env_raw = svc.get("environment") or {}
        environment: dict[str, str | None] = {}
        if isinstance(env_raw, dict):
            for k, v in env_raw.items():
                environment[str(k)] = None if v is None else (str(v).lower() if isinstance(v, bool) else str(v))
        else:
            for item in env_raw:
                k, sep, v = str(item).partition("=")
                environment[k] = v if sep else None

        deps_raw = svc.get("depends_on") or {}
        if isinstance(deps_raw, list):
            depends_on = {str(d): "service_started" for d in deps_raw}
        else:
            depends_on = {str(d): (c or {}).get("condition", "service_started") for d, c in deps_raw.items()}
        for dep, cond in depends_on.items():
            if cond not in CONDITIONS:
                raise StackError(f"service {name}: unknown depends_on condition {cond!r} for {dep}")

        hc = svc.get("healthcheck") or {}
        test = hc.get("test")
        health_test: list[str] | None
        if hc.get("disable") or test is None:
            health_test = None
        elif isinstance(test, str):
            health_test = ["/bin/sh", "-c", test]
        elif test and test[0] == "NONE":
            health_test = None
        elif test and test[0] == "CMD-SHELL":
            health_test = ["/bin/sh", "-c", " ".join(test[1:])]
        elif test and test[0] == "CMD":
            health_test = [str(t) for t in test[1:]]
        else:
            health_test = [str(t) for t in test]
        return cls(
            name=name,
            command=command,
            environment=environment,
            depends_on=depends_on,
            health_test=health_test,
            health_timeout=parse_duration(hc.get("timeout"), 5.0),
            stop_grace=parse_duration(svc.get("stop_grace_period"), 10.0),
        )

    @property
    def health_target(self) -> str | None:
        """host:port (grpc) or base URL (http) of the service, from its health check's last argument."""
        if not self.health_test:
            return None
        target = self.health_test[-1]
        if target.startswith(("http://", "https://")):
            return re.sub(r"/healthz/?$", "", target)
        return target


def _with_python(argv: list[str], python: str) -> list[str]:
    if argv and argv[0] in ("python", "python3"):
        return [python, *argv[1:]]
    return argv


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
        argv = _with_python(self.spec.command, python)
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
                _with_python(self.spec.health_test, python),
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


# ---------------------------------------------------------------------------------------------------
# the stack


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
        self.base_env = {**os.environ, **(self.env or {}), DATA_VAR: str(self.data_dir)}
        for var, sub in LOCAL_PATH_VARS.items():
            self.base_env.setdefault(var, str(self.data_dir / sub))
        self.base_env.setdefault("PYTHONUNBUFFERED", "1")
        model = load_compose(self.compose_files, self.base_env)
        all_specs = {name: ServiceSpec.from_compose(name, svc) for name, svc in model["services"].items()}
        for spec in all_specs.values():
            for dep, cond in spec.depends_on.items():
                if dep not in all_specs:
                    raise StackError(f"service {spec.name} depends on unknown service {dep}")
                if cond == "service_completed_successfully":
                    all_specs[dep].oneshot = True
        wanted = list(self.services or all_specs)
        for name in wanted:
            if name not in all_specs:
                raise StackError(f"no service {name!r} in the compose file (have: {', '.join(all_specs)})")
        self.order = _topo_order(all_specs, wanted)
        self.specs = {n: all_specs[n] for n in self.order}
        self.out = self.out or sys.stdout
        self._width = max(len(n) for n in self.order) + 2
        self._lock = threading.Lock()
        self._color = self.out.isatty() and os.environ.get("NO_COLOR") is None
        self._logs: dict[str, IO[str]] = {}
        self._stopped = False

    # -- info
    @property
    def addresses(self) -> dict[str, str]:
        """service -> host:port (gRPC) or base URL (HTTP), as its health check reaches it."""
        return {n: s.health_target for n, s in self.specs.items() if s.health_target}

    def env_for(self, name: str) -> dict[str, str]:
        env = dict(self.base_env)
        for k, v in self.specs[name].environment.items():
            if v is not None:
                env[k] = v
            # None: compose passes the variable through from its own environment when set there,
            # which is what inheriting base_env already does.
        return env

    def commands(self) -> dict[str, list[str]]:
        return {n: _with_python(s.command, self.python) for n, s in self.specs.items()}

    def describe(self) -> str:
        lines = [f"data dir: {self.data_dir}  (FORKRL_DATA)"]
        for name, spec in self.specs.items():
            deps = ", ".join(f"{d} ({c.removeprefix('service_')})" for d, c in spec.depends_on.items())
            lines.append(f"{name}{' (one-shot)' if spec.oneshot else ''}:")
            lines.append(f"  command: {shlex.join(_with_python(spec.command, self.python))}")
            if spec.environment:
                env = " ".join(f"{k}={'<inherited>' if v is None else v}" for k, v in spec.environment.items())
                lines.append(f"  env:     {env}")
            if deps:
                lines.append(f"  after:   {deps}")
            if spec.health_test:
                lines.append(f"  health:  {shlex.join(_with_python(spec.health_test, self.python))}")
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
                    self.say("launch", f"starting {name}: {shlex.join(_with_python(spec.command, self.python))}")
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
        svc = self.procs[name]
        if svc._pump is not None:
            svc._pump.join(timeout=2)
        tail = "\n".join(f"    {line}" for line in list(svc.tail)[-15:])
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


def _topo_order(specs: Mapping[str, ServiceSpec], wanted: Iterable[str]) -> list[str]:
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise StackError(f"dependency cycle through {name}")
        visiting.add(name)
        for dep in specs[name].depends_on:
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in wanted:
        visit(name)
    return order


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
