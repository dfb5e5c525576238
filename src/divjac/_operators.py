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
4 one collapsed Taylor sweep of that order where the backend has one
(:meth:`~divjac._backend.Backend.taylor_sweep`: each direction's lower coefficients, the top
one summed), else the first- and second-order terms of a second-order sweep of the
second-order sweep along each direction (``(v . grad)^2`` of ``(v . grad)^2 u``), the
directions a batch axis in chunks (:meth:`~divjac._backend.Backend.map_stacked`). With
``method="auto"``, where the Hessian's pattern has a diagonal coloring, the pure powers
``d^k u/dx_i^k`` of one color are one direction (:func:`divjac._core.partials.merged`): a
separable ``u``'s diagonal terms cost its colors, not its inputs. The stochastic methods
compute exactly the orders their budget pays for and sample the (direction, weight) pairs of
the others (:func:`_sampled_values`). Imports neither JAX nor PyTorch.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._backend import Array, Backend
from ._call import Call, Coupling, OperatorMethod, check_num_probes, check_option
from ._core import partials
from ._divergence import is_probes
from ._errors import CoefficientError, MultiIndexError, NumProbesError
from ._second import SWEEP_STOCHASTIC, second_order_transform
from ._second_order_sweep import (
    Options,
    _num_probes,
    _plan,
    _sweep,
    _values,
    one_sample_at_a_time,
    powers,
    weighted_sum,
)
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


def _is_number(c: Any) -> bool:
    return isinstance(c, numbers.Real) and not isinstance(c, bool)


def _constants(coefficients: tuple[Any, ...]) -> np.ndarray:
    """Each term's coefficient where it is a number, 1 where it is per sample: made once per
    transform, so that its device copy is made once too (:meth:`Backend.on_device`)."""
    return np.array([float(c) if _is_number(c) else 1.0 for c in coefficients])


def _device(call: Call, host: np.ndarray) -> Array:
    """A host array of the transform or its plan (kept while they live) as an array of the
    call's dtype on its device, copied from the host once per device."""
    return call.backend.asarray(call.backend.on_device(host, call.xb), like=call.xb)


def _coefficients(
    call: Call, coefficients: tuple[Any, ...], constants: np.ndarray
) -> tuple[np.ndarray, Array | None]:
    """``(constants (T,), per_sample (B, T) or None)``: each term's coefficient, a number in
    ``constants`` (1 where it is per sample), the per-sample ones (arrays ``(B,)``, functions
    of the per-sample input) in ``per_sample`` (1 where it is a number)."""
    backend, B, fname = call.backend, call.batch_size, call.spec.fname
    columns: list[Array | None] = []
    for t, c in enumerate(coefficients):
        if _is_number(c):
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
    ones = backend.asarray(backend.arange(B, call.xb) >= 0, like=call.xb)
    stacked = backend.stack([ones if col is None else col for col in columns])
    return constants, backend.moveaxis(stacked, 0, 1)


def _weights(call: Call, plan: partials.OrderPlan, coefficients: tuple[np.ndarray, Any]) -> Array:
    """The directions' weights ``[K]`` (shared) or ``[K, B]`` (per sample)."""
    constants, per_sample = coefficients
    folded = _device(call, plan.weights) * _device(call, constants)[None, :]  # (K, T)
    if per_sample is None:
        return folded.sum(1)
    return folded @ call.backend.moveaxis(per_sample, 0, 1)


# --- the directional derivatives ----------------------------------------------------------------


def _first(call: Call, directions: Array) -> Array:
    """``J v`` ``[K, B, *out]`` for the directions ``[K, B, *in]`` (JVPs)."""
    K = int(directions.shape[0])
    linear = call.backend.linearize(call, reverse=False)
    chunk = call.backend.ahead(Call.chunk, call, K, None, False)
    return linear.passes(directions, lambda c: c, lambda c, t, pushed: pushed, chunk, shared=False)


def _order_terms(call: Call, order: int, directions: Array, chunk_size: int | None) -> Array:
    """``(v_k . grad)^order u`` ``[K, B, *out]`` for the directions ``[K, B or 1, *in]``."""
    if order == 1:
        full = directions + call.backend.zeros_like(call.xb)[None]  # [K, B, *in]
        if call.backend.first_order_by_sweep():
            return call.backend.second_order_sweep(
                _values(call), call.xb, full, weights=None, collapse=False, point=call
            )[1]
        return _first(call, full)
    if order == 2:
        return _sweep(call, directions, None, collapse=False, chunk_size=chunk_size)
    return powers(call, order, directions, None, chunk_size)


def _order_value(
    call: Call, order: int, directions: Array, weights: Array, coupled: bool, chunk: int | None
) -> Array:
    """``sum_k w_k (v_k . grad)^order u`` ``[B, *out]``: directions ``[K, 1, *in]``, weights
    ``[K]`` or ``[K, B]``."""
    if coupled:
        directions, weights = one_sample_at_a_time(call, directions, weights)
    elif order == 1:  # linear in the direction: one JVP along the weighted sum
        w = weights if weights.ndim == 2 else weights[:, None]
        flat = directions.reshape(int(directions.shape[0]), 1, -1)
        combined = (w[..., None] * flat).sum(0)  # (B or 1, n)
        return _order_terms(call, 1, combined.reshape(1, -1, *call.in_sample), chunk)[0]
    if order == 2:
        return _sweep(call, directions, weights, collapse=True, chunk_size=chunk)
    if order == 1:  # coupled: a JVP per sample and direction
        return weighted_sum(weights, _order_terms(call, 1, directions, chunk))
    return powers(call, order, directions, weights, chunk)


def _exact_values(
    call: Call,
    plans: list[partials.OrderPlan],
    coefficients: Any,
    *,
    coupled: bool,
    chunk: Any,
) -> Array:
    """The operator ``[B, *out]``, one computation per order (``plans`` not empty)."""
    parts = [
        _order_value(
            call,
            plan.order,
            _device(call, plan.directions).reshape(len(plan.directions), 1, *call.in_sample),
            _weights(call, plan, coefficients),
            coupled,
            chunk,
        )
        for plan in plans
    ]
    return sum(parts[1:], parts[0])


# --- the stochastic estimate --------------------------------------------------------------------


_BIT_SCALES = 0.5 ** np.arange(2, 26)
"""The scale of each of 24 random signs ``r`` in a uniform draw: ``(r + 1)/2 * 2^-(b+1)``."""


def _uniforms(call: Call, randomness: Any, shape: tuple[int, ...]) -> Array:
    """Uniform draws on ``[0, 1)`` of ``shape``, from 24 random bits each."""
    bits = call.backend.draw(randomness, (*shape, 24), "rademacher", like=call.xb)
    scale = _device(call, _BIT_SCALES)
    return ((bits + 1) * scale).sum(-1)


def _masses(plan: partials.OrderPlan, constants: np.ndarray, call: Call | None = None) -> Any:
    """``|w_j| |v_j|^d`` of an order's pairs (``w_j``'s number-coefficient part): the scale of
    each pair's term (``|(v . grad)^d u| <= |v|^d |D^d u|``). On the host, or with ``call`` on
    its device (the plan's arrays copied once)."""
    weights, directions, c = plan.weights, plan.directions, constants
    if call is not None:
        weights, directions, c = (_device(call, a) for a in (weights, directions, c))
    scale = ((directions * directions).sum(1) ** 0.5) ** plan.order
    return abs(weights * c[None, :]).sum(1) * scale


def _strata(plans: list[partials.OrderPlan], constants: np.ndarray, k: int) -> list[int | None]:
    """Per order, ``None`` where it is computed exactly, else its number of sampled pairs.

    Order 1 (one JVP along the weighted sum) and an order of one direction are exact at no
    cost in the budget. Of the others, while one has no more directions than its share of the
    budget left (shares in proportion to the orders' masses, to their numbers of directions
    where no order left has mass, at least 2 each), the one of fewest directions is computed
    exactly and its directions leave the budget; the rest are sampled, each its share. A
    budget of every direction computes every order exactly (some order's share is always at
    least its directions then)."""
    exact = [p.order == 1 or len(p.directions) == 1 for p in plans]
    mass = [float(_masses(p, constants).sum()) for p in plans]
    left = k
    while True:
        open_ = [i for i, done in enumerate(exact) if not done]
        if not any(mass[i] > 0 for i in open_):  # zero coefficients
            mass = [float(len(p.directions)) for p in plans]
        total = sum(mass[i] for i in open_) or 1.0
        shares = {i: max(2, round(left * mass[i] / total)) for i in open_}
        fits = [i for i in open_ if len(plans[i].directions) <= min(shares[i], left)]
        if not fits:
            return [None if exact[i] else shares[i] for i in range(len(plans))]
        smallest = min(fits, key=lambda i: len(plans[i].directions))
        exact[smallest] = True
        left -= len(plans[smallest].directions)


def _exact_budget(plans: list[partials.OrderPlan], constants: np.ndarray) -> int:
    """The least budget from which every budget computes every order exactly (every sampled
    order's directions, counted once, always do)."""
    k = sum(len(p.directions) for p in plans if p.order > 1 and len(p.directions) > 1)
    while k > 1 and all(s is None for s in _strata(plans, constants, k - 1)):
        k -= 1
    return max(k, 1)


def _sampled_values(
    call: Call,
    plans: list[partials.OrderPlan],
    coefficients: Any,
    opts: Options,
    randomness: Any,
) -> tuple[Array, Array | None]:
    """The operator, stratified by order (:func:`_strata`): the orders within the budget
    exact, and in each other order ``k_d`` (direction, weight) pairs drawn per sample,
    independently, with probabilities ``p_j`` proportional to ``|w_j| |v_j|^d``, and
    ``w_j (v_j . grad)^d u / p_j`` averaged (unbiased: its expectation is
    ``sum_j w_j (v_j . grad)^d u``). A standard error is given only where every order is exact
    (stderr 0): a sampled order's terms take few values or are heavy-tailed, and their spread
    covered 0.49-0.96 (docs/calibration.md), so ``return_stderr=True`` below the exact
    budget raises :class:`~divjac.NumProbesError` naming it."""
    backend, B = call.backend, call.batch_size
    if is_probes(backend, randomness):
        raise NumProbesError(
            f"{call.spec.fname}: method={opts.method!r} samples the operator's directions "
            f"itself; pass a source of randomness ({backend.randomness_example}) rather than "
            "probes."
        )
    constants = coefficients[0]
    strata = _strata(plans, constants, _num_probes(call, opts, randomness))
    if opts.return_stderr and any(s is not None for s in strata):
        needed = _exact_budget(plans, constants)
        raise NumProbesError(
            f"{call.spec.fname}: return_stderr=True with method={opts.method!r} needs "
            f"num_probes >= {needed} here (every direction of the operator's orders: the exact "
            "value, stderr 0); a sampled order's terms take few values or are heavy-tailed and "
            "their spread is no error bar that holds (docs/calibration.md). Pass "
            f"num_probes={needed}, method='exact', or return_stderr=False."
        )
    exact = [p for p, s in zip(plans, strata, strict=True) if s is None]
    means = (
        [_exact_values(call, exact, coefficients, coupled=False, chunk=opts.chunk_size)]
        if exact
        else []
    )
    for plan, k_d in zip(plans, strata, strict=True):
        if k_d is None:
            continue
        mass = _masses(plan, constants, call)  # on the device; uniform where all are 0
        p = mass / mass.sum() if _masses(plan, constants).sum() > 0 else mass * 0 + 1 / len(mass)
        cdf = p.cumsum(0)[:-1]
        index = (_uniforms(call, randomness, (k_d, B))[..., None] >= cdf).sum(-1)  # (k_d, B)
        chosen = backend.asarray(index[..., None] == backend.arange(len(p), call.xb), like=call.xb)
        directions = chosen @ _device(call, plan.directions)
        ratio = _weights(call, plan, coefficients)  # (K,) or (K, B)
        ratio = ratio[:, None] if ratio.ndim == 1 else ratio
        # w_j / p_j of each draw, (k_d, B)
        p_arr = p + (p == 0)  # p = 0: never drawn
        w_over_p = (chosen * (backend.moveaxis(ratio, 0, 1) / p_arr)[None]).sum(-1)
        shaped = directions.reshape(k_d, B, *call.in_sample)
        terms = _order_terms(call, plan.order, shaped, opts.chunk_size)
        means.append(_weighted_terms(w_over_p, terms).mean(0))
    mean = sum(means[1:], means[0])  # at least one order
    return mean, (backend.zeros_like(mean) if opts.return_stderr else None)


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
    opts: Options,
    has_aux: bool,
    coupling: Coupling,
    fname: str,
) -> Callable[..., Any]:
    stochastic_method = opts.method in SWEEP_STOCHASTIC
    constants = _constants(coefficients)

    def held_constants(call: Call) -> np.ndarray:
        return constants

    def colored(call: Call) -> tuple[list[partials.OrderPlan], np.ndarray] | None:
        """The plans merged by the colors of the Hessian's pattern (where ``"auto"`` found
        them, and every coefficient is a number), with their one term's coefficient."""
        colors = _plan(call, opts.method, stochastic_method).colors
        if colors is None or not all(_is_number(c) for c in coefficients):
            return None
        plans = _planned(call, alphas)
        return [partials.merged(p, constants, colors) for p in plans], np.ones(1)

    def values(call: Call, randomness: Any) -> tuple[Array, Array | None]:
        plans = backend.ahead(_planned, call, alphas)
        coupled = backend.ahead(_plan, call, opts.method, stochastic_method).coupled
        # The constants reach the passes as a setup's result: read from this closure under
        # torch.compile, dynamo guards the array as a tensor, a guard that fails as it is
        # made under inference_mode (torch 2.13, "Guard failed on the same frame").
        c = _coefficients(call, coefficients, backend.ahead(held_constants, call))
        if stochastic_method:
            return _sampled_values(call, plans, c, opts, randomness)
        merged = None if coupled else backend.ahead(colored, call)
        if merged is not None:
            plans, c = merged[0], (merged[1], None)
        result = _exact_values(call, plans, c, coupled=coupled, chunk=opts.chunk_size)
        return result, (backend.zeros_like(result) if opts.return_stderr else None)

    def one(argnum: int) -> Callable[..., Any]:
        return second_order_transform(
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
    opts = Options(method, num_probes, "rademacher", return_stderr, chunk_size)
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
    opts = Options("exact", None, "rademacher", return_stderr=False, chunk_size=chunk_size)
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
