"""What torch's inductor is known to crash the process on, refused ahead of its compilation.

On torch 2.13's CPU inductor, the compiled second-order code (``vmap`` of ``jvp`` of ``jvp``:
a Laplacian's sweep under ``torch.compile``) of a function that multiplies or divides a value
that depends on the input by a tensor that needs no gradient (an argument ``t``, a global, a
constant, a detached tensor; whatever its shape) dies with a segmentation fault in inductor's
generated code, before any Python error. It is torch's: plain ``torch.compile`` of
``vmap(jvp(jvp(lambda z: torch.tanh(z * t).sum(1))))`` crashes the same way; first-order code,
a product with a parameter, ``backend="aot_eager"`` and torch 2.14.1 do not.
"""

from __future__ import annotations

import torch
import torch.fx

from .._backend import Point
from .._errors import CompileError
from ._aten import inexact
from ._compat import compiler_name, pytree, release
from ._traced import Traced

__all__ = ["refuse_crashing_sweep"]

# The torch release whose inductor compiles these products.
_FIXED = (2, 14)
_PRODUCTS = (torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor)
# Operations whose value depends on their input's shape alone.
_SHAPED = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("full_like", "zeros_like", "ones_like", "empty_like", "new_full", "new_zeros")
)


def refuse_crashing_sweep(point: Point[Traced], fname: str) -> None:
    """:class:`CompileError` where the call's second-order sweep, about to be compiled by
    inductor on a torch older than 2.14, runs such a product (see the module docstring),
    naming the ways out. Raised in the setup ahead of dynamo's trace, which propagates it
    (wrapped) with or without ``fullgraph``: raised in its trace, without ``fullgraph`` dynamo
    broke the graph there and compiled the passes' own frames, and crashed."""
    if release() >= _FIXED or compiler_name() != "inductor":
        return
    node = _grad_free_product(point)
    if node is None:
        return
    raise CompileError(
        f"{fname}: the function multiplies or divides a value that depends on x by a tensor "
        f"that needs no gradient ({node.target}): torch {torch.__version__}'s inductor "
        "crashes the process (a segmentation fault) on the compiled second-order code of such "
        "a product (a hand-written vmap(jvp(jvp(f))) too; torch 2.14.1 compiles it). Compile "
        "with backend='aot_eager', compute the Laplacian outside the compiled region, or "
        "upgrade torch (docs/scaling.md)."
    )


def _grad_free_product(point: Point[Traced]) -> torch.fx.Node | None:
    """The first product of the call's trace of an ``x``-dependent value by a floating-point
    tensor that does not depend on ``x`` and needs no gradient, if any."""
    traced = point.traced
    gm = traced.gm
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    tensors = [
        a for a in pytree.tree_leaves((point.args, point.kwargs)) if isinstance(a, torch.Tensor)
    ]
    dependent = {placeholders[traced.x_pos]}
    grad: dict[torch.fx.Node, bool] = {}
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "placeholder":
            i = placeholders.index(node)
            grad[node] = i < len(tensors) and tensors[i].requires_grad
        elif node.op == "get_attr":
            ref = traced.dropped.get(str(node.target))
            value = ref() if ref is not None else getattr(gm, str(node.target), None)
            grad[node] = isinstance(value, torch.Tensor) and value.requires_grad
        else:
            grad[node] = any(grad.get(a, False) for a in inputs)
            if node.target in _SHAPED or not any(a in dependent for a in inputs):
                continue
            dependent.add(node)
            if node.target in _PRODUCTS:
                for a in node.args[:2]:
                    if (
                        isinstance(a, torch.fx.Node)
                        and a not in dependent
                        and not grad[a]
                        and isinstance(a.meta.get("val"), torch.Tensor)
                        and inexact(a.meta["val"])
                    ):
                        return node
    return None
