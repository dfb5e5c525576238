"""Hutchinson's trace estimator (Girard 1989; Hutchinson 1990).

For probes ``v`` with ``E[v v^T] = I`` (Rademacher signs, standard normal, uniform on the sphere
of radius ``sqrt(n)``), ``E[v^T J v] = tr(J)``; the estimate is the mean of ``k`` independent
terms ``v^T J v``, with variance ``Var(v^T J v) / k`` (``||J + J^T||_F^2 / (2k)`` for Gaussian
probes, less for Rademacher ones).

References:
    - Girard (1989), "A fast 'Monte-Carlo cross-validation' procedure for large least squares
      problems with noisy data", Numerische Mathematik 56.
    - Hutchinson (1990), "A stochastic estimator of the trace of the influence matrix for
      Laplacian smoothing splines", Communications in Statistics - Simulation and Computation 19.
"""

from __future__ import annotations

from ..._errors import InternalError
from ._common import (
    Array,
    Matvec,
    apply,
    check_probes,
    column_dots,
    exact_trace,
    mean_and_stderr,
    mean_and_variance,
    namespace,
    t_factor,
)

__all__ = ["hutchinson", "hutchinson_from_terms"]


def hutchinson(matvec: Matvec, probes: Array) -> tuple[Array, Array]:
    """Hutchinson's trace estimator, per sample (Girard 1989; Hutchinson 1990).

    The estimate is the mean of ``v^T J v`` over the ``k`` probes ``v``; it is unbiased for any
    probes with ``E[v v^T] = I`` (Rademacher, Gaussian, sphere of radius ``sqrt(n)``).

    Args:
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        probes: The probes, shape ``(B, n, k)``; ``k`` matvecs, in one call.

    When the budget pays for the exact answer (``k >= n``), the ``n`` identity columns are
    passed to ``matvec`` instead (``n <= k`` matvecs) and the exact trace is returned with a
    standard error of 0, as :func:`xtrace` does; the values of ``probes`` are then not used.

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``: the mean of the ``k`` independent terms
        and its standard error (:func:`~divjac._core.estimators.mean_and_stderr`):
        ``kappa(k - 1) sqrt((u + w max(s^2 - u, 0)) / k)``, ``s^2`` the terms' sample
        variance, ``u`` the unbiased estimate of the variance of one term from the images
        ``J v`` and the probes' cross products, ``w = min(1, (k - 1) / nu)`` with ``nu``
        the degrees of freedom of ``u`` (its jackknife), kept above a floor and widened where
        the terms are skewed. With ``k == 1``: ``sqrt(2 ||J v||^2)``.

    Raises:
        NumProbesError: ``probes`` is not 3-d.
        InputDtypeError: ``probes`` does not have a real floating dtype.
        InternalError: ``matvec`` returns a different shape.

    Example:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> J = rng.standard_normal((2, 50, 50))
        >>> probes = rng.choice([-1.0, 1.0], size=(2, 50, 40))
        >>> estimate, stderr = hutchinson(lambda V: J @ V, probes)
        >>> estimate.shape, stderr.shape
        ((2,), (2,))
        >>> bool(np.all(np.abs(estimate - np.trace(J, axis1=1, axis2=2)) < 5 * stderr))
        True
        >>> probes = rng.choice([-1.0, 1.0], size=(2, 50, 50))  # k >= n: the exact trace
        >>> estimate, stderr = hutchinson(lambda V: J @ V, probes)
        >>> np.allclose(estimate, np.trace(J, axis1=1, axis2=2)), stderr.tolist()
        (True, [0.0, 0.0])
    """
    xp = namespace(probes)
    check_probes(probes, "probes", xp)
    if probes.shape[-1] >= probes.shape[-2]:  # the budget pays for the n identity columns
        return exact_trace(matvec, probes, xp)
    products = apply(matvec, probes)
    return mean_and_stderr(column_dots(probes, products), xp, products, probes)


def hutchinson_from_terms(terms: Array, *, stderr: bool = True) -> tuple[Array, Array | None]:
    """Hutchinson's estimate from its terms ``v^T A v``, ``(k, B)`` (``k`` independent probes
    per sample, probe-major as passes give them; any trailing shape without ``stderr``); the
    standard error with ``stderr``, else ``None``.

    Without the images ``A v`` there is no variance bound: the standard error is the terms'
    own, ``kappa(k - 1) s / sqrt(k)`` (``s``: their sample standard deviation), which needs
    ``k >= 2`` and holds only where the terms are not few-valued or strongly skewed (see
    docs/calibration.md); :func:`hutchinson` is the estimator that bounds the variance.

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
    xp = namespace(terms)
    mean, variance = mean_and_variance(xp.permute_dims(terms, (1, 0)), xp)
    return mean, t_factor(terms.shape[0] - 1) * xp.sqrt(variance)
