"""The package imports without cycles: a module-level import graph of opbc_metrics (ast, no import) has no
cycle, and every module imports first in a fresh interpreter.

A cycle works or breaks depending on which module a user imports first, so it is checked on the graph,
not by importing: an edge ``A -> B`` is an import that runs when ``A`` is imported (module level, class
bodies, ``try``/``if`` blocks; not function bodies and not ``if TYPE_CHECKING``), plus ``A -> P`` for each
package ``P`` that Python initialises to import ``B`` (its ``__init__`` runs first), unless ``P`` contains
``A`` (then it is already being initialised). Lazy imports inside functions are what a cycle forces
people to write, so the same graph with them included must be acyclic too.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package name -> folder (pyproject.toml maps the top-level integrations/ folder to opbc_metrics.integrations)
PACKAGES = {"opbc_metrics": ROOT / "opbc_metrics", "opbc_metrics.integrations": ROOT / "integrations"}


def module_files() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _imports(tree: ast.AST, lazy: bool) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run at import time (``lazy``: also those inside functions)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not lazy:
                continue
            elif isinstance(child, ast.If) and ast.unparse(child.test).split(".")[-1] == "TYPE_CHECKING":
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
            else:
                visit(child)

    visit(tree)
    return found


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path)), lazy):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            if node.level:  # relative: from the package of this module
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets.add(module)
            targets.update(f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in files)
        for target in targets:
            if not target.startswith("opbc_metrics"):
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in files and dep != name and not name.startswith(dep + "."):
                    graph[name].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]`` (``a`` imports ``b``), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()  # a node's set holds its predecessors: the path comes reversed
    except graphlib.CycleError as err:
        return err.args[1][::-1]
    return None


def test_the_graph_sees_the_imports():
    graph = import_graph()
    assert "opbc_metrics.functional" in graph["opbc_metrics.agent.metrics"]  # from opbc_metrics.functional import ...
    assert "opbc_metrics.functional.agent" in graph["opbc_metrics.agent.metrics"]
    assert "opbc_metrics.trajectory" in graph["opbc_metrics.functional.agent"]
    assert "opbc_metrics.functional" not in graph["opbc_metrics.functional.agent"]  # its own package
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("lazy", [False, True], ids=["module-level", "with-lazy-imports"])
def test_no_import_cycles(lazy: bool):
    cycle = find_cycle(import_graph(lazy))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_first_in_a_fresh_interpreter():
    names = sorted(module_files())
    script = (
        "import importlib, sys, traceback\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('opbc_metrics')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc(limit=3))\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
