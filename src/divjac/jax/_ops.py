"""The facts about JAX primitives that several transforms read, one entry per primitive.

:data:`ELEMENTWISE` holds every element-wise primitive (each output element reads the operands'
elements at its position; rank-0 operands broadcast) with what is known of its derivatives
(:class:`Elementwise`). It is the one place such a primitive is listed; it feeds

- sparsity detection (:mod:`~divjac.jax._table`: the element-wise rule, or no dependency for a
  :attr:`~Elementwise.constant` one) and the memory estimate (:mod:`~divjac.jax._detect`: XLA
  fuses element-wise work);
- the collapsed Taylor sweep (:mod:`~divjac.jax._taylor`: a :attr:`~Elementwise.linear` one is
  pushed by its linearization alone, one with :attr:`~Elementwise.curvature` adds
  ``g''(x) sum_k w_k dx_k^2``, any other by ``jvp`` of ``jvp``);
- the sparse sweep (:mod:`~divjac.jax._sparse_taylor`: an element's inputs are the union of its
  operands' at that element).

:data:`CALLS` names the primitives that call a program on their operands as they are, which the
sweeps run inline (:data:`SWEPT_CALLS` adds ``custom_vjp`` functions, swept by their primal). Tests (and extensions) add a primitive with
:func:`divjac.jax._table.register_elementwise`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from .._core.derivatives import UNARY

__all__ = ["CALLS", "ELEMENTWISE", "SWEPT_CALLS", "Curvature", "Elementwise"]

Curvature = Callable[[Any, Any, Mapping[str, Any]], Any]
"""``(x, y, params) -> g''(x)`` of an element-wise ``y = g(x)`` with the equation's params."""


@dataclass(frozen=True)
class Elementwise:
    """An element-wise primitive.

    Attributes:
        linear: its second derivative is zero (linear, or piecewise linear, in its operands).
        constant: its first derivative is zero wherever it exists (``floor``, ``sign``): its
            output depends on no input.
        curvature: ``g''`` of a function of one operand (``None``: not known in closed form).
    """

    linear: bool = False
    constant: bool = False
    curvature: Curvature | None = None


def _neutral(name: str) -> Elementwise:
    """The entry of a function whose derivatives :data:`divjac._core.derivatives.UNARY` has."""
    derivatives = UNARY[name]
    return Elementwise(curvature=lambda x, y, p: derivatives(jnp, x, y)[1])


def _integer_pow(x: Any, y: Any, p: Mapping[str, Any]) -> Any:
    n = p["y"]
    return jnp.zeros_like(x) if n in (0, 1) else n * (n - 1) * lax.integer_pow(x, n - 2)


_LINEAR = Elementwise(linear=True)
_CONSTANT = Elementwise(linear=True, constant=True)
_SMOOTH = Elementwise()

ELEMENTWISE: dict[str, Elementwise] = {
    **{name: _LINEAR for name in [
        "neg", "add", "add_any", "sub", "convert_element_type", "copy", "copy_p",
        "reduce_precision", "real", "imag", "conj", "complex", "max", "min", "abs", "clamp",
        "select_n",
    ]},
    **{name: _CONSTANT for name in ["sign", "floor", "ceil", "round", "stop_gradient"]},
    **{name: _SMOOTH for name in [
        "acos", "acosh", "asin", "asinh", "atan2", "atanh", "bessel_i0e", "bessel_i1e", "digamma",
        "div", "erf_inv", "erf_inv_p", "erfc", "igamma", "igamma_grad_a", "igammac", "lgamma",
        "mul", "nextafter", "polygamma", "pow", "random_gamma_grad",
        "regularized_incomplete_beta", "rem", "zeta", "bitcast_convert_type", "select_if_vmap",
    ]},
    **{name: _neutral(name) for name in [
        "tanh", "exp", "exp2", "expm1", "log", "log1p", "sin", "cos", "tan", "sinh", "cosh",
        "atan", "sqrt", "rsqrt", "cbrt", "square", "erf",
    ]},
    "square_p": _neutral("square"),
    "logistic": _neutral("sigmoid"),
    "integer_pow": Elementwise(curvature=_integer_pow),
}  # fmt: skip
"""Every element-wise JAX primitive divjac knows, by name."""

CALLS = frozenset(["jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"])
"""Primitives that run a program on their operands as they are (inlined by the sweeps)."""

SWEPT_CALLS = CALLS | {"custom_vjp_call"}
"""The calls the Taylor sweeps run inline: a ``custom_vjp`` function by its primal program (its
rule is for reverse mode)."""
