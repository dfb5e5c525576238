"""Stochastic and probing trace estimators over an abstract batched matvec.

Every estimator here works per sample on a batch of ``B`` square matrices ``J_b`` (``n x n``), the
per-sample Jacobians, seen only through a batched matvec::

    matvec(V) -> W    with V, W of shape (B, n, k) and W[b] = J_b @ V[b]

The backends implement it with one batched JVP per column, so the cost of an estimator is the
total number of columns it passes to ``matvec`` (its *matvec budget*, ``num_probes`` per sample).
The estimators pass all the columns of a stage in one call: Hutchinson and probing call ``matvec``
once, Hutch++ and XTrace twice. ``J_b`` need not be symmetric (Jacobians of vector fields are not),
and only products with ``J_b`` are used, never with its transpose.

The math is written once with the Python array API standard (through ``array_api_compat``), so it
runs unchanged on NumPy arrays, ``jax.numpy`` arrays (inside ``jax.jit`` / ``jax.grad``) and torch
tensors (inside ``torch.func`` transforms and ordinary autograd); nothing here imports a framework,
mutates an array in place, or draws random numbers. The backends draw the random test vectors
(JAX keys, torch generators) and pass them in; :func:`num_random_vectors` says how many each
method needs and :func:`normalize_probes` turns raw draws into probes.

Each estimator returns ``(estimate, stderr)``, two arrays of shape ``(B,)``. The standard error is
meant to be read as a confidence interval: ``estimate +- 2 * stderr`` covers the exact trace at
least 94 % of the time (for normally distributed terms; 95.4 % for many terms). It is built in
two steps:

1. An unbiased estimate ``V`` of the variance of the estimate, with ``nu`` degrees of freedom: the
   sample variance of the independent terms the estimate averages, over their number (Hutchinson,
   the Hutchinson part of Hutch++; ``nu = k - 1``), pooled over the color classes (probing), or
   with a covariance correction for XTrace's dependent terms (see each estimator).
2. Student's correction for estimating the variance from few terms: ``stderr = kappa(nu) *
   sqrt(V)`` with ``kappa(nu) = max(1, t_nu(0.97) / 2)`` (``t_nu(p)``: the quantile of Student's
   t with ``nu`` degrees of freedom), so that ``estimate +- 2 * stderr`` is at least the 94 %
   Student-t interval, and ``stderr`` is never below the usual standard error ``sqrt(V)``,
   which it equals from ``nu = 19`` on. ``kappa`` is 5.29 at ``nu = 1`` (a 94 % interval from
   two terms is wide), 1.95 at ``nu = 2``, 1.30 at ``nu = 4``, 1.12 at ``nu = 7`` and 1.02 at
   ``nu = 15``; it is computed by the Cornish-Fisher expansion of the t quantile (Abramowitz &
   Stegun 26.7.5) with a fifth term that makes it exact at ``nu = 1``, within 0.6 % for every
   ``nu >= 1``, also fractional (probing estimates its degrees of freedom).

A single term has no sample variance; the estimators then return a conservative error estimate,
never NaN: for a Hutchinson term ``v^T A v`` with ``E[v v^T] = I``, ``Var(v^T A v)`` is
``||A + A^T||_F^2 / 2 <= 2 ||A||_F^2`` (Gaussian), less for Rademacher and sphere probes, and
``||A v||^2`` is an unbiased estimate of ``||A||_F^2``: ``stderr = sqrt(2) ||A v||`` estimates an
upper bound of the standard deviation, about ``sqrt(2)`` too large for non-symmetric ``A``.

References:
    - Girard (1989), "A fast 'Monte-Carlo cross-validation' procedure for large least squares
      problems with noisy data", Numerische Mathematik 56.
    - Hutchinson (1990), "A stochastic estimator of the trace of the influence matrix for
      Laplacian smoothing splines", Communications in Statistics - Simulation and Computation 19.
    - Meyer, Musco, Musco & Woodruff (2021), "Hutch++: Optimal stochastic trace estimation",
      SOSA 2021.
    - Epperly, Tropp & Webber (2024), "XTrace: Making the most of every sample in stochastic trace
      estimation", SIAM Journal on Matrix Analysis and Applications 45(1).
    - Tang & Saad (2012), "A probing method for computing the diagonal of a matrix inverse",
      Numerical Linear Algebra with Applications 19(3).
    - Stathopoulos, Laeuchli & Orginos (2013), "Hierarchical probing for estimating the trace of
      the matrix inverse on toroidal lattices", SIAM Journal on Scientific Computing 35(5).
    - Satterthwaite (1946), "An approximate distribution of estimates of variance components",
      Biometrics Bulletin 2(6).
    - Abramowitz & Stegun (1964), "Handbook of mathematical functions", formula 26.7.5.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeAlias

import array_api_compat
import numpy as np

from .._errors import (
    InputDtypeError,
    InternalError,
    NumProbesError,
    OptionError,
    PatternError,
    PatternTypeError,
)

__all__ = [
    "DISTRIBUTIONS",
    "METHODS",
    "estimate_trace",
    "hutch_plus_plus",
    "hutchinson",
    "normalize_probes",
    "num_random_vectors",
    "probe_matrix",
    "probing",
    "xtrace",
]

Array: TypeAlias = Any
"""An array of any array-API namespace (NumPy, ``jax.numpy``, torch)."""

Matvec: TypeAlias = Callable[[Array], Array]
"""Batched matvec: ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``."""

METHODS: tuple[str, ...] = ("hutchinson", "hutch++", "xtrace")
"""The stochastic trace estimators, as named by ``divergence(method=...)``."""

DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "gaussian", "sphere")
"""The probe distributions :func:`normalize_probes` accepts."""


# --------------------------------------------------------------------------------------------
# Budget bookkeeping and probe preparation
# --------------------------------------------------------------------------------------------


def num_random_vectors(
    method: str, num_probes: int | np.integer[Any], n: int | np.integer[Any]
) -> int:
    """Number of random vectors of length ``n`` per sample that a method needs.

    ``num_probes`` is the matvec budget per sample (the number of JVP passes). Hutchinson spends
    one matvec per random vector; Hutch++ spends ``num_probes / 3`` on the sketch ``J S``, as many
    on ``J Q`` and as many on the Hutchinson probes ``G`` (so ``2 * num_probes / 3`` random
    vectors, ``S`` then ``G``); XTrace spends two matvecs per random vector (``J Omega`` and
    ``J Q``).

    Args:
        method: ``"hutchinson"``, ``"hutch++"`` or ``"xtrace"``.
        num_probes: The matvec budget per sample: a positive integer for ``"hutchinson"``, a
            positive multiple of 3 for ``"hutch++"``, a positive even number for ``"xtrace"``.
        n: The number of input elements per sample (``J_b`` is ``n x n``).

    Returns:
        The number ``k`` of random vectors to draw: probes of shape ``(B, n, k)``.

    Raises:
        NumProbesError: ``num_probes`` does not fit the method, or the low-rank part of Hutch++
            (``num_probes / 3``) or XTrace (``num_probes / 2``) would exceed ``n``, in which case
            ``method="exact"`` (``n`` passes) is cheaper.
        OptionError: ``method`` is not a stochastic method.

    Example:
        >>> num_random_vectors("hutchinson", 10, n=100)
        10
        >>> num_random_vectors("hutch++", 30, n=100)
        20
        >>> num_random_vectors("xtrace", 30, n=100)
        15
    """
    if method not in METHODS:
        raise OptionError(
            f"method={method!r} is not a stochastic trace estimator: use one of "
            f"{', '.join(repr(m) for m in METHODS)}."
        )
    if not _is_int(n) or n < 1:
        raise InternalError(f"num_random_vectors: n={n!r} must be a positive integer")
    divisor = {"hutchinson": 1, "hutch++": 3, "xtrace": 2}[method]
    needs = {
        "hutchinson": "a positive integer (1, 2, 3, ...)",
        "hutch++": "a positive multiple of 3 (3, 6, 9, ...)",
        "xtrace": "a positive even number (2, 4, 6, ...)",
    }[method]
    if not _is_int(num_probes) or num_probes < 1 or num_probes % divisor:
        raise NumProbesError(
            f"num_probes={num_probes!r} is not accepted by method={method!r}: it needs {needs}."
        )
    num_probes = int(num_probes)
    rank = num_probes // divisor
    if method != "hutchinson" and rank > n:
        raise NumProbesError(
            f"num_probes={num_probes} is too large for method={method!r} with n={n} input "
            f"elements per sample: its low-rank part would have {rank} > n={n} columns. "
            f"Exact divergence is cheaper: method='exact' costs n={n} passes and has no error "
            f"(or use num_probes <= {divisor * n})."
        )
    return {"hutchinson": num_probes, "hutch++": 2 * rank, "xtrace": rank}[method]


def normalize_probes(raw: Array, distribution: str) -> Array:
    """Turn raw random draws into probes with ``E[v v^T] = I``.

    Args:
        raw: Random draws of shape ``(B, n, k)``, one probe per column: random signs (+-1) for
            ``"rademacher"``, standard normal for ``"gaussian"`` and ``"sphere"``.
        distribution: ``"rademacher"`` and ``"gaussian"`` return ``raw`` as it is; ``"sphere"``
            scales each column to norm ``sqrt(n)``, which makes standard normal draws uniform on
            the sphere of radius ``sqrt(n)`` (so ``E[v v^T] = I`` still holds).

    Returns:
        The probes, shape ``(B, n, k)``, same namespace and dtype as ``raw``.

    Raises:
        OptionError: ``distribution`` is not one of :data:`DISTRIBUTIONS`.
        NumProbesError: ``raw`` is not 3-d.
        InputDtypeError: ``raw`` does not have a real floating dtype.

    Example:
        >>> import numpy as np
        >>> raw = np.random.default_rng(0).standard_normal((2, 4, 3))
        >>> probes = normalize_probes(raw, "sphere")
        >>> np.allclose(np.linalg.norm(probes, axis=1), 2.0)
        True
    """
    if distribution not in DISTRIBUTIONS:
        raise OptionError(
            f"distribution={distribution!r} is not a probe distribution: use one of "
            f"{', '.join(repr(d) for d in DISTRIBUTIONS)}."
        )
    xp = _namespace(raw)
    _check_probes(raw, "raw", xp)
    if distribution != "sphere":
        return raw
    n = raw.shape[-2]
    norms = xp.linalg.vector_norm(raw, axis=-2, keepdims=True)
    return raw * (math.sqrt(n) / norms)


# --------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------


def hutchinson(matvec: Matvec, probes: Array) -> tuple[Array, Array]:
    """Hutchinson's trace estimator, per sample (Girard 1989; Hutchinson 1990).

    The estimate is the mean of ``v^T J v`` over the ``k`` probes ``v``; it is unbiased for any
    probes with ``E[v v^T] = I`` (Rademacher, Gaussian, sphere of radius ``sqrt(n)``).

    Args:
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        probes: The probes, shape ``(B, n, k)``; ``k`` matvecs, in one call.

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``: the mean of the ``k`` independent terms
        and their sample standard deviation (``ddof=1``) over ``sqrt(k)``, times Student's
        ``kappa(k - 1)`` (module docstring). With ``k == 1``: the conservative single-term
        estimate ``sqrt(2) ||J v||``.

    Raises:
        NumProbesError: ``probes`` is not 3-d.
        InputDtypeError: ``probes`` does not have a real floating dtype.
        InternalError: ``matvec`` returns a different shape.

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> J = rng.standard_normal((2, 5, 5))
        >>> probes = rng.choice([-1.0, 1.0], size=(2, 5, 2000))
        >>> estimate, stderr = hutchinson(lambda V: J @ V, probes)
        >>> estimate.shape, stderr.shape
        ((2,), (2,))
        >>> bool(np.all(np.abs(estimate - np.trace(J, axis1=1, axis2=2)) < 5 * stderr))
        True
    """
    xp = _namespace(probes)
    _check_probes(probes, "probes", xp)
    products = _apply(matvec, probes)
    return _mean_and_stderr(_column_dots(probes, products), xp, lambda: products)


def hutchinson_from_terms(terms: Array, *, stderr: bool = True) -> tuple[Array, Array | None]:
    """Hutchinson's estimate from its terms ``v^T J v``, ``(k, B)`` (``k`` independent probes
    per sample, probe-major as passes give them), as :func:`hutchinson` computes it; the
    standard error with ``stderr`` (which needs ``k >= 2``: the single-term bound needs the
    images ``J v``), else ``None``.

    Raises:
        InternalError: ``stderr`` for a single term.
    """
    if not stderr:
        return (terms[0] if terms.shape[0] == 1 else terms.mean(0)), None
    if terms.shape[0] < 2:
        raise InternalError(
            "hutchinson_from_terms: the standard error of a single term needs its image "
            "(hutchinson computes it)"
        )
    xp = _namespace(terms)
    return _mean_and_stderr(xp.permute_dims(terms, (1, 0)), xp, lambda: terms)


def hutch_plus_plus(matvec: Matvec, probes: Array) -> tuple[Array, Array]:
    """Hutch++ trace estimator, per sample (Meyer, Musco, Musco & Woodruff 2021).

    The probes hold ``2m`` columns: the first ``m`` are the sketch ``S``, the last ``m`` the
    Hutchinson probes ``G``. With ``Q`` an orthonormal basis of ``range(J S)`` and
    ``P = I - Q Q^T``, the trace splits exactly as ``tr(J) = tr(Q^T J Q) + tr(P J P)`` (also for
    non-symmetric ``J``); the first term is computed exactly, the second by Hutchinson with the
    probes ``P G``. The estimate is unbiased for any ``S`` and any ``G`` with ``E[g g^T] = I``,
    and its error falls like ``1/num_probes`` instead of ``1/sqrt(num_probes)`` when ``J`` has a
    fast-decaying spectrum. Cost: ``3m`` matvecs in two calls (``J S``, then ``J [Q, P G]``).

    Args:
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        probes: ``(B, n, 2m)``: ``S = probes[..., :m]`` then ``G = probes[..., m:]``, with
            ``1 <= m <= n``; see :func:`num_random_vectors`.

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``. Given the sketch, the exact part has no
        error and the ``m`` Hutchinson terms ``g^T P J P g`` are independent with mean
        ``tr(P J P)``: the standard error is theirs (sample standard deviation over ``sqrt(m)``,
        times ``kappa(m - 1)``, module docstring). With ``m == 1`` (``num_probes=3``) there is no
        sample variance: the conservative single-term estimate ``sqrt(2) ||P J P g||`` (about
        ``sqrt(2)`` times too large for non-symmetric ``J``, more for Rademacher probes and a
        large diagonal).

    Raises:
        NumProbesError: The number of probe columns is odd, zero, or above ``2n``.
        NumProbesError: ``probes`` is not 3-d.
        InputDtypeError: ``probes`` does not have a real floating dtype.
        InternalError: ``matvec`` returns a different shape.

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> U, V = rng.standard_normal((2, 2, 50, 3))
        >>> J = U @ np.swapaxes(V, 1, 2)  # rank 3
        >>> probes = rng.choice([-1.0, 1.0], size=(2, 50, 8))  # 12 matvecs
        >>> estimate, stderr = hutch_plus_plus(lambda W: J @ W, probes)
        >>> np.allclose(estimate, np.trace(J, axis1=1, axis2=2))
        True
    """
    xp = _namespace(probes)
    _check_probes(probes, "probes", xp)
    n, k = probes.shape[-2], probes.shape[-1]
    if k % 2 or not 2 <= k <= 2 * n:
        raise NumProbesError(
            f"hutch_plus_plus got probes with {k} columns for n={n}: it needs an even number "
            f"2m of columns with 1 <= m <= n (m sketch columns, then m Hutchinson probes); "
            f"draw num_random_vectors('hutch++', num_probes, n) of them."
        )
    m = k // 2
    if 3 * m >= n:  # the budget pays for the n identity columns: the exact trace
        return _exact_trace(matvec, probes, xp)
    sketch, gauss = probes[..., :m], probes[..., m:]
    q, _ = xp.linalg.qr(_apply(matvec, sketch))
    qt = xp.matrix_transpose(q)
    projected = gauss - q @ (qt @ gauss)
    products = _apply(matvec, xp.concat([q, projected], axis=-1))
    exact_part = xp.sum(_column_dots(q, products[..., :m]), axis=-1)
    images = products[..., m:]  # J P g; P J P g = P (J P g) for the single-term bound
    estimate, stderr = _mean_and_stderr(
        _column_dots(projected, images), xp, lambda: images - q @ (qt @ images)
    )
    return exact_part + estimate, stderr


def xtrace(matvec: Matvec, probes: Array) -> tuple[Array, Array]:
    """XTrace, the exchangeable trace estimator, per sample (Epperly, Tropp & Webber 2024).

    With test vectors ``Omega = [w_1, ..., w_m]``, let ``Q_(i)`` be an orthonormal basis of
    ``range(J Omega_{-i})`` (``Omega`` without column ``i``) and ``P_(i) = I - Q_(i) Q_(i)^T``.
    Each ``i`` gives an unbiased estimate
    ``t_i = tr(Q_(i)^T J Q_(i)) + w_i^T P_(i) J P_(i) w_i`` (``Q_(i)`` does not depend on
    ``w_i``) and XTrace returns their mean: every test vector serves both the low-rank part and
    the Hutchinson part. All ``m`` leave-one-out bases come from one QR factorization
    ``J Omega = Q R``: ``Q_(i) Q_(i)^T = Q (I - s_i s_i^T) Q^T`` where ``s_i`` is column ``i`` of
    ``R^{-T}``, normalized; the ``t_i`` then follow from ``m x m`` products (downdating, no
    ``m`` separate QRs). Valid for non-symmetric ``J``, using only products with ``J``.
    Cost: ``2m`` matvecs in two calls (``J Omega``, then ``J Q``).

    When the budget pays for the exact answer (``2m >= n``), the ``n`` identity columns are
    passed to ``matvec`` instead (``n <= 2m`` matvecs, in one call) and the exact trace is
    returned with a standard error of 0; the values of ``probes`` are then not used.

    The estimate is unbiased for any probes with ``E[w w^T] = I``. (The paper's *improved*
    variant rescales each Hutchinson term by ``(n - m + 1) / ||P_(i) w_i||^2``; it is biased for
    Rademacher probes, divjac's default, and is not implemented.)

    Standard error. The paper's error estimate ``s^2 / m`` (``s^2`` the sample variance of the
    ``t_i``) treats the ``t_i`` as independent, but they share the test vectors: by
    exchangeability every pair ``i != j`` has the same covariance ``c = Cov(t_i, t_j)``, and
    ``Var(mean t_i) = E[s^2] / m + c``. ``c > 0`` when ``J`` is far from low rank with a large
    diagonal (``J = I + E``: residual networks), where ``s / sqrt(m)`` is too small by a factor
    up to 1.4 and covers about 85 % at two standard errors. The covariance has an estimate that
    does not involve the unknown trace ``tau``: let ``t_i^(-j)`` be the estimate of ``w_i``
    from the basis of ``J Omega_{-ij}`` (leaving out ``w_j`` too) and
    ``D_ij = t_i - t_i^(-j)``. Given ``Omega_{-i}`` (all the test vectors but ``w_i``),
    ``t_i`` has mean ``tau`` and ``t_j^(-i)`` is fixed, so
    ``E[(t_i - tau)(t_j^(-i) - tau)] = 0`` and ``c = E[(t_i - tau) D_ji]``; given
    ``Omega_{-j}``, both ``t_j`` and ``t_j^(-i)`` have mean ``tau`` (``E[D_ji] = 0``) and
    ``t_i^(-j)`` is fixed, so ``c = E[D_ij D_ji]``. The argument holds for any probes with
    ``E[w w^T] = I``. With ``c_hat`` the mean of
    ``D_ij D_ji`` over the ``m (m - 1)`` ordered pairs, ``s^2 / m + c_hat`` is an unbiased
    estimate of the variance; being an average of products it is noisy (when ``c`` is about 0
    its standard deviation is 10-60 % of ``s^2 / m``) and can be negative, so the variance
    estimate is ``V = max(s^2 / m + c_hat, s^2 / (2 m))``, and ``stderr = kappa(m - 1)
    sqrt(V)`` (module docstring). The leave-two-out bases come from the same QR (their
    complement in ``range(Q)`` is spanned by ``s_i`` and ``s_j``): ``O(m^3)`` more work per
    sample, no matvec. With ``m == 1`` the estimate is the single Hutchinson term ``w^T J w``,
    and the standard error its conservative single-term estimate
    (module docstring).

    Args:
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        probes: The test vectors ``Omega``, shape ``(B, n, m)`` with ``1 <= m <= n``; see
            :func:`num_random_vectors`.

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``: the mean of the ``t_i`` and the
        standard error above (0 when ``2m >= n``: the exact trace).

    Raises:
        NumProbesError: ``probes`` has no column or more than ``n`` columns.
        NumProbesError: ``probes`` is not 3-d.
        InputDtypeError: ``probes`` does not have a real floating dtype.
        InternalError: ``matvec`` returns a different shape.

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> U, V = rng.standard_normal((2, 2, 50, 3))
        >>> J = U @ np.swapaxes(V, 1, 2)  # rank 3
        >>> probes = rng.choice([-1.0, 1.0], size=(2, 50, 6))  # 12 matvecs
        >>> estimate, stderr = xtrace(lambda W: J @ W, probes)
        >>> np.allclose(estimate, np.trace(J, axis1=1, axis2=2))
        True
        >>> probes = rng.standard_normal((2, 50, 25))  # 2m = 50 >= n: the exact trace
        >>> estimate, stderr = xtrace(lambda W: J @ W, probes)
        >>> np.allclose(estimate, np.trace(J, axis1=1, axis2=2)), stderr.tolist()
        (True, [0.0, 0.0])
    """
    xp = _namespace(probes)
    _check_probes(probes, "probes", xp)
    n, m = probes.shape[-2], probes.shape[-1]
    if not 1 <= m <= n:
        raise NumProbesError(
            f"xtrace got probes with {m} columns for n={n}: it needs 1 <= m <= n test vectors; "
            f"draw num_random_vectors('xtrace', num_probes, n) of them."
        )
    if 2 * m >= n:
        return _exact_trace(matvec, probes, xp)
    y = _apply(matvec, probes)
    q, r = xp.linalg.qr(y)
    z = _apply(matvec, q)
    qt = xp.matrix_transpose(q)
    w = qt @ probes  # Q^T Omega
    h = qt @ z  # Q^T J Q
    t = xp.matrix_transpose(z) @ probes  # (J Q)^T Omega
    s = _normalized_inverse_transpose_columns(r, xp)
    # Column i of c holds the coordinates in the basis Q of Q_(i) Q_(i)^T w_i, that is
    # (I - s_i s_i^T) Q^T w_i, so that P_(i) w_i = w_i - Q c_i.
    sw = _column_dots(s, w)
    c = w - s * sw[..., None, :]
    # w_i^T P_(i) J P_(i) w_i with J w_i = Q r_i and P_(i) w_i = w_i - Q c_i.
    residual = sw * _column_dots(s, r) - _column_dots(t, c) + _column_dots(c, h @ c)
    trace_h = xp.sum(_column_dots(q, z), axis=-1)
    terms = trace_h[..., None] - _column_dots(s, h @ s) + residual
    if m == 1:
        return _mean_and_stderr(terms, xp, lambda: y)
    mean, variance = _mean_and_variance(terms, xp)
    covariance = _xtrace_covariance(s, w, r, h, t, c, xp)
    corrected = variance + covariance
    return mean, _t_factor(m - 1) * xp.sqrt(xp.maximum(corrected, variance / 2))


def probe_matrix(colors: Array, signs: Array, *, num_colors: int | None = None) -> Array:
    """Probe matrix of probing: random signs restricted to each color class.

    Column ``rep * c + color`` (for repetition ``rep`` and color ``color``, ``c`` colors) is
    ``signs[..., rep]`` with the elements of the other colors set to zero.

    Args:
        colors: Color of each input element, integers ``0 .. c-1``, shape ``(n,)``: a NumPy
            array (or sequence), or an array of the namespace of ``signs``.
        signs: Random signs (+-1), shape ``(B, n, r)``: ``r`` repetitions.
        num_colors: The number ``c`` of colors; defaults to ``max(colors) + 1`` (give it when
            ``colors`` is a traced array, whose maximum is not known at trace time).

    Returns:
        The probes, shape ``(B, n, r * c)``, in the namespace and dtype of ``signs``.

    Raises:
        NumProbesError: ``signs`` is not 3-d.
        InputDtypeError: ``signs`` does not have a real floating dtype.
        PatternError: ``colors`` does not have shape ``(n,)``, or its values do not fit.
        PatternTypeError: ``colors`` is not integer.

    Example:
        >>> import numpy as np
        >>> signs = np.ones((1, 4, 1))
        >>> probe_matrix(np.array([0, 1, 0, 1]), signs)[0]
        array([[1., 0.],
               [0., 1.],
               [1., 0.],
               [0., 1.]])
    """
    return _probes_and_mask(colors, signs, num_colors)[0]


def probing(
    matvec: Matvec,
    colors: Array,
    signs: Array,
    *,
    exact: bool = False,
    num_colors: int | None = None,
) -> tuple[Array, Array]:
    """Trace by probing with a coloring (Tang & Saad 2012; Stathopoulos, Laeuchli & Orginos 2013).

    For each repetition and each color class ``C``, the probe ``v_C`` is the repetition's random
    signs restricted to ``C``; one repetition estimates ``tr(J)`` by the sum over colors of
    ``t_C = v_C^T J v_C``, which is ``sum_{j in C} J[j, j]`` plus cross terms
    ``J[j, j'] v_j v_j'`` between same-colored ``j != j'``. The estimate is unbiased for any
    coloring, and exact (zero variance) for a *diagonal* coloring (same-colored ``j != j'`` have
    ``J[j, j'] = J[j', j] = 0``). Cost: ``r * c`` matvecs in one call.

    Standard error. The signs are independent per element, and the color classes hold disjoint
    sets of elements, so the ``c`` terms ``t_C`` of a repetition are independent (though not
    identically distributed: each has its own mean): the variance of the mean over the ``r``
    repetitions is ``sum_C Var(t_C) / r``, estimated without bias by ``sum_C s_C^2 / r`` with
    ``s_C^2`` the sample variance of ``t_C`` over the repetitions. This pooled estimate has up to
    ``c (r - 1)`` degrees of freedom instead of the ``r - 1`` of the sample variance of the
    repetitions' totals (two repetitions, the usual plan, would give a single one):
    Satterthwaite's (1946) ``nu = (r - 1) (sum_C Var(t_C))^2 / sum_C Var(t_C)^2``. Plugging in
    ``s_C^2`` would bias it low (``E[s_C^4] = Var(t_C)^2 (r + 1) / (r - 1)`` for normal terms);
    correcting both sums gives ``nu_hat = (r + 1) (sum_C s_C^2)^2 / sum_C s_C^4 - 2``, clipped
    to ``[r - 1, c (r - 1)]`` (exactly ``r - 1`` when one class carries all the variance). The
    standard error is ``kappa(nu_hat) sqrt(sum_C s_C^2 / r)`` (module docstring). With one
    repetition it is the conservative single-term estimate ``sqrt(2 sum_C ||(J v_C)_C||^2)``
    (``(x)_C``: the elements of ``x`` in ``C``; it includes the diagonal of ``J``, so it can be
    far too large).

    Args:
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        colors: Color of each input element, integers ``0 .. c-1``, shape ``(n,)`` (see
            :func:`probe_matrix`).
        signs: Random signs (+-1), independent per element, shape ``(B, n, r)``: ``r``
            repetitions.
        exact: The coloring is a valid diagonal coloring: report a standard error of exactly 0.
        num_colors: The number ``c`` of colors; defaults to ``max(colors) + 1``.

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``: the mean over the ``r`` repetitions and
        the standard error above (0 if ``exact``).

    Raises:
        NumProbesError: ``signs`` is not 3-d.
        InputDtypeError: ``signs`` does not have a real floating dtype.
        PatternError: ``colors`` does not have shape ``(n,)``, or its values do not fit.
        PatternTypeError: ``colors`` is not integer.
        InternalError: ``matvec`` returns a different shape.

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> J = np.triu(np.tril(rng.standard_normal((2, 6, 6)), 1), -1)  # tridiagonal
        >>> signs = rng.choice([-1.0, 1.0], size=(2, 6, 1))
        >>> estimate, stderr = probing(lambda V: J @ V, np.arange(6) % 2, signs, exact=True)
        >>> np.allclose(estimate, np.trace(J, axis1=1, axis2=2)), stderr.tolist()
        (True, [0.0, 0.0])
    """
    xp = _namespace(signs)
    probes, mask = _probes_and_mask(colors, signs, num_colors)
    products = _apply(matvec, probes)
    batch, _, reps = signs.shape
    per_color = xp.reshape(_column_dots(probes, products), (batch, reps, mask.shape[-1]))
    estimate = xp.mean(xp.sum(per_color, axis=-1), axis=-1)
    if exact:
        return estimate, xp.zeros_like(estimate)
    if reps == 1:
        return estimate, _single_term_stderr(products * mask, xp)
    deviations = per_color - xp.mean(per_color, axis=-2)[..., None, :]
    class_variance = xp.sum(deviations * deviations, axis=-2) / (reps - 1)  # s_C^2, (B, c)
    total = xp.sum(class_variance, axis=-1)
    squares = xp.sum(class_variance * class_variance, axis=-1)
    spread = squares > 0  # else every s_C is 0, and so is the standard error
    ratio = total * total / xp.where(spread, squares, xp.ones_like(squares))
    dof = xp.where(spread, (reps + 1) * ratio - 2, xp.zeros_like(ratio))
    lowest, highest = reps - 1, (reps - 1) * mask.shape[-1]
    dof = xp.minimum(xp.maximum(dof, xp.full_like(dof, lowest)), xp.full_like(dof, highest))
    return estimate, _t_factor(dof) * xp.sqrt(total / reps)


def estimate_trace(method: str, matvec: Matvec, probes: Array) -> tuple[Array, Array]:
    """Dispatch to the stochastic estimator named by ``method``.

    Args:
        method: ``"hutchinson"``, ``"hutch++"`` or ``"xtrace"``.
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        probes: ``(B, n, k)`` with ``k = num_random_vectors(method, num_probes, n)``.

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``.

    Raises:
        OptionError: ``method`` is not one of :data:`METHODS`.

    Example:
        >>> import numpy as np
        >>> J = np.stack([np.eye(3), 2 * np.eye(3)])
        >>> probes = np.ones((2, 3, 2))
        >>> estimate_trace("hutchinson", lambda V: J @ V, probes)[0]
        array([3., 6.])
    """
    if method == "hutchinson":
        return hutchinson(matvec, probes)
    if method == "hutch++":
        return hutch_plus_plus(matvec, probes)
    if method == "xtrace":
        return xtrace(matvec, probes)
    raise OptionError(
        f"method={method!r} is not a stochastic trace estimator: use one of "
        f"{', '.join(repr(m) for m in METHODS)}."
    )


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def _t97_coefficients() -> tuple[float, ...]:
    """Coefficients ``a_1 .. a_5`` of ``t_nu(0.97) = z + sum_k a_k / nu^k``, ``z = z(0.97)``.

    ``a_1 .. a_4``: the Cornish-Fisher expansion of Student's t quantile in powers of ``1 / nu``
    (Abramowitz & Stegun 26.7.5); ``a_5`` makes the series exact at ``nu = 1``, where
    ``t_1(0.97) = tan(0.47 pi)``. Within 0.6 % of the quantile for ``nu >= 1``, 0.2 % for
    ``nu >= 2``.
    """
    z = _Z97
    series = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return (*series, math.tan(0.47 * math.pi) - z - sum(series))


_Z97 = 1.8807936081512509
"""The 97th percentile of the standard normal distribution."""

_T97 = _t97_coefficients()


def _t_factor(dof: Any) -> Any:
    """``kappa(dof) = max(1, t_dof(0.97) / 2)`` for ``dof >= 1``: a number or an array."""
    inverse = 1 / dof
    series = 0.0
    for coefficient in reversed(_T97):
        series = inverse * (coefficient + series)
    half = (_Z97 + series) / 2
    if isinstance(half, float):
        return max(half, 1.0)
    xp = _namespace(half)
    return xp.maximum(half, xp.ones_like(half))


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _namespace(x: Array) -> Any:
    return array_api_compat.array_namespace(x)


def _check_probes(probes: Array, name: str, xp: Any) -> None:
    if probes.ndim != 3:
        raise NumProbesError(
            f"{name} must have shape (B, n, k) (batch, input elements, columns); "
            f"got shape {tuple(probes.shape)}."
        )
    if not xp.isdtype(probes.dtype, "real floating"):
        raise InputDtypeError(f"{name} must have a real floating dtype; got {probes.dtype}.")


def _apply(matvec: Matvec, columns: Array) -> Array:
    """Call ``matvec`` on all ``columns`` at once and check the shape of its answer."""
    products = matvec(columns)
    if tuple(products.shape) != tuple(columns.shape):
        raise InternalError(
            f"matvec returned shape {tuple(products.shape)} for columns of shape "
            f"{tuple(columns.shape)}: it must return J_b @ V[b] for every sample b, "
            "with the shape (B, n, k) of its input"
        )
    return products


def _column_dots(v: Array, w: Array) -> Array:
    """``(..., n, k), (..., n, k) -> (..., k)``: the diagonal of ``V^T W``."""
    xp = _namespace(v)
    return xp.sum(v * w, axis=-2)


def _mean_and_variance(terms: Array, xp: Any) -> tuple[Array, Array]:
    """Mean of ``(B, k)`` independent terms over ``k >= 2`` and its variance estimate."""
    k = terms.shape[-1]
    mean = xp.mean(terms, axis=-1)
    deviations = terms - mean[..., None]
    return mean, xp.sum(deviations * deviations, axis=-1) / (k * (k - 1))


def _mean_and_stderr(terms: Array, xp: Any, images: Callable[[], Array]) -> tuple[Array, Array]:
    """Mean of ``(B, k)`` independent terms over ``k`` and its standard error.

    ``kappa(k - 1)`` times the sample standard deviation over ``sqrt(k)``; for ``k == 1``, the
    single-term estimate from ``images()``, the columns ``A v`` of the term ``v^T A v``.
    """
    k = terms.shape[-1]
    if k == 1:
        return xp.mean(terms, axis=-1), _single_term_stderr(images(), xp)
    mean, variance = _mean_and_variance(terms, xp)
    return mean, _t_factor(k - 1) * xp.sqrt(variance)


def _single_term_stderr(images: Array, xp: Any) -> Array:
    """``sqrt(2 sum ||A v||^2)`` over the ``(B, n, c)`` columns ``A v`` of independent terms."""
    return xp.sqrt(2 * xp.sum(images * images, axis=(-2, -1)))


def _exact_trace(matvec: Matvec, like: Array, xp: Any) -> tuple[Array, Array]:
    """The exact traces from the ``n`` identity columns (``n`` matvecs), standard error 0."""
    batch, n = like.shape[0], like.shape[-2]
    eye = xp.eye(n, dtype=like.dtype, device=array_api_compat.device(like))
    columns = xp.broadcast_to(eye, (batch, n, n))
    trace = xp.sum(_column_dots(columns, _apply(matvec, columns)), axis=-1)
    return trace, xp.zeros_like(trace)


def _xtrace_covariance(
    s: Array, w: Array, r: Array, h: Array, t: Array, c: Array, xp: Any
) -> Array:
    """XTrace's ``c_hat``: the mean of ``D_ij D_ji`` over the pairs ``i != j``, shape ``(B,)``.

    The arguments are those of :func:`xtrace`: ``s`` (the normalized ``R^{-T}``), ``w``
    (``Q^T Omega``), ``r``, ``h`` (``Q^T J Q``), ``t`` (``(J Q)^T Omega``), ``c`` (the
    coordinates of ``Q_(i) Q_(i)^T w_i``). Leaving out ``w_j`` as well adds to the complement of the
    basis of ``w_i`` (in the coordinates of ``Q``) the unit vector ``e = (s_j - g s_i) / rho``,
    ``g = s_i . s_j``, ``rho = sqrt(1 - g^2)``; with ``beta = e . Q^T w_i``, the low-rank part
    loses ``e^T H e`` and the Hutchinson term of ``w_i`` (coordinates ``c_i - beta e``) grows by
    ``beta (e . (r_i + t_i - (H + H^T) c_i)) + beta^2 e^T H e``.
    """
    m = s.shape[-1]
    st = xp.matrix_transpose
    eye = xp.eye(m, dtype=s.dtype, device=array_api_compat.device(s))
    g = st(s) @ s
    floor = xp.finfo(s.dtype).eps
    rho_sq = xp.where(eye > 0, xp.ones_like(g), xp.maximum(1 - g * g, xp.full_like(g, floor)))
    rho = xp.sqrt(rho_sq)

    def along(x: Array) -> Array:
        """``e_ij . x_i`` from ``X[i, j] = x_i . s_j``."""
        return (x - g * xp.sum(x * eye, axis=-1)[..., :, None]) / rho

    beta = along(st(w) @ s)
    linear = along(st(r + t - (h + st(h)) @ c) @ s)
    shs = st(s) @ h @ s
    d = xp.sum(shs * eye, axis=-1)
    e_h = (d[..., None, :] - g * (shs + st(shs)) + g * g * d[..., :, None]) / rho_sq
    delta = (e_h - beta * linear - beta * beta * e_h) * (1 - eye)
    return xp.sum(delta * st(delta), axis=(-2, -1)) / (m * (m - 1))


def _normalized_inverse_transpose_columns(r: Array, xp: Any) -> Array:
    """Columns of ``R^{-T}`` normalized to unit length, for batched upper-triangular ``R``.

    Exactly zero diagonal entries of ``R`` (``J Omega`` of rank below ``m``, e.g. ``J = 0``) are
    replaced by a tiny value of the same scale, so the inverse exists; the directions it then
    picks lie outside ``range(J Omega)``, where leaving them out changes nothing.
    """
    m = r.shape[-1]
    eye = xp.eye(m, dtype=r.dtype, device=array_api_compat.device(r))
    diagonal = xp.sum(r * eye, axis=-1)
    scale = xp.max(xp.abs(r), axis=(-2, -1))
    floor = xp.where(scale > 0, scale * xp.finfo(r.dtype).eps, xp.ones_like(scale))[..., None]
    safe = xp.where(xp.abs(diagonal) >= floor, diagonal, xp.where(diagonal >= 0, floor, -floor))
    inverse = xp.linalg.inv(r + eye * (safe - diagonal)[..., None, :])
    s = xp.matrix_transpose(inverse)
    return s / xp.linalg.vector_norm(s, axis=-2, keepdims=True)


def _probes_and_mask(colors: Array, signs: Array, num_colors: int | None) -> tuple[Array, Array]:
    """Probing's probes ``(B, n, r * c)`` (see :func:`probe_matrix`) and the ``(n, c)`` classes."""
    xp = _namespace(signs)
    _check_probes(signs, "signs", xp)
    batch, n, reps = signs.shape
    mask = _color_mask(colors, n, num_colors, signs, xp)
    probes = signs[..., None] * mask[:, None, :]  # (B, n, r, c)
    return xp.reshape(probes, (batch, n, reps * mask.shape[-1])), mask


def _color_mask(colors: Array, n: int, num_colors: int | None, like: Array, xp: Any) -> Array:
    """``(n, c)`` indicator of the color classes, in the namespace, dtype and device of ``like``."""
    if num_colors is not None and (not _is_int(num_colors) or num_colors < 1):
        raise PatternError(f"num_colors={num_colors!r} must be a positive integer.")
    device = array_api_compat.device(like)
    if isinstance(colors, (np.ndarray, list, tuple)):
        host = np.asarray(colors)
        if host.ndim != 1 or host.shape[0] != n:
            raise PatternError(
                f"colors must have shape (n,) = ({n},), one color per input element; "
                f"got shape {host.shape}."
            )
        if host.size and not np.issubdtype(host.dtype, np.integer):
            raise PatternTypeError(f"colors must hold integers 0 .. c-1; got dtype {host.dtype}.")
        largest = int(host.max()) if host.size else -1
        if host.size and int(host.min()) < 0:
            raise PatternError(f"colors must be nonnegative; got {int(host.min())}.")
        num = largest + 1 if num_colors is None else int(num_colors)
        if largest >= num:
            raise PatternError(f"colors holds color {largest} but num_colors={num}.")
        mask = xp.asarray(host[:, None] == np.arange(num), device=device)
        return xp.astype(mask, like.dtype)
    if colors.ndim != 1 or colors.shape[0] != n:
        raise PatternError(
            f"colors must have shape (n,) = ({n},), one color per input element; "
            f"got shape {tuple(colors.shape)}."
        )
    if not xp.isdtype(colors.dtype, "integral"):
        raise PatternTypeError(f"colors must hold integers 0 .. c-1; got dtype {colors.dtype}.")
    num = int(xp.max(colors)) + 1 if num_colors is None else int(num_colors)
    labels = xp.arange(num, dtype=colors.dtype, device=device)
    return xp.astype(colors[:, None] == labels, like.dtype)
