"""The compose-file interpreter: compose.yaml (plus overrides) read into the services the launcher runs.

compose.yaml is the one source of truth for how each service starts: its `command`, `environment`,
`depends_on` and `healthcheck.test` are read here, `${VAR:-default}` is interpolated from the environment,
and container data paths become local ones through one variable: compose writes every data path as
`${FORKRL_DATA:-/data}/...`, and the launcher sets FORKRL_DATA to a local directory (default
`<repo>/runs/stack`; the probe's job outputs, a volume of their own there, go to its probe_jobs/ here).
Commands run from the repository root (the image's working directory holds the same tree), with
`python` replaced by the launcher's interpreter. Running them is clients/stack.py's job.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_COMPOSE = REPO_ROOT / "compose.yaml"
DEFAULT_DATA_DIR = REPO_ROOT / "runs" / "stack"
DATA_VAR = "FORKRL_DATA"
# Other container paths, as (variable, default below the data dir).
LOCAL_PATH_VARS = {"FORKRL_PROBE_JOBS": "probe_jobs"}

CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")


class StackError(RuntimeError):
    """The compose file cannot be used, or a service failed to start, became unhealthy, or died."""


# ---------------------------------------------------------------------------------------------------
# loading, merging, interpolation


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

    def argv(self, python: str) -> list[str]:
        """The command as the launcher runs it (`python` -> its interpreter)."""
        return _with_python(self.command, python)

    def health_argv(self, python: str) -> list[str] | None:
        return None if self.health_test is None else _with_python(self.health_test, python)

    def process_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` plus this service's `environment`."""
        env = dict(base)
        for k, v in self.environment.items():
            if v is not None:
                env[k] = v
            # None: compose passes the variable through from its own environment when set there,
            # which is what inheriting `base` already does.
        return env


def _with_python(argv: list[str], python: str) -> list[str]:
    if argv and argv[0] in ("python", "python3"):
        return [python, *argv[1:]]
    return argv


# ---------------------------------------------------------------------------------------------------
# the services to run


def local_environment(data_dir: Path, env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment for interpolation and for every service: this process's, then `env`, then the
    local data paths (FORKRL_DATA = data_dir; the other container paths below it unless set)."""
    out = {**os.environ, **(env or {}), DATA_VAR: str(data_dir)}
    for var, sub in LOCAL_PATH_VARS.items():
        out.setdefault(var, str(data_dir / sub))
    out.setdefault("PYTHONUNBUFFERED", "1")  # service logs stream through a pipe: line by line, not in blocks
    return out


def load_services(
    files: Sequence[str | os.PathLike] | None, env: Mapping[str, str], wanted: Sequence[str] | None = None
) -> dict[str, ServiceSpec]:
    """The `wanted` services (default: all) and their dependencies, in start order (dependencies first)."""
    model = load_compose(files, env)
    all_specs = {name: ServiceSpec.from_compose(name, svc) for name, svc in model["services"].items()}
    for spec in all_specs.values():
        for dep, cond in spec.depends_on.items():
            if dep not in all_specs:
                raise StackError(f"service {spec.name} depends on unknown service {dep}")
            if cond == "service_completed_successfully":
                all_specs[dep].oneshot = True
    names = list(wanted or all_specs)
    for name in names:
        if name not in all_specs:
            raise StackError(f"no service {name!r} in the compose file (have: {', '.join(all_specs)})")
    return {n: all_specs[n] for n in _topo_order(all_specs, names)}


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


