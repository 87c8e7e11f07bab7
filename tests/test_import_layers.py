"""The package reads as layers: no import cycle anywhere in gpusched, type-only imports included.

(Issue #12: engine.py sat in a circle with doctor.py, launch.py and metrics.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "gpusched"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name and not name.startswith(f"{d}.")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "gpusched.daemon.engine" in graph["gpusched.daemon.metrics"]  # the graph sees type-only imports
    assert cycles(graph) == []


def test_a_cycle_would_be_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The house rule (ARCHITECTURE.md): a vendor library is imported by its door and its simulator only,
# so nothing else can reach a real driver, and the simulator's parts get pynvml from SimNVML.
VENDOR_IMPORTERS = {"pynvml": {"gpusched.gpu.nvml", "gpusched.gpu.simnvml"}, "amdsmi": {"gpusched.gpu.amdsmi"}}


def vendor_imports() -> dict[str, set[str]]:
    """Vendor library -> the gpusched modules that import it (anywhere in them, lazily too)."""
    found: dict[str, set[str]] = {lib: set() for lib in VENDOR_IMPORTERS}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module.split(".")[0]]
            else:
                continue
            for lib in found.keys() & set(names):
                found[lib].add(_module_name(path))
    return found


def test_only_the_door_and_the_simulator_import_a_vendor_library() -> None:
    found = vendor_imports()
    for lib, allowed in VENDOR_IMPORTERS.items():
        assert found[lib] <= allowed, f"{lib} imported by {sorted(found[lib] - allowed)}"
    assert found["pynvml"] == VENDOR_IMPORTERS["pynvml"]  # (the walk does see them)
