"""What the estimators share: the array namespace, checks, and the standard error's recipe.

The standard error of every estimator is ``kappa(nu) * sqrt(V)`` with ``V`` an unbiased variance
estimate with ``nu`` degrees of freedom and ``kappa(nu) = max(1, t_nu(0.97) / 2)`` (the package
docstring), computed here by the Cornish-Fisher expansion of Student's t quantile (Abramowitz &
Stegun 1964, formula 26.7.5).

The namespace of an array is its own ``__array_namespace__()`` (NumPy >= 2 and JAX arrays have
one, so JAX needs no extra package); only arrays without one (torch tensors) go through
``array_api_compat``, imported then.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np

from ..._errors import InputDtypeError, InternalError, NumProbesError

__all__ = [
    "Array",
    "Matvec",
    "apply",
    "check_probes",
    "column_dots",
    "device",
    "diagonal_mean_and_stderr",
    "exact_trace",
    "is_int",
    "mean_and_stderr",
    "mean_and_variance",
    "namespace",
    "rank_one_share",
    "single_term_stderr",
    "squared_norm_mean_and_stderr",
    "t_factor",
    "term_variance",
    "term_variance_and_dof_share",
]

Array: TypeAlias = Any
"""An array of any array-API namespace (NumPy, ``jax.numpy``, torch)."""

Matvec: TypeAlias = Callable[[Array], Array]
"""Batched matvec: ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``."""


def namespace(x: Array) -> Any:
    """The array API namespace of ``x``: its own, else ``array_api_compat``'s (torch tensors).

    Example:
        >>> import numpy as np
        >>> float(namespace(np.ones(3)).sum(np.ones(3)))  # NumPy 2: its own; 1.x: array_api_compat
        3.0
    """
    own = getattr(x, "__array_namespace__", None)
    if own is not None:
        return own()
    if type(x).__module__.partition(".")[0] == "torch":
        # (array_api_compat's own lookup calls lru_cache'd helpers, about which torch.compile
        # warns at every call it traces)
        from array_api_compat import torch as compat_torch

        return compat_torch
    import array_api_compat

    return array_api_compat.array_namespace(x)


def device(x: Array) -> Any:
    """The device of ``x``, for creating arrays beside it (``None`` for a traced JAX array)."""
    own = getattr(x, "device", None)
    if own is None and getattr(x, "__array_namespace__", None) is None:  # (a NumPy 1.x array)
        import array_api_compat

        return array_api_compat.device(x)
    return own() if callable(own) else own  # a method in older JAX releases


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


def t_factor(dof: Any) -> Any:
    """``kappa(dof) = max(1, t_dof(0.97) / 2)`` for ``dof >= 1``: a number or an array."""
    inverse = 1 / dof
    series = 0.0
    for coefficient in reversed(_T97):
        series = inverse * (coefficient + series)
    half = (_Z97 + series) / 2
    if isinstance(half, float):
        return max(half, 1.0)
    xp = namespace(half)
    return xp.maximum(half, xp.ones_like(half))


def is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_probes(probes: Array, name: str, xp: Any) -> None:
    if probes.ndim != 3:
        raise NumProbesError(
            f"{name} must have shape (B, n, k) (batch, input elements, columns); "
            f"got shape {tuple(probes.shape)}."
        )
    if not xp.isdtype(probes.dtype, "real floating"):
        raise InputDtypeError(f"{name} must have a real floating dtype; got {probes.dtype}.")


def apply(matvec: Matvec, columns: Array) -> Array:
    """Call ``matvec`` on all ``columns`` at once and check the shape of its answer."""
    products = matvec(columns)
    if tuple(products.shape) != tuple(columns.shape):
        raise InternalError(
            f"matvec returned shape {tuple(products.shape)} for columns of shape "
            f"{tuple(columns.shape)}: it must return J_b @ V[b] for every sample b, "
            "with the shape (B, n, k) of its input"
        )
    return products


def column_dots(v: Array, w: Array) -> Array:
    """``(..., n, k), (..., n, k) -> (..., k)``: the diagonal of ``V^T W``."""
    xp = namespace(v)
    return xp.sum(v * w, axis=-2)


def mean_and_variance(terms: Array, xp: Any) -> tuple[Array, Array]:
    """Mean of ``(B, k)`` independent terms over ``k >= 2`` and its variance estimate."""
    k = terms.shape[-1]
    mean = xp.mean(terms, axis=-1)
    deviations = terms - mean[..., None]
    return mean, xp.sum(deviations * deviations, axis=-1) / (k * (k - 1))


def mean_and_stderr(terms: Array, xp: Any, images: Array, probes: Array) -> tuple[Array, Array]:
    """Mean of ``(B, k)`` independent Hutchinson terms ``v^T A v`` over ``k`` and its standard
    error, from the ``(B, n, k)`` probes ``v`` and their ``images``, the columns ``A v``.

    The variance of one term is estimated twice, both times without bias: by the terms' sample
    variance ``s^2`` (``k - 1`` degrees of freedom for normal terms), and by
    :func:`term_variance`, the exact variance formula of the probe distribution estimated from
    the images and the cross products ``v_a^T A v_b`` (``u``), which does not collapse when the
    terms happen to agree (few-valued or skewed terms). The variance used is
    ``u + w max(s^2 - u, 0)``: ``u``, and the sample variance's excess over it in the share
    ``w = min(1, (k - 1) / nu)`` (:func:`term_variance_and_dof_share`), ``nu`` the degrees of
    freedom of ``u`` from its jackknife over the probes. Where one direction dominates
    (``rand(n, n)``, a fast-decaying spectrum) or ``u`` is a difference of large parts, ``nu``
    is ``k`` or less, ``w = 1``, and the variance is the larger of the two (the maximum guards
    the draws where ``u`` falls short); where many directions contribute (the Jacobians of
    networks: ``nu`` about 25 at 8 probes) ``u`` is several times more precise than ``s^2``, and
    the maximum's upward bias (about 10 % of the standard error at 8 probes) mostly goes. Both
    can still vanish together when the probes coincide up to sign (Rademacher probes
    at small ``n``), so the variance of the mean is also kept above ``g / k^2``, with
    ``g = 2 mean ||A v||^2`` an unbiased estimate of the upper bound ``2 ||A||_F^2`` of the
    variance of one term: a floor ``k`` times below that bound's own ``g / k``, which matters
    only at a few probes. The standard error is
    ``s0 = kappa(k - 1) sqrt(max((u + w max(s^2 - u, 0)) / k, g / k^2))``: Student's factor
    stays at the ``k - 1`` degrees of freedom of ``k`` terms, not ``nu``, as ``nu`` is itself
    estimated from the same ``k`` probes and overstates the precision of ``u`` where the terms
    are skewed (``rand(10, 10)`` at 8 probes: ``u`` has about 4 degrees of freedom, the
    jackknife's median says 8; ``kappa(nu)`` covered 0.92-0.94 there, docs/calibration.md).
    Where every term of a sample has
    one sign (a definite ``A``, as a nearly rank-one PSD Hessian), the terms are skewed like
    chi-square ones and the draws that fall short have small variances too, so the standard
    error is widened with its relative half-width ``c = min(2 s0 / |mean|, 1)``, to
    ``s0 (1 + c / 4)`` (:func:`skew_widened`): by at most a quarter, hardly where the estimate
    is precise. Terms of both signs are just as skewed where one direction dominates the
    symmetric part ``S`` of ``A`` (``rand(n, n)``, about ``0.5 * 1 1^T``: the draws that fall
    short are those with many small terms, some of them negative), so they get that widening
    in the share :func:`rank_one_share` (``|tr(S^3)| / tr(S^2)^(3/2)``, 1 for rank one, about 0
    for a spectrum symmetric about 0, as the Jacobians of networks). With it every cell of the
    calibration set covers >= 0.94 (docs/calibration.md; :func:`relative_stderr` is the full
    correction, up to tenfold, which the squared norm needs). A single term has neither estimate: its standard error is ``sqrt(g)``, documented
    but refused by the transforms (:func:`~divjac._core.estimators.check_stderr_budget`).
    """
    k = terms.shape[-1]
    if k == 1:
        return xp.mean(terms, axis=-1), single_term_stderr(images, xp)
    mean, variance = mean_and_variance(terms, xp)
    cross = xp.matrix_transpose(probes) @ images  # v_a^T A v_b, (B, k, k): shared by all
    bound, weight = term_variance_and_dof_share(probes, images, xp, cross)
    excess = xp.maximum(variance - bound / k, xp.zeros_like(variance))
    floor = 2 * xp.sum(images * images, axis=(-2, -1)) / k**3
    s0 = t_factor(k - 1) * xp.sqrt(xp.maximum(bound / k + weight * excess, floor))
    share = rank_one_share(cross, xp)
    return mean, skew_widened(mean, s0, xp, weight=0.25, terms=terms, share=share)


def skew_widened(
    mean: Array, s0: Array, xp: Any, *, weight: float, terms: Array, share: Array | None = None
) -> Array:
    """The standard error ``s0`` of a mean of the ``(B, k)`` skewed ``terms``, widened with its
    relative half-width: ``s0 (1 + weight c)``, ``c = min(2 s0 / |mean|, 1)``, where every
    term of a sample has one sign; elsewhere ``s0 (1 + share weight c)`` with the ``(B,)``
    ``share`` in ``[0, 1]`` (:func:`rank_one_share`), or ``s0`` without one."""
    growth = weight * _relative_halfwidth(mean, s0, xp, cap=1.0)
    definite = xp.all(terms >= 0, axis=-1) | xp.all(terms <= 0, axis=-1)
    if share is None:
        return xp.where(definite, s0 * (1 + growth), s0)
    return s0 * (1 + xp.where(definite, growth, share * growth))


def rank_one_share(cross: Array, xp: Any) -> Array:
    """``(B,)`` estimate of ``|tr(S^3)| / tr(S^2)^(3/2)`` (in ``[0, 1]``: 1 when ``S`` has rank
    one, ``n^(-1/2)`` for ``S = I``, about 0 for a spectrum symmetric about 0), ``S`` the
    symmetric part of ``A``, from the cross products ``v_a^T A v_b`` ``(B, k, k)`` of ``k``
    probes with ``E[v v^T] = I``; 0 below ``k = 3``.

    It is the skewness of the Hutchinson terms ``v^T A v`` for Gaussian probes
    (``8 tr(S^3) / (2 tr(S^2))^(3/2)``) over a rank-one matrix's (chi-square with one degree of
    freedom). With ``C_ab = v_a^T S v_b`` (the symmetrized cross products), ``C_ab^2`` over the
    pairs ``a != b`` is unbiased for ``tr(S^2)`` and ``C_ab C_bc C_ca`` over the triples of
    distinct probes for ``tr(S^3)`` (the probes are independent): ``O(B k^3)`` work, no matvec.
    """
    k = cross.shape[-1]
    if k < 3:
        return xp.zeros(cross.shape[:-2], dtype=cross.dtype, device=device(cross))
    eye = xp.eye(k, dtype=cross.dtype, device=device(cross))
    off = (cross + xp.matrix_transpose(cross)) * ((1 - eye) / 2)  # C without its diagonal
    square = xp.sum(off * off, axis=(-2, -1)) / (k * (k - 1))
    cube = xp.sum((off @ off) * off, axis=(-2, -1)) / (k * (k - 1) * (k - 2))
    scale = square * xp.sqrt(square)
    tiny = xp.full_like(scale, xp.finfo(scale.dtype).tiny)
    return xp.minimum(xp.abs(cube), scale) / xp.maximum(scale, tiny)


def term_variance(probes: Array, images: Array, xp: Any, *, cross: Array | None = None) -> Array:
    """``(B,)`` unbiased estimate of ``Var(v^T A v)`` from ``k >= 2`` probes ``(B, n, k)`` and
    their images ``A v`` (and their cross products ``v_a^T A v_b``, ``(B, k, k)``, where the
    caller has them), for Gaussian or (where every entry is +-1) Rademacher probes.

    For Gaussian ``v``, ``Var(v^T A v) = ||A||_F^2 + tr(A^2)``; for Rademacher ``v`` the
    diagonal does not vary (``v_i^2 = 1``): ``Var = ||A||_F^2 + tr(A^2) - 2 sum_i A_ii^2``.
    With independent probes ``v_a, v_b`` (``E[v v^T] = I``), ``||A v_a||^2`` is unbiased for
    ``||A||_F^2``, ``(v_a^T A v_b) (v_b^T A v_a)`` for ``tr(A^2)`` and ``d_a . d_b``
    (``d_a = v_a * A v_a``, each an unbiased estimate of the diagonal, Bekas, Kokiopoulou &
    Saad 2007) for ``sum_i A_ii^2``; each is averaged over the probes or their pairs
    (``O(B n k^2)`` work, no matvec). For probes on the sphere of radius ``sqrt(n)`` (every
    probe's squared norm is ``n``), ``Var = (n (||A||_F^2 + tr(A^2)) - 2 tr(A)^2) / (n + 2)``
    (with ``E[(u^T S u)^2] = (tr(S)^2 + 2 tr(S^2)) / (n (n + 2))`` for ``u`` uniform on the unit
    sphere, ``S`` the symmetric part), ``tr(A)^2`` estimated by the products of two probes'
    terms; the Gaussian formula would overstate it (intervals covering 0.998 at 16 probes).
    """
    return _term_variance_of(*_term_variance_parts(probes, images, xp, cross), xp)


def term_variance_and_dof_share(
    probes: Array, images: Array, xp: Any, cross: Array
) -> tuple[Array, Array]:
    """``(B,)`` ``bound``, the estimate of :func:`term_variance` (from the cross products
    ``cross``), and ``(B,)`` ``min(1, (k - 1) / nu)``: the degrees of freedom ``k - 1`` of the
    sample variance of ``k >= 3`` terms over ``nu = 2 bound^2 / J``, those of ``bound``, ``J``
    its jackknife variance over the probes (Arvesen 1969, for U-statistics); 1 below ``k = 3``
    and where ``bound <= 0``.

    :func:`term_variance` is a sum of U-statistics of degrees 1 and 2 over the probes (single
    probes' ``||A v_a||^2``, pairs' products), so its ``k`` leave-one-out values come from the
    per-probe parts and the pairs' row sums, ``O(B k)`` work beyond the estimate's own; their
    mean is the estimate. ``nu`` grows with ``k`` and with the number of directions that
    contribute: a median of 24-31 at 8 probes on the Jacobians of an MLP and a CNN (their true
    30-50: the jackknife overstates the variance), about ``k`` where one direction dominates
    (``rand(10, 10)``, a spectrum ``1/i^2``), about 1 where the estimate is a difference of
    large parts (Rademacher probes on ``I + 0.1 E``, whose diagonal does not vary).
    """
    k = images.shape[-1]
    singles, rows = _term_variance_parts(probes, images, xp, cross)
    bound = _term_variance_of(singles, rows, xp)
    if k < 3:
        return bound, xp.ones_like(bound)
    total = xp.sum(singles, axis=-1)[..., None]
    pairs = xp.sum(rows, axis=-1)[..., None]
    left_out = (total - singles) / (k - 1) + (pairs - 2 * rows) / ((k - 1) * (k - 2))
    deviations = left_out - bound[..., None]
    scaled = (k - 1) ** 2 / k * xp.sum(deviations * deviations, axis=-1)  # (k - 1) J
    tiny = xp.full_like(bound, xp.finfo(bound.dtype).tiny)
    share = scaled / xp.maximum(xp.maximum(2 * bound * bound, scaled), tiny)  # <= 1, finite
    return bound, xp.where(bound > 0, share, xp.ones_like(bound))


def _term_variance_of(singles: Array, rows: Array, xp: Any) -> Array:
    """:func:`term_variance` from its parts (:func:`_term_variance_parts`)."""
    k = singles.shape[-1]
    return xp.mean(singles, axis=-1) + xp.sum(rows, axis=-1) / (k * (k - 1))


def _term_variance_parts(
    probes: Array, images: Array, xp: Any, cross: Array | None
) -> tuple[Array, Array]:
    """The ``(B, k)`` parts of :func:`term_variance`: ``singles[a]``, the single probes' terms
    (its mean over ``a`` the degree-1 part), and ``rows[a]``, the sum over ``b != a`` of the
    pairs' terms (their sum over ``a``, over ``k (k - 1)``, the degree-2 part)."""
    n = probes.shape[-2]
    squares = xp.sum(images * images, axis=-2)  # ||A v_a||^2, (B, k)
    if cross is None:
        cross = xp.matrix_transpose(probes) @ images  # v_a^T A v_b, (B, k, k)
    terms = column_dots(probes, images)  # v_a^T A v_a, (B, k)
    trace_square = xp.sum(cross * xp.matrix_transpose(cross), axis=-1) - terms * terms
    d = probes * images
    diagonal = column_dots(d, xp.sum(d, axis=-1)[..., None]) - xp.sum(d * d, axis=-2)
    trace_squared = terms * (xp.sum(terms, axis=-1)[..., None] - terms)
    signs = xp.all(probes * probes == 1, axis=(-2, -1))[..., None]
    norms = xp.sum(probes * probes, axis=-2)  # (B, k)
    sphere = ~signs & xp.all(xp.abs(norms - n) <= 1e-6 * n, axis=-1)[..., None]
    singles = xp.where(sphere, n * squares / (n + 2), squares)
    rademacher = trace_square - 2 * diagonal
    on_sphere = (n * trace_square - 2 * trace_squared) / (n + 2)
    return singles, xp.where(signs, rademacher, xp.where(sphere, on_sphere, trace_square))


def squared_norm_mean_and_stderr(images: Array, xp: Any) -> tuple[Array, Array]:
    """Mean of the ``k >= 2`` terms ``||w_a||^2`` of the ``(B, m, k)`` images ``w_a = M v_a``
    of independent probes (Hutchinson for ``tr(A)``, ``A = M^T M`` PSD), and its standard error.

    For Gaussian probes ``Var(v^T A v) = 2 ||A||_F^2`` (less for Rademacher ones, whose
    diagonal does not vary), and the cross products ``w_a . w_b = v_a^T A v_b`` of two probes
    estimate ``||A||_F^2`` without bias by their square; the variance of one term is estimated
    by the larger of that (times 2) and the terms' sample variance, giving ``s0 = kappa(k - 1) sqrt(V / k)``. The terms are skewed
    (chi-square-like) and the draws that fall short of ``tr(A)`` have small ``V`` too, so the
    interval is taken on the relative scale, where ``V / mean^2`` (the relative variance) does
    not shrink with the miss: the ``T`` with ``|mean - T| <= c T``, ``c = 2 s0 / mean``, reach
    ``mean / (1 - c)``: :func:`relative_stderr`.
    """
    k = images.shape[-1]
    gram = xp.matrix_transpose(images) @ images  # (B, k, k)
    terms = xp.sum(images * images, axis=-2)  # the diagonal of the Gram matrix, (B, k)
    mean, variance = mean_and_variance(terms, xp)
    off = (xp.sum(gram * gram, axis=(-2, -1)) - xp.sum(terms * terms, axis=-1)) / (k * (k - 1))
    s0 = t_factor(k - 1) * xp.sqrt(xp.maximum(variance, 2 * off / k))
    return mean, relative_stderr(mean, s0, xp)


def relative_stderr(mean: Array, s0: Array, xp: Any) -> Array:
    """The standard error of a mean of one-signed terms whose relative spread, not their
    spread, is what the sample tells: the variance of such terms scales with the square of
    their mean (it depends on the matrix's normalized spectrum), and a draw that falls short of
    the truth ``T`` has a small variance estimate too. With the relative half-width
    ``c = 2 s0 / |mean|``, the ``T`` with ``|mean - T| <= c |T|`` reach ``mean / (1 - c)``, and
    the standard error is half that distance, ``s0 / (1 - c)``: never below ``s0`` (``c``
    capped at 0.9: at most a tenfold widening; docs/calibration.md measures it)."""
    return s0 / (1 - _relative_halfwidth(mean, s0, xp, cap=0.9))


def _relative_halfwidth(mean: Array, s0: Array, xp: Any, cap: float) -> Array:
    """``min(2 s0 / |mean|, cap)``."""
    tiny = xp.full_like(mean, xp.finfo(mean.dtype).tiny)
    return xp.minimum(2 * s0 / xp.maximum(xp.abs(mean), tiny), xp.full_like(mean, cap))


def diagonal_mean_and_stderr(probes: Array, images: Array, xp: Any) -> tuple[Array, Array]:
    """The diagonal estimate ``mean(v * A v)`` (Bekas, Kokiopoulou & Saad 2007) from ``k >= 2``
    probes ``(B, n, k)`` with ``E[v v^T] = I`` and their images ``A v``, with its ``(B, n)``
    standard error, entry by entry.

    Entry ``i`` of a term is ``v_i (A v)_i``, of variance ``||A_i||^2 + A_ii^2`` for Gaussian
    probes, ``||A_i||^2 - A_ii^2`` for Rademacher ones (``A_i``: row ``i``): at most
    ``2 ||A_i||^2``, of which ``2 mean (A v)_i^2`` is an unbiased estimate. An entry's terms take
    few values and are skewed (a row with one or two off-diagonal entries, a dominant
    diagonal), so their sample variance ``s^2`` and even the unbiased estimate of the exact
    variance fall short too often (docs/calibration.md); the standard error is this bound's:
    ``kappa(k - 1) sqrt(max(s^2, 2 mean (A v)_i^2) / k)``.
    """
    k = images.shape[-1]
    mean, variance = mean_and_variance(probes * images, xp)
    bound = 2 * xp.mean(images * images, axis=-1) / k
    return mean, t_factor(k - 1) * xp.sqrt(xp.maximum(variance, bound))


def single_term_stderr(images: Array, xp: Any) -> Array:
    """``sqrt(2 sum ||A v||^2)`` over the ``(B, n, c)`` columns ``A v`` of independent terms."""
    return xp.sqrt(2 * xp.sum(images * images, axis=(-2, -1)))


def exact_trace(matvec: Matvec, like: Array, xp: Any) -> tuple[Array, Array]:
    """The exact traces from the ``n`` identity columns (``n`` matvecs), standard error 0."""
    batch, n = like.shape[0], like.shape[-2]
    eye = xp.eye(n, dtype=like.dtype, device=device(like))
    columns = xp.broadcast_to(eye, (batch, n, n))
    trace = xp.sum(column_dots(columns, apply(matvec, columns)), axis=-1)
    return trace, xp.zeros_like(trace)
