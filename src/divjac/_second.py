"""Second-order operators of a batched function, written once over a backend: the Laplacian,
the weighted Laplacian ``tr(A H)``, the Hessian and its diagonal, per sample.

The operators that are sums of second directional derivatives ``v^T H v`` are read from one
second-order Taylor sweep (:meth:`~divjac._backend.Backend.second_order_sweep`, the collapsed
Taylor mode / forward Laplacian of the framework's ``_taylor`` module): with the unit basis the
summed term is the Laplacian (``"exact"``); with the indicators of a diagonal coloring of the
per-sample Hessian pattern it is again the Laplacian, in ``#colors`` directions
(``"sparse"``); with a factor ``S`` of ``A = S S^T`` it is ``tr(A H)`` in ``rank(S)``
directions; with random probes each term is a Hutchinson sample, and with random coordinates
an STDE one (Shi et al. 2024). The Hessian and its sparse or stochastic diagonal need
Hessian-vector products: they are Jacobian passes of the per-sample gradient
(forward-over-reverse). The Hessian pattern is that of the per-sample gradient's Jacobian,
detected by the engine as for any function. Imports neither JAX nor PyTorch.

References:
    - Li, Zhang, Wang, Ren & Chen (2023), "A computational framework for neural network-based
      variational Monte Carlo with Forward Laplacian", arXiv:2307.08214.
    - Dangel, Siebert, Zeinhofer & Walther (2025), "Collapsing Taylor mode automatic
      differentiation", NeurIPS.
    - Shi, Hu, Lin & Kawaguchi (2024), "Stochastic Taylor derivative estimator: efficient
      amortization for arbitrary differential operators", NeurIPS.
    - Bekas, Kokiopoulou & Saad (2007), "An estimator for the diagonal of a matrix", Applied
      Numerical Mathematics 57.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from . import _transforms as T
from ._backend import Array, Backend
from ._call import (
    BiLaplacianMethod,
    Call,
    Coupling,
    DiagonalMethod,
    Distribution,
    LaplacianMethod,
    Method,
    Mode,
    Spec,
    WeightedMethod,
    check_num_probes,
    check_option,
    prepare,
)
from ._core import checks, estimators as est, stochastic
from ._divergence import (
    _divergence_transform,
    _DivSpec,
    _draw,
    _is_probes,
    _itself,
    _split_randomness,
)
from ._errors import ArgnumsError, CoefficientError, NumProbesError, OptionError, OutputError
from ._transforms import auto_detects, per_argnum, shaped, tuple_of

__all__ = [
    "SWEEP_STOCHASTIC",
    "bilaplacian",
    "coefficient_of",
    "hessian",
    "hessian_diagonal",
    "laplacian",
    "weighted_laplacian",
]

_HVP_METHODS = ("hutch++", "xtrace", "probing")
"""Laplacian methods estimated from Hessian-vector products (the divergence of the gradient)."""

SWEEP_STOCHASTIC = ("hutchinson", "stde")
"""The stochastic methods read from the Taylor sweep (their randomness comes first)."""


@dataclass(frozen=True)
class _Options:
    """The options of a second-order transform."""

    method: str
    num_probes: int | None
    distribution: Distribution
    return_stderr: bool
    chunk_size: int | None


@dataclass(frozen=True)
class _Plan:
    """How a call's directions are chosen, planned ahead of the sweep.

    Attributes:
        coupled: the function mixes samples (``coupling="exact"``): each direction is placed
            in one sample at a time.
        colors: the colors of the Hessian pattern whose indicators are the directions;
            ``None``: dense (the unit basis).
    """

    coupled: bool
    colors: np.ndarray | None


# --- the functions and their calls --------------------------------------------------------------


def _gradient(
    backend: Backend[Any], u: Callable[..., Any], argnum: int, has_aux: bool, fname: str
) -> Any:
    """The per-sample gradient of ``u`` (of the sum of its output components) w.r.t. argument
    ``argnum``: a batched function with ``u``'s signature (``(gradient, aux)`` with ``has_aux``)."""

    def gradient(*args: Any, **kwargs: Any) -> Any:
        at = checks.normalize_argnum(argnum, len(args), fname=fname)

        def values(x: Array) -> Any:
            return u(*args[:at], x, *args[at + 1 :], **kwargs)

        return backend.grad_of_sum(values, args[at], has_aux=has_aux)

    return gradient


def _values(call: Call) -> Callable[[Array], Array]:
    """The call's batch-first function without its aux."""
    if call.has_aux:
        return lambda xb: call.g(xb)[0]
    return call.g


def _aux(call: Call) -> Any:
    """The call's aux (one more forward evaluation), ``None`` without ``has_aux``."""
    return call.g(call.xb)[1] if call.has_aux else None


def _require_scalar(call: Call) -> None:
    if math.prod(call.out_sample) != 1:
        raise OutputError(
            f"{call.spec.fname}: u must return one scalar per sample (output shape (B,) or "
            f"(B, 1)); its per-sample output has shape {call.out_sample}. Use laplacian or "
            "weighted_laplacian (per output component), or jacobian, for vector outputs."
        )


def _unbatch(call: Call, result: Array, batch_axis: int | None) -> Array:
    """A batch-first result with the layout of ``u``'s output."""
    if batch_axis is None:
        return result[0]
    return call.backend.moveaxis(result, 0, batch_axis % result.ndim)


def _plan(call: Call, method: str, stochastic_method: bool) -> _Plan:
    """Check coupling (raising as ``coupling`` says) and choose the directions: the colors of
    a diagonal coloring of the detected Hessian pattern (same-colored ``i != j`` have
    ``H_ij = H_ji = 0``) for ``"sparse"``, and for ``"auto"`` when they are at most half the
    unit basis."""
    found = call.detect(per_sample=False)
    if found.coupling is not None:
        if stochastic_method:
            raise checks.coupling_error(found.coupling, fname=call.spec.fname, method=method)
        return _Plan(True, None)
    if method not in ("sparse", "auto"):
        return _Plan(False, None)
    # The gradient's spec made here: under torch.compile this runs ahead of dynamo's trace,
    # which cannot take the gradient's closure as an argument.
    grad_call = prepare(_grad_spec(call.spec), call.args, call.kwargs)
    if method == "auto" and not auto_detects(grad_call, call.n_in):
        return _Plan(False, None)  # the colours could not pay for the detection
    hess = grad_call.detect(per_sample=True, auto=method == "auto")
    if hess.coupling is not None or hess.pattern is None:  # too dense to finish (auto)
        return _Plan(False, None)
    pattern = hess.pattern
    if method == "auto" and 2 * pattern.n_diagonal_colors > call.n_in:
        return _Plan(False, None)
    return _Plan(False, np.asarray(pattern.diagonal_colors, np.int64))


def _grad_spec(spec: Spec) -> Spec:
    """The spec of the per-sample gradient of ``spec``'s function (its Hessian's pattern)."""
    backend = spec.backend
    return Spec(
        backend,
        _gradient(backend, spec.fun, spec.argnums, spec.has_aux, spec.fname),
        spec.argnums,
        spec.batch_axis,
        spec.has_aux,
        "exact",  # u's coupling is checked on u itself
        spec.fname,
    )


# --- directions ---------------------------------------------------------------------------------


def _basis(call: Call, colors: np.ndarray | None) -> Array:
    """Shared directions ``[K, 1, *in]``: the unit basis, or the indicators of ``colors``."""
    n = call.n_in
    if colors is None:
        matrix = np.eye(n)
    else:
        n_colors = int(colors.max()) + 1 if colors.size else 0
        matrix = (colors[None, :] == np.arange(n_colors)[:, None]).astype(float)
    return call.backend.asarray(matrix.reshape(len(matrix), 1, *call.in_sample), like=call.xb)


def _one_sample_at_a_time(
    call: Call, directions: Array, weights: Array | None
) -> tuple[Array, Array]:
    """Directions ``[B*K, B, *in]`` placing each of ``[K, B or 1, *in]`` in one sample only, and
    the weights ``[B*K, B]`` that keep, in each sample, its own directions' terms (times their
    ``weights`` ``[K]``): the exact per-sample sums of a function that mixes samples."""
    backend, B = call.backend, call.batch_size
    K, n = int(directions.shape[0]), call.n_in
    flat = directions.reshape(K, -1, n)
    eye = backend.asarray(np.eye(B), like=call.xb)
    spread = (eye[:, None, :, None] * flat[None]).reshape(B * K, B, *call.in_sample)
    w = backend.asarray(np.ones(K), like=call.xb) if weights is None else weights
    return spread, (eye[:, None, :] * w[None, :, None]).reshape(B * K, B)


def _own_terms(call: Call, terms: Array) -> Array:
    """``[K, B, *out]`` from the per-direction terms ``[B*K, B, *out]`` of
    :func:`_one_sample_at_a_time`: each sample's terms of its own directions."""
    B = call.batch_size
    m = math.prod(call.out_sample)
    eye = call.backend.asarray(np.eye(B), like=call.xb)
    own = (terms.reshape(B, -1, B, m) * eye[:, None, :, None]).sum(2)  # (B, K, m)
    return call.backend.moveaxis(own, 0, 1).reshape(-1, B, *call.out_sample)


def _sweep(
    call: Call, directions: Array, weights: Array | None, collapse: bool, chunk_size: int | None
) -> Array:
    """The second-order terms of the sweep of ``directions`` (summed with ``weights`` when
    ``collapse``), ``chunk_size`` directions at a time."""
    backend = call.backend
    K = int(directions.shape[0])
    chunk = backend.ahead(Call.chunk, call, K, chunk_size)
    if K == 0:  # an empty sample: no direction, every second-order term is zero
        passes = () if collapse else (0,)
        zeros = np.zeros((*passes, call.batch_size, *call.out_sample))
        return backend.asarray(zeros, like=call.xb)
    f = _values(call)

    def run(xb: Array, v: Array, w: Array | None) -> Array:
        return backend.second_order_sweep(f, xb, v, weights=w, collapse=collapse)[2]

    swept = backend.checkpointed(call, -(-K // chunk))(run)
    parts = []
    for start in range(0, K, chunk):
        w = None if weights is None else weights[start : start + chunk]
        parts.append(swept(call.xb, directions[start : start + chunk], w))
    if collapse:
        return sum(parts[1:], parts[0])
    return parts[0] if len(parts) == 1 else backend.concatenate(parts)


def _mean_and_stderr(call: Call, terms: Array, stderr: bool) -> tuple[Array, Array | None]:
    """Mean over ``k`` of independent terms ``[k, B, *shape]`` and its standard error."""
    k = int(terms.shape[0])
    if stderr and k < 2:
        raise NumProbesError(
            f"{call.spec.fname}: return_stderr=True needs at least 2 probes (the spread of "
            "their terms is the error bar); pass num_probes=2 or more."
        )
    shape = tuple(terms.shape[1:])
    mean, err = est.hutchinson_from_terms(terms.reshape(k, -1), stderr=stderr)
    return mean.reshape(shape), None if err is None else err.reshape(shape)


def _num_probes(opts: _Options, n: int) -> int:
    return opts.num_probes or stochastic.default_num_probes("hutchinson", n)


def _coordinates(call: Call, randomness: Any, k: int) -> Array:
    """``k`` distinct random unit directions per sample, ``[k, B, *in]`` (STDE's jets)."""
    backend, B, n = call.backend, call.batch_size, call.n_in
    if _is_probes(backend, randomness):
        raise NumProbesError(
            f"{call.spec.fname}: method='stde' samples coordinates itself; pass a source of "
            f"randomness ({backend.randomness_example}) rather than probes."
        )
    order = backend.draw(randomness, (B, n), "gaussian", like=call.xb).argsort(-1)[:, :k]
    chosen = order[..., None] == backend.arange(n, call.xb)  # (B, k, n)
    unit = backend.asarray(chosen, like=call.xb)
    return backend.moveaxis(unit, 1, 0).reshape(k, B, *call.in_sample)


# --- the Laplacian ------------------------------------------------------------------------------


def _laplacian_values(call: Call, opts: _Options, randomness: Any) -> tuple[Array, Array | None]:
    """``(Laplacian, stderr or None)``, batch first ``(B, *out)``."""
    stochastic_method = opts.method in SWEEP_STOCHASTIC
    planned = call.backend.ahead(_plan, call, opts.method, stochastic_method)
    # A budget of n directions or more pays for the exact sweep (n directions, no error).
    if opts.method == "hutchinson" and _num_probes(opts, call.n_in) < call.n_in:
        k = _num_probes(opts, call.n_in)
        probes = _draw(call, randomness, k, opts.distribution)
        if opts.return_stderr:
            return _calibrated_laplacian(call, probes, opts)
        return _sweep(call, probes, None, True, opts.chunk_size) / k, None
    if opts.method == "stde":
        n = call.n_in
        k = min(_num_probes(opts, n), n)
        if opts.return_stderr and k < n:
            raise NumProbesError(
                f"{call.spec.fname}: method='stde' has no error bar that holds below n = {n} "
                "coordinates (a coordinate not drawn is not seen: its terms' spread covered "
                f"0.75-0.93, docs/calibration.md); pass num_probes={n} (exact, stderr 0), or "
                "use method='hutchinson' with return_stderr=True."
            )
        terms = _sweep(call, _coordinates(call, randomness, k), None, False, opts.chunk_size)
        mean, err = _mean_and_stderr(call, n * terms, opts.return_stderr)
        # Coordinates drawn without replacement: the finite-population correction.
        return mean, None if err is None else err * math.sqrt(1 - k / n)
    directions, weights = _basis(call, planned.colors), None
    if planned.coupled:
        directions, weights = _one_sample_at_a_time(call, directions, None)
    second = _sweep(call, directions, weights, True, opts.chunk_size)
    return second, (call.backend.zeros_like(second) if opts.return_stderr else None)


def _calibrated_laplacian(call: Call, probes: Array, opts: _Options) -> tuple[Array, Array]:
    """Hutchinson's Laplacian with a standard error that holds: the probes' Hessian-vector
    products ``H v`` (forward-over-reverse) give the terms ``v^T H v`` and the variance bound
    of :func:`~divjac._core.estimators.mean_and_stderr`, which the terms alone do not (a Taylor
    sweep's terms covered 0.69-0.84 at a few probes, docs/calibration.md)."""
    k = int(probes.shape[0])
    images = _hessian_images(call, probes, k, opts.chunk_size)
    return _calibrated_trace(call, probes.reshape(k, call.batch_size, -1), images)


def _hessian_images(call: Call, probes: Array, k: int, chunk_size: int | None) -> Array:
    """``H v`` ``(k, B, n)`` for the probes ``v`` ``(k, B, *in)`` of a scalar-per-sample ``u``
    below ``n`` probes, for a standard error (refused otherwise, naming the way out)."""
    n = call.n_in
    if math.prod(call.out_sample) != 1:
        raise NumProbesError(
            f"{call.spec.fname}: return_stderr=True with method='hutchinson' below n = {n} "
            "probes needs the Hessian-vector products of a scalar-per-sample u; this u has "
            f"outputs of shape {call.out_sample}: pass num_probes={n} (exact, stderr 0), "
            "return_stderr=False, or each output component as its own function."
        )
    _checked_stderr_budget(call, k)
    return _own_products(call, _grad_spec(call.spec), probes, _itself, k, chunk_size, False, False)


def _calibrated_trace(call: Call, probes: Array, images: Array) -> tuple[Array, Array]:
    """Hutchinson's mean of ``v^T M v`` and its standard error from the probes ``v`` and their
    images ``M v``, both ``(k, B, m)``, shaped as ``u``'s output ``(B, *out)``."""
    backend = call.backend
    v, mv = (backend.moveaxis(a, 0, -1) for a in (probes, images))
    mean, err = est.mean_and_stderr((v * mv).sum(-2), est.namespace(v), mv, v)
    shape = (call.batch_size, *call.out_sample)
    return mean.reshape(shape), err.reshape(shape)


def _checked_stderr_budget(call: Call, k: int, least: int = 2) -> None:
    if k < least:
        raise NumProbesError(
            f"{call.spec.fname}: return_stderr=True needs at least {least} probes below n "
            f"(the error bar is estimated from them); pass num_probes={least} or more."
        )


def _second_order_transform(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnum: int,
    batch_axis: int | None,
    has_aux: bool,
    coupling: Coupling,
    opts: _Options,
    fname: str,
    values: Callable[..., tuple[Array, Array | None]],
) -> Callable[..., Any]:
    """``(*args) -> result``: ``values(call, randomness)`` laid out as ``u``'s
    output, with its stderr and aux as asked."""
    spec = Spec(backend, u, argnum, batch_axis, has_aux, coupling, fname)
    stochastic_method = opts.method in SWEEP_STOCHASTIC

    def transformed(*args: Any, **kwargs: Any) -> Any:
        randomness, args = _split_randomness(backend, stochastic_method, args, fname)
        call = prepare(spec, args, kwargs)
        result, err = values(call, randomness[0] if randomness else None)
        result = _unbatch(call, result, batch_axis)
        out = (result, _unbatch(call, err, batch_axis)) if opts.return_stderr else result
        return (out, _aux(call)) if has_aux else out

    return transformed


def _check_options(opts: _Options, coupling: Coupling, methods: Any, fname: str) -> None:
    check_option("method", opts.method, methods, fname=fname)
    check_option("distribution", opts.distribution, Distribution, fname=fname)
    check_option("coupling", coupling, Coupling, fname=fname)
    check_num_probes(opts.num_probes, fname=fname)


def laplacian(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    method: LaplacianMethod,
    num_probes: int | None,
    distribution: Distribution,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
) -> Callable[..., Any]:
    """Per-sample Laplacian of each output component (see ``divjac.jax.laplacian``)."""
    fname = "laplacian"
    opts = _Options(method, num_probes, distribution, return_stderr, chunk_size)
    _check_options(opts, coupling, LaplacianMethod, fname)

    def one(argnum: int) -> Callable[..., Any]:
        if method in _HVP_METHODS:
            return _hvp_laplacian(backend, u, argnum, batch_axis, has_aux, coupling, opts)

        def values(call: Call, randomness: Any) -> Any:
            return _laplacian_values(call, opts, randomness)

        return _second_order_transform(
            backend, u, argnum, batch_axis, has_aux, coupling, opts, fname, values
        )

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)


def _hvp_laplacian(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnum: int,
    batch_axis: int | None,
    has_aux: bool,
    coupling: Coupling,
    opts: _Options,
) -> Callable[..., Any]:
    """The Laplacian of a scalar-per-sample ``u`` as the divergence of its gradient, for the
    estimators that need Hessian-vector products (Hutch++, XTrace, probing)."""
    fname = "laplacian"
    spec = Spec(backend, u, argnum, batch_axis, has_aux, coupling, fname)
    ds = _DivSpec(
        cast(Method, opts.method),  # one of the divergence's stochastic methods
        "auto",
        opts.num_probes,
        opts.distribution,
        opts.return_stderr,
        opts.chunk_size,
        None,
    )
    gradient = _gradient(backend, u, argnum, has_aux, fname)
    inner = _divergence_transform(
        backend, gradient, argnum, batch_axis, has_aux, coupling, ds, fname, False
    )

    def lap_fn(*args: Any, **kwargs: Any) -> Any:
        _, own = _split_randomness(backend, True, args, fname)
        call = prepare(spec, own, kwargs)
        backend.ahead(_require_scalar, call)
        _, lap, aux = inner(*args, **kwargs)
        return (lap, aux) if has_aux else lap

    return lap_fn


# --- the weighted Laplacian tr(A H) -------------------------------------------------------------


def _coefficient(call: Call, coefficient: Any, is_factor: bool) -> tuple[Array, bool]:
    """``A`` (``(n, n)`` or ``(B, n, n)``) or its factor ``S`` (``(n, r)`` or ``(B, n, r)``)
    checked, in the input's dtype, and whether it is per sample."""
    backend, fname = call.backend, call.spec.fname
    name = "factor" if is_factor else "A"
    if not backend.is_array(coefficient):
        raise CoefficientError(
            f"{fname}: {name} must be a {backend.array_noun}; got {type(coefficient).__name__}."
        )
    if not backend.is_floating_input(coefficient.dtype):
        raise CoefficientError(
            f"{fname}: {name} must be a floating {backend.array_noun}; got dtype "
            f"{coefficient.dtype}."
        )
    shape, n, B = tuple(coefficient.shape), call.n_in, call.batch_size
    want = "(n, r) or (B, n, r)" if is_factor else "(n, n) or (B, n, n)"
    fits = (
        len(shape) in (2, 3)
        and shape[-2] == n
        and (is_factor or shape[-1] == n)
        and (len(shape) == 2 or shape[0] == B)
    )
    if not fits:
        raise CoefficientError(
            f"{fname}: {name} must have shape {want} with n = {n} (the elements of one input "
            f"sample {call.in_sample}) and B = {B} (per sample, batch first); got {shape}."
        )
    return backend.asarray(coefficient, like=call.xb), len(shape) == 3


def _weighted_values(
    call: Call, coefficient: Any, is_factor: bool, opts: _Options, randomness: Any
) -> tuple[Array, Array | None]:
    """``(tr(A H), stderr or None)`` per sample and output component, batch first.

    A factor's columns are the directions (``r`` of them); a matrix ``A`` is polarized,
    ``tr(A H) = sum_i [q(e_i + a_i) - q(e_i - a_i)] / 4`` with ``a_i = A e_i`` and
    ``q(v) = v^T H v``: ``2n`` directions, linear in ``A`` (so differentiable in ``A``
    everywhere, where an eigendecomposition's gradient breaks at repeated eigenvalues, as
    at ``A = kappa I``), and only ``A``'s symmetric part counts (as ``H`` is symmetric).
    """
    backend, B, n = call.backend, call.batch_size, call.n_in
    planned = backend.ahead(_plan, call, "exact", opts.method == "hutchinson")
    M, per_sample = _coefficient(call, coefficient, is_factor)
    shape = call.in_sample
    # A budget of as many directions as the exact sum (n, or the factor's r) computes it.
    exact_directions = int(M.shape[-1]) if is_factor else n
    if opts.method == "hutchinson" and _num_probes(opts, n) < exact_directions:
        k = _num_probes(opts, n)
        if is_factor:
            if _is_probes(backend, randomness):
                raise NumProbesError(
                    f"{call.spec.fname}: with a factor, the probes are drawn in its r "
                    f"columns; pass a source of randomness ({backend.randomness_example})."
                )
            r = int(M.shape[-1])
            raw = backend.draw(randomness, (B, r, k), opts.distribution, like=call.xb)
            v = backend.moveaxis(est.normalize_probes(raw, opts.distribution), -1, 0)
            directions = (M @ v[..., None])[..., 0].reshape(k, B, *shape)  # S v: (k, B, n)
            if opts.return_stderr:  # tr(S^T H S) from w = S^T H S v
                hsv = _hessian_images(call, directions, k, opts.chunk_size)
                images = (backend.moveaxis(M, -1, -2) @ hsv[..., None])[..., 0]
                return _calibrated_trace(call, v, images)
            terms = _sweep(call, directions, None, False, opts.chunk_size)
        else:
            v = _draw(call, randomness, k, opts.distribution).reshape(k, B, n)
            if opts.return_stderr:  # tr(A H) from w = A H v
                hv = _hessian_images(call, v.reshape(k, B, *shape), k, opts.chunk_size)
                return _calibrated_trace(call, v, (M @ hv[..., None])[..., 0])
            Av = (M @ v[..., None])[..., 0]
            directions = backend.concatenate([v + Av, v - Av]).reshape(2 * k, B, *shape)
            second = _sweep(call, directions, None, False, opts.chunk_size)
            terms = (second[:k] - second[k:]) / 4
        return _mean_and_stderr(call, terms, opts.return_stderr)
    if is_factor:
        directions = backend.moveaxis(M, -1, 0).reshape(int(M.shape[-1]), -1, *shape)
        weights = None
    else:
        eye = backend.asarray(np.eye(n), like=call.xb)
        columns = backend.moveaxis(M, -1, 0)  # a_i = A e_i: (n, n) or (n, B, n)
        if per_sample:
            eye = eye[:, None, :]
        else:
            eye, columns = eye[:, None, :], columns[:, None, :]
        directions = backend.concatenate([eye + columns, eye - columns])
        directions = directions.reshape(2 * n, -1, *shape)
        quarter = np.concatenate([np.full(n, 0.25), np.full(n, -0.25)])
        weights = backend.asarray(quarter, like=call.xb)
    if planned.coupled:
        directions, weights = _one_sample_at_a_time(call, directions, weights)
    second = _sweep(call, directions, weights, True, opts.chunk_size)
    return second, (backend.zeros_like(second) if opts.return_stderr else None)


def weighted_laplacian(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int,
    *,
    is_factor: bool,
    batch_axis: int | None,
    method: WeightedMethod,
    num_probes: int | None,
    distribution: Distribution,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
) -> Callable[..., Any]:
    """``sum_ij A_ij d2u/dx_i dx_j`` per sample and output component (see
    ``divjac.jax.weighted_laplacian``): the returned function takes ``A`` (or its factor)
    first, then the randomness of a stochastic method, then ``u``'s arguments."""
    fname = "weighted_laplacian"
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise ArgnumsError(
            f"{fname}: argnums must be one int (A acts on one argument); got {argnums!r}."
        )
    opts = _Options(method, num_probes, distribution, return_stderr, chunk_size)
    _check_options(opts, coupling, WeightedMethod, fname)

    def with_coefficient(coefficient: Any, *args: Any, **kwargs: Any) -> Any:
        def values(call: Call, randomness: Any) -> Any:
            return _weighted_values(call, coefficient, is_factor, opts, randomness)

        transform = _second_order_transform(
            backend, u, argnums, batch_axis, has_aux, coupling, opts, fname, values
        )
        return transform(*args, **kwargs)

    return with_coefficient


# --- the bi-Laplacian ---------------------------------------------------------------------------


def _nested(call: Call, inner: Array, outer: Array, chunk_size: int | None) -> Array:
    """``sum_j d^2/dw_j^2 sum_i d^2u/dv_i^2`` (``v`` the ``inner`` directions, ``w`` the
    ``outer`` ones, ``[K, B or 1, *in]``): a collapsed sweep of a collapsed sweep, batch
    first ``(B, *out)``."""
    backend, f = call.backend, _values(call)

    def second(xb: Array) -> Array:
        return backend.second_order_sweep(f, xb, inner, weights=None, collapse=True)[2]

    K = int(outer.shape[0])
    chunk = backend.ahead(Call.chunk, call, K, chunk_size)
    parts = [
        backend.second_order_sweep(
            second, call.xb, outer[i : i + chunk], weights=None, collapse=True
        )[2]
        for i in range(0, K, chunk)
    ]
    return sum(parts[1:], parts[0])


def _bilaplacian_values(call: Call, opts: _Options, randomness: Any) -> tuple[Array, Array | None]:
    """``(bi-Laplacian, stderr or None)``, batch first ``(B, *out)``.

    ``"exact"``: the Laplacian of the Laplacian, a collapsed sweep of the unit basis through
    the collapsed sweep of the unit basis (``n`` outer directions each carrying the inner
    sweep's ``n`` first-order terms: ``O(n^2)`` terms per value, as ``sum_ij`` needs, against
    ``n`` Hessian-vector products of a function that itself makes ``n`` of them for nested
    Hessians). ``"hutchinson"``: for ``v ~ N(0, I)``, ``E[v_i v_j v_k v_l] = d_ij d_kl +
    d_ik d_jl + d_il d_jk``, so ``E[(v . grad)^4 u] = 3 sum_ij d^4u/dx_i^2 dx_j^2``: each probe
    gives ``(v . grad)^4 u / 3``, the second directional derivative along ``v`` of the second
    directional derivative along ``v``.
    """
    call.backend.ahead(_uncoupled, call, opts.method)
    if opts.method == "hutchinson":
        probes = _draw(call, randomness, _num_probes(opts, call.n_in), "gaussian")
        terms = [
            _nested(call, probes[i : i + 1], probes[i : i + 1], opts.chunk_size)
            for i in range(int(probes.shape[0]))
        ]
        stacked = call.backend.concatenate([t[None] for t in terms]) / 3
        return _mean_and_stderr(call, stacked, opts.return_stderr)
    basis = _basis(call, None)
    result = _nested(call, basis, basis, opts.chunk_size)
    return result, (call.backend.zeros_like(result) if opts.return_stderr else None)


def _uncoupled(call: Call, method: str) -> None:
    """Refuse a function that mixes samples (with any ``coupling``)."""
    found = call.detect(per_sample=False)
    if found.coupling is not None:
        raise checks.coupling_error(found.coupling, fname=call.spec.fname, method=method)


def bilaplacian(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    method: BiLaplacianMethod,
    num_probes: int | None,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
) -> Callable[..., Any]:
    """Per-sample bi-Laplacian ``sum_ij d^4u/dx_i^2 dx_j^2`` of each output component (see
    ``divjac.jax.bilaplacian``)."""
    fname = "bilaplacian"
    check_option("method", method, BiLaplacianMethod, fname=fname)
    check_option("coupling", coupling, Coupling, fname=fname)
    opts = _Options(method, num_probes, "gaussian", return_stderr, chunk_size)
    if method == "hutchinson" and return_stderr:
        raise OptionError(
            f"{fname}: method='hutchinson' has no error bar that holds (its terms, fourth "
            "powers of Gaussian probes, are heavy-tailed: their spread covered 0.69-0.93 even at "
            "64 probes, docs/calibration.md); pass return_stderr=False, or method='exact'."
        )

    def one(argnum: int) -> Callable[..., Any]:
        def values(call: Call, randomness: Any) -> Any:
            return _bilaplacian_values(call, opts, randomness)

        return _second_order_transform(
            backend, u, argnum, batch_axis, has_aux, coupling, opts, fname, values
        )

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)


# --- the Hessian and its diagonal ---------------------------------------------------------------


def hessian(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    mode: Mode,
    chunk_size: int | None,
    has_aux: bool,
) -> Callable[..., Any]:
    """Per-sample Hessians of a scalar-per-sample function (see ``divjac.jax.hessian``): the
    per-sample Jacobian of its per-sample gradient (forward-over-reverse; ``"sparse"``: one
    pass per color of the detected Hessian pattern)."""
    fname = "hessian"
    check_option("mode", mode, Mode, fname=fname)

    def one(argnum: int) -> Callable[..., Any]:
        spec = Spec(backend, u, argnum, batch_axis, has_aux, "raise", fname)
        gradient = _gradient(backend, u, argnum, has_aux, fname)
        jac = T.jacobian(
            backend,
            gradient,
            argnum,
            batch_axis=batch_axis,
            mode=mode,
            chunk_size=chunk_size,
            has_aux=has_aux,
            coupling="exact",  # u's coupling is checked on u itself
            fname=fname,
        )

        def hess_fn(*args: Any, **kwargs: Any) -> Any:
            backend.ahead(_checked_scalar, prepare(spec, args, kwargs))
            return jac(*args, **kwargs)

        return hess_fn

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)


def _checked_scalar(call: Call) -> None:
    """Refuse a function that mixes samples (the per-sample gradient would not see it: a sum
    over samples of terms each in one sample is per-sample again) or has vector outputs."""
    call.detect(per_sample=False)
    _require_scalar(call)


def hessian_diagonal(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    method: DiagonalMethod,
    num_probes: int | None,
    distribution: Distribution,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
) -> Callable[..., Any]:
    """The diagonal of the per-sample Hessians of a scalar-per-sample function, shaped as the
    input (see ``divjac.jax.hessian_diagonal``)."""
    fname = "hessian_diagonal"
    opts = _Options(method, num_probes, distribution, return_stderr, chunk_size)
    _check_options(opts, coupling, DiagonalMethod, fname)

    def one(argnum: int) -> Callable[..., Any]:
        spec = Spec(backend, u, argnum, batch_axis, has_aux, coupling, fname)
        grad_spec = _grad_spec(spec)
        hutchinson = method == "hutchinson"

        def diag_fn(*args: Any, **kwargs: Any) -> Any:
            randomness, args = _split_randomness(backend, hutchinson, args, fname)
            call = prepare(spec, args, kwargs)
            diag, err = _diagonal_values(
                call, opts, randomness[0] if randomness else None, grad_spec
            )
            diag = call.unbatch(diag)
            out = (diag, call.unbatch(err)) if return_stderr else diag
            return (out, _aux(call)) if has_aux else out

        return diag_fn

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)


def _diagonal_values(
    call: Call, opts: _Options, randomness: Any, grad_spec: Spec
) -> tuple[Array, Array | None]:
    """``(diagonal, stderr or None)``, batch first ``(B, *in)``."""
    backend, B, n = call.backend, call.batch_size, call.n_in
    hutchinson = opts.method == "hutchinson"
    planned = backend.ahead(_plan, call, opts.method, hutchinson)
    backend.ahead(_require_scalar, call)
    # Bekas, Kokiopoulou & Saad: E[v * H v] = diag(H) when E[v v^T] = I; a budget of n
    # probes or more pays for the exact diagonal (n directions, no error).
    if hutchinson and _num_probes(opts, n) < n:
        k = _num_probes(opts, n)
        probes = _draw(call, randomness, k, opts.distribution)
        images = _own_products(call, grad_spec, probes, _itself, k, opts.chunk_size, False, False)
        v = probes.reshape(k, B, n)
        if not opts.return_stderr:
            return (v * images).mean(0).reshape(B, *call.in_sample), None
        # Two probes leave the bound itself too noisy (coverage 0.93, docs/calibration.md).
        _checked_stderr_budget(call, k, least=3)
        v, hv = (backend.moveaxis(a, 0, -1) for a in (v, images))
        mean, err = est.diagonal_mean_and_stderr(v, hv, est.namespace(v))
        return mean.reshape(B, *call.in_sample), _shaped(call, err)
    colors = planned.colors
    # The sweep pushes forward derivatives: where an operation lacks them, Hessian rows.
    sweep = colors is None and not planned.coupled
    if sweep and n and not backend.ahead(Call.columns_possible, call, "auto"):
        colors = np.arange(n)
    if colors is not None:
        n_colors = int(colors.max()) + 1
        inputs, indicator = backend.indicators(colors, n, n_colors, call.xb)
        seed = shaped(indicator, call.in_sample)
        # Diagonal colors: H_ij = 0 for i != j of one color, so (H v_c)_i = H_ii for i in c.
        passes = _own_products(call, grad_spec, inputs, seed, n_colors, opts.chunk_size, True)
        diag = passes.sum(0).reshape(B, *call.in_sample)
        return diag, (backend.zeros_like(diag) if opts.return_stderr else None)
    directions = _basis(call, None)
    if planned.coupled:
        spread, _ = _one_sample_at_a_time(call, directions, None)
        terms = _own_terms(call, _sweep(call, spread, None, False, opts.chunk_size))
    else:
        terms = _sweep(call, directions, None, False, opts.chunk_size)  # (n, B, *out)
    diag = backend.moveaxis(terms.reshape(n, B), 0, 1).reshape(B, *call.in_sample)
    return diag, (backend.zeros_like(diag) if opts.return_stderr else None)


def _own_products(
    call: Call,
    grad_spec: Spec,
    inputs: Array,
    seed: Callable[[Array], Array],
    n_passes: int,
    chunk_size: int | None,
    shared: bool,
    times_tangent: bool = True,
) -> Array:
    """``v * H v`` ``(k, B, n)`` for the tangents ``v`` of the passes (``H v`` without
    ``times_tangent``): Hessian-vector products, JVPs of the per-sample gradient
    (forward-over-reverse), or its VJPs (``v^T H``, the same by symmetry) where the backend
    says so (:meth:`~divjac._backend.Backend.pull_hessian_rows`)."""
    backend, B, n = call.backend, call.batch_size, call.n_in
    grad_call = prepare(grad_spec, call.args, call.kwargs)
    linear = backend.linearize(grad_call, backend.pull_hessian_rows(grad_call))

    def own(c: Array, t: Array, pushed: Array) -> Array:
        return (pushed * t if times_tangent else pushed).reshape(B, n)

    chunk = backend.ahead(Call.chunk, grad_call, n_passes, chunk_size)
    return linear.passes(inputs, seed, own, chunk, shared=shared)


def _shaped(call: Call, err: Array | None) -> Array | None:
    return None if err is None else err.reshape(call.batch_size, *call.in_sample)


def coefficient_of(A: Any, factor: Any) -> tuple[Any, bool]:
    """The coefficient of ``weighted_laplacian`` and whether it is a factor: exactly one of
    ``A`` and ``factor`` is given."""
    if (A is None) == (factor is None):
        got = "neither" if A is None else "both"
        raise CoefficientError(
            f"weighted_laplacian: pass exactly one of A (the matrix, positional) and factor=S "
            f"(with A = S S^T); got {got}."
        )
    return (factor, True) if A is None else (A, False)
