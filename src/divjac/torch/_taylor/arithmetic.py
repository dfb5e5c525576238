"""The rules of the second-order sweep of :mod:`divjac.torch._taylor.sweep`, by ATen operation
(:data:`_RULES`): element-wise functions by their exact first and second derivatives (from the
op-fact table :data:`divjac.torch._ops.DERIVATIVES`: :func:`elementwise_rule`), products
by one contraction over the directions, sums and scalings on the terms (moves of elements are
in :mod:`~divjac.torch._taylor.moves`, softmax, norms and normalizations in
:mod:`~divjac.torch._taylor.reductions`); any other operation by
:func:`~divjac.torch._taylor.generic.generic`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from .._aten import inexact
from .._ops import DERIVATIVES
from .generic import generic
from .jets import (
    Jet,
    Rule,
    Sweep,
    _full,
    _map,
    _scale,
    add,
    folded,
    lift,
    registrar,
)

__all__: list[str] = []

Tensor = torch.Tensor
aten = torch.ops.aten


_RULES: dict[Any, Rule] = {}
_rule = registrar(_RULES)


def elementwise_rule(target: Any) -> Rule | None:
    """The rule of an element-wise function with known derivatives
    (:data:`divjac.torch._ops.DERIVATIVES`), ``None`` for any other operation."""
    derivatives = DERIVATIVES.get(target)
    return None if derivatives is None else _unary(derivatives)


def _unary(derivatives: Callable[..., tuple[Tensor, Tensor | None]]) -> Rule:
    """An element-wise function of its first argument: ``derivatives(x, y, *params)`` gives
    ``g'`` and ``g''`` (``None``: zero) of a real argument (a complex one is pushed by
    :func:`generic`: ``abs`` of it is not holomorphic)."""

    def rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if args[0].is_complex() or any(isinstance(a, torch.fx.Node) for a in node.args[1:]):
            return generic(sw, node, args, kwargs)
        x = args[0]
        y = node.target(*args, **kwargs)  # type: ignore[operator]
        a = sw.needed(node.args[0])
        g1, g2 = derivatives(x, y, *args[1:], **kwargs)
        curvature = None if g2 is None else g2 * sw.quad(a.first, a.first)
        return y, Jet(g1 * a.first, add(_scale(a.second, g1), curvature))

    return rule


@_rule(aten.add.Tensor, aten.sub.Tensor)
def _add_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    sign = -alpha if node.target is aten.sub.Tensor else alpha
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    n = y.ndim
    first = add(
        None if a is None else lift(a.first, n), None if b is None else lift(b.first, n) * sign
    )
    second = add(
        None if a is None else lift(a.second, n),
        None if b is None else _scale(lift(b.second, n), sign),
    )
    return y, Jet(first, second)  # type: ignore[arg-type]


@_rule(aten.mul.Tensor)
def _mul_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[0], args[1]
    y = x * z
    n = y.ndim
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    a1 = None if a is None else lift(a.first, n)
    b1 = None if b is None else lift(b.first, n)
    first = add(_scale(a1, z), _scale(b1, x))
    second = add(
        None if a is None else _scale(lift(a.second, n), z),
        None if b is None else _scale(lift(b.second, n), x),
        None if a1 is None or b1 is None else 2 * sw.quad(a1, b1),
    )
    return y, Jet(first, second)  # type: ignore[arg-type]


@_rule(aten.logaddexp.default, aten.logaddexp2.default)
def _logaddexp_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x, z = args[0], args[1]
    if x.is_complex() or z.is_complex():
        return generic(sw, node, args, kwargs)
    y = node.target(x, z)  # type: ignore[operator]
    n = y.ndim
    # y' = s x' + (1 - s) z' with s = sigmoid(c (x - z)), y'' = s x'' + (1 - s) z''
    # + c s (1 - s) (x' - z')^2 (c = 1, or log 2 in base 2). At x = z, s = 1/2, infinities
    # included: where both are -inf (a masked entry) the tangents are zero and so is y'.
    c = 1.0 if node.target is aten.logaddexp.default else math.log(2.0)
    s = torch.sigmoid(c * torch.where(x == z, 0.0, x - z))
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    a1 = None if a is None else lift(a.first, n)
    b1 = None if b is None else lift(b.first, n)
    diff = add(a1, _scale(b1, -1))
    first = add(_scale(a1, s), _scale(b1, 1 - s))
    second = add(
        None if a is None else _scale(lift(a.second, n), s),
        None if b is None else _scale(lift(b.second, n), 1 - s),
        c * s * (1 - s) * sw.quad(diff, diff),  # type: ignore[arg-type]
    )
    return y, Jet(first, second)  # type: ignore[arg-type]


def _prefix_average(x: Tensor, y: Tensor, t: Tensor, axis: int) -> Tensor:
    """``sum_{j <= i} exp(x_j - y_i) t_j`` along ``axis`` of terms ``t`` ``[K, *s]``, where
    ``y = logcumsumexp(x)``: in the log domain, the positive and negative parts of ``t``
    apart (as torch's backward of ``logcumsumexp``; its forward derivative normalizes by the
    maximum of the whole axis and adds ``1e-13``, off by ~1e-6 before a large entry). The
    logarithms are taken where they are finite, so that gradients through them are too."""
    y = torch.where(torch.isneginf(y), 0.0, y)  # an empty prefix (all -inf) has zero weights

    def part(mask: Tensor, magnitude: Tensor) -> Tensor:
        log = torch.where(mask, torch.log(torch.where(mask, magnitude, 1.0)), -torch.inf)
        return torch.exp(torch.logcumsumexp(x + log, axis) - y)

    return part(t > 0, t) - part(t < 0, -t)


@_rule(aten.logcumsumexp.default)
def _logcumsumexp_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    if x.is_complex() or x.ndim == 0:
        return generic(sw, node, args, kwargs)
    axis = int(args[1] if len(args) > 1 else kwargs["dim"]) % x.ndim + 1
    a = sw.needed(node.args[0])
    # y_i = log sum_{j <= i} exp(x_j): y' = P x', y'' = P x'' + P (x')^2 - (y')^2 with
    # P the prefix average of weights exp(x_j - y_i).
    a1 = _full(a.first, tuple(x.shape))
    first = _prefix_average(x, y, a1, axis)
    curvature = sw.weighted(_prefix_average(x, y, a1 * a1, axis) - first * first)
    if a.second is not None:
        curvature = curvature + _prefix_average(x, y, _full(a.second, tuple(x.shape)), axis)
    return y, Jet(first, curvature)


@_rule(aten.div.Tensor)
def _div_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[0], args[1]
    y = x / z
    n = y.ndim
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    if b is None:
        return y, _map(sw.needed(node.args[0]), lambda t: lift(t, n) / z)
    # y = x / z: y' = (x' - y z') / z, y'' = (x'' - y z'' - 2 y' z') / z
    b1 = lift(b.first, n)
    num1 = add(None if a is None else lift(a.first, n), -y * b1)
    first = num1 / z
    num2 = add(
        None if a is None else lift(a.second, n),
        _scale(lift(b.second, n), -y),
        -2 * sw.quad(first, b1),
    )
    return y, Jet(first, num2 / z)


@_rule(aten.mul.Scalar, aten.div.Scalar, aten.neg.default)
def _scalar_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    return y, _map(a, lambda t: node.target(t, *args[1:], **kwargs))  # type: ignore[operator]


@_rule(aten.rsub.Scalar)
def _reflected_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """A number minus the value (``1 - h``: ``c - alpha h``): the terms times ``-alpha``."""
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    return y, _map(a, lambda t: t * -alpha)


@_rule(aten.add.Scalar, aten.sub.Scalar, aten.clone.default, aten.alias.default)
def _shifted_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    return node.target(*args, **kwargs), sw.jet(node.args[0])  # type: ignore[operator]


@_rule(aten.detach.default)
def _detach_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    return args[0].detach(), None


@_rule(aten._to_copy.default)
def _to_copy_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.jet(node.args[0])
    if not inexact(y) or a is None:
        return y, None
    return y, _map(a, lambda t: t.to(dtype=y.dtype, device=y.device))


@_rule(aten.copy.default)
def _copy_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # copy(self, src): src's values in self's shape and dtype (the functional form of copy_,
    # in circular padding and in-place writes; torch has no forward derivative for it).
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    b = sw.jet(node.args[1])
    if b is None or not inexact(y):
        return y, None
    return y, _map(b, lambda t: lift(t, y.ndim).to(y.dtype))


@_rule(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default)
def _sum_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    dims_arg = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if dims_arg is None or len(dims_arg) == 0:
        dims = list(range(x.ndim))
    else:  # a 0-d value has no axis to reduce (its dimension 0 or -1 is itself)
        dims = [int(d) % x.ndim for d in dims_arg] if x.ndim else []
    axes = [d + 1 for d in dims]
    mean = node.target is aten.mean.dim

    def reduce(t: Tensor) -> Tensor:
        t = _full(t, tuple(x.shape))
        if not axes:
            return t
        r = t.mean(axes, keepdim=keepdim) if mean else t.sum(axes, keepdim=keepdim)
        return r.to(y.dtype)

    return y, _map(a, reduce)


def _matmul(sw: Sweep, x: Tensor, z: Tensor, a: Jet | None, b: Jet | None, y: Tensor) -> Jet:
    """The jet of ``y = x @ z`` (``mm``, ``bmm``)."""
    n = y.ndim
    a1 = None if a is None else lift(a.first, n)
    b1 = None if b is None else _full(b.first, tuple(z.shape))
    if a1 is not None and a1.shape[-1] != x.shape[-1]:
        a1 = _full(a1, tuple(x.shape))
    first = add(
        None if a1 is None else torch.matmul(a1, z), None if b1 is None else torch.matmul(x, b1)
    )
    second = add(
        None if a is None or a.second is None else torch.matmul(_full(a.second, x.shape), z),
        None if b is None or b.second is None else torch.matmul(x, _full(b.second, z.shape)),
        None if a1 is None or b1 is None else 2 * _matmul_quad(sw, _full(a1, x.shape), b1),
    )
    return Jet(first, second)  # type: ignore[arg-type]


def _matmul_quad(sw: Sweep, a: Tensor, b: Tensor) -> Tensor:
    """``sum_k w_k a_k @ b_k`` as one contraction over ``k`` and the inner axis."""
    if sw.per_direction:
        return torch.matmul(a, b)
    if sw.w is not None:
        a = a * sw.w.reshape(sw.k, *([1] * (a.ndim - 1)))
    k, m = a.shape[0], a.shape[-1]
    lead = tuple(a.shape[1:-2])
    # [K, *lead, n, m] -> [*lead, n, K*m] and [K, *lead, m, p] -> [*lead, K*m, p]
    nd = a.ndim
    order = (*range(1, nd - 1), 0, nd - 1)
    left = a.permute(order).reshape(*lead, a.shape[-2], k * m)
    right = b.permute(*range(1, nd - 2), 0, nd - 2, nd - 1).reshape(*lead, k * m, b.shape[-1])
    return torch.matmul(left, right)[None]


@_rule(aten.mm.default, aten.bmm.default)
def _mm_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[0], args[1]
    y = node.target(x, z)  # type: ignore[operator]
    return y, _matmul(sw, x, z, sw.jet(node.args[0]), sw.jet(node.args[1]), y)


@_rule(aten.mv.default)
def _mv_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # x @ z with z a vector: the product with z as a column (pushed by torch.func otherwise,
    # jvp of jvp per direction: 65% of a pair potential's sparse sweep).
    x, z = args[0], args[1]
    y = node.target(x, z)  # type: ignore[operator]
    b = sw.jet(node.args[1])
    column = None if b is None else _map(b, lambda t: lift(t, 1).unsqueeze(-1))
    jet = _matmul(sw, x, z.unsqueeze(-1), sw.jet(node.args[0]), column, y.unsqueeze(-1))
    return y, _map(jet, lambda t: t.squeeze(-1))


@_rule(aten.addmm.default, aten.baddbmm.default)
def _addmm_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[1], args[2]
    beta = kwargs.get("beta", 1)
    alpha = kwargs.get("alpha", 1)
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a, b, cj = sw.jet(node.args[1]), sw.jet(node.args[2]), sw.jet(node.args[0])
    terms = []
    if a is not None or b is not None:  # the product depends on the input
        prod = _matmul(sw, x, z, a, b, y)
        terms.append(_map(prod, lambda t: t * alpha) if alpha != 1 else prod)
    if cj is not None:
        terms.append(Jet(lift(cj.first, y.ndim) * beta, _scale(lift(cj.second, y.ndim), beta)))
    first = add(*(t.first for t in terms))
    return y, Jet(first, add(*(t.second for t in terms)))  # type: ignore[arg-type]


@_rule(aten.convolution.default)
def _conv_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if any(isinstance(a, torch.fx.Node) and a in sw.jets for a in node.args[1:]):
        return generic(sw, node, args, kwargs)
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])

    def conv(t: Tensor) -> Tensor:
        return node.target(t, args[1], None, *args[3:])  # type: ignore[operator]

    return y, _map(a, lambda t: folded(t, x.shape, conv))
