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
detected by the engine as for any function. The Hessian and its diagonal are in
:mod:`divjac._hessian`, what the operators share (options, plans, directions, the sweep in
chunks) in :mod:`divjac._second_order_sweep`. Imports neither JAX nor PyTorch.

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
from typing import Any, cast

from ._backend import Array, Backend
from ._call import (
    BiLaplacianMethod,
    Call,
    Coupling,
    Distribution,
    LaplacianMethod,
    Method,
    Spec,
    WeightedMethod,
    check_num_probes,
    check_option,
    prepare,
)
from ._core import checks, estimators as est
from ._divergence import (
    DivSpec,
    divergence_transform,
    draw,
    is_probes,
    itself,
    split_randomness,
)
from ._errors import ArgnumsError, CoefficientError, NumProbesError, OptionError
from ._hessian import gradient_passes, hessian, hessian_diagonal, own_products
from ._second_order_sweep import (
    Options,
    _aux,
    _basis,
    _eye,
    _grad_spec,
    _gradient,
    _num_probes,
    _plan,
    _sweep,
    _values,
    check_options,
    checked_stderr_budget,
    coordinates,
    mean_and_stderr,
    one_sample_at_a_time,
    powers,
    require_scalar,
    sampled,
    sweep_chunk,
    unbatch,
)
from ._transforms import per_argnum, tuple_of

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


# --- the Laplacian ------------------------------------------------------------------------------


def _laplacian_values(call: Call, opts: Options, randomness: Any) -> tuple[Array, Array | None]:
    """``(Laplacian, stderr or None)``, batch first ``(B, *out)``."""
    stochastic_method = opts.method in SWEEP_STOCHASTIC
    planned = call.backend.ahead(_plan, call, opts.method, stochastic_method)
    # A budget of n directions or more pays for the exact sweep (n directions, no error).
    k = sampled(call, opts, randomness, call.n_in) if opts.method == "hutchinson" else None
    if k is not None:
        probes = draw(call, randomness, k, opts.distribution)
        if opts.return_stderr:
            return _calibrated_laplacian(call, probes, opts)
        return _sweep(call, probes, None, collapse=True, chunk_size=opts.chunk_size) / k, None
    if opts.method == "stde":
        n = call.n_in
        k = min(_num_probes(call, opts, randomness), n)
        if opts.return_stderr and k < n:
            raise NumProbesError(
                f"{call.spec.fname}: method='stde' has no error bar that holds below n = {n} "
                "coordinates (a coordinate not drawn is not seen: its terms' spread covered "
                f"0.75-0.93, docs/calibration.md); pass num_probes={n} (exact, stderr 0), or "
                "use method='hutchinson' with return_stderr=True."
            )
        terms = _sweep(
            call,
            coordinates(call, randomness, k),
            None,
            collapse=False,
            chunk_size=opts.chunk_size,
        )
        mean, err = mean_and_stderr(call, n * terms, opts.return_stderr)
        # Coordinates drawn without replacement: the finite-population correction.
        return mean, None if err is None else err * math.sqrt(1 - k / n)
    directions, weights = _basis(call, planned.colors), None
    if planned.coupled:
        directions, weights = one_sample_at_a_time(call, directions, None)
    elif opts.method in ("exact", "auto") and call.n_in > 0:
        # Stored sparse where intermediates depend on few inputs, when that halves the work of
        # the dense passes it replaces (in the memory a chunk of them may take): the unit
        # basis, or the colors of the Hessian auto found (pair potentials: 12 colors, sparse
        # 1.75x faster; particles: 4 colors, their passes 1.3x faster than sparse).
        n = call.n_in
        passes = n if planned.colors is None else int(planned.colors.max(initial=0)) + 1
        budget = call.backend.ahead(Call.chunk, call, n, opts.chunk_size, False).size  # memory
        lap = call.backend.sparse_laplacian(_values(call), call.xb, passes, budget, call)
        if lap is not None:
            return lap, (call.backend.zeros_like(lap) if opts.return_stderr else None)
    second = _sweep(call, directions, weights, collapse=True, chunk_size=opts.chunk_size)
    return second, (call.backend.zeros_like(second) if opts.return_stderr else None)


def _calibrated_laplacian(call: Call, probes: Array, opts: Options) -> tuple[Array, Array]:
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
    checked_stderr_budget(call, k)
    how = call.backend.ahead(gradient_passes, call, k, chunk_size)
    return own_products(
        call, _grad_spec(call.spec), probes, itself, how, shared=False, times_tangent=False
    )


def _calibrated_trace(call: Call, probes: Array, images: Array) -> tuple[Array, Array]:
    """Hutchinson's mean of ``v^T M v`` and its standard error from the probes ``v`` and their
    images ``M v``, both ``(k, B, m)``, shaped as ``u``'s output ``(B, *out)``."""
    backend = call.backend
    v, mv = (backend.moveaxis(a, 0, -1) for a in (probes, images))
    mean, err = est.mean_and_stderr((v * mv).sum(-2), est.namespace(v), mv, v)
    shape = (call.batch_size, *call.out_sample)
    return mean.reshape(shape), err.reshape(shape)


def second_order_transform(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnum: int,
    batch_axis: int | None,
    has_aux: bool,
    coupling: Coupling,
    opts: Options,
    fname: str,
    values: Callable[..., tuple[Array, Array | None]],
) -> Callable[..., Any]:
    """``(*args) -> result``: ``values(call, randomness)`` laid out as ``u``'s
    output, with its stderr and aux as asked."""
    spec = Spec(backend, u, argnum, batch_axis, has_aux, coupling, fname)
    stochastic_method = opts.method in SWEEP_STOCHASTIC

    def transformed(*args: Any, **kwargs: Any) -> Any:
        randomness, args = split_randomness(
            backend, args, fname, stochastic_method=stochastic_method
        )
        call = prepare(spec, args, kwargs)
        result, err = values(call, randomness[0] if randomness else None)
        result = unbatch(call, result, batch_axis)
        out = (result, unbatch(call, err, batch_axis)) if opts.return_stderr else result
        return (out, _aux(call)) if has_aux else out

    return transformed


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
    opts = Options(method, num_probes, distribution, return_stderr, chunk_size)
    check_options(opts, coupling, LaplacianMethod, fname)

    def one(argnum: int) -> Callable[..., Any]:
        if method in _HVP_METHODS:
            return _hvp_laplacian(backend, u, argnum, batch_axis, has_aux, coupling, opts)

        def values(call: Call, randomness: Any) -> Any:
            return _laplacian_values(call, opts, randomness)

        return second_order_transform(
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
    opts: Options,
) -> Callable[..., Any]:
    """The Laplacian of a scalar-per-sample ``u`` as the divergence of its gradient, for the
    estimators that need Hessian-vector products (Hutch++, XTrace, probing)."""
    fname = "laplacian"
    spec = Spec(backend, u, argnum, batch_axis, has_aux, coupling, fname)
    ds = DivSpec(
        cast(Method, opts.method),  # one of the divergence's stochastic methods
        "auto",
        opts.num_probes,
        opts.distribution,
        opts.return_stderr,
        opts.chunk_size,
        None,
    )
    gradient = _gradient(backend, u, argnum, has_aux, fname)
    inner = divergence_transform(
        Spec(
            backend,
            gradient,
            argnum,
            batch_axis,
            has_aux,
            coupling,
            fname,
            prefer_reverse=False,
            direction=ds.mode,
        ),
        ds,
    )

    def lap_fn(*args: Any, **kwargs: Any) -> Any:
        _, own = split_randomness(backend, args, fname, stochastic_method=True)
        call = prepare(spec, own, kwargs)
        backend.ahead(require_scalar, call)
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
    call: Call, coefficient: Any, is_factor: bool, opts: Options, randomness: Any
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
    k = sampled(call, opts, randomness, exact_directions) if opts.method == "hutchinson" else None
    if k is not None:
        if is_factor:
            if is_probes(backend, randomness):
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
            terms = _sweep(call, directions, None, collapse=False, chunk_size=opts.chunk_size)
        else:
            v = draw(call, randomness, k, opts.distribution).reshape(k, B, n)
            if opts.return_stderr:  # tr(A H) from w = A H v
                hv = _hessian_images(call, v.reshape(k, B, *shape), k, opts.chunk_size)
                return _calibrated_trace(call, v, (M @ hv[..., None])[..., 0])
            Av = (M @ v[..., None])[..., 0]
            directions = backend.concatenate([v + Av, v - Av]).reshape(2 * k, B, *shape)
            second = _sweep(call, directions, None, collapse=False, chunk_size=opts.chunk_size)
            terms = (second[:k] - second[k:]) / 4
        return mean_and_stderr(call, terms, opts.return_stderr)
    if is_factor:
        directions = backend.moveaxis(M, -1, 0).reshape(int(M.shape[-1]), -1, *shape)
        weights = None
    else:
        eye = _eye(call, n)
        columns = backend.moveaxis(M, -1, 0)  # a_i = A e_i: (n, n) or (n, B, n)
        if per_sample:
            eye = eye[:, None, :]
        else:
            eye, columns = eye[:, None, :], columns[:, None, :]
        directions = backend.concatenate([eye + columns, eye - columns])
        directions = directions.reshape(2 * n, -1, *shape)
        first = backend.asarray(backend.arange(2 * n, call.xb) < n, like=call.xb)
        weights = first * 0.5 - 0.25  # 1/4 for the n sums, -1/4 for the n differences
    if planned.coupled:
        directions, weights = one_sample_at_a_time(call, directions, weights)
    second = _sweep(call, directions, weights, collapse=True, chunk_size=opts.chunk_size)
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
    opts = Options(method, num_probes, distribution, return_stderr, chunk_size)
    check_options(opts, coupling, WeightedMethod, fname)

    def with_coefficient(coefficient: Any, *args: Any, **kwargs: Any) -> Any:
        def values(call: Call, randomness: Any) -> Any:
            return _weighted_values(call, coefficient, is_factor, opts, randomness)

        transform = second_order_transform(
            backend, u, argnums, batch_axis, has_aux, coupling, opts, fname, values
        )
        return transform(*args, **kwargs)

    return with_coefficient


# --- the bi-Laplacian ---------------------------------------------------------------------------


def _nested(
    call: Call, inner: Array, outer: Array, chunk_size: int | None, weights: Array | None = None
) -> Array:
    """``sum_j d^2/dw_j^2 sum_i d^2u/dv_i^2`` (``v`` the ``inner`` directions, ``w`` the
    ``outer`` ones, ``[K, B or 1, *in]``): a collapsed sweep of a collapsed sweep, batch
    first ``(B, *out)``. ``weights`` ``[K, B]``: those of both sweeps' directions (the same
    ones inside and outside)."""
    backend, f, traced = call.backend, _values(call), call.traced

    # The call's trace: f's branch at the call's values. Not the call itself, which the outer
    # sweep would walk (a new object each call): in torch, the tensors its trace captured were
    # then not found where the trace's call found them, and the outer sweep ran the reference
    # (jvp of jvp), 6x slower (tanh MLP 16-128-128-1, B = 128: 0.055 -> 0.29-0.34 s).
    def second(xb: Array) -> Array:
        return backend.second_order_sweep(
            f, xb, inner, weights=weights, collapse=True, traced=traced
        )[2]

    K = int(outer.shape[0])
    chunk = sweep_chunk(call, K, chunk_size).size
    parts = [
        backend.second_order_sweep(
            second,
            call.xb,
            outer[i : i + chunk],
            weights=None if weights is None else weights[i : i + chunk],
            collapse=True,
        )[2]
        for i in range(0, K, chunk)
    ]
    return sum(parts[1:], parts[0])


def _bilaplacian_values(call: Call, opts: Options, randomness: Any) -> tuple[Array, Array | None]:
    """``(bi-Laplacian, stderr or None)``, batch first ``(B, *out)``.

    ``"exact"``: the Laplacian of the Laplacian, a collapsed sweep of the unit basis through
    the collapsed sweep of the unit basis (``n`` outer directions each carrying the inner
    sweep's ``n`` first-order terms: ``O(n^2)`` terms per value, as ``sum_ij`` needs, against
    ``n`` Hessian-vector products of a function that itself makes ``n`` of them for nested
    Hessians); for a function that mixes samples (``coupling="exact"``), each direction in one
    sample at a time, each sample keeping its own directions' terms in both sweeps.
    ``"hutchinson"``: for ``v ~ N(0, I)``, ``E[v_i v_j v_k v_l] = d_ij d_kl + d_ik d_jl +
    d_il d_jk``, so ``E[(v . grad)^4 u] = 3 sum_ij d^4u/dx_i^2 dx_j^2``: each probe gives
    ``(v . grad)^4 u / 3``, the second directional derivative along ``v`` of the second
    directional derivative along ``v``.
    """
    coupled = call.backend.ahead(_coupled, call, opts.method)
    if opts.method == "hutchinson":
        if is_probes(call.backend, randomness):
            raise NumProbesError(
                f"{call.spec.fname}: method='hutchinson' draws its Gaussian probes itself: its "
                "terms are unbiased only for standard normal directions (their fourth moments, "
                "E[v_i^4] = 3: Rademacher signs count the pure fourth derivatives d^4u/dx_i^4 "
                "a third), which the caller's probes cannot be checked to be. Pass a source of randomness ({call.backend.randomness_example})."
            )
        k = _num_probes(call, opts, randomness)
        probes = draw(call, randomness, k, "gaussian")

        # The mean of (v . grad)^4 u / 3: one collapsed fourth-order sweep of the probes, each
        # weighted 1 / 3k (or each probe's nested second-order sweeps, the probes a batch axis:
        # one program traced, whatever their number).
        weights = call.backend.zeros_like(probes.reshape(k, -1)[:, 0]) + 1 / (3 * k)  # (on device)
        return powers(call, 4, probes, weights, opts.chunk_size), None
    basis, weights = _basis(call, None), None
    if coupled:
        basis, weights = one_sample_at_a_time(call, basis, None)
    result = _nested(call, basis, basis, opts.chunk_size, weights)
    return result, (call.backend.zeros_like(result) if opts.return_stderr else None)


def _coupled(call: Call, method: str) -> bool:
    """Whether the function mixes samples (``coupling="exact"``: else refused, as it is for a
    stochastic ``method``)."""
    found = call.detect(per_sample=False)
    if found.coupling is not None and method == "hutchinson":
        raise checks.coupling_error(
            found.coupling, fname=call.spec.fname, method=method, second_order=True
        )
    return found.coupling is not None


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
    check_num_probes(num_probes, fname=fname)
    opts = Options(method, num_probes, "gaussian", return_stderr, chunk_size)
    if method == "hutchinson" and return_stderr:
        raise OptionError(
            f"{fname}: method='hutchinson' has no error bar that holds (its terms, fourth "
            "powers of Gaussian probes, are heavy-tailed: their spread covered 0.69-0.93 even at "
            "64 probes, docs/calibration.md); pass return_stderr=False, or method='exact'."
        )

    def one(argnum: int) -> Callable[..., Any]:
        def values(call: Call, randomness: Any) -> Any:
            return _bilaplacian_values(call, opts, randomness)

        return second_order_transform(
            backend, u, argnum, batch_axis, has_aux, coupling, opts, fname, values
        )

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)


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
