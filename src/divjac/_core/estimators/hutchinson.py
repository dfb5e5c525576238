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
    mean_and_stderr,
    namespace,
    single_term_stderr,
)

__all__ = ["hutchinson", "hutchinson_from_terms"]


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
        ``kappa(k - 1)`` (package docstring). With ``k == 1``: the conservative single-term
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
    xp = namespace(probes)
    check_probes(probes, "probes", xp)
    products = apply(matvec, probes)
    return mean_and_stderr(column_dots(probes, products), xp, lambda: products)


def hutchinson_from_terms(
    terms: Array,
    *,
    stderr: bool = True,
    psd: bool = False,
    squared_images: Array | None = None,
) -> tuple[Array, Array | None]:
    """Hutchinson's estimate from its terms ``v^T A v``, ``(k, B)`` (``k`` independent probes
    per sample, probe-major as passes give them), as :func:`hutchinson` computes it; the
    standard error with ``stderr``, else ``None``.

    A single term has no sample variance; its conservative standard error (package docstring)
    is ``sqrt(2) ||A v||`` from ``squared_images``, the ``||A v||^2`` ``(k, B)`` of the terms,
    or, with ``psd`` (``A = J^T J``, terms ``||J v||^2``, trace ``||J||_F^2``),
    ``sqrt(2) * term``: ``Var(v^T A v) <= 2 ||A||_F^2 <= 2 tr(A)^2`` for ``A >= 0``, and
    ``E[term^2] >= tr(A)^2``.

    Raises:
        InternalError: ``stderr`` for a single term, with neither ``psd`` nor
            ``squared_images``.
    """
    if not stderr:
        return (terms[0] if terms.shape[0] == 1 else terms.mean(0)), None
    xp = namespace(terms)
    if terms.shape[0] == 1 and psd:
        return terms[0], single_term_stderr(terms[0][:, None, None], xp)
    if terms.shape[0] == 1 and squared_images is not None:
        return terms[0], single_term_stderr(xp.sqrt(squared_images[0])[:, None, None], xp)
    if terms.shape[0] < 2:
        raise InternalError(
            "hutchinson_from_terms: the standard error of a single term needs its image "
            "(hutchinson computes it)"
        )
    return mean_and_stderr(xp.permute_dims(terms, (1, 0)), xp, lambda: terms)
