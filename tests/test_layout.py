"""The layout of ``src/divjac``: its modules import each other as a DAG, and none is too long.

Every import of a divjac module is an edge of the graph: at module level, under
``if TYPE_CHECKING:`` (a cycle there is still a cycle of the design), and inside functions (an
import deferred to call time hides a cycle from Python, not from the design; the deferred
imports of optional frameworks, ``divjac.jax`` from the CLI, are edges as well). Relative
imports are resolved against the importing module's package. Run alone:
``python -m pytest tests/test_layout.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

MAX_LINES = 700
"""The most lines a module of ``src/divjac`` may have (split it by responsibility beyond)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / "divjac").rglob("*.py"))}


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports at module level, also inside module-level ``if`` / ``try`` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                todo += handler.body
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of the module, those inside functions and classes included."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def import_graph(*, deferred: bool = True) -> dict[str, set[str]]:
    """Module -> the divjac modules it imports (``deferred=False``: at module level only)."""
    modules = _modules()
    imports = _all_imports if deferred else _top_level_imports
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_cycle_in_divjac():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_is_too_long():
    lengths = {path: len(path.read_text().splitlines()) for path in _modules().values()}
    long = sorted((n, str(path.relative_to(SRC))) for path, n in lengths.items() if n > MAX_LINES)
    assert not long, f"files over {MAX_LINES} lines (split them): " + ", ".join(
        f"{path} ({n})" for n, path in long
    )


def test_the_transforms_sit_above_the_backend_interface():
    graph = import_graph(deferred=False)
    for backend in ("divjac.jax._backend", "divjac.torch._backend"):
        assert "divjac._backend" in graph[backend]
        assert not reachable(graph, backend) & {
            "divjac._call",
            "divjac._transforms",
            "divjac._divergence",
        }
    assert graph["divjac._backend"] <= {"divjac._core.detection"}
    assert "divjac._backend" in graph["divjac._call"]


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ],
)
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_the_graph_counts_imports_inside_functions():
    tree = ast.parse("import os\n\ndef f():\n    from . import b\n")
    assert len(_all_imports(tree)) == 2
    assert len(_top_level_imports(tree)) == 1
