"""First and second derivatives of element-wise functions, written once for every framework.

Each formula takes the array namespace ``xp`` of the framework (``jax.numpy``, ``torch``), the
argument ``x`` and the value ``y = g(x)``, and returns ``(g'(x), g''(x))``, reusing ``y`` where
that saves work. Only functions both namespaces spell alike are used (``exp``, ``sqrt``,
``tanh``, ...), with Python numbers for constants (so that the arrays keep their dtype). The
collapsed Taylor sweeps of :mod:`divjac.jax._taylor` and :mod:`divjac.torch.taylor` read them
through their frameworks' op-fact tables, under their own names of the operation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["UNARY", "Derivatives"]

Derivatives = Callable[[Any, Any, Any], tuple[Any, Any]]
"""``(xp, x, y) -> (g'(x), g''(x))`` of an element-wise ``y = g(x)``."""


def _tanh(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    d = 1 - y * y
    return d, -2 * y * d


def _sigmoid(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    d = y - y * y
    return d, d - 2 * y * d


def _log(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    d = 1 / x
    return d, -d * d


def _log1p(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    d = 1 / (x + 1)
    return d, -d * d


def _sqrt(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    d = 0.5 / y
    return d, -d * d / y


def _rsqrt(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    y3 = y * y * y
    return -0.5 * y3, 0.75 * y3 * y * y


def _inverse_trig(sign: float, plus: bool) -> Derivatives:
    """``asin``/``acos`` (``q = 1 - x^2``) and ``asinh`` (``q = 1 + x^2``): ``sign / sqrt(q)``
    and its derivative ``-sign q' / (2 q^(3/2))``."""

    def derivatives(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
        q = 1 + x * x if plus else 1 - x * x
        r = 1 / xp.sqrt(q)
        return sign * r, (-sign if plus else sign) * x * r * r * r

    return derivatives


def _erf(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    d = 2 / math.sqrt(math.pi) * xp.exp(-x * x)
    return d, -2 * x * d


def _atan(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    q = 1 + x * x
    return 1 / q, -2 * x / (q * q)


def _atanh(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    q = 1 - x * x
    return 1 / q, 2 * x / (q * q)


def _tan(xp: Any, x: Any, y: Any) -> tuple[Any, Any]:
    d = 1 + y * y
    return d, 2 * y * d


UNARY: dict[str, Derivatives] = {
    "tanh": _tanh,
    "sigmoid": _sigmoid,
    "exp": lambda xp, x, y: (y, y),
    "exp2": lambda xp, x, y: (math.log(2) * y, math.log(2) ** 2 * y),
    "expm1": lambda xp, x, y: (y + 1, y + 1),
    "log": _log,
    "log1p": _log1p,
    "log2": lambda xp, x, y: (1 / (x * math.log(2)), -1 / (x * x * math.log(2))),
    "log10": lambda xp, x, y: (1 / (x * math.log(10)), -1 / (x * x * math.log(10))),
    "sin": lambda xp, x, y: (xp.cos(x), -y),
    "cos": lambda xp, x, y: (-xp.sin(x), -y),
    "tan": _tan,
    "sinh": lambda xp, x, y: (xp.cosh(x), y),
    "cosh": lambda xp, x, y: (xp.sinh(x), y),
    "atan": _atan,
    "atanh": _atanh,
    "asin": _inverse_trig(1.0, plus=False),
    "acos": _inverse_trig(-1.0, plus=False),
    "asinh": _inverse_trig(1.0, plus=True),
    "sqrt": _sqrt,
    "rsqrt": _rsqrt,
    "cbrt": lambda xp, x, y: (y / (3 * x), -2 / 9 * y / (x * x)),
    "reciprocal": lambda xp, x, y: (-y * y, 2 * y * y * y),
    "square": lambda xp, x, y: (2 * x, 2 * xp.ones_like(x)),
    "erf": _erf,
}
"""The derivatives of each element-wise function of one argument, by a neutral name."""
