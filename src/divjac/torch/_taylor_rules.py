"""The rules of the second-order sweep of :mod:`divjac.torch._taylor`, by ATen operation
(:data:`_RULES`): element-wise functions by their exact first and second derivatives, products
by one contraction over the directions, sums and scalings on the terms (moves of elements are
in :mod:`~divjac.torch._taylor_moves`, softmax, norms and normalizations in
:mod:`~divjac.torch._taylor_reductions`); any other operation by
:func:`~divjac.torch._taylor_generic._generic`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from ._aten import inexact
from ._taylor_generic import _generic
from ._taylor_jets import (
    Rule,
    _add,
    _folded,
    _full,
    _Jet,
    _lift,
    _map,
    _scale,
    _Sweep,
    registrar,
)

__all__: list[str] = []

Tensor = torch.Tensor
aten = torch.ops.aten


_RULES: dict[Any, Rule] = {}
_rule = registrar(_RULES)


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


def _within(x: Tensor, closed: bool, *bounds: Any, **named: Any) -> Tensor:
    """1 where ``x`` is within the bounds (``clamp``'s ``min``, ``max``; ``hardtanh``'s
    ``min_val``, ``max_val``: -1 and 1; ``None``: none), else 0: the derivative of a clamp
    (torch's: the bounds count as within for ``clamp``, not for ``hardtanh``)."""
    default = (None, None) if closed else (-1.0, 1.0)
    low = bounds[0] if bounds else named.get("min", named.get("min_val", default[0]))
    high = bounds[1] if len(bounds) > 1 else named.get("max", named.get("max_val", default[1]))
    inside = torch.ones_like(x, dtype=torch.bool)
    if low is not None:
        inside &= x >= low if closed else x > low
    if high is not None:
        inside &= x <= high if closed else x < high
    return inside.to(x.dtype)


def _gelu(x: Tensor, y: Tensor, approximate: str = "none") -> Any:
    if approximate == "tanh":  # x (1 + tanh u) / 2 with u = c (x + k x^3)
        c, k = math.sqrt(2 / math.pi), 0.044715
        du = c * (1 + 3 * k * x * x)
        t = torch.tanh(c * (x + k * x * x * x))
        s = 1 - t * t
        return 0.5 * (1 + t) + 0.5 * x * s * du, s * du + 0.5 * x * s * (
            6 * c * k * x - 2 * t * du * du
        )
    density = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)  # x Phi(x)
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * density, density * (2 - x * x)


def _mish(x: Tensor, y: Tensor) -> Any:
    # x tanh(softplus(x)): with t = tanh(softplus(x)), s = sigmoid(x), t' = (1 - t^2) s
    s = torch.sigmoid(x)
    t = torch.tanh(F.softplus(x))
    u = 1 - t * t
    return t + x * u * s, u * (2 * s + x * s * (1 - s) - 2 * x * t * s * s)


def _inverse_trig(x: Tensor, sign: float, plus: bool) -> Any:
    """``asin``/``acos`` (``1 - x^2``) and ``asinh`` (``1 + x^2``): ``sign / sqrt(q)`` and its
    derivative ``-sign q' / (2 q^(3/2))``."""
    q = 1 + x * x if plus else 1 - x * x
    r = torch.rsqrt(q)
    return sign * r, (-sign if plus else sign) * x * r * r * r


def _erf(x: Tensor, y: Tensor) -> Any:
    d = 2 / math.sqrt(math.pi) * torch.exp(-x * x)
    return d, -2 * x * d


def _elu(
    x: Tensor, y: Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0
) -> Any:
    # scale * x for x > 0, scale * alpha * (exp(input_scale x) - 1) otherwise
    inner = scale * alpha * input_scale * torch.exp(input_scale * x)
    positive = x > 0
    return torch.where(positive, scale, inner), torch.where(positive, 0.0, inner * input_scale)


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
    aten.leaky_relu.default: lambda x, y, slope=0.01: (
        (x > 0).to(x.dtype) * (1 - slope) + slope,
        None,
    ),
    aten.gelu.default: _gelu,
    aten.erf.default: _erf,
    aten.elu.default: _elu,
    aten.celu.default: lambda x, y, alpha=1.0: _elu(x, y, alpha, 1.0, 1 / alpha),
    aten.sinh.default: lambda x, y: (torch.cosh(x), y),
    aten.cosh.default: lambda x, y: (torch.sinh(x), y),
    aten.tan.default: lambda x, y: (1 + y * y, 2 * y * (1 + y * y)),
    aten.atan.default: lambda x, y: (1 / (1 + x * x), -2 * x / ((1 + x * x) * (1 + x * x))),
    aten.atanh.default: lambda x, y: (1 / (1 - x * x), 2 * x / ((1 - x * x) * (1 - x * x))),
    aten.asin.default: lambda x, y: _inverse_trig(x, 1.0, plus=False),
    aten.acos.default: lambda x, y: _inverse_trig(x, -1.0, plus=False),
    aten.asinh.default: lambda x, y: _inverse_trig(x, 1.0, plus=True),
    aten.log2.default: lambda x, y: (1 / (x * math.log(2)), -1 / (x * x * math.log(2))),
    aten.log10.default: lambda x, y: (1 / (x * math.log(10)), -1 / (x * x * math.log(10))),
    aten.exp2.default: lambda x, y: (math.log(2) * y, math.log(2) ** 2 * y),
    aten.mish.default: _mish,
    aten.hardsigmoid.default: lambda x, y: (((x > -3) & (x < 3)).to(x.dtype) / 6, None),
    aten.clamp.default: lambda x, y, *bounds, **named: (_within(x, True, *bounds, **named), None),
    aten.clamp_min.default: lambda x, y, low: (_within(x, True, low), None),
    aten.clamp_max.default: lambda x, y, high: (_within(x, True, None, high), None),
    aten.hardtanh.default: lambda x, y, *bounds, **named: (
        _within(x, False, *bounds, **named),
        None,
    ),
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


@_rule(aten.addmm.default, aten.baddbmm.default)
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
        return node.target(t, args[1], None, *args[3:])  # type: ignore[operator]

    return y, _map(a, lambda t: _folded(t, x.shape, conv))
