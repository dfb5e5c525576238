"""The rules of the second-order sweep of :mod:`divjac.torch._taylor`, by ATen operation
(:data:`_RULES`): element-wise functions by their exact first and second derivatives, products
by one contraction over the directions, linear operations on the terms; any other operation by
:func:`~divjac.torch._taylor_generic._generic`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from .._errors import OptionError
from ._aten import inexact, located, storage_positions
from ._kernels import _without_overlap
from ._taylor_generic import _generic
from ._taylor_jets import Rule, _add, _full, _Jet, _lift, _map, _scale, _Sweep

__all__: list[str] = []

Tensor = torch.Tensor
aten = torch.ops.aten


_RULES: dict[Any, Rule] = {}


def _rule(*targets: Any) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for t in targets:
            _RULES[t] = fn
        return fn

    return register


def _unary(derivatives: Callable[..., tuple[Tensor, Tensor | None]]) -> Rule:
    """An element-wise function of its first argument: ``derivatives(x, y, *params)`` gives
    ``g'`` and ``g''`` (``None``: zero) of a real argument (a complex one is pushed by
    :func:`_generic`: ``abs`` of it is not holomorphic)."""

    def rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if args[0].is_complex() or any(isinstance(a, torch.fx.Node) for a in node.args[1:]):
            return _generic(sw, node, args, kwargs)
        x = args[0]
        y = node.target(*args, **kwargs)  # type: ignore[operator]
        a = sw.needed(node.args[0])
        g1, g2 = derivatives(x, y, *args[1:], **kwargs)
        curvature = None if g2 is None else g2 * sw.quad(a.first, a.first)
        return y, _Jet(g1 * a.first, _add(_scale(a.second, g1), curvature))

    return rule


def _softplus(x: Tensor, y: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Any:
    s = torch.sigmoid(beta * x)
    linear = beta * x > threshold
    return torch.where(linear, 1.0, s), torch.where(linear, 0.0, beta * (s - s * s))


def _silu(x: Tensor, y: Tensor) -> Any:
    s = torch.sigmoid(x)
    ds = s - s * s
    return s + x * ds, ds * (2 + x - 2 * x * s)


def _pow(x: Tensor, y: Tensor, p: float) -> Any:
    if p == 0:
        return torch.zeros_like(x), None
    if p == 1:
        return torch.ones_like(x), None
    if p == 2:
        return 2 * x, 2 * torch.ones_like(x)
    return p * x ** (p - 1), p * (p - 1) * x ** (p - 2)


def _tanh(x: Tensor, y: Tensor) -> Any:
    d = torch.rsub(y * y, 1)
    return d, -2 * y * d


def _sigmoid(x: Tensor, y: Tensor) -> Any:
    d = y - y * y
    return d, d - 2 * y * d


def _log(x: Tensor, y: Tensor) -> Any:
    d = torch.reciprocal(x)
    return d, -d * d


def _log1p(x: Tensor, y: Tensor) -> Any:
    d = torch.reciprocal(x + 1)
    return d, -d * d


def _sqrt(x: Tensor, y: Tensor) -> Any:
    d = 0.5 * torch.reciprocal(y)
    return d, -d * d / y


def _rsqrt(x: Tensor, y: Tensor) -> Any:
    y3 = y * y * y
    return -0.5 * y3, 0.75 * y3 * y * y


def _reciprocal(x: Tensor, y: Tensor) -> Any:
    y2 = y * y
    return -y2, 2 * y2 * y


_UNARY: dict[Any, Callable[..., Any]] = {
    aten.tanh.default: _tanh,
    aten.sigmoid.default: _sigmoid,
    aten.exp.default: lambda x, y: (y, y),
    aten.expm1.default: lambda x, y: (y + 1, y + 1),
    aten.log.default: _log,
    aten.log1p.default: _log1p,
    aten.sin.default: lambda x, y: (torch.cos(x), -y),
    aten.cos.default: lambda x, y: (-torch.sin(x), -y),
    aten.sqrt.default: _sqrt,
    aten.rsqrt.default: _rsqrt,
    aten.reciprocal.default: _reciprocal,
    aten.softplus.default: _softplus,
    aten.silu.default: _silu,
    aten.pow.Tensor_Scalar: _pow,
    aten.relu.default: lambda x, y: ((x > 0).to(x.dtype), None),
    aten.abs.default: lambda x, y: (torch.sgn(x), None),
}
for _op, _d in _UNARY.items():
    _RULES[_op] = _unary(_d)


@_rule(aten.add.Tensor, aten.sub.Tensor)
def _add_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    sign = -alpha if node.target is aten.sub.Tensor else alpha
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    n = y.ndim
    first = _add(
        None if a is None else _lift(a.first, n), None if b is None else _lift(b.first, n) * sign
    )
    second = _add(
        None if a is None else _lift(a.second, n),
        None if b is None else _scale(_lift(b.second, n), sign),
    )
    return y, _Jet(first, second)  # type: ignore[arg-type]


@_rule(aten.mul.Tensor)
def _mul_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[0], args[1]
    y = x * z
    n = y.ndim
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    a1 = None if a is None else _lift(a.first, n)
    b1 = None if b is None else _lift(b.first, n)
    first = _add(_scale(a1, z), _scale(b1, x))
    second = _add(
        None if a is None else _scale(_lift(a.second, n), z),
        None if b is None else _scale(_lift(b.second, n), x),
        None if a1 is None or b1 is None else 2 * sw.quad(a1, b1),
    )
    return y, _Jet(first, second)  # type: ignore[arg-type]


@_rule(aten.logaddexp.default, aten.logaddexp2.default)
def _logaddexp_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x, z = args[0], args[1]
    if x.is_complex() or z.is_complex():
        return _generic(sw, node, args, kwargs)
    y = node.target(x, z)  # type: ignore[operator]
    n = y.ndim
    # y' = s x' + (1 - s) z' with s = sigmoid(c (x - z)), y'' = s x'' + (1 - s) z''
    # + c s (1 - s) (x' - z')^2 (c = 1, or log 2 in base 2). At x = z, s = 1/2, infinities
    # included: where both are -inf (a masked entry) the tangents are zero and so is y'.
    c = 1.0 if node.target is aten.logaddexp.default else math.log(2.0)
    s = torch.sigmoid(c * torch.where(x == z, 0.0, x - z))
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    a1 = None if a is None else _lift(a.first, n)
    b1 = None if b is None else _lift(b.first, n)
    diff = _add(a1, _scale(b1, -1))
    first = _add(_scale(a1, s), _scale(b1, 1 - s))
    second = _add(
        None if a is None else _scale(_lift(a.second, n), s),
        None if b is None else _scale(_lift(b.second, n), 1 - s),
        c * s * (1 - s) * sw.quad(diff, diff),  # type: ignore[arg-type]
    )
    return y, _Jet(first, second)  # type: ignore[arg-type]


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
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    if x.is_complex() or x.ndim == 0:
        return _generic(sw, node, args, kwargs)
    axis = int(args[1] if len(args) > 1 else kwargs["dim"]) % x.ndim + 1
    a = sw.needed(node.args[0])
    # y_i = log sum_{j <= i} exp(x_j): y' = P x', y'' = P x'' + P (x')^2 - (y')^2 with
    # P the prefix average of weights exp(x_j - y_i).
    a1 = _full(a.first, tuple(x.shape))
    first = _prefix_average(x, y, a1, axis)
    curvature = sw.weighted(_prefix_average(x, y, a1 * a1, axis) - first * first)
    if a.second is not None:
        curvature = curvature + _prefix_average(x, y, _full(a.second, tuple(x.shape)), axis)
    return y, _Jet(first, curvature)


@_rule(aten.div.Tensor)
def _div_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[0], args[1]
    y = x / z
    n = y.ndim
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    if b is None:
        return y, _map(sw.needed(node.args[0]), lambda t: _lift(t, n) / z)
    # y = x / z: y' = (x' - y z') / z, y'' = (x'' - y z'' - 2 y' z') / z
    b1 = _lift(b.first, n)
    num1 = _add(None if a is None else _lift(a.first, n), -y * b1)
    first = num1 / z
    num2 = _add(
        None if a is None else _lift(a.second, n),
        _scale(_lift(b.second, n), -y),
        -2 * sw.quad(first, b1),
    )
    return y, _Jet(first, num2 / z)


@_rule(aten.mul.Scalar, aten.div.Scalar, aten.neg.default)
def _scalar_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    return y, _map(a, lambda t: node.target(t, *args[1:], **kwargs))  # type: ignore[operator]


@_rule(aten.rsub.Scalar)
def _reflected_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """A number minus the value (``1 - h``: ``c - alpha h``): the terms times ``-alpha``."""
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
    return y, _map(a, lambda t: t * -alpha)


@_rule(aten.add.Scalar, aten.sub.Scalar, aten.clone.default, aten.alias.default)
def _shifted_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    return node.target(*args, **kwargs), sw.jet(node.args[0])  # type: ignore[operator]


@_rule(aten.detach.default)
def _detach_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    return args[0].detach(), None


@_rule(aten._to_copy.default)
def _to_copy_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.jet(node.args[0])
    if not inexact(y) or a is None:
        return y, None
    return y, _map(a, lambda t: t.to(dtype=y.dtype, device=y.device))


@_rule(aten.copy.default)
def _copy_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # copy(self, src): src's values in self's shape and dtype (the functional form of copy_,
    # in circular padding and in-place writes; torch has no forward derivative for it).
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    b = sw.jet(node.args[1])
    if b is None or not inexact(y):
        return y, None
    return y, _map(b, lambda t: _lift(t, y.ndim).to(y.dtype))


@_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    xs, ys = tuple(x.shape), tuple(y.shape)

    def view(t: Tensor) -> Tensor:
        # Terms constant along the batch axis stay so when the view keeps that axis.
        if (
            xs
            and t.ndim == len(xs) + 1
            and tuple(t.shape[2:]) == xs[1:]
            and t.shape[1] == 1
            and xs[:1] == ys[:1]
        ):
            return t.reshape(t.shape[0], 1, *ys[1:])
        return _full(t, xs).reshape(t.shape[0], *ys)

    return y, _map(a, view)


@_rule(aten.permute.default)
def _permute_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    dims = [0, *(int(d) % max(x.ndim, 1) + 1 for d in args[1])]
    return y, _map(a, lambda t: _lift(t, x.ndim).permute(dims))


@_rule(aten.t.default, aten.transpose.int)
def _transpose_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if x.ndim < 2:
        return y, a
    d0, d1 = (0, 1) if node.target is aten.t.default else (int(args[1]), int(args[2]))
    d0, d1 = d0 % x.ndim + 1, d1 % x.ndim + 1
    return y, _map(a, lambda t: _lift(t, x.ndim).transpose(d0, d1))


@_rule(aten.expand.default)
def _expand_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    return y, _map(a, lambda t: _lift(t, y.ndim))


@_rule(aten.unsqueeze.default)
def _unsqueeze_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    d = int(args[1]) % (x.ndim + 1) + 1
    return y, _map(a, lambda t: _lift(t, x.ndim).unsqueeze(d))


@_rule(aten.select.int, aten.slice.Tensor)
def _along_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """Elements taken along one axis (``u(x)[..., 0]``, ``h[:, 1:3]``): the same taken from
    each direction's terms, one axis further. Terms broadcast along that axis (size one) are
    constant there: taken as they are (``select``: their one element)."""
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if x.ndim == 0:
        return y, a
    dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.ndim
    rest = {k: v for k, v in kwargs.items() if k != "dim"}

    def take(t: Tensor) -> Tensor:
        t = _lift(t, x.ndim)
        if t.shape[dim + 1] == x.shape[dim]:
            return node.target(t, dim + 1, *args[2:], **rest)  # type: ignore[operator]
        return t.select(dim + 1, 0) if node.target is aten.select.int else t

    return y, _map(a, take)


@_rule(aten.squeeze.dim, aten.squeeze.dims)
def _squeeze_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """The axes of one removed from each direction's terms too (one axis further)."""
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    dims = args[1] if isinstance(args[1], list | tuple) else [args[1]]
    gone = [int(d) % x.ndim + 1 for d in dims if x.ndim and x.shape[int(d)] == 1]
    return y, _map(a, lambda t: _lift(t, x.ndim).squeeze(gone))


@_rule(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default)
def _sum_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
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


def _matmul(sw: _Sweep, x: Tensor, z: Tensor, a: _Jet | None, b: _Jet | None, y: Tensor) -> _Jet:
    """The jet of ``y = x @ z`` (``mm``, ``bmm``)."""
    n = y.ndim
    a1 = None if a is None else _lift(a.first, n)
    b1 = None if b is None else _full(b.first, tuple(z.shape))
    if a1 is not None and a1.shape[-1] != x.shape[-1]:
        a1 = _full(a1, tuple(x.shape))
    first = _add(
        None if a1 is None else torch.matmul(a1, z), None if b1 is None else torch.matmul(x, b1)
    )
    second = _add(
        None if a is None or a.second is None else torch.matmul(_full(a.second, x.shape), z),
        None if b is None or b.second is None else torch.matmul(x, _full(b.second, z.shape)),
        None if a1 is None or b1 is None else 2 * _matmul_quad(sw, _full(a1, x.shape), b1),
    )
    return _Jet(first, second)  # type: ignore[arg-type]


def _matmul_quad(sw: _Sweep, a: Tensor, b: Tensor) -> Tensor:
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
def _mm_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[0], args[1]
    y = node.target(x, z)  # type: ignore[operator]
    return y, _matmul(sw, x, z, sw.jet(node.args[0]), sw.jet(node.args[1]), y)


@_rule(aten.mv.default)
def _mv_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # x @ z with z a vector: the product with z as a column (pushed by torch.func otherwise,
    # jvp of jvp per direction: 65% of a pair potential's sparse sweep).
    x, z = args[0], args[1]
    y = node.target(x, z)  # type: ignore[operator]
    b = sw.jet(node.args[1])
    column = None if b is None else _map(b, lambda t: _lift(t, 1).unsqueeze(-1))
    jet = _matmul(sw, x, z.unsqueeze(-1), sw.jet(node.args[0]), column, y.unsqueeze(-1))
    return y, _map(jet, lambda t: t.squeeze(-1))


@_rule(aten.addmm.default)
def _addmm_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
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
        terms.append(_Jet(_lift(cj.first, y.ndim) * beta, _scale(_lift(cj.second, y.ndim), beta)))
    first = _add(*(t.first for t in terms))
    return y, _Jet(first, _add(*(t.second for t in terms)))  # type: ignore[arg-type]


@_rule(aten.convolution.default)
def _conv_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if any(isinstance(a, torch.fx.Node) and a in sw.jets for a in node.args[1:]):
        return _generic(sw, node, args, kwargs)
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])

    def conv(t: Tensor) -> Tensor:
        if tuple(t.shape[2:]) != tuple(x.shape[1:]):
            t = _full(t, x.shape)
        lead = t.shape[:2]
        out = node.target(t.reshape(-1, *t.shape[2:]), args[1], None, *args[3:])  # type: ignore[operator]
        return out.reshape(*lead, *out.shape[1:])

    return y, _map(a, conv)


def _gathered(t: Tensor, shape: Sequence[int], index: Tensor) -> Tensor:
    """The terms ``[*, *shape]`` of a value at its flat indices ``index`` (shaped as them)."""
    flat = _full(t, shape).reshape(t.shape[0], -1)
    return flat[:, index.reshape(-1)].reshape(t.shape[0], *index.shape)


def _strided_view(args: Sequence[Any], kwargs: dict[str, Any], at: int) -> tuple[Any, Any, int]:
    """``(size, stride, storage_offset)`` of an ``as_strided`` family call whose size is its
    argument ``at`` (the offset defaults to that of the first argument)."""
    size, stride = args[at], args[at + 1]
    offset = args[at + 2] if len(args) > at + 2 else kwargs.get("storage_offset")
    return size, stride, int(args[0].storage_offset() if offset is None else offset)


@_rule(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    # The view reads the storage of its input: its terms are those of the input's elements at
    # the positions it reads (a gather; vmap cannot view a batched tensor so).
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    index, found = located(
        storage_positions(x, *_strided_view(args, kwargs, 1)),
        storage_positions(x, x.shape, x.stride(), int(x.storage_offset())),
    )
    if not bool(found.all()):
        raise OptionError(
            f"the second-order sweep (laplacian, hessian_diagonal) differentiates {node.target} "
            "through its input's elements, but this one reads memory outside its input. Take "
            "the strided view of the whole tensor the function is given."
        )
    return y, _map(a, lambda t: _gathered(t, x.shape, index))


@_rule(aten.as_strided_scatter.default)
def _as_strided_scatter_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    # The input's values, those its strided view reads replaced by src's: the terms likewise,
    # by the storage positions of the output (laid out as the input, or contiguous where the
    # input's elements share memory, as torch's clone_preserve_strides).
    x, src = args[0], args[1]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    out = _without_overlap(x)
    index, written = located(
        storage_positions(x, out.shape, out.stride(), int(out.storage_offset())),
        storage_positions(x, *_strided_view(args, kwargs, 2)),
    )
    n = y.ndim

    def scatter(self_terms: Tensor | None, src_terms: Tensor | None) -> Tensor | None:
        if self_terms is None and src_terms is None:
            return None
        kept = 0 if self_terms is None else _lift(self_terms, n)
        put = 0 if src_terms is None else _gathered(src_terms, src.shape, index)
        return torch.where(written, put, kept).expand(-1, *y.shape)

    first = scatter(None if a is None else a.first, None if b is None else b.first)
    second = scatter(None if a is None else a.second, None if b is None else b.second)
    return y, _Jet(first, second)  # type: ignore[arg-type]
