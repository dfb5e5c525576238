"""PyTorch's private names are read in one module of divjac: ``divjac/torch/_compat.py``.

The rule: no module of ``src/divjac`` other than ``divjac/torch/_compat.py`` names a private
part of torch's namespace. A name is a dotted path rooted at the ``torch`` package, found

- in imports (``import torch._dynamo``, ``from torch.utils import _pytree``,
  ``from torch._ops import OpOverload``),
- in attribute chains of the code, resolved through what the module imported from torch
  (``torch._C._functorch.peek_interpreter_stack``; ``nn.modules.batchnorm._BatchNorm`` after
  ``from torch import nn``; ``F._x`` after ``import torch.nn.functional as F``),
- in the text of string constants other than docstrings (``sys.modules.get("torch._dynamo")``);

and it is private when a part after ``torch`` starts with one underscore (``_dynamo``, ``_C``,
``_pytree``; dunders such as ``__version__`` are public) or is ``fx.experimental`` (``make_fx``
and its tracer, experimental by name). Not names of torch's namespace, so not checked: ATen
operator names under ``torch.ops`` (``torch.ops.aten._softmax``, the vocabulary of the graphs
divjac reads, not Python API), divjac's own modules (``divjac.torch._taylor``, relative imports),
docstrings and comments.

Private attributes of torch's objects are read in the seam alone too (a tensor's ``_version``,
an operator's ``_schema``, a module's ``_parameters``, a recurrent layer's ``_flat_weights``):
:func:`private_torch_attributes` finds them by name, among the private attributes this torch
defines on the objects divjac handles (:data:`PRIVATE_ATTRIBUTES`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn
from torch._library.custom_ops import CustomOpDef

SRC = Path(__file__).resolve().parents[2] / "src"
SEAM = SRC / "divjac" / "torch" / "_compat.py"

_TEXT = re.compile(r"(?<![\w.])torch(?:\.\w+)+")


def _private(path: str) -> bool:
    """Whether the dotted ``path`` (rooted at ``torch``) names a private part of torch."""
    parts = path.split(".")
    if parts[0] != "torch" or parts[1:2] == ["ops"]:
        return False
    if "fx.experimental" in ".".join(parts[1:3]):
        return True
    return any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _in_torch(module: str | None) -> bool:
    return module is not None and module.split(".")[0] == "torch"


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants of the module, its classes and functions."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    """The root name and attributes of ``a.b.c`` (``None`` unless rooted at a plain name)."""
    attrs: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        attrs.append(current.attr)
        current = current.value
    return (current.id, attrs[::-1]) if isinstance(current, ast.Name) else None


def _bindings(tree: ast.Module) -> tuple[dict[str, str], list[str]]:
    """The local names bound to torch paths by the imports of ``tree`` (name -> path), and the
    paths imported."""
    bound: dict[str, str] = {}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _in_torch(alias.name):
                    found.append(alias.name)
                    bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and _in_torch(node.module):
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                found.append(path)
                bound[alias.asname or alias.name] = path
    return bound, found


def private_torch_names(source: str) -> list[str]:
    """Every private torch name ``source`` uses (see the module's docstring), in order."""
    tree = ast.parse(source)
    bound, found = _bindings(tree)
    docstrings = _docstrings(tree)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # whole chains only
            chain = _chain(node)
            if chain is not None and chain[0] in bound:
                found.append(".".join([bound[chain[0]], *chain[1]]))
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            found += _TEXT.findall(node.value) if isinstance(node.value, str) else []
    return list(dict.fromkeys(p for p in found if _private(p)))


def _samples() -> list[Any]:
    """The torch objects divjac handles: tensors, parameters, modules (a recurrent one too),
    operators and their schemas, graphs, generators, and the classes it wraps or subclasses."""
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    graph.output(node)
    return [
        torch.zeros(1),
        nn.Parameter(torch.zeros(1)),
        nn.Linear(1, 1),
        nn.LSTM(1, 1),
        torch.ops.aten.add,
        torch.ops.aten.add.Tensor,
        torch.ops.aten.add.Tensor._schema,
        torch.ops.higher_order.cond,
        torch.Generator(),
        graph,
        node,
        torch.fx.GraphModule(nn.Module(), graph),
        torch.fx.Interpreter,
        torch.autograd.Function,
        nn.parallel.DistributedDataParallel,
        CustomOpDef,
    ]


PRIVATE_ATTRIBUTES = frozenset(
    name
    for sample in _samples()
    for name in [*dir(sample), *getattr(sample, "__annotations__", {})]
    if name.startswith("_") and not name.startswith("__")
)
"""The private attributes (``_x``, not dunders) that this torch defines on the objects of
:func:`_samples` (instance attributes included, and a class's annotated ones)."""

_ATTRIBUTE_READERS = frozenset({"getattr", "hasattr", "setattr", "delattr", "attrgetter"})


def _resolve(node: ast.expr, bound: Mapping[str, str]) -> str | None:
    """The dotted torch path of the expression ``node`` (``None`` if not one)."""
    chain = _chain(node) if isinstance(node, ast.Attribute) else None
    if isinstance(node, ast.Name):
        chain = (node.id, [])
    if chain is None or chain[0] not in bound:
        return None
    return ".".join([bound[chain[0]], *chain[1]])


def private_torch_attributes(
    source: str, private: frozenset[str] = PRIVATE_ATTRIBUTES
) -> list[str]:
    """Every private attribute of a torch object that ``source`` reads or writes, in order:

    - ``value._x`` with ``_x`` in ``private``, on any value but divjac's own objects (``self``
      and ``cls`` in a class with no torch base) and operator namespaces (``aten._softmax``
      after ``aten = torch.ops.aten``: ATen operators, the graphs' vocabulary);
    - a string naming an attribute in a call of ``getattr``, ``hasattr``, ``setattr``,
      ``delattr`` or ``operator.attrgetter``, when it starts with one underscore;
    - any other string equal to a name in ``private`` (an attribute read later by name), but
      docstrings, ``__slots__`` (divjac's own attributes) and ATen operator names.
    """
    tree = ast.parse(source)
    bound = dict(_bindings(tree)[0])
    for node in tree.body:  # aten = torch.ops.aten
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, path = node.targets[0], _resolve(node.value, bound)
            if isinstance(target, ast.Name) and path is not None:
                bound[target.id] = path
    own: set[int] = set()  # self._x / cls._x in divjac's own classes
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if not any(_resolve(base, bound) for base in cls.bases):
            own |= {
                id(n)
                for n in ast.walk(cls)
                if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id in ("self", "cls")
            }
    skipped = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            skipped |= {id(n) for n in ast.walk(node.value)}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private and id(node) not in own:
            path = _resolve(node.value, bound)
            if path is None or not path.startswith("torch.ops"):
                found.append(node.attr)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in _ATTRIBUTE_READERS:
                args = node.args if name == "attrgetter" else node.args[1:2]
                for arg in args:
                    skipped.add(id(arg))
                    if isinstance(arg, ast.Constant) and _single_underscore(arg.value):
                        found.append(arg.value)
        elif (
            isinstance(node, ast.Constant)
            and id(node) not in skipped
            and node.value in private
            and not hasattr(torch.ops.aten, node.value)
        ):
            found.append(node.value)
    return list(dict.fromkeys(found))


def _single_underscore(value: object) -> bool:
    return isinstance(value, str) and value.startswith("_") and not value.startswith("__")


def _modules() -> list[Path]:
    return sorted((SRC / "divjac").rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_private_torch_name_outside_the_seam(path):
    if path == SEAM:
        return
    names = private_torch_names(path.read_text())
    assert not names, (
        f"{path.relative_to(SRC)} uses private torch API {names}: reach it through an accessor "
        f"of divjac/torch/_compat.py (the one module that holds torch's version branches)"
    )


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_private_torch_attribute_outside_the_seam(path):
    if path == SEAM:
        return
    names = private_torch_attributes(path.read_text())
    assert not names, (
        f"{path.relative_to(SRC)} reads private attributes of torch objects {names}: reach "
        f"them through an accessor of divjac/torch/_compat.py (version_counter, op_schema, "
        f"module_dicts, ...)"
    )


def test_the_seam_reads_the_private_attributes():
    assert {"_version", "_schema", "_parameters", "_flat_weights", "_qualified_op_name"} <= (
        PRIVATE_ATTRIBUTES
    )
    assert {"_version", "_schema", "_flat_weights", "_qualname"} <= set(
        private_torch_attributes(SEAM.read_text())
    )


@pytest.mark.parametrize(
    ("source", "names"),
    [
        ("def f(t):\n    return t._version", ["_version"]),
        ("def f(node):\n    return node.target._schema.name", ["_schema"]),
        ("def f(m):\n    m._parameters.clear()", ["_parameters"]),
        ("def f(m):\n    m._buffers = {}", ["_buffers"]),
        ("CACHE = frozenset({'_flat_weights'})", ["_flat_weights"]),
        ("def f(op):\n    return getattr(op, '_qualname', None)", ["_qualname"]),
        ("import operator\nget = operator.attrgetter('_anything')", ["_anything"]),
        (
            "import torch\nclass V(torch.fx.Interpreter):\n    def f(self):\n        self._version",
            ["_version"],
        ),
        # divjac's own attributes, and what is no attribute of a torch object
        ("class C:\n    __slots__ = ('_modules',)\n    def f(self):\n        self._modules", []),
        ("class C:\n    @classmethod\n    def f(cls):\n        return cls._version", []),
        ("import torch\naten = torch.ops.aten\naten._to_copy.default, torch.ops.aten._softmax", []),
        ("NAMES = ['_to_copy', '_softmax']", []),
        ("from . import arithmetic\narithmetic._RULES", []),
        ('"""Reads a tensor\'s ``_version``."""', []),
        ("getattr(f, '__qualname__')", []),
    ],
)
def test_the_attribute_rule_finds_private_attributes_and_only_them(source, names):
    assert private_torch_attributes(source) == names


def test_the_seam_is_where_the_private_names_are():
    names = private_torch_names(SEAM.read_text())
    assert {"torch._C._functorch.peek_interpreter_stack", "torch.utils._pytree"} <= set(names)


@pytest.mark.parametrize(
    ("source", "names"),
    [
        ("import torch\ntorch._C._functorch.is_functorch_wrapped_tensor(t)", ["torch._C"]),
        ("import torch._dynamo", ["torch._dynamo"]),
        ("from torch.utils import _pytree as pytree", ["torch.utils._pytree"]),
        ("from torch._ops import OpOverload", ["torch._ops.OpOverload"]),
        ("from torch import nn\nnn.modules.batchnorm._BatchNorm", ["torch.nn.modules"]),
        ("import torch.nn.functional as F\nF._canonical_mask(m)", ["torch.nn.functional._canon"]),
        ("def f():\n    from torch.fx.experimental.proxy_tensor import make_fx", ["torch.fx.exp"]),
        ("import sys\nsys.modules.get('torch._dynamo.eval_frame')", ["torch._dynamo.eval_frame"]),
        ("import torch\ngetattr(torch, 'x')._y", []),  # a value's attribute: the next rule
        ("import torch\ntorch.ops.aten._softmax.default", []),
        ("import torch\ntorch.__version__, torch.func.jvp, torch.compiler.is_compiling()", []),
        ("from ...torch._taylor import sweep\nimport divjac.torch._api", []),
        ('"""Reads ``torch._dynamo``."""\nimport torch', []),
        ("x = 'divjac.torch._taylor'", []),
    ],
)
def test_the_rule_finds_private_names_and_only_them(source, names):
    found = private_torch_names(source)
    assert len(found) == len(names)
    assert all(f.startswith(n) for f, n in zip(found, names, strict=True))
