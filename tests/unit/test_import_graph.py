"""The import graph of tidal.*: no cycle between the worker's files or its packages, and the operator and the worker
meet only in the contract (test_import_boundaries.py says what the contract and the operator may import besides).

Read from the source with `ast` (nothing is imported), counting every import: module level, inside functions and
under `if TYPE_CHECKING`, since each is a dependency a reader must follow even when Python defers it.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _folders() -> dict[str, str]:
    """folder -> import name, from setup.py's mapping (hack/folder_mapping.py reads it)."""
    spec = importlib.util.spec_from_file_location("folder_mapping", REPO / "hack" / "folder_mapping.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {folder: name for name, folder in module.read_folder_mapping().items()}


FOLDERS = _folders()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[parts[0]], *parts[1:]])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")}


MODULES = _modules()


def _known(name: str) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (`from a.b import c` may name a module c)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(m for m in map(_known, names) if m is not None)
    return found


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _package(module: str) -> str:
    """tidal.worker.engine.scheduler -> tidal.worker.engine; a top-level file (tidal.worker.cli) is its own node."""
    return ".".join(module.split(".")[:3])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, ()))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _worker_graph(by_package: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        if not module.startswith("tidal.worker."):
            continue
        source = _package(module) if by_package else module
        for dep in deps:
            if dep.startswith("tidal.worker."):
                target = _package(dep) if by_package else dep
                if target != source:
                    graph.setdefault(source, set()).add(target)
    return graph


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_worker_files():
    assert _cycles(_worker_graph(by_package=False)) == []


def test_no_import_cycle_between_worker_packages():
    assert _cycles(_worker_graph(by_package=True)) == []


def _reaches(module_prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} -> {dep}"
        for module, deps in GRAPH.items()
        if module.startswith(module_prefix)
        for dep in deps
        if dep.startswith(forbidden)
    )


def test_the_operator_and_the_worker_meet_only_in_the_contract():
    assert _reaches("tidal.operator", ("tidal.worker", "tidal.kernels")) == []
    assert _reaches("tidal.worker", ("tidal.operator",)) == []
    assert _reaches("tidal.kernels", ("tidal.worker", "tidal.operator")) == []
