"""The tree is the architecture map: these tests keep it true.

* Imports point one way: the core (``trajstore/*.py`` and ``trajstore/log/``)
  never imports the edges (``ingest/``, ``train/``, ``inspect/``, ``demo/``,
  ``scale/``, ``replay/``, ``cli``), not even inside a function.
* No import cycles between trajstore modules, function-level imports included.
* Every public module declares ``__all__``, and it lists exactly the public
  names the module defines (not the ones it imports).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import trajstore

PKG = Path(trajstore.__file__).resolve().parent
EDGES = ("trajstore.ingest", "trajstore.train", "trajstore.inspect", "trajstore.demo", "trajstore.scale",
         "trajstore.replay", "trajstore.cli")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "migrations":
            continue  # Alembic scripts, loaded by file path
        parts = ["trajstore", *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """trajstore modules that ``name`` imports anywhere in its body."""
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and t != "trajstore":
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_edge(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in EDGES)


def test_core_never_imports_edges():
    bad = {m: sorted(t for t in GRAPH[m] if _is_edge(t)) for m in GRAPH if not _is_edge(m) and m != "trajstore"}
    assert {m: t for m, t in bad.items() if t} == {}


def test_no_import_cycles():
    # A package __init__ that re-exports its own submodule is not a cycle.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in GRAPH.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_check_sees_function_level_imports():
    # The rule above would be vacuous if nested imports were missed.
    assert "trajstore.materializer" in GRAPH["trajstore.store"]


PUBLIC = sorted(m for m in MODULES if not any(p.startswith("_") for p in m.split(".")))


@pytest.mark.parametrize("name", PUBLIC)
def test_all_lists_exactly_the_public_definitions(name: str):
    try:
        mod = importlib.import_module(name)
    except ImportError as e:  # an optional extra that is not installed
        pytest.skip(f"{name}: {e}")
    assert hasattr(mod, "__all__"), f"{name} has no __all__"
    for n in mod.__all__:
        assert hasattr(mod, n), f"{name}.__all__ names {n!r}, which does not exist"
    defined = {
        n for n, v in vars(mod).items()
        if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
        and getattr(v, "__module__", None) == name
    }
    missing = defined - set(mod.__all__)
    assert not missing, f"{name} defines public {sorted(missing)} but __all__ leaves them out"
