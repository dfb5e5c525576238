"""The facts about ATen (and custom) operations that several parts of the torch backend read.

An operation is element-wise (:func:`is_elementwise`) when PyTorch tags it ``pointwise``, or
it is listed here (:data:`_UNTAGGED`; :func:`divjac.torch._rules.register_elementwise` adds
one). :data:`DERIVATIVES` gives the first and second derivatives of the element-wise functions
of one argument the Taylor sweep pushes by formula (those both frameworks share are written
once, in :mod:`divjac._core.derivatives`). Read by sparsity detection
(:mod:`~divjac.torch._interpret`: the element-wise rule), the collapsed Taylor sweep
(:mod:`divjac.torch._taylor.arithmetic`) and the sparse sweep (:mod:`divjac.torch._taylor.sparse`:
an element's inputs are the union of its operands').
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .._core.derivatives import UNARY

__all__ = ["DERIVATIVES", "Derivatives", "add_elementwise", "is_elementwise"]

Tensor = torch.Tensor
aten = torch.ops.aten

Derivatives = Callable[..., tuple[Any, Any]]
"""``(x, y, *params, **named) -> (g'(x), g''(x))`` (``g''`` ``None``: zero) of ``y = g(x)``."""

_UNTAGGED: set[Any] = {aten._to_copy.default, aten.alias.default, aten.lift_fresh_copy.default}
"""Element-wise operations without PyTorch's ``pointwise`` tag."""


def is_elementwise(target: Any) -> bool:
    """Whether the operation ``target`` is element-wise in its tensor arguments."""
    return torch.Tag.pointwise in getattr(target, "tags", ()) or target in _UNTAGGED


def add_elementwise(target: Any, derivatives: Derivatives | None) -> None:
    """Make ``target`` element-wise, with ``derivatives`` (``None``: none known)."""
    _UNTAGGED.add(target)
    if derivatives is not None:
        DERIVATIVES[target] = derivatives


def _shared(name: str) -> Derivatives:
    """The derivatives of :data:`divjac._core.derivatives.UNARY` ``name``, on tensors."""
    derivatives = UNARY[name]
    return lambda x, y: derivatives(torch, x, y)


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


def _elu(
    x: Tensor, y: Tensor, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0
) -> Any:
    # scale * x for x > 0, scale * alpha * (exp(input_scale x) - 1) otherwise
    inner = scale * alpha * input_scale * torch.exp(input_scale * x)
    positive = x > 0
    return torch.where(positive, scale, inner), torch.where(positive, 0.0, inner * input_scale)


# The element-wise functions whose derivatives are written once for both frameworks.
_SHARED = [
    "tanh", "sigmoid", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sin", "cos",
    "tan", "sinh", "cosh", "atan", "atanh", "asin", "acos", "asinh", "sqrt", "rsqrt",
    "reciprocal", "erf",
]  # fmt: skip
DERIVATIVES: dict[Any, Derivatives] = {
    **{getattr(aten, name).default: _shared(name) for name in _SHARED},
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
    aten.elu.default: _elu,
    aten.celu.default: lambda x, y, alpha=1.0: _elu(x, y, alpha, 1.0, 1 / alpha),
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
"""The derivatives of the element-wise functions the Taylor sweep pushes by formula."""
