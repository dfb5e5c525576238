"""The rules of the second-order sweep of :mod:`divjac.torch._taylor.sweep` for reductions with
their own formulas (:data:`_RULES`): softmax, log-softmax and log-sum-exp by the mean and
spread of the terms under the softmax's weights, variances and deviations, the 2-norm, and
layer and group normalization composed of differentiable operations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from .._aten import dims, packet
from .generic import generic
from .jets import Jet, Rule, Sweep, _full, _map, _scale, add, registrar

__all__: list[str] = []

Tensor = torch.Tensor
aten = torch.ops.aten


_RULES: dict[Any, Rule] = {}
_rule = registrar(_RULES)


def _centred(t: Tensor, shape: Sequence[int], axes: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The mean of the terms ``t`` of a value of ``shape`` over ``axes`` (of the terms; kept as
    axes of one), and the terms less it."""
    t = _full(t, shape)
    m = t.mean(tuple(axes), keepdim=True)
    return m, t - m


def _expected(p: Tensor, t: Tensor, axes: Sequence[int]) -> Tensor:
    """``sum p t`` over ``axes`` of the terms ``t`` (kept as axes of one)."""
    return (p * t).sum(tuple(axes), keepdim=True)


def _log_partition(
    sw: Sweep, p: Tensor, a: Jet, shape: Sequence[int], axes: Sequence[int]
) -> tuple[Tensor, Tensor, Tensor]:
    """The terms of ``L = log sum exp x`` over ``axes`` (of the terms; kept as axes of one),
    ``p = exp(x - L)``: ``(L', c, s)`` with ``L' = E[x']``, ``c = x' - L'`` and ``s = x'' +
    sum_k w_k c_k^2``, whose expectation is ``L''``."""
    a1 = _full(a.first, shape).to(p.dtype)
    first = _expected(p, a1, axes)
    centred = a1 - first
    spread = sw.quad(centred, centred)
    if a.second is not None:
        spread = spread + _full(a.second, shape).to(p.dtype)
    return first, centred, spread


@_rule(aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default)
def _softmax_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """``y = exp(x - L)`` along one axis: ``y' = y (x' - L')``, ``y'' = y ((x' - L')^2 + x'' -
    L'')``; ``log_softmax`` ``x - L`` likewise. Rows of ``-inf`` (masked) have zero weights."""
    x = args[0]
    if x.is_complex() or x.ndim == 0:
        return generic(sw, node, args, kwargs)
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    axes = [int(args[1]) % x.ndim + 1]
    if node.target is aten._log_softmax.default:
        p = torch.exp(y)
        _, centred, spread = _log_partition(sw, p, a, tuple(x.shape), axes)
        own = None if a.second is None else _full(a.second, x.shape).to(y.dtype)
        return y, Jet(centred, add(own, -_expected(p, spread, axes)))
    _, centred, spread = _log_partition(sw, y, a, tuple(x.shape), axes)
    return y, Jet(y * centred, y * (spread - _expected(y, spread, axes)))


@_rule(aten.logsumexp.default)
def _logsumexp_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    if x.is_complex() or x.ndim == 0:
        return generic(sw, node, args, kwargs)
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    reduced = dims(args[1] if len(args) > 1 else kwargs.get("dim"), x.ndim)
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    log_z = torch.logsumexp(x, reduced, keepdim=True)
    p = torch.exp(x - torch.where(torch.isneginf(log_z), 0.0, log_z))  # all -inf: zero weights
    axes = [d + 1 for d in reduced]
    first, _, spread = _log_partition(sw, p, a, tuple(x.shape), axes)
    second = _expected(p, spread, axes)
    if not keepdim:
        first, second = first.squeeze(axes), second.squeeze(axes)
    return y, Jet(first, second)


@_rule(aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction)
def _variance_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """The variance ``v = sum (x - m)^2 / (n - correction)`` over axes: ``v' = 2 E[c c']``,
    ``v'' = 2 E[c c''] + 2 E[c'^2]`` (``c``: the centred value and terms, ``E``: the sum over
    ``n - correction``); the deviation ``sqrt(v)`` by the chain rule; the mean's jet beside."""
    x = args[0]
    if x.is_complex() or x.ndim == 0:
        return generic(sw, node, args, kwargs)
    out = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    reduced = dims(args[1] if len(args) > 1 else kwargs.get("dim"), x.ndim)
    correction = kwargs.get("correction")
    keepdim = bool(kwargs.get("keepdim", False))
    axes = tuple(d + 1 for d in reduced)
    count = math.prod(x.shape[d] for d in reduced)
    scale = 2 / (count - (1 if correction is None else correction))
    c = x - x.mean(tuple(reduced), keepdim=True)

    m1, c1 = _centred(a.first, x.shape, axes)
    v1 = scale * (c * c1).sum(axes, keepdim=True)
    v2 = scale * sw.quad(c1, c1).sum(axes, keepdim=True)
    m2 = None
    if a.second is not None:
        m2, c2 = _centred(a.second, x.shape, axes)
        v2 = v2 + scale * (c * c2).sum(axes, keepdim=True)
    jet = Jet(v1, v2)
    if packet(node.target).startswith("std"):
        s = (out[0] if isinstance(out, tuple) else out).reshape(v1.shape[1:])
        jet = Jet(v1 / (2 * s), v2 / (2 * s) - sw.quad(v1, v1) / (4 * s * s * s))
    if not keepdim:
        jet = _map(jet, lambda t: t.squeeze(axes))
    if not isinstance(out, tuple):
        return out, jet
    mean = Jet(m1, m2)
    return out, [jet, mean if keepdim else _map(mean, lambda t: t.squeeze(axes))]


@_rule(aten.linalg_vector_norm.default)
def _norm_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The 2-norm ``n`` over axes: ``n' = <x, x'> / n``, ``n'' = (<x, x''> + |x'|^2 - n'^2) / n``;
    zero terms where ``n = 0`` (torch's convention for its derivative there). Other orders: the
    generic rule."""
    x = args[0]
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = kwargs.get("dtype", args[4] if len(args) > 4 else None)
    if x.is_complex() or order != 2 or x.ndim == 0:
        return generic(sw, node, args, kwargs)
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    x = x if dtype is None else x.to(dtype)
    reduced = dims(args[2] if len(args) > 2 else kwargs.get("dim"), x.ndim)
    keepdim = bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False))
    axes = tuple(d + 1 for d in reduced)
    n = torch.linalg.vector_norm(x, 2, reduced, keepdim=True)
    inverse = torch.where(n == 0, 0.0, 1 / torch.where(n == 0, 1.0, n))
    a1 = _full(a.first, x.shape).to(x.dtype)
    first = (x * a1).sum(axes, keepdim=True) * inverse
    second = sw.quad(a1, a1).sum(axes, keepdim=True) - sw.quad(first, first)
    if a.second is not None:
        second = second + (x * _full(a.second, x.shape).to(x.dtype)).sum(axes, keepdim=True)
    second = second * inverse
    if not keepdim:
        first, second = first.squeeze(axes), second.squeeze(axes)
    return y, Jet(first, second)


def _standardized(
    sw: Sweep, x: Tensor, a: Jet, reduced: Sequence[int], eps: float
) -> tuple[Tensor, Tensor, Tensor, list[Jet]]:
    """``x`` standardized over the value axes ``reduced``: ``n = (x - m) r`` with ``m`` the mean
    and ``r = (v + eps)^(-1/2)`` (``v`` the biased variance), composed of differentiable
    operations; ``(n, m, r)`` (``m`` and ``r`` kept as axes of one) and their jets."""
    axes = tuple(d + 1 for d in reduced)
    mean = x.mean(tuple(reduced), keepdim=True)
    c = x - mean
    rstd = torch.rsqrt((c * c).mean(tuple(reduced), keepdim=True) + eps)

    m1, c1 = _centred(a.first, x.shape, axes)
    v1 = 2 * (c * c1).mean(axes, keepdim=True)
    r3 = rstd * rstd * rstd
    r1 = -0.5 * r3 * v1
    v2 = 2 * sw.quad(c1, c1).mean(axes, keepdim=True)
    m2 = c2 = None
    if a.second is not None:
        m2, c2 = _centred(a.second, x.shape, axes)
        v2 = v2 + 2 * (c * c2).mean(axes, keepdim=True)
    r2 = -0.5 * r3 * v2 + 0.75 * r3 * rstd * rstd * sw.quad(v1, v1)
    n2 = add(c * r2, 2 * sw.quad(c1, r1), None if c2 is None else c2 * rstd)
    jets = [Jet(c1 * rstd + c * r1, n2), Jet(m1, m2), Jet(r1, r2)]
    return c * rstd, mean, rstd, jets


def _affine(n: Tensor, jet: Jet, weight: Tensor | None, bias: Tensor | None) -> Any:
    """``n * weight + bias`` (either ``None``: none) and its jet."""
    y = n if weight is None else n * weight
    y = y if bias is None else y + bias
    if weight is None:
        return y, jet
    return y, Jet(jet.first * weight, _scale(jet.second, weight))


def _norm_by_rule(sw: Sweep, node: torch.fx.Node, x: Tensor) -> bool:
    """Whether a normalization is swept by its own rule: a weight and bias that do not depend
    on the input, in single or double precision (torch computes others in float32)."""
    return x.dtype in (torch.float32, torch.float64) and all(
        sw.jet(n) is None for n in node.args[1:]
    )


@_rule(aten.native_layer_norm.default)
def _layer_norm_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """Standardized over the normalized axes, times the weight, plus the bias; the mean and
    ``r`` as torch returns them, constants to its autograd (its kernel does not differentiate
    them): no terms."""
    x, shape, weight, bias = args[0], args[1], args[2], args[3]
    if not _norm_by_rule(sw, node, x):
        return generic(sw, node, args, kwargs)
    eps = args[4] if len(args) > 4 else kwargs["eps"]
    reduced = range(x.ndim - len(shape), x.ndim)
    n, mean, rstd, jets = _standardized(sw, x, sw.needed(node.args[0]), reduced, eps)
    y, jet = _affine(n, jets[0], weight, bias)
    return (y, mean.detach(), rstd.detach()), [jet, None, None]


@_rule(aten.native_group_norm.default)
def _group_norm_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """Standardized per sample and group of channels, times the weight, plus the bias (per
    channel); the mean and ``r`` ``[N, groups]`` with their jets (torch differentiates them)."""
    x, weight, bias, groups, eps = args[0], args[1], args[2], int(args[6]), args[7]
    if not _norm_by_rule(sw, node, x):
        return generic(sw, node, args, kwargs)
    lead = tuple(x.shape[:1])
    grouped = (*lead, groups, -1)
    a = _map(sw.needed(node.args[0]), lambda t: _full(t, x.shape).reshape(t.shape[0], *grouped))
    n, mean, rstd, jets = _standardized(sw, x.reshape(grouped), a, [2], eps)
    per_channel = (-1, *([1] * (x.ndim - 2)))
    y, jet = _affine(
        n.reshape(x.shape),
        _map(jets[0], lambda t: t.reshape(t.shape[0], *x.shape)),
        None if weight is None else weight.reshape(per_channel),
        None if bias is None else bias.reshape(per_channel),
    )
    stats = [_map(j, lambda t: t.reshape(t.shape[:3])) for j in jets[1:]]
    return (y, mean.reshape(*lead, groups), rstd.reshape(*lead, groups)), [jet, *stats]
