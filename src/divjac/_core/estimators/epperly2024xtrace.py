"""XTrace, the exchangeable trace estimator (Epperly, Tropp & Webber 2024).

Every test vector serves both parts of Hutch++: ``t_i = tr(Q_(i)^T J Q_(i)) +
w_i^T P_(i) J P_(i) w_i``, with ``Q_(i)`` a basis of ``range(J Omega_{-i})`` (all the test
vectors but ``w_i``), is unbiased, and XTrace averages the ``t_i``; the leave-one-out bases all
come from one QR of ``J Omega`` by downdating. The standard error adds an estimate of the
covariance of the dependent ``t_i`` (see :func:`xtrace`).

References:
    - Epperly, Tropp & Webber (2024), "XTrace: Making the most of every sample in stochastic trace
      estimation", SIAM Journal on Matrix Analysis and Applications 45(1).
"""

from __future__ import annotations

from typing import Any

from ..._errors import NumProbesError
from ._common import (
    Array,
    Matvec,
    apply,
    check_probes,
    column_dots,
    device,
    exact_trace,
    mean_and_stderr,
    mean_and_variance,
    namespace,
    skew_widened,
    t_factor,
)

__all__ = ["xtrace"]


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
    sqrt(V)`` (package docstring), widened up to twofold where the residual terms
    ``w_i^T P_(i) J P_(i) w_i`` all have one sign (a definite ``J``: their skew, as for the
    Hutchinson terms; :func:`~divjac._core.estimators._common.skew_widened` relative to
    the residual's mean). The leave-two-out bases come from the same QR (their
    complement in ``range(Q)`` is spanned by ``s_i`` and ``s_j``): ``O(m^3)`` more work per
    sample, no matvec. With ``m == 1`` the estimate is the single Hutchinson term ``w^T J w``,
    and the standard error its conservative single-term estimate (package docstring).

    Args:
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        probes: The test vectors ``Omega``, shape ``(B, n, m)`` with ``1 <= m <= n``; see
            :func:`num_random_vectors`.

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``: the mean of the ``t_i`` and the
        standard error above (0 when ``2m >= n``: the exact trace).

    Raises:
        NumProbesError: ``probes`` is not 3-d, or has no column or more than ``n`` columns.
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
    xp = namespace(probes)
    check_probes(probes, "probes", xp)
    n, m = probes.shape[-2], probes.shape[-1]
    if not 1 <= m <= n:
        raise NumProbesError(
            f"xtrace got probes with {m} columns for n={n}: it needs 1 <= m <= n test vectors; "
            f"draw num_random_vectors('xtrace', num_probes, n) of them."
        )
    if 2 * m >= n:
        return exact_trace(matvec, probes, xp)
    y = apply(matvec, probes)
    q, r = xp.linalg.qr(y)
    z = apply(matvec, q)
    qt = xp.matrix_transpose(q)
    w = qt @ probes  # Q^T Omega
    h = qt @ z  # Q^T J Q
    t = xp.matrix_transpose(z) @ probes  # (J Q)^T Omega
    s = _normalized_inverse_transpose_columns(r, xp)
    # Column i of c holds the coordinates in the basis Q of Q_(i) Q_(i)^T w_i, that is
    # (I - s_i s_i^T) Q^T w_i, so that P_(i) w_i = w_i - Q c_i.
    sw = column_dots(s, w)
    c = w - s * sw[..., None, :]
    # w_i^T P_(i) J P_(i) w_i with J w_i = Q r_i and P_(i) w_i = w_i - Q c_i.
    residual = sw * column_dots(s, r) - column_dots(t, c) + column_dots(c, h @ c)
    trace_h = xp.sum(column_dots(q, z), axis=-1)
    terms = trace_h[..., None] - column_dots(s, h @ s) + residual
    if m == 1:
        return mean_and_stderr(terms, xp, y, probes)
    mean, variance = mean_and_variance(terms, xp)
    covariance = _xtrace_covariance(s, w, r, h, t, c, xp)
    corrected = variance + covariance
    s0 = t_factor(m - 1) * xp.sqrt(xp.maximum(corrected, variance))
    # One-signed residual terms (a definite J): the leave-one-out estimates share their test
    # vectors and are skewed like the Hutchinson terms; their error is the residual trace's, so
    # the widening is relative to the residual's mean, and in full (up to 2x): a quarter of it
    # still covered 0.93 on a nearly rank-one PSD spectrum (docs/calibration.md).
    residual_mean = xp.mean(residual, axis=-1)
    return mean, skew_widened(residual_mean, s0, xp, weight=1.0, terms=residual)


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
    eye = xp.eye(m, dtype=s.dtype, device=device(s))
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
    eye = xp.eye(m, dtype=r.dtype, device=device(r))
    diagonal = xp.sum(r * eye, axis=-1)
    scale = xp.max(xp.abs(r), axis=(-2, -1))
    floor = xp.where(scale > 0, scale * xp.finfo(r.dtype).eps, xp.ones_like(scale))[..., None]
    safe = xp.where(xp.abs(diagonal) >= floor, diagonal, xp.where(diagonal >= 0, floor, -floor))
    inverse = xp.linalg.inv(r + eye * (safe - diagonal)[..., None, :])
    s = xp.matrix_transpose(inverse)
    return s / xp.linalg.vector_norm(s, axis=-2, keepdims=True)
