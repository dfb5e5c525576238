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

Each estimator returns ``(estimate, stderr)``, two arrays of shape ``(B,)``: the trace estimate
of each sample and its standard error (the sample standard deviation of the independent terms the
estimate averages, over the square root of their number).

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeAlias

import array_api_compat
import numpy as np

from .._errors import NumProbesError

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
        ValueError: ``method`` is not a stochastic method, or ``n`` is not a positive integer.

    Example:
        >>> num_random_vectors("hutchinson", 10, n=100)
        10
        >>> num_random_vectors("hutch++", 30, n=100)
        20
        >>> num_random_vectors("xtrace", 30, n=100)
        15
    """
    if method not in METHODS:
        raise ValueError(
            f"method={method!r} is not a stochastic trace estimator: use one of "
            f"{', '.join(repr(m) for m in METHODS)}."
        )
    if not _is_int(n) or n < 1:
        raise ValueError(f"n={n!r} must be a positive integer (the input size per sample).")
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
        ValueError: ``distribution`` is not one of :data:`DISTRIBUTIONS`, or ``raw`` is not 3-d.

    Example:
        >>> import numpy as np
        >>> raw = np.random.default_rng(0).standard_normal((2, 4, 3))
        >>> probes = normalize_probes(raw, "sphere")
        >>> np.allclose(np.linalg.norm(probes, axis=1), 2.0)
        True
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(
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
        ``(estimate, stderr)``, each of shape ``(B,)``: the mean of the ``k`` terms and their
        sample standard deviation (``ddof=1``) over ``sqrt(k)``. With ``k == 1`` the standard
        error is unknown and returned as NaN.

    Raises:
        ValueError: ``probes`` is not 3-d, or ``matvec`` returns a different shape.
        TypeError: ``probes`` does not have a real floating dtype.

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
    return _mean_and_stderr(_column_dots(probes, _apply(matvec, probes)), xp)


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
        ``(estimate, stderr)``, each of shape ``(B,)``. The standard error is that of the
        Hutchinson part (standard deviation of its ``m`` terms over ``sqrt(m)``; NaN if
        ``m == 1``): given the sketch, the exact part has no error.

    Raises:
        NumProbesError: The number of probe columns is odd, zero, or above ``2n``.
        ValueError: ``probes`` is not 3-d, or ``matvec`` returns a different shape.
        TypeError: ``probes`` does not have a real floating dtype.

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
    sketch, gauss = probes[..., :m], probes[..., m:]
    q, _ = xp.linalg.qr(_apply(matvec, sketch))
    projected = gauss - q @ (xp.matrix_transpose(q) @ gauss)
    products = _apply(matvec, xp.concat([q, projected], axis=-1))
    exact_part = xp.sum(_column_dots(q, products[..., :m]), axis=-1)
    estimate, stderr = _mean_and_stderr(_column_dots(projected, products[..., m:]), xp)
    return exact_part + estimate, stderr


def xtrace(matvec: Matvec, probes: Array, *, improved: bool = False) -> tuple[Array, Array]:
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

    The *improved* variant of the paper (``improved=True``) rescales each Hutchinson term by
    ``(n - m + 1) / ||P_(i) w_i||^2``, as if ``P_(i) w_i`` were uniform on the sphere of radius
    ``sqrt(n - m + 1)`` in ``range(P_(i))``: it lowers the variance and keeps the estimate
    unbiased for probes whose direction is uniformly distributed (``"sphere"``, the paper's
    choice, or ``"gaussian"``), but it is biased for ``"rademacher"`` probes. Without it the
    estimate is unbiased for any probes with ``E[w w^T] = I``.

    Args:
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        probes: The test vectors ``Omega``, shape ``(B, n, m)`` with ``1 <= m <= n``; see
            :func:`num_random_vectors`.
        improved: Apply the paper's normalization of the Hutchinson terms (see above).

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``: the mean of the ``t_i`` and the paper's
        error estimate, the standard deviation of the ``t_i`` over ``sqrt(m)`` (NaN if
        ``m == 1``).

    Raises:
        NumProbesError: ``probes`` has no column or more than ``n`` columns.
        ValueError: ``probes`` is not 3-d, or ``matvec`` returns a different shape.
        TypeError: ``probes`` does not have a real floating dtype.

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> U, V = rng.standard_normal((2, 2, 50, 3))
        >>> J = U @ np.swapaxes(V, 1, 2)  # rank 3
        >>> raw = rng.standard_normal((2, 50, 6))  # 12 matvecs
        >>> probes = normalize_probes(raw, "sphere")
        >>> estimate, stderr = xtrace(lambda W: J @ W, probes, improved=True)
        >>> np.allclose(estimate, np.trace(J, axis1=1, axis2=2))
        True
    """
    xp = _namespace(probes)
    _check_probes(probes, "probes", xp)
    n, m = probes.shape[-2], probes.shape[-1]
    if not 1 <= m <= n:
        raise NumProbesError(
            f"xtrace got probes with {m} columns for n={n}: it needs 1 <= m <= n test vectors; "
            f"draw num_random_vectors('xtrace', num_probes, n) of them."
        )
    q, r = xp.linalg.qr(_apply(matvec, probes))
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
    if improved:
        projected_sq = _column_dots(probes, probes) - _column_dots(w, w) + sw * sw
        residual = residual * ((n - m + 1) / projected_sq)
    trace_h = xp.sum(_column_dots(q, z), axis=-1)
    terms = trace_h[..., None] - _column_dots(s, h @ s) + residual
    return _mean_and_stderr(terms, xp)


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
        ValueError: Shapes or color values do not fit.
        TypeError: ``signs`` does not have a real floating dtype, or ``colors`` is not integer.

    Example:
        >>> import numpy as np
        >>> signs = np.ones((1, 4, 1))
        >>> probe_matrix(np.array([0, 1, 0, 1]), signs)[0]
        array([[1., 0.],
               [0., 1.],
               [1., 0.],
               [0., 1.]])
    """
    xp = _namespace(signs)
    _check_probes(signs, "signs", xp)
    batch, n, reps = signs.shape
    mask = _color_mask(colors, n, num_colors, signs, xp)
    num = mask.shape[-1]
    probes = signs[..., None] * mask[:, None, :]  # (B, n, r, c)
    return xp.reshape(probes, (batch, n, reps * num))


def probing(
    matvec: Matvec,
    colors: Array,
    signs: Array,
    *,
    exact: bool = False,
    num_colors: int | None = None,
) -> tuple[Array, Array]:
    """Trace by probing with a coloring (Tang & Saad 2012; Stathopoulos, Laeuchli & Orginos 2013).

    For each repetition and each color class ``C``, the probe ``v`` is the repetition's random
    signs restricted to ``C``; one repetition estimates ``tr(J)`` by the sum over colors of
    ``v^T J v``, which is ``sum_j J[j, j]`` plus cross terms ``J[j, j'] v_j v_j'`` between
    same-colored ``j != j'``. The estimate is unbiased for any coloring, and exact (zero
    variance) for a *diagonal* coloring (same-colored ``j != j'`` have
    ``J[j, j'] = J[j', j] = 0``). Cost: ``r * c`` matvecs in one call.

    Args:
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        colors: Color of each input element, integers ``0 .. c-1``, shape ``(n,)`` (see
            :func:`probe_matrix`).
        signs: Random signs (+-1), shape ``(B, n, r)``: ``r`` repetitions.
        exact: The coloring is a valid diagonal coloring: report a standard error of exactly 0.
        num_colors: The number ``c`` of colors; defaults to ``max(colors) + 1``.

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``: the mean over the ``r`` repetitions and
        the standard deviation of the repetitions over ``sqrt(r)`` (NaN if ``r == 1``, 0 if
        ``exact``).

    Raises:
        ValueError: Shapes or color values do not fit, or ``matvec`` returns a different shape.
        TypeError: ``signs`` does not have a real floating dtype, or ``colors`` is not integer.

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
    probes = probe_matrix(colors, signs, num_colors=num_colors)
    batch, _, reps = signs.shape
    num = probes.shape[-1] // reps
    per_color = xp.reshape(_column_dots(probes, _apply(matvec, probes)), (batch, reps, num))
    estimate, stderr = _mean_and_stderr(xp.sum(per_color, axis=-1), xp)
    if exact:
        stderr = xp.zeros_like(estimate)
    return estimate, stderr


def estimate_trace(
    method: str, matvec: Matvec, probes: Array, *, improved: bool = False
) -> tuple[Array, Array]:
    """Dispatch to the stochastic estimator named by ``method``.

    Args:
        method: ``"hutchinson"``, ``"hutch++"`` or ``"xtrace"``.
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        probes: ``(B, n, k)`` with ``k = num_random_vectors(method, num_probes, n)``.
        improved: Passed to :func:`xtrace` (ignored by the other methods).

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``.

    Raises:
        ValueError: ``method`` is not one of :data:`METHODS`.

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
        return xtrace(matvec, probes, improved=improved)
    raise ValueError(
        f"method={method!r} is not a stochastic trace estimator: use one of "
        f"{', '.join(repr(m) for m in METHODS)}."
    )


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _namespace(x: Array) -> Any:
    return array_api_compat.array_namespace(x)


def _check_probes(probes: Array, name: str, xp: Any) -> None:
    if probes.ndim != 3:
        raise ValueError(
            f"{name} must have shape (B, n, k) (batch, input elements, columns); "
            f"got shape {tuple(probes.shape)}."
        )
    if not xp.isdtype(probes.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype; got {probes.dtype}.")


def _apply(matvec: Matvec, columns: Array) -> Array:
    """Call ``matvec`` on all ``columns`` at once and check the shape of its answer."""
    products = matvec(columns)
    if tuple(products.shape) != tuple(columns.shape):
        raise ValueError(
            f"matvec returned shape {tuple(products.shape)} for columns of shape "
            f"{tuple(columns.shape)}: it must return J_b @ V[b] for every sample b, "
            f"with the shape (B, n, k) of its input."
        )
    return products


def _column_dots(v: Array, w: Array) -> Array:
    """``(..., n, k), (..., n, k) -> (..., k)``: the diagonal of ``V^T W``."""
    xp = _namespace(v)
    return xp.sum(v * w, axis=-2)


def _mean_and_stderr(terms: Array, xp: Any) -> tuple[Array, Array]:
    """Mean of ``(B, k)`` terms over ``k`` and its standard error (NaN when ``k == 1``)."""
    k = terms.shape[-1]
    mean = xp.mean(terms, axis=-1)
    if k == 1:
        return mean, xp.full_like(mean, math.nan)
    deviations = terms - mean[..., None]
    variance = xp.sum(deviations * deviations, axis=-1) / (k - 1)
    return mean, xp.sqrt(variance / k)


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


def _color_mask(colors: Array, n: int, num_colors: int | None, like: Array, xp: Any) -> Array:
    """``(n, c)`` indicator of the color classes, in the namespace, dtype and device of ``like``."""
    if num_colors is not None and (not _is_int(num_colors) or num_colors < 1):
        raise ValueError(f"num_colors={num_colors!r} must be a positive integer.")
    device = array_api_compat.device(like)
    if isinstance(colors, (np.ndarray, list, tuple)):
        host = np.asarray(colors)
        if host.ndim != 1 or host.shape[0] != n:
            raise ValueError(
                f"colors must have shape (n,) = ({n},), one color per input element; "
                f"got shape {host.shape}."
            )
        if host.size and not np.issubdtype(host.dtype, np.integer):
            raise TypeError(f"colors must hold integers 0 .. c-1; got dtype {host.dtype}.")
        largest = int(host.max()) if host.size else -1
        if host.size and int(host.min()) < 0:
            raise ValueError(f"colors must be nonnegative; got {int(host.min())}.")
        num = largest + 1 if num_colors is None else int(num_colors)
        if largest >= num:
            raise ValueError(f"colors holds color {largest} but num_colors={num}.")
        mask = xp.asarray(host[:, None] == np.arange(num), device=device)
        return xp.astype(mask, like.dtype)
    if colors.ndim != 1 or colors.shape[0] != n:
        raise ValueError(
            f"colors must have shape (n,) = ({n},), one color per input element; "
            f"got shape {tuple(colors.shape)}."
        )
    if not xp.isdtype(colors.dtype, "integral"):
        raise TypeError(f"colors must hold integers 0 .. c-1; got dtype {colors.dtype}.")
    num = int(xp.max(colors)) + 1 if num_colors is None else int(num_colors)
    labels = xp.arange(num, dtype=colors.dtype, device=device)
    return xp.astype(colors[:, None] == labels, like.dtype)
