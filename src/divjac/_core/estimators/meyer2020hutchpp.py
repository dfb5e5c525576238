"""Hutch++ (Meyer, Musco, Musco & Woodruff 2021; arXiv 2020).

With ``Q`` an orthonormal basis of ``range(J S)`` for a random sketch ``S`` and
``P = I - Q Q^T``, ``tr(J) = tr(Q^T J Q) + tr(P J P)``: the low-rank part is exact, the rest is
estimated by Hutchinson with projected probes ``P G``. For ``J`` with a fast-decaying spectrum
the error falls like ``1 / num_probes`` instead of Hutchinson's ``1 / sqrt(num_probes)``.

References:
    - Meyer, Musco, Musco & Woodruff (2021), "Hutch++: Optimal stochastic trace estimation",
      SOSA 2021 (arXiv:2010.09649).
"""

from __future__ import annotations

from ..._errors import NumProbesError
from ._common import (
    Array,
    Matvec,
    apply,
    check_probes,
    column_dots,
    exact_trace,
    mean_and_stderr,
    namespace,
)

__all__ = ["hutch_plus_plus"]


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
        times ``kappa(m - 1)``, package docstring). With ``m == 1`` (``num_probes=3``) there is no
        sample variance: the conservative single-term estimate ``sqrt(2) ||P J P g||`` (about
        ``sqrt(2)`` times too large for non-symmetric ``J``, more for Rademacher probes and a
        large diagonal).

    Raises:
        NumProbesError: ``probes`` is not 3-d, or its number of columns is odd, zero, or
            above ``2n``.
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
    xp = namespace(probes)
    check_probes(probes, "probes", xp)
    n, k = probes.shape[-2], probes.shape[-1]
    if k % 2 or not 2 <= k <= 2 * n:
        raise NumProbesError(
            f"hutch_plus_plus got probes with {k} columns for n={n}: it needs an even number "
            f"2m of columns with 1 <= m <= n (m sketch columns, then m Hutchinson probes); "
            f"draw num_random_vectors('hutch++', num_probes, n) of them."
        )
    m = k // 2
    if 3 * m >= n:  # the budget pays for the n identity columns: the exact trace
        return exact_trace(matvec, probes, xp)
    sketch, gauss = probes[..., :m], probes[..., m:]
    q, _ = xp.linalg.qr(apply(matvec, sketch))
    qt = xp.matrix_transpose(q)
    projected = gauss - q @ (qt @ gauss)
    products = apply(matvec, xp.concat([q, projected], axis=-1))
    exact_part = xp.sum(column_dots(q, products[..., :m]), axis=-1)
    images = products[..., m:]  # J P g; P J P g = P (J P g) for the single-term bound
    # g^T (P J P) g: Hutchinson terms of P J P in the raw probes g, with images P J P g.
    estimate, stderr = mean_and_stderr(
        column_dots(projected, images), xp, images - q @ (qt @ images), gauss
    )
    return exact_part + estimate, stderr
