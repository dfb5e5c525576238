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
private attributes of torch objects reached through values (a tensor's ``_version``, a module's
``_parameters``), docstrings and comments.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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


def private_torch_names(source: str) -> list[str]:
    """Every private torch name ``source`` uses (see the module's docstring), in order."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the torch path it is bound to
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
        ("import torch\ngetattr(torch, 'x')._y", []),  # a value's attribute: not checked
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
