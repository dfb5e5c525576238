"""The layout of ``src/divjac``: its modules import each other as a DAG, and keep their
private names to themselves.

Every import of a divjac module is an edge of the graph: at module level, under
``if TYPE_CHECKING:`` (a cycle there is still a cycle of the design), and inside functions (an
import deferred to call time hides a cycle from Python, not from the design; the deferred
imports of optional frameworks, ``divjac.jax`` from the CLI, are edges as well). Relative
imports are resolved against the importing module's package.

A module's private (``_``-prefixed) names are its own: no package (``divjac._core``,
``divjac.jax``, ``divjac.torch``, ``divjac.cli``, ``divjac.models``, and the top-level modules of
``divjac``) imports another's, and within a package at most :data:`MAX_PRIVATE_IMPORTS` private
names are imported by another module (a name that other modules need is that module's public
name, or the two modules are one concept). A module's length is not capped: a long module is
fine when it is one concept. Run alone: ``python -m pytest tests/test_layout.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

MAX_PRIVATE_IMPORTS = 21
"""The most distinct private names (module, name) that other modules of ``src/divjac`` import;
lower it as names become public or modules merge, never raise it."""


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


def _package(module: str) -> str:
    """The package a module belongs to for :func:`private_imports`: ``divjac._core``,
    ``divjac.jax``, ... (a subpackage of ``divjac`` with its own subpackages), or ``divjac`` for
    the top-level modules."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module in _PACKAGES else parts[0]


_PACKAGES = {name for name, path in _modules().items() if path.name == "__init__.py"}


def private_imports(sources: dict[str, str]) -> set[tuple[str, str, str]]:
    """``(importer, module, name)`` for every private name (``_x``, not a dunder, not a
    submodule) that a module of ``sources`` (module name -> its source) imports from another;
    relative imports resolved as in :func:`import_graph` (a module named ``pkg`` or
    ``pkg.__init__`` is a package)."""
    found: set[tuple[str, str, str]] = set()
    for name, text in sources.items():
        is_package = name in _PACKAGES or name.endswith(".__init__")
        name = name.removesuffix(".__init__")
        package = name if is_package else name.rpartition(".")[0]
        for node in _all_imports(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "divjac":
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{base}.{alias.name}" not in sources and base != name:
                    found.add((name, base, alias.name))
    return found


def _sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in _modules().items()}


def _cross_package(found: set[tuple[str, str, str]]) -> list[str]:
    return sorted(
        f"{importer} imports {module}.{name}"
        for importer, module, name in found
        if _package(importer) != _package(module)
    )


def test_no_private_name_is_imported_across_packages():
    crossing = _cross_package(private_imports(_sources()))
    assert not crossing, "private names imported across packages: " + "; ".join(crossing)


def test_few_private_names_are_imported_across_modules():
    names = sorted({f"{module}.{name}" for _, module, name in private_imports(_sources())})
    assert len(names) <= MAX_PRIVATE_IMPORTS, (
        f"{len(names)} private names imported by other modules (at most "
        f"{MAX_PRIVATE_IMPORTS}): make a name other modules need public in its module, or "
        "merge modules that share their private names: " + ", ".join(names)
    )


def test_the_private_import_rule_catches_violations():
    sources = {
        "divjac._core.plan": "def _fit(): ...\ndef fit(): ...\n",
        "divjac._core.checks": "from .plan import _fit, fit\n",
        "divjac.jax._backend": "def f():\n    from .._core.plan import _fit\n",
        "divjac.jax._api": "from . import _backend\nfrom ._backend import __all__\n",
        "divjac._call": "from divjac._core.plan import _fit\n",
    }
    found = private_imports(sources)
    assert found == {
        ("divjac._core.checks", "divjac._core.plan", "_fit"),
        ("divjac.jax._backend", "divjac._core.plan", "_fit"),
        ("divjac._call", "divjac._core.plan", "_fit"),
    }
    assert _cross_package(found) == [
        "divjac._call imports divjac._core.plan._fit",
        "divjac.jax._backend imports divjac._core.plan._fit",
    ]


def environment_reads(sources: dict[str, str]) -> list[str]:
    """The modules of ``sources`` that read the environment (name ``os.environ``,
    ``os.getenv`` or ``environ``/``getenv`` imported from ``os``)."""
    found = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            attribute = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
            imported = isinstance(node, ast.ImportFrom) and node.module == "os"
            if attribute or (
                imported and {a.name for a in node.names} & {"environ", "getenv"}  # type: ignore[union-attr]
            ):
                found.append(name)
                break
    return found


def test_the_environment_is_read_in_one_module():
    """``DIVJAC_*`` variables are read in :mod:`divjac._core.settings` alone, which documents
    them (the benchmarks of ``divjac.cli.bench`` read their own)."""
    sources = {
        name: text for name, text in _sources().items() if not name.startswith("divjac.cli.bench")
    }
    assert environment_reads(sources) == ["divjac._core.settings"]
    assert environment_reads({"a": "import os\nx = os.environ.get('A')\n"}) == ["a"]
    assert environment_reads({"a": "from os import getenv\n"}) == ["a"]


def test_the_transforms_sit_above_the_backend_interface():
    graph = import_graph(deferred=False)
    for backend in ("divjac.jax._backend", "divjac.torch._backend"):
        assert "divjac._backend" in graph[backend]
        assert not reachable(graph, backend) & {
            "divjac._call",
            "divjac._transforms",
            "divjac._divergence",
        }
    assert graph["divjac._backend"] <= {"divjac._core.detection", "divjac._core.plan"}
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
