"""Sparsity rules users give their own operations (``divjac.torch.register_rule``), and
element-wise operations added to the op-fact table (``register_elementwise``)."""

from __future__ import annotations

from .._core import rules as D
from .._core.rules import Rule, RuleError
from ._compat import OpOverload, has_operator, op_schema, operator_name
from ._detect import CACHE, clear_memos
from ._interpret import REGISTRY, decompositions
from ._ops import Derivatives, add_elementwise

__all__ = ["register_elementwise", "register_rule"]


def register_rule(op: object, rule: Rule, /) -> None:
    """Give an ATen operation (or a custom operator of ``torch.library``) a sparsity rule.

    The rule receives an :class:`divjac.rules.Op`: the dependency sets of the operation's tensor
    arguments in the order of its schema (``op.ins``), the shapes of its outputs
    (``op.out_shapes``), its other arguments by schema name (``op.params``) and the constant
    values of its tensor arguments (``op.value(i)``); it returns the dependency sets of every
    output, built with the functions of :mod:`divjac.rules`. It replaces any built-in rule and
    keeps the operation from being decomposed while tracing; the traces and detections made
    before are dropped.

    Args:
        op: the operator (``torch.ops.mylib.myop``, one of its overloads, or what
            ``torch.library.custom_op`` returns) or its name (``"mylib::myop"``; a bare name
            is an ATen operation).
        rule: ``Op -> list[Deps]``; it may over-approximate, it must never miss a dependency.

    Returns:
        Nothing; every later detection uses the rule.

    Raises:
        RuleError: ``op`` is not an operator, or names none that torch has registered (a
            misspelled name would give a rule that is never used), or ``rule`` is not callable
            (later: it returned what does not fit).

    Example:
        >>> import torch
        >>> import divjac.torch as dt
        >>> from divjac import rules
        >>> @torch.library.custom_op("divjac_example::flip", mutates_args=())
        ... def flip(x: torch.Tensor) -> torch.Tensor:
        ...     return torch.flip(x, [-1])
        >>> @flip.register_fake
        ... def _(x):
        ...     return torch.empty_like(x)
        >>> dt.register_rule(flip, lambda op: [rules.rev(op.ins[0], [len(op.ins[0].shape) - 1])])
        >>> pattern = dt.sparsity(lambda x: torch.sin(flip(x)))(torch.ones(2, 3))
        >>> pattern.csr.toarray().astype(int)
        array([[0, 0, 1],
               [0, 1, 0],
               [1, 0, 0]])
    """
    name: object
    if isinstance(op, str):
        name = op if "::" in op else f"aten::{op}"
    elif isinstance(op, OpOverload):
        name = op_schema(op).name
    else:  # an OpOverloadPacket, or what torch.library.custom_op returns
        name = operator_name(op)
    if not isinstance(name, str):
        raise RuleError(
            f"register_rule: op must be a torch operator (torch.ops.mylib.myop, an overload of "
            f"it, a torch.library.custom_op) or its name 'mylib::myop', got {op!r}"
        )
    if not has_operator(name):
        raise RuleError(
            f"register_rule: torch has no operator named {name!r}, so the rule would never be "
            "used. Check the spelling (a bare name is an ATen operation: 'sin' is "
            "'aten::sin'), and register a custom operator's rule after defining it "
            "(torch.library.custom_op), or pass the operator itself."
        )
    REGISTRY.register(name, rule)
    decompositions.cache_clear()
    CACHE.clear()
    clear_memos()


def register_elementwise(op: OpOverload, derivatives: Derivatives | None = None, /) -> None:
    """Make the operator overload ``op`` an element-wise one: one entry of the op-fact table
    :mod:`divjac.torch._ops`, read by detection, the Taylor sweep (by ``derivatives``, its
    ``(g', g'')``; ``None``: by ``torch.func``) and the sparse sweep alike (the traces and
    detections made before are dropped)."""
    add_elementwise(op, derivatives)
    register_rule(op, D.elementwise_rule)
