"""The architecture as rules (docs/architecture.md): who may import whom, and how big a module may grow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("rollout_service", "trainer_service", "probe_service")


def _modules(top: str) -> list[Path]:
    return sorted(p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path, submodules: bool = False) -> set[str]:
    """Every module name an import statement in `path` names (absolute imports; relative ones are in-package);
    with `submodules`, also `pkg.name` for each `from pkg import name` (it may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if submodules:
                names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("path", _modules("forkrl"), ids=_rel)
def test_the_core_imports_no_service_and_no_server(path: Path) -> None:
    bad = {m for m in _imports(path) if m.split(".")[0] in (*SERVICES, "clients", "fastapi", "uvicorn", "starlette")}
    assert not bad, f"{_rel(path)} imports {sorted(bad)}: the core never imports a service or a server framework"


@pytest.mark.parametrize("path", _modules("forkrl/rl"), ids=_rel)
def test_the_rl_math_imports_no_other_room(path: Path) -> None:
    bad = {m for m in _imports(path) if m.startswith("forkrl") and not m.startswith("forkrl.rl")}
    assert not bad, f"{_rel(path)} imports {sorted(bad)}: forkrl/rl is pure math"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("room", ["forkrl/data", "forkrl/rl", "forkrl/training", "forkrl/weights", "forkrl/probe"])
def test_a_room_of_the_core_has_no_import_cycle(room: str) -> None:
    # every import counts, also one inside a function (a lazy import hides a cycle, it does not remove it)
    dotted = room.replace("/", ".")
    mods = {f"{dotted}.{p.stem}": p for p in _modules(room) if p.stem != "__init__"}
    graph = {name: {m for m in _imports(p, submodules=True) if m in mods} for name, p in mods.items()}
    assert _cycle(graph) is None, f"{room} has an import cycle: {' -> '.join(_cycle(graph) or [])}"


@pytest.mark.parametrize("service", SERVICES)
def test_services_never_import_each_other(service: str) -> None:
    others = set(SERVICES) - {service}
    for path in _modules(service):
        bad = {m for m in _imports(path) if m.split(".")[0] in others | {"clients"}}
        assert not bad, f"{_rel(path)} imports {sorted(bad)}"


def test_no_hand_written_module_is_past_the_split_point() -> None:
    # style.md: split by responsibility past ~600 lines; issue 10 set the bar at ~500 for source modules.
    tops = ("forkrl", *SERVICES, "clients", "bench", "scripts")
    sizes = {_rel(p): len(p.read_text().splitlines()) for t in tops for p in _modules(t)
             if "wire" not in p.relative_to(ROOT).parts}
    big = {k: v for k, v in sizes.items() if v > 520}
    assert not big, f"modules past the split point: {big}"
