"""Second-order directional derivatives of a batched function, for many directions at once.

``second_order_sweep(f, x, directions)`` is the engine of the Laplacian and of the other
second-order operators: with directions ``v_k`` it gives ``f(x)``, the first-order terms
``J v_k`` and the second-order terms ``v_k^T H v_k`` (each, or their weighted sum). With the
unit basis the summed second-order term is the Laplacian; with a factor ``S`` of ``A = S S^T``
it is ``sum_ij A_ij d2f/dx_i dx_j``; with the indicators of a diagonal coloring of a sparse
Hessian it is again the Laplacian, in ``#colors`` directions.

It is collapsed second-order Taylor mode, the forward Laplacian of Li et al. (2023), "Forward
Laplacian: a new computational framework for neural network-based variational Monte Carlo",
generalized to weighted directions as in Dangel, Siebert, Zeinhofer & Walther (NeurIPS 2025),
"Collapsing Taylor mode automatic differentiation". One sweep over the jaxpr of ``f`` carries,
for every intermediate ``z``, its value, its ``K`` first-order terms ``dz[v_k]`` (a pass axis in
front) and ONE second-order term ``sum_k w_k d2z[v_k, v_k]`` (``K`` of them, unweighted, when the
caller keeps them apart). An equation ``z = p(a)`` maps them as

    dz[v_k] = dp(a)[da[v_k]],   d2z = dp(a)[d2a] + sum_k w_k d2p(a)[da[v_k], da[v_k]].

The first-order part is ``p``'s own linearization, pushed for every pass at once by
:mod:`divjac.jax._tangent_passes` (batch-local, shared directions kept unbroadcast through the first
linear layers). The curvature term is zero for linear and piecewise-linear primitives, is
``p''(a) * sum_k w_k da_k^2`` for the element-wise functions with a known second derivative
(both facts read from the op-fact table :data:`divjac.jax._ops.ELEMENTWISE`),
``2 sum_k w_k p(da_k, db_k)`` for products of two dependent operands (one ``dot_general`` with
the passes contracted), and otherwise comes from ``jvp`` of ``jvp`` of that one equation,
batched over the passes (``custom_jvp`` functions through their rule, loops and conditionals as
whole equations).

With weights per sample (``[K, B]``) the second-order terms are kept apart through the sweep and
summed at the end: the batch axis of an intermediate is not known to the sweep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _compat, _sharding
from ._ops import ELEMENTWISE, SWEPT_CALLS
from ._refusals import check_differentiable_twice
from ._tangent_passes import Bcast, Passes, _eval, bind, lift, real, varying_like

__all__ = ["second_order_sweep"]


def second_order_sweep(
    f: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    directions: jax.Array,
    *,
    weights: jax.Array | None = None,
    collapse: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``f(x)``, ``J v_k`` and ``v_k^T H v_k`` of a batch-first function.

    Args:
        f: ``[B, *in] -> [B, *out]``, batch first, acting on each sample separately (the caller
            has checked coupling).
        x: the point, ``[B, *in]``.
        directions: ``[K, B, *in]``, or ``[K, 1, *in]`` for directions shared by all samples.
        weights: ``None`` (all 1), ``[K]`` or ``[K, B]``: the weight of each direction in the
            collapsed sum.
        collapse: return the weighted sum over ``k`` of the second-order terms (``[B, *out]``)
            instead of each of them (``[K, B, *out]``, unweighted).

    Returns:
        ``(y, first, second)``: ``y = f(x)`` ``[B, *out]``; ``first[k] = J v_k`` ``[K, B, *out]``;
        ``second`` as ``collapse`` says.
    """
    k = int(directions.shape[0])
    seed, closed = seeded(f, x, directions)
    apart = not collapse or (weights is not None and weights.ndim == 2)
    w = None if weights is None or apart else weights.astype(x.dtype)
    sweep = Sweep(w, apart)
    ((y, t, s),) = sweep.eval(closed.jaxpr, closed.consts, [(x, seed, None)])
    t = real(t)
    first = t.front() if isinstance(t, Passes) else jnp.zeros((k, *jnp.shape(y)), y.dtype)
    if apart:
        second = s.front() if isinstance(s, Passes) else jnp.zeros((k, *jnp.shape(y)), y.dtype)
        return y, first, second if not collapse else _weighted_sum(second, weights)
    return y, first, jnp.zeros_like(y) if s is None else jnp.broadcast_to(s, jnp.shape(y))


def seeded(
    f: Callable[[jax.Array], jax.Array], x: jax.Array, directions: jax.Array, behind: bool = True
) -> Any:
    """``(seed, closed)``: the directions ``[K, B or 1, *in]`` as the input's first-order
    terms (laid out behind the samples, or with ``behind=False`` in front), and the jaxpr of
    ``f`` at ``x`` (one output)."""
    v = directions.astype(x.dtype)
    # Every first-order term lies behind its sample (_Passes.behind): the sums over the passes
    # then reduce blocks that stay in cache, fused with their operands (a tanh MLP of width
    # 256, d = 64, B = 256: 1.4x faster than with the passes in front, as folx lays them out).
    if v.shape[1] == x.shape[0]:
        own = varying_like(v, x)
        seed: Any = Passes.behind(own) if behind else Passes(own)
    else:  # shared by the samples: kept unbroadcast until an operation needs the batch
        seed = Bcast(Passes(varying_like(v[:, 0], x)), tuple(x.shape), (0,), behind=behind)
    closed = jax.make_jaxpr(f)(x)
    if len(closed.jaxpr.outvars) != 1:
        closed = jax.make_jaxpr(lambda p: jnp.asarray(f(p)))(x)
    return seed, closed


def _weighted_sum(terms: Any, weights: jax.Array | None) -> jax.Array:
    """``sum_k w_k terms[k]`` with ``w`` of shape ``[K]`` or ``[K, B]`` (``None``: all 1)."""
    if weights is None:
        return terms.sum(0)
    w = weights.reshape(weights.shape + (1,) * (terms.ndim - weights.ndim)).astype(terms.dtype)
    return (w * terms).sum(0)


# Linear, or piecewise linear (zero curvature almost everywhere), in the dependent operands,
# besides the element-wise ones of :data:`~divjac.jax._ops.ELEMENTWISE` marked ``linear``.
_LINEAR = {
    "reshape", "squeeze", "broadcast_in_dim", "transpose", "slice", "dynamic_slice", "gather",
    "concatenate", "pad", "rev", "split", "dynamic_update_slice", "scatter", "scatter-add",
    "scatter_add", "reduce_sum", "cumsum", "reduce_window_sum", "reduce_max", "reduce_min",
    "cummax", "cummin", "sort", "reduce_window_max", "reduce_window_min", "select_and_gather_add",
}  # fmt: skip
# Linear in each operand: linear when only one of them depends on the input.
_BILINEAR = {"mul", "dot_general", "conv_general_dilated"}


_Value = tuple[Any, Any, Any]  # (primal, first-order terms or None, second-order term or None)


class Interpreter:
    """A sweep over a jaxpr carrying a tuple per variable, its value first: the equations
    without a dependent operand (or without inexact outputs) are evaluated, the calls of
    :data:`~divjac.jax._ops.SWEPT_CALLS` swept inline, the others left to :meth:`equation`."""

    def constant_value(self, value: Any) -> Any:
        """The tuple of a value that depends on no input."""
        raise NotImplementedError

    def depends(self, value: Any) -> bool:
        raise NotImplementedError

    def equation(self, eqn: Any, ins: list[Any], dep: list[int]) -> list[Any]:
        raise NotImplementedError

    def constant(self, eqn: Any, values: list[Any]) -> Any:
        """An equation without terms (no dependent operand, or integer outputs)."""
        return bind(eqn, *values)

    def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return self.constant_value(v.val) if isinstance(v, _compat.Literal) else env[v]

        for var, val in zip(jaxpr.constvars, consts, strict=True):
            env[var] = self.constant_value(val)
        for var, arg in zip(jaxpr.invars, args, strict=True):
            env[var] = arg
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            dep = [i for i, value in enumerate(ins) if self.depends(value)]
            if not dep or not any(inexact(v.aval) for v in eqn.outvars):
                out = self.constant(eqn, [value[0] for value in ins])
                many = out if eqn.primitive.multiple_results else [out]
                outs = [self.constant_value(o) for o in many]
            elif eqn.primitive.name in SWEPT_CALLS:
                outs = self.eval(*_compat.open_jaxpr(_compat.called(eqn)), ins)
            else:
                outs = self.equation(eqn, ins, dep)
            for var, val in zip(eqn.outvars, outs, strict=True):
                env[var] = val
        return [read(v) for v in jaxpr.outvars]


def is_linear(eqn: Any, dep: list[int]) -> bool:
    """Whether ``eqn`` is linear (or piecewise linear) in its dependent operands ``dep``."""
    name = eqn.primitive.name
    fact = ELEMENTWISE.get(name)
    return (
        ((name in _LINEAR or (fact is not None and fact.linear)) and not _complex_abs(eqn))
        or (name in _BILINEAR and len(dep) == 1)
        or (name == "div" and dep == [0])
    )


class Sweep(Interpreter):
    """One collapsed Taylor sweep: ``w`` the weights ``[K]`` (``None``: all 1) of the summed
    second-order term, or ``apart``: keep one second-order term per pass (unweighted)."""

    def __init__(self, w: jax.Array | None, apart: bool) -> None:
        self.w = w
        self.apart = apart

    def constant_value(self, value: Any) -> _Value:
        return (value, None, None)

    def depends(self, value: _Value) -> bool:
        return value[1] is not None

    def equation(self, eqn: Any, ins: list[_Value], dep: list[int]) -> list[_Value]:
        name = eqn.primitive.name
        fact = ELEMENTWISE.get(name)
        if is_linear(eqn, dep):
            return self.linear(eqn, ins, dep)
        if fact is not None and fact.curvature is not None and len(ins) == 1:
            ((y, t, s),) = self.linear(eqn, ins, dep)
            x, tx, _ = ins[0]
            return [(y, t, self.add(s, self.scale(fact.curvature(x, y, eqn.params), tx, tx)))]
        if name == "mul":
            ((y, t, s),) = self.linear(eqn, ins, dep)
            return [(y, t, self.add(s, self.scale(2, ins[0][1], ins[1][1])))]
        if name == "div":
            ((y, t, s),) = self.linear(eqn, ins, dep)
            (_, ta, _), (b, tb, _) = ins
            q = self.scale(2 * y / (b * b), tb, tb)
            if ta is not None:
                q = self.add(q, self.scale(-2 / (b * b), ta, tb))
            return [(y, t, self.add(s, q))]
        if name == "dot_general":
            ((y, t, s),) = self.linear(eqn, ins, dep)
            return [(y, t, self.add(s, self.dot_curvature(eqn, ins[0][1], ins[1][1])))]
        if name == "custom_jvp_call":
            check_differentiable_twice(eqn)
        return self.fallback(eqn, ins, dep)

    def linear(self, eqn: Any, ins: list[_Value], dep: list[int]) -> list[_Value]:
        """The values and first-order terms of ``eqn``'s outputs (its linearization pushed for
        every pass), and the first part ``dp(a)[d2a]`` of their second-order terms."""
        primals = [p for p, _, _ in ins]
        fn = as_function(eqn, primals, dep)
        ys, lin = jax.linearize(fn, *(primals[i] for i in dep))
        closed = jax.make_jaxpr(lin)(*(primals[i] for i in dep))
        firsts = [pushed(o) for o in _eval(closed.jaxpr, closed.consts, [ins[i][1] for i in dep])]
        seconds: list[Any] = [None] * len(ys)
        if any(ins[i][2] is not None for i in dep):
            s_in = [jnp.zeros_like(primals[i]) if ins[i][2] is None else ins[i][2] for i in dep]
            seconds = [self.second(o) for o in _eval(closed.jaxpr, closed.consts, s_in)]
        return [
            (y, t, s if t is not None else None)
            for y, t, s in zip(ys, firsts, seconds, strict=True)
        ]

    def second(self, value: Any) -> Any:
        value = real(value)
        if self.apart:
            return value if isinstance(value, Passes) else None
        return value

    def add(self, a: Any, b: Any) -> Any:
        if a is None or b is None:
            return b if a is None else a
        return lift(jnp.add, a, b)

    def scale(self, c: Any, ta: Any, tb: Any) -> Any:
        """``c * sum_k w_k ta_k tb_k`` (``c`` an array of one pass's shape, or a number)."""
        q = self.contract(ta, tb)
        return lift(lambda v: c * v, q)

    def contract(self, ta: Any, tb: Any) -> Any:
        """``sum_k w_k ta_k tb_k`` (element-wise; per pass when kept apart)."""
        if (
            isinstance(ta, Bcast)
            and isinstance(tb, Bcast)
            and (ta.shape, ta.new_axes) == (tb.shape, tb.new_axes)
            and not self.apart
        ):  # on the unbroadcast bases
            return Bcast(
                self.reduce(*_product(ta.base, tb.base)), ta.shape, ta.new_axes
            ).materialize()
        return self.reduce(*_product(real(ta), real(tb)))

    def reduce(self, terms: jax.Array, axis: int = 0) -> Any:
        """``sum_k w_k terms_k`` over the passes, on ``terms``' axis ``axis`` (kept apart:
        the terms themselves)."""
        if self.apart:
            return Passes(terms, axis)
        if axis:  # a reduction XLA fuses with the product that made the terms
            if self.w is None:
                return terms.sum(axis)
            w = self.w.astype(terms.dtype).reshape((-1,) + (1,) * (terms.ndim - axis - 1))
            return (terms * w).sum(axis)
        k = terms.shape[0]
        w = jnp.ones((1, k), terms.dtype) if self.w is None else self.w.astype(terms.dtype)[None]
        # A product, not a reduce_sum: XLA:CPU's YNNPACK fusion runs a leading-axis reduction
        # fused with the surrounding products several times slower.
        reduced = w @ terms.reshape(k, -1)
        return _sharding.reshape(
            reduced, terms.shape[1:], _sharding.sharded_like(terms, slice(1, None))
        )

    def dot_curvature(self, eqn: Any, ta: Any, tb: Any) -> Any:
        """``2 sum_k w_k dot_general(ta_k, tb_k)``: one product with the passes contracted."""
        pa, pb = real(ta), real(tb)
        a, b = pa.value, pb.value
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        pref = eqn.params.get("preferred_element_type")
        if self.apart:
            dims = ((lc, rc), (lb, rb))
            products = jax.vmap(
                partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=pref),
                in_axes=(pa.axis, pb.axis),
            )
            return Passes(2 * products(a, b))
        if self.w is not None:
            w = self.w.astype(a.dtype)
            a = a * w.reshape((-1,) + (1,) * (a.ndim - pa.axis - 1))
        # One pass's axis i is the value's axis i, or i + 1 behind the pass axis.
        ua = lambda axes: tuple(i + (i >= pa.axis) for i in axes)  # noqa: E731
        ub = lambda axes: tuple(i + (i >= pb.axis) for i in axes)  # noqa: E731
        dims = (((*ua(lc), pa.axis), (*ub(rc), pb.axis)), (ua(lb), ub(rb)))
        return 2 * lax.dot_general(a, b, dims, preferred_element_type=pref)

    def fallback(self, eqn: Any, ins: list[_Value], dep: list[int]) -> list[_Value]:
        """Any other equation: ``jvp`` of ``jvp`` of it, batched over the passes."""
        primals = [p for p, _, _ in ins]
        fn = as_function(eqn, primals, dep)
        floats = [i for i, v in enumerate(eqn.outvars) if inexact(v.aval)]
        at = tuple(primals[i] for i in dep)

        def g(*a: Any) -> tuple[Any, ...]:
            out = fn(*a)
            return tuple(out[i] for i in floats)

        def h(a: tuple[Any, ...], t: tuple[Any, ...]) -> tuple[Any, ...]:
            return jax.jvp(g, a, t)[1]

        tangents = tuple(real(ins[i][1]).front() for i in dep)
        seconds = [ins[i][2] for i in dep]
        if self.apart:
            s_in = tuple(
                jnp.zeros_like(t) if s is None else s.front()
                for t, s in zip(tangents, seconds, strict=True)
            )
            d1, d2 = jax.vmap(lambda t, s: jax.jvp(h, (at, t), (t, s)))(tangents, s_in)
            second = [Passes(q) for q in d2]
        else:
            d1, d2 = jax.vmap(lambda t: jax.jvp(lambda a: h(a, t), (at,), (t,)))(tangents)
            second = [self.reduce(q) for q in d2]
            if any(s is not None for s in seconds):
                s_in = tuple(
                    jnp.zeros_like(a) if s is None else s for a, s in zip(at, seconds, strict=True)
                )
                second = [self.add(q, lq) for q, lq in zip(second, h(at, s_in), strict=True)]
        ys = fn(*at)
        outs: list[_Value] = [(y, None, None) for y in ys]
        for j, i in enumerate(floats):
            outs[i] = (ys[i], Passes(d1[j]), second[j])
        return outs


def _product(a: Passes, b: Passes) -> tuple[jax.Array, int]:
    """The element-wise product of every pass of ``a`` and ``b`` (one of them possibly of a
    rank-0 operand of a binary operation), and the axis of its passes."""
    if a.axis == b.axis and a.value.ndim == b.value.ndim:
        return a.value * b.value, a.axis
    va, vb = a.front(), b.front()
    rank = max(va.ndim, vb.ndim)
    va = va.reshape(va.shape + (1,) * (rank - va.ndim))
    vb = vb.reshape(vb.shape + (1,) * (rank - vb.ndim))
    return va * vb, 0


def as_function(eqn: Any, primals: list[Any], dep: list[int]) -> Callable[..., list[Any]]:
    """``eqn`` as a function of its dependent operands (the others fixed), a list of outputs."""

    def fn(*args: Any) -> list[Any]:
        full = list(primals)
        for i, a in zip(dep, args, strict=True):
            full[i] = a
        out = bind(eqn, *full)
        return list(out) if eqn.primitive.multiple_results else [out]

    return fn


def pushed(value: Any) -> Any:
    """A pushed first-order value, or ``None`` where no pass reached it (a zero)."""
    if isinstance(value, Passes) or (isinstance(value, Bcast) and isinstance(value.base, Passes)):
        return value
    return None


def _complex_abs(eqn: Any) -> bool:
    """``|z|`` of a complex ``z``: piecewise linear on the reals only, curved on the plane
    (``d2|z|[dz, dz] = Im(conj(z) dz)^2 / |z|^3``), so left to the fallback."""
    return eqn.primitive.name == "abs" and jnp.issubdtype(
        eqn.invars[0].aval.dtype, jnp.complexfloating
    )


def inexact(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)
