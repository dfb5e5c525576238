"""Third- and fourth-order directional derivatives of a batched function, for many directions
at once: ``sum_k w_k (v_k . grad)^K f`` by one collapsed univariate Taylor sweep of order ``K``.

Along a direction ``v`` every intermediate ``z`` of ``f`` has the Taylor series
``z(x + t v) = z_0 + z_1 t + ... + z_K t^K + O(t^(K+1))``, and ``K! f_K = (v . grad)^K f``.
One sweep over the jaxpr of ``f`` carries, for every intermediate, its value ``z_0`` (shared by
the directions), its coefficients ``z_1 ... z_(K-1)`` for each direction (a pass axis, as the
second-order sweep's first-order terms: :mod:`divjac.jax._tangent_passes`) and ONE top
coefficient ``sum_k w_k z_K[v_k]``: the top coefficient enters every equation linearly
(through ``dp(z_0)``), so its weighted sum is propagated once, the per-direction products of
lower coefficients that feed it summed over the directions where they are made (the collapse
of Dangel, Siebert, Zeinhofer & Walther, NeurIPS 2025). An equation ``z = p(a)`` maps them as

- linear (and piecewise linear) ``p``: every coefficient, and the top, by ``p``'s
  linearization;
- an element-wise ``p`` of one operand: the composition of the series of ``p`` at ``a_0``
  (``p^(q)(a_0)`` by nested ``jvp`` of the primitive) with ``a(t) - a_0``;
- a product of two dependent operands (``mul``, ``dot_general``, a convolution): the Cauchy
  product of the two series, the operation itself as the product;
- anything else: nested ``jvp`` in ``t`` of ``p(a_0 + a_1 t + ...)``, batched over the passes.

Against two nested second-order sweeps (``(v . grad)^2`` of ``(v . grad)^2 f``: nine terms per
direction, most of them on the outer sweep's jaxpr of the inner one), each direction carries
``K - 1`` coefficients, and coefficients known to be zero are not computed (an input's
direction has only ``z_1``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import InternalError
from ._ops import ELEMENTWISE
from ._refusals import check_differentiable_twice
from ._tangent_passes import Passes, _eval, bind, real
from ._taylor import Interpreter, Sweep, as_function, inexact, is_linear, pushed, seeded

__all__ = ["taylor_sweep"]

_Value = tuple[Any, tuple[Any, ...], Any]
"""(value, per-pass coefficients ``1 ... m`` (``None``: zero), summed top coefficient or
``None``)."""

_PRODUCTS = {"mul", "dot_general", "conv_general_dilated"}


def taylor_sweep(
    f: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    directions: jax.Array,
    order: int,
    *,
    weights: jax.Array | None = None,
    collapse: bool = True,
) -> jax.Array:
    """``(v_k . grad)^order f`` of a batch-first per-sample function, summed over ``k``.

    Args:
        f: ``[B, *in] -> [B, *out]``, acting on each sample separately.
        x: the point, ``[B, *in]``.
        directions: ``[K, B, *in]``, or ``[K, 1, *in]`` for directions shared by the samples.
        order: 3 or 4 (any order from 2 is computed).
        weights: ``None`` (all 1), ``[K]`` or ``[K, B]``: each direction's weight in the sum.
        collapse: the weighted sum ``[B, *out]``; else each direction's term ``[K, B, *out]``
            (unweighted).
    """
    k = int(directions.shape[0])
    # The passes in front: the products of each coefficient are then one matrix product over
    # every pass and sample (a tanh MLP 16-256-256-1, B = 128, on a loaded 2-core CPU:
    # 10.6-12.6 ms, against 14.0-25.9 ms with the passes behind the samples).
    seed, closed = seeded(f, x, directions, behind=False)
    per_sample = weights is not None and weights.ndim == 2
    apart = not collapse or per_sample
    m = order if apart else order - 1
    w = None if weights is None or apart else weights.astype(x.dtype)
    sweep = _TaylorSweep(order, m, Sweep(w, apart=False))
    coefficients = (seed,) + (None,) * (m - 1)
    ((y, cs, top),) = sweep.eval(closed.jaxpr, closed.consts, [(x, coefficients, None)])
    scale = math.factorial(order)
    if not apart:
        return scale * (jnp.zeros_like(y) if top is None else jnp.broadcast_to(top, jnp.shape(y)))
    last = real(cs[order - 1])
    terms = scale * (last.front() if isinstance(last, Passes) else jnp.zeros((k, *jnp.shape(y))))
    if not collapse:
        return terms
    if weights is None:
        raise InternalError("a collapsed sweep kept apart without its weights")
    wk = weights.astype(terms.dtype)
    return (wk.reshape(wk.shape + (1,) * (terms.ndim - wk.ndim)) * terms).sum(0)


class _TaylorSweep(Interpreter):
    """One sweep of order ``order`` carrying ``m`` coefficients per pass (``order - 1``, the
    top one summed by ``summed``; or ``order``, nothing summed)."""

    def __init__(self, order: int, m: int, summed: Sweep) -> None:
        self.order = order
        self.m = m
        self.summed = summed

    @property
    def collapsed(self) -> bool:
        return self.m < self.order

    def constant_value(self, value: Any) -> _Value:
        return (value, (None,) * self.m, None)

    def depends(self, value: _Value) -> bool:
        _, cs, top = value
        return top is not None or any(c is not None for c in cs)

    def equation(self, eqn: Any, ins: list[_Value], dep: list[int]) -> list[_Value]:
        if is_linear(eqn, dep):
            return self.linear(eqn, ins, dep)
        name = eqn.primitive.name
        fact = ELEMENTWISE.get(name)
        real_float = not jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.complexfloating)
        if fact is not None and fact.curvature is not None and len(ins) == 1 and real_float:
            return self.elementwise(eqn, ins[0])
        if name in _PRODUCTS and len(dep) == 2:
            return self.product(eqn, ins)
        if name == "custom_jvp_call":
            check_differentiable_twice(eqn)
        return self.fallback(eqn, ins, dep)

    # --- the rules ----------------------------------------------------------------------------

    def linear(self, eqn: Any, ins: list[_Value], dep: list[int]) -> list[_Value]:
        primals = [p for p, _, _ in ins]
        fn = as_function(eqn, primals, dep)
        ys, lin = jax.linearize(fn, *(primals[i] for i in dep))
        closed = jax.make_jaxpr(lin)(*(primals[i] for i in dep))

        def push(terms: list[Any]) -> list[Any]:
            if all(t is None for t in terms):
                return [None] * len(ys)
            args = [
                jnp.zeros_like(primals[i]) if t is None else t
                for i, t in zip(dep, terms, strict=True)
            ]
            return _eval(closed.jaxpr, closed.consts, args)

        per_j = [[pushed(o) for o in push([ins[i][1][j] for i in dep])] for j in range(self.m)]
        tops = [None if t is None else real(t) for t in push([ins[i][2] for i in dep])]
        return [(y, tuple(per_j[j][n] for j in range(self.m)), tops[n]) for n, y in enumerate(ys)]

    def elementwise(self, eqn: Any, a: _Value) -> list[_Value]:
        """``p(a(t))``: the series of ``p`` at ``a_0`` composed with ``a(t) - a_0``."""
        a0, cs, top = a
        derivatives = _derivatives(lambda z: bind(eqn, z), a0, self.order)
        order = self.order

        def one(*c: Any) -> list[Any]:
            delta = [None, *c] + [None] * (order - len(c))
            z: list[Any] = [None] * (order + 1)
            power = delta
            for q in range(1, order + 1):
                coef = derivatives[q] / math.factorial(q)
                z = [_add(zi, _scale(coef, pi)) for zi, pi in zip(z, power, strict=True)]
                power = _series_product(power, delta, order, _mul)
            return z[1:]

        outs = _per_pass(one, *(real(c) for c in cs))
        linear = None if top is None else derivatives[1] * top
        return [self._finish(derivatives[0], outs, linear)]

    def product(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
        """The Cauchy product of two dependent operands' series, ``p`` as the product."""
        (a0, ca, ta), (b0, cb, tb) = ins
        prod = lambda u, v: bind(eqn, u, v)  # noqa: E731
        order, m = self.order, self.m

        def one(*c: Any) -> list[Any]:
            left = [a0, *c[:m]] + [None] * (order - m)
            right = [b0, *c[m:]] + [None] * (order - m)
            return _series_product(left, right, order, prod)[1:]

        outs = _per_pass(one, *(real(c) for c in (*ca, *cb)))
        y = bind(eqn, a0, b0)
        linear = _add(None if tb is None else prod(a0, tb), None if ta is None else prod(ta, b0))
        return [self._finish(y, outs, linear)]

    def fallback(self, eqn: Any, ins: list[_Value], dep: list[int]) -> list[_Value]:
        """Nested ``jvp`` in ``t`` of the equation at ``a_0 + a_1 t + ...``, per pass."""
        primals = [p for p, _, _ in ins]
        fn = as_function(eqn, primals, dep)
        floats = [i for i, v in enumerate(eqn.outvars) if inexact(v.aval)]
        at = tuple(primals[i] for i in dep)
        order, m = self.order, self.m
        dtype = jnp.result_type(*(jnp.asarray(a).dtype for a in at))

        def one(*c: Any) -> list[Any]:
            def g(t: Any) -> list[Any]:
                args = [
                    a0
                    + sum(
                        cj * t ** (j + 1)
                        for j, cj in enumerate(c[n * m : (n + 1) * m])
                        if cj is not None
                    )
                    for n, a0 in enumerate(at)
                ]
                out = fn(*args)
                return [out[i] for i in floats]

            series = _derivatives(g, jnp.zeros((), dtype), order)
            per_out = [
                [series[q][j] / math.factorial(q) for q in range(1, order + 1)]
                for j in range(len(floats))
            ]
            return [c for out in per_out for c in out]

        flat = [real(c) for i in dep for c in ins[i][1]]
        outs = _per_pass(one, *flat)
        ys = fn(*at)
        tops_in = [ins[i][2] for i in dep]
        linear: list[Any] = [None] * len(floats)
        if any(t is not None for t in tops_in):
            zeros = [
                jnp.zeros_like(a) if t is None else t for a, t in zip(at, tops_in, strict=True)
            ]
            pushed = jax.jvp(lambda *a: [fn(*a)[i] for i in floats], at, tuple(zeros))[1]
            linear = list(pushed)
        results: list[_Value] = [(y, (None,) * m, None) for y in ys]
        for n, i in enumerate(floats):
            results[i] = self._finish(ys[i], outs[n * order : (n + 1) * order], linear[n])
        return results

    def _finish(self, y: Any, outs: list[Any], linear: Any) -> _Value:
        """The value of an output from its per-pass coefficients ``1 ... order`` (the top one
        without the summed top coefficient's part ``linear``)."""
        if not self.collapsed:
            return y, tuple(outs), None
        last = outs[self.order - 1]
        top = _add(linear, None if last is None else self.summed.reduce(last.value, last.axis))
        return y, tuple(outs[: self.m]), top


def _add(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    return a + b


def _mul(a: Any, b: Any) -> Any:
    return a * b


def _scale(c: Any, a: Any) -> Any:
    return None if a is None else c * a


def _series_product(
    a: list[Any], b: list[Any], order: int, prod: Callable[[Any, Any], Any]
) -> list[Any]:
    """The coefficients ``0 ... order`` of the product of two series (``None``: zero)."""
    out: list[Any] = [None] * (order + 1)
    for i, ai in enumerate(a):
        for j, bj in enumerate(b[: order + 1 - i]):
            if ai is not None and bj is not None:
                out[i + j] = _add(out[i + j], prod(ai, bj))
    return out


def _derivatives(g: Callable[[Any], Any], at: Any, order: int) -> list[Any]:
    """``g(at), g'(at), ..., g^(order)(at)`` of an element-wise ``g`` (or a function of a
    scalar) by nested ``jvp`` along ones."""
    fns = [g]
    for _ in range(order):
        fns.append(partial_jvp(fns[-1]))
    return [fn(at) for fn in fns]


def partial_jvp(g: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda z: jax.jvp(g, (z,), (jnp.ones_like(z),))[1]


def _per_pass(fn: Callable[..., list[Any]], *args: Any) -> list[Any]:
    """``fn`` of per-pass values (``None``: zero, and ``None`` out where ``fn`` gives it),
    batched over the pass axis of the :class:`Passes` arguments."""
    passes = [a for a in args if isinstance(a, Passes)]
    if not passes:  # every direction's series is constant: no coefficient
        return [None for _ in fn(*args)]
    axes = [a.axis if isinstance(a, Passes) else None for a in args]
    values = [a.value if isinstance(a, Passes) else a for a in args]
    out = jax.vmap(fn, in_axes=axes)(*values)
    lay = Passes.behind if any(a.axis for a in passes) else Passes
    return [None if o is None else lay(o) for o in out]
