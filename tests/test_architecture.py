"""The shape of the package: wings import one way, modules stay small, no import cycles.

The import direction is checked by import-linter's contracts in pyproject.toml (a wrong import
fails here with the contract and the import that broke it); module length and cycles by reading
the sources.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qcal"
MAX_LINES = 450  # a longer module says why in its first lines ("long: ...")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every qcal module or name `path` imports, absolute."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("qcal")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("qcal"):
                found.add(target)
                found |= {f"{target}.{alias.name}" for alias in node.names}
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in _imports(path, name):
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
            # importing qcal.a.b runs qcal.a's __init__ first
            parent = target.rpartition(".")[0]
            while parent and parent != name and not name.startswith(parent + "."):
                edges.add(parent)
                parent = parent.rpartition(".")[0]
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def test_import_contracts_hold() -> None:
    cli = pytest.importorskip("importlinter.cli", reason="import-linter is a test dependency")
    assert cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def test_no_import_cycles() -> None:
    assert _cycles(_import_graph()) == []


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_modules_stay_small() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > MAX_LINES and not any("long:" in line for line in lines[:5]):
            long.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert long == []


def test_every_wing_says_what_it_owns_and_may_import() -> None:
    for wing in ("numerics", "graph", "calibration", "accuracy"):
        doc = ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text()))
        assert doc and "May import" in doc, wing
