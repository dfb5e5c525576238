"""Linear differential operators up to fourth order, per sample, written once over a backend:
a mixed partial ``d^alpha u`` (:func:`derivative`) and sums ``sum_t c_t d^{alpha_t} u``
(:func:`differential_operator`).

Each mixed partial of order ``d`` is an exact combination of ``d``-th directional derivatives
along integer directions supported on its indices (:mod:`divjac._core.partials`, Griewank,
Utke & Walther 2000). The terms are grouped by order; each order's distinct directions carry
their summed weights (the coefficients times the interpolation weights, per sample where a
coefficient is), and ``sum_k w_k (v_k . grad)^d u`` is one computation per order: order 1 a JVP
along the weighted sum of the directions (linear in them), order 2 one collapsed second-order
Taylor sweep (the weights summed before they are propagated, as the Laplacian's), orders 3 and
4 the first- and second-order terms of a second-order sweep of the second-order sweep along
each direction (``(v . grad)^2`` of ``(v . grad)^2 u``), the directions a batch axis in chunks
(:meth:`~divjac._backend.Backend.map_stacked`). The stochastic methods sample the
(direction, weight) pairs of each order (:func:`_sampled_values`). Imports neither JAX nor
PyTorch.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._backend import Array, Backend
from ._call import Call, Coupling, OperatorMethod, check_num_probes, check_option
from ._core import partials
from ._directions import (
    _mean_and_stderr,
    _num_probes,
    _one_sample_at_a_time,
    _Options,
    _plan,
    _sweep,
    _values,
    sweep_chunk,
)
from ._divergence import _is_probes
from ._errors import CoefficientError, MultiIndexError, NumProbesError
from ._second import SWEEP_STOCHASTIC, _second_order_transform
from ._transforms import per_argnum, tuple_of

__all__ = ["derivative", "differential_operator"]


# --- the terms ----------------------------------------------------------------------------------


def _checked_alpha(alpha: Any, fname: str) -> tuple[int, ...]:
    """``alpha`` as a tuple of flat indices, its order checked (1 to 4)."""
    if isinstance(alpha, numbers.Integral) and not isinstance(alpha, bool):
        alpha = (alpha,)
    if not isinstance(alpha, Sequence) or isinstance(alpha, str):
        raise MultiIndexError(
            f"{fname}: alpha must be a tuple of flat per-sample input indices, e.g. (0, 0, 1) "
            f"for d^3u/dx0^2 dx1; got {alpha!r}."
        )
    bad = [i for i in alpha if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
    if bad:
        raise MultiIndexError(
            f"{fname}: alpha's entries must be integer indices of the flat per-sample input; "
            f"got {bad[0]!r} of type {type(bad[0]).__name__} in {tuple(alpha)!r}."
        )
    if not alpha:
        raise MultiIndexError(
            f"{fname}: alpha=() is no derivative; pass at least one index (order 1 to "
            f"{partials.MAX_ORDER}), e.g. (0,) for du/dx0."
        )
    if len(alpha) > partials.MAX_ORDER:
        raise MultiIndexError(
            f"{fname}: alpha={tuple(alpha)!r} has order {len(alpha)}; the orders 1 to "
            f"{partials.MAX_ORDER} are computed. Nest a transform for higher orders."
        )
    return tuple(int(i) for i in alpha)


def _checked_terms(terms: Any, fname: str) -> tuple[tuple[Any, ...], tuple[tuple[int, ...], ...]]:
    """``(coefficients, alphas)`` of the terms ``[(c, alpha), ...]``."""
    if isinstance(terms, (str, bytes)) or not isinstance(terms, Sequence) or not terms:
        raise MultiIndexError(
            f"{fname}: terms must be a non-empty sequence of (coefficient, alpha) pairs, e.g. "
            f"[(1.0, (0, 0)), (1.0, (1, 1))] for u_xx + u_yy; got {terms!r}."
        )
    for term in terms:
        if not isinstance(term, Sequence) or len(term) != 2:
            raise MultiIndexError(
                f"{fname}: each term must be a pair (coefficient, alpha); got {term!r}."
            )
    return (
        tuple(c for c, _ in terms),
        tuple(_checked_alpha(alpha, fname) for _, alpha in terms),
    )


def _planned(call: Call, alphas: tuple[tuple[int, ...], ...]) -> list[partials.OrderPlan]:
    """The plans of the terms' orders, their indices checked against the input's size."""
    n = call.n_in
    for alpha in alphas:
        out = [i for i in alpha if not -n <= i < n]
        if out:
            raise MultiIndexError(
                f"{call.spec.fname}: alpha={alpha!r} has index {out[0]}, out of range for a "
                f"per-sample input of {n} elements (shape {call.in_sample}); the indices are "
                "of the flattened sample, 0 to n - 1."
            )
    return partials.plan([tuple(i % n for i in alpha) for alpha in alphas], n)


def _coefficients(call: Call, coefficients: tuple[Any, ...]) -> tuple[np.ndarray, Array | None]:
    """``(constants (T,), per_sample (B, T) or None)``: each term's coefficient, a number in
    ``constants`` (1 where it is per sample), the per-sample ones (arrays ``(B,)``, functions
    of the per-sample input) in ``per_sample`` (1 where it is a number)."""
    backend, B, fname = call.backend, call.batch_size, call.spec.fname
    constants = np.ones(len(coefficients))
    columns: list[Array | None] = []
    for t, c in enumerate(coefficients):
        if isinstance(c, numbers.Real) and not isinstance(c, bool):
            constants[t] = float(c)
            columns.append(None)
            continue
        if callable(c) and not backend.is_array(c):
            value = backend.per_sample(c, call.xb)
            where = f"coefficient {t} (a function of the per-sample input) returned"
        elif backend.is_array(c):
            value, where = c, f"coefficient {t} is"
        else:
            raise CoefficientError(
                f"{fname}: coefficient {t} must be a number, a {backend.array_noun} of shape "
                f"(B,) = ({B},), or a function of one input sample returning a scalar; got "
                f"{type(c).__name__}."
            )
        if tuple(value.shape) not in ((B,), (B, 1)) or not backend.is_floating_input(value.dtype):
            raise CoefficientError(
                f"{fname}: {where} of shape {tuple(value.shape)} and dtype {value.dtype}; a "
                f"per-sample coefficient is floating, one value per sample, shape (B,) = ({B},) "
                "(batch first)."
            )
        columns.append(backend.asarray(value, like=call.xb).reshape(B))
    if all(col is None for col in columns):
        return constants, None
    ones = backend.asarray(np.ones(B), like=call.xb)
    stacked = backend.stack([ones if col is None else col for col in columns])
    return constants, backend.moveaxis(stacked, 0, 1)


def _weights(call: Call, plan: partials.OrderPlan, coefficients: tuple[np.ndarray, Any]) -> Array:
    """The directions' weights ``[K]`` (shared) or ``[K, B]`` (per sample)."""
    constants, per_sample = coefficients
    folded = plan.weights * constants[None, :]  # (K, T)
    if per_sample is None:
        return call.backend.asarray(folded.sum(1), like=call.xb)
    return call.backend.asarray(folded, like=call.xb) @ call.backend.moveaxis(per_sample, 0, 1)


# --- the directional derivatives ----------------------------------------------------------------


def _weighted_sum(weights: Array, terms: Array) -> Array:
    """``sum_k weights[k] terms[k]``: weights ``[K]`` or ``[K, B]``, terms ``[K, B, *out]``."""
    w = weights if weights.ndim == 2 else weights[:, None]
    return (w.reshape(*w.shape, *(1,) * (terms.ndim - 2)) * terms).sum(0)


def _first(call: Call, directions: Array) -> Array:
    """``J v`` ``[K, B, *out]`` for the directions ``[K, B, *in]`` (JVPs)."""
    K = int(directions.shape[0])
    linear = call.backend.linearize(call, False)
    chunk = call.backend.ahead(Call.chunk, call, K, None, False)
    return linear.passes(directions, lambda c: c, lambda c, t, pushed: pushed, chunk, shared=False)


def _powers(call: Call, order: int, directions: Array, chunk_size: int | None) -> Array:
    """``(v . grad)^order u`` ``[K, B, *out]`` for ``order`` 3 or 4: the first- or second-order
    term of the second-order sweep, along ``v``, of the second-order sweep along ``v``."""
    backend, f, traced = call.backend, _values(call), call.traced
    backend.refuse_compiled_sweep(call, call.spec.fname)

    def power(v: Array) -> Array:
        def second(xb: Array) -> Array:
            return backend.second_order_sweep(
                f, xb, v[None], weights=None, collapse=True, traced=traced, nested=True
            )[2]

        swept = backend.second_order_sweep(
            second, call.xb, v[None], weights=None, collapse=False, nested=True
        )
        return swept[order - 2][0]

    chunk = sweep_chunk(call, int(directions.shape[0]), chunk_size)
    return backend.map_stacked(power, directions, chunk)


def _order_terms(call: Call, order: int, directions: Array, chunk_size: int | None) -> Array:
    """``(v_k . grad)^order u`` ``[K, B, *out]`` for the directions ``[K, B or 1, *in]``."""
    if order == 1:
        shape = (int(directions.shape[0]), call.batch_size, *call.in_sample)
        full = directions * call.backend.asarray(np.ones(shape), like=call.xb)
        return _first(call, full)
    if order == 2:
        return _sweep(call, directions, None, False, chunk_size)
    return _powers(call, order, directions, chunk_size)


def _order_value(
    call: Call, order: int, directions: Array, weights: Array, coupled: bool, chunk: int | None
) -> Array:
    """``sum_k w_k (v_k . grad)^order u`` ``[B, *out]``: directions ``[K, 1, *in]``, weights
    ``[K]`` or ``[K, B]``."""
    if coupled:
        directions, weights = _one_sample_at_a_time(call, directions, weights)
    elif order == 1:  # linear in the direction: one JVP along the weighted sum
        w = weights if weights.ndim == 2 else weights[:, None]
        flat = directions.reshape(int(directions.shape[0]), 1, -1)
        combined = (w[..., None] * flat).sum(0)  # (B or 1, n)
        return _order_terms(call, 1, combined.reshape(1, -1, *call.in_sample), chunk)[0]
    if order == 2:
        return _sweep(call, directions, weights, True, chunk)
    return _weighted_sum(weights, _order_terms(call, order, directions, chunk))


def _exact_values(
    call: Call, plans: list[partials.OrderPlan], coefficients: Any, coupled: bool, chunk: Any
) -> Array:
    """The operator ``[B, *out]``, one computation per order (``plans`` not empty)."""
    parts = [
        _order_value(
            call,
            plan.order,
            call.backend.asarray(
                plan.directions.reshape(len(plan.directions), 1, *call.in_sample), like=call.xb
            ),
            _weights(call, plan, coefficients),
            coupled,
            chunk,
        )
        for plan in plans
    ]
    return sum(parts[1:], parts[0])


# --- the stochastic estimate --------------------------------------------------------------------


def _uniforms(call: Call, randomness: Any, shape: tuple[int, ...]) -> Array:
    """Uniform draws on ``[0, 1)`` of ``shape``, from 24 random bits each."""
    bits = call.backend.draw(randomness, (*shape, 24), "rademacher", like=call.xb)
    scale = call.backend.asarray(0.5 ** np.arange(2, 26), like=call.xb)  # (r + 1)/2 * 2^-(b+1)
    return ((bits + 1) * scale).sum(-1)


def _sampled_values(
    call: Call,
    plans: list[partials.OrderPlan],
    coefficients: Any,
    opts: _Options,
    randomness: Any,
) -> tuple[Array, Array | None]:
    """The operator and its standard error, stratified by order: each order with one direction
    is exact; in each other order, ``k_d`` (direction, weight) pairs are drawn per sample,
    independently, with probabilities ``p_j`` proportional to ``|w_j| |v_j|^d`` (``w_j``'s
    number-coefficient part), and ``w_j (v_j . grad)^d u / p_j`` averaged (unbiased: its
    expectation is ``sum_j w_j (v_j . grad)^d u``). The budget ``num_probes`` is split over the sampled orders
    in proportion to their weights' mass, at least 2 each; the standard error is that of the
    sum of the orders' independent means."""
    backend, B = call.backend, call.batch_size
    if _is_probes(backend, randomness):
        raise NumProbesError(
            f"{call.spec.fname}: method={opts.method!r} samples the operator's directions "
            f"itself; pass a source of randomness ({backend.randomness_example}) rather than "
            "probes."
        )
    constants = coefficients[0]
    exact = [p for p in plans if len(p.directions) == 1]
    sampled = [p for p in plans if len(p.directions) > 1]
    means = [_exact_values(call, exact, coefficients, False, opts.chunk_size)] if exact else []
    variances = []
    # |w_j| |v_j|^d: the scale of each pair's term (|(v . grad)^d u| <= |v|^d |D^d u|).
    masses = [
        np.abs(p.weights * constants).sum(1) * np.linalg.norm(p.directions, axis=1) ** p.order
        for p in sampled
    ]
    total_mass = sum(m.sum() for m in masses) or 1.0
    k = _num_probes(call, opts, randomness)
    for plan, mass in zip(sampled, masses, strict=True):
        k_d = max(2, round(k * mass.sum() / total_mass))
        p = mass / mass.sum() if mass.sum() > 0 else np.full(len(mass), 1 / len(mass))
        cdf = backend.asarray(np.cumsum(p)[:-1], like=call.xb)
        index = (_uniforms(call, randomness, (k_d, B))[..., None] >= cdf).sum(-1)  # (k_d, B)
        chosen = backend.asarray(index[..., None] == backend.arange(len(p), call.xb), like=call.xb)
        directions = chosen @ backend.asarray(plan.directions.astype(float), like=call.xb)
        ratio = _weights(call, plan, coefficients)  # (K,) or (K, B)
        ratio = ratio[:, None] if ratio.ndim == 1 else ratio
        # w_j / p_j of each draw, (k_d, B)
        p_arr = backend.asarray(np.where(p > 0, p, 1.0), like=call.xb)  # p = 0: never drawn
        w_over_p = (chosen * (backend.moveaxis(ratio, 0, 1) / p_arr)[None]).sum(-1)
        shaped = directions.reshape(k_d, B, *call.in_sample)
        terms = _order_terms(call, plan.order, shaped, opts.chunk_size)
        terms = _weighted_terms(w_over_p, terms)
        m, err = _mean_and_stderr(call, terms, opts.return_stderr)
        means.append(m)
        if err is not None:
            variances.append(err * err)
    mean = sum(means[1:], means[0])  # at least one order
    if not opts.return_stderr:
        return mean, None
    if not variances:  # every order exact
        return mean, backend.zeros_like(mean)
    return mean, sum(variances[1:], variances[0]) ** 0.5


def _weighted_terms(weights: Array, terms: Array) -> Array:
    """``weights[k, b] * terms[k, b, ...]``."""
    return weights.reshape(*weights.shape, *(1,) * (terms.ndim - 2)) * terms


# --- the transforms -----------------------------------------------------------------------------


def _operator(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int | Sequence[int],
    coefficients: tuple[Any, ...],
    alphas: tuple[tuple[int, ...], ...],
    *,
    batch_axis: int | None,
    opts: _Options,
    has_aux: bool,
    coupling: Coupling,
    fname: str,
) -> Callable[..., Any]:
    stochastic_method = opts.method in SWEEP_STOCHASTIC

    def values(call: Call, randomness: Any) -> tuple[Array, Array | None]:
        plans = backend.ahead(_planned, call, alphas)
        coupled = backend.ahead(_plan, call, opts.method, stochastic_method).coupled
        c = _coefficients(call, coefficients)
        if stochastic_method:
            return _sampled_values(call, plans, c, opts, randomness)
        result = _exact_values(call, plans, c, coupled, opts.chunk_size)
        return result, (backend.zeros_like(result) if opts.return_stderr else None)

    def one(argnum: int) -> Callable[..., Any]:
        return _second_order_transform(
            backend, u, argnum, batch_axis, has_aux, coupling, opts, fname, values
        )

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)


def differential_operator(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    terms: Any,
    batch_axis: int | None,
    method: OperatorMethod,
    num_probes: int | None,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
) -> Callable[..., Any]:
    """``sum_t c_t d^{alpha_t} u`` per sample and output component (see
    ``divjac.jax.differential_operator``)."""
    fname = "differential_operator"
    check_option("method", method, OperatorMethod, fname=fname)
    check_option("coupling", coupling, Coupling, fname=fname)
    check_num_probes(num_probes, fname=fname)
    coefficients, alphas = _checked_terms(terms, fname)
    opts = _Options(method, num_probes, "rademacher", return_stderr, chunk_size)
    return _operator(
        backend,
        u,
        argnums,
        coefficients,
        alphas,
        batch_axis=batch_axis,
        opts=opts,
        has_aux=has_aux,
        coupling=coupling,
        fname=fname,
    )


def derivative(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    alpha: Any,
    batch_axis: int | None,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
) -> Callable[..., Any]:
    """The mixed partial ``d^alpha u`` per sample and output component (see
    ``divjac.jax.derivative``)."""
    fname = "derivative"
    check_option("coupling", coupling, Coupling, fname=fname)
    opts = _Options("exact", None, "rademacher", False, chunk_size)
    return _operator(
        backend,
        u,
        argnums,
        (1.0,),
        (_checked_alpha(alpha, fname),),
        batch_axis=batch_axis,
        opts=opts,
        has_aux=has_aux,
        coupling=coupling,
        fname=fname,
    )
