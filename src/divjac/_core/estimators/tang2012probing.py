"""Trace by probing with a coloring (Tang & Saad 2012; Stathopoulos, Laeuchli & Orginos 2013).

With random signs restricted to each color class ``C`` (``v_C``), ``sum_C v_C^T J v_C`` is
``tr(J)`` plus cross terms ``J[j, j'] v_j v_j'`` between same-colored ``j != j'``: unbiased for
any coloring, exact for a diagonal coloring (same-colored ``j != j'`` have
``J[j, j'] = J[j', j] = 0``). The standard error pools the classes' variances, with
Satterthwaite's (1946) degrees of freedom.

References:
    - Tang & Saad (2012), "A probing method for computing the diagonal of a matrix inverse",
      Numerical Linear Algebra with Applications 19(3).
    - Stathopoulos, Laeuchli & Orginos (2013), "Hierarchical probing for estimating the trace of
      the matrix inverse on toroidal lattices", SIAM Journal on Scientific Computing 35(5).
    - Satterthwaite (1946), "An approximate distribution of estimates of variance components",
      Biometrics Bulletin 2(6).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._errors import PatternError, PatternTypeError
from ._common import (
    Array,
    Matvec,
    apply,
    check_probes,
    column_dots,
    device,
    is_int,
    mean_and_stderr,
    namespace,
    single_term_stderr,
    skew_widened,
    t_factor,
)

__all__ = ["probe_matrix", "probing"]


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
    repetitions is ``sum_C Var(t_C) / r``. Two estimates of it are kept, the larger: the
    classes' sample variances ``sum_C s_C^2 / r``, and ``sum_C U_C / r`` from the images
    ``J v_C`` (:func:`_class_variances`: the spread of the entries ``v_i (J v_C)_i`` over the
    repetitions, which is exactly 0 for a diagonal class block, times ``2 - q`` with ``q`` the
    matrix's measured asymmetry, 0 for a Hessian; a class whose repetitions drew the same signs
    up to sign counts as one term). With two repetitions, the usual plan, ``s_C^2`` alone takes
    few values (0 half the time for a class of two elements) and fell short on small Hessians
    (coverage 0.79, docs/calibration.md). The degrees of freedom are Satterthwaite's (1946)
    ``nu = (r - 1) (sum_C V_C)^2 / sum_C V_C^2`` over the classes, from ``U_C`` corrected for
    plugging in estimates, ``nu_hat = (r + 1) (sum_C U_C)^2 / sum_C U_C^2 - 2``, clipped to
    ``[r - 1, c (r - 1)]``. The standard error ``s0 = kappa(nu_hat) sqrt(max(sum_C s_C^2,
    sum_C U_C) / r)`` (package docstring) is widened where all ``r c`` terms ``t_C`` of a sample
    have one sign (a definite ``J``: skewed terms), as Hutchinson's
    (:func:`~divjac._core.estimators._common.skew_widened`). One color is Hutchinson with
    Rademacher probes, and gets its standard error
    (:func:`~divjac._core.estimators.mean_and_stderr`). With one repetition it is the
    conservative single-term estimate ``sqrt(2 sum_C ||(J v_C)_C||^2)`` (``(x)_C``: the
    elements of ``x`` in ``C``; it includes the diagonal of ``J``, so it can be far too large).

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
    xp = namespace(signs)
    probes, mask = _probes_and_mask(colors, signs, num_colors)
    products = apply(matvec, probes)
    batch, n, reps = signs.shape
    num = mask.shape[-1]
    per_color = xp.reshape(column_dots(probes, products), (batch, reps, num))
    estimate = xp.mean(xp.sum(per_color, axis=-1), axis=-1)
    if exact:
        return estimate, xp.zeros_like(estimate)
    if reps == 1:
        return estimate, single_term_stderr(products * mask, xp)
    if num == 1:  # one class: Hutchinson with Rademacher probes
        return mean_and_stderr(per_color[..., 0], xp, products, probes)
    images = xp.reshape(products, (batch, n, reps, num))
    deviations = per_color - xp.mean(per_color, axis=-2)[..., None, :]
    class_variance = xp.sum(deviations * deviations, axis=-2) / (reps - 1)  # s_C^2, (B, c)
    bound = _class_variances(signs, images, mask, xp)  # (B, c)
    total = xp.maximum(xp.sum(class_variance, axis=-1), xp.sum(bound, axis=-1))
    s0 = t_factor(_pooled_dof(bound, reps, xp)) * xp.sqrt(total / reps)
    return estimate, skew_widened(
        estimate, s0, xp, weight=0.25, terms=xp.reshape(per_color, (batch, reps * num))
    )


def _pooled_dof(variances: Array, reps: int, xp: Any) -> Array:
    """Satterthwaite's (1946) degrees of freedom of a sum of ``c`` class variances ``V_C``,
    each estimated from ``r`` repetitions: ``(r + 1) (sum_C V_C)^2 / sum_C V_C^2 - 2``
    (corrected for plugging in estimates: ``E[s^4] = Var^2 (r + 1) / (r - 1)`` for normal
    terms), clipped to ``[r - 1, c (r - 1)]`` (``r - 1`` when one class carries all the
    variance, or none)."""
    total = xp.sum(variances, axis=-1)
    squares = xp.sum(variances * variances, axis=-1)
    spread = squares > 0
    ratio = total * total / xp.where(spread, squares, xp.ones_like(squares))
    dof = xp.where(spread, (reps + 1) * ratio - 2, xp.zeros_like(ratio))
    lowest, highest = reps - 1, (reps - 1) * variances.shape[-1]
    return xp.minimum(xp.maximum(dof, xp.full_like(dof, lowest)), xp.full_like(dof, highest))


def _class_variances(signs: Array, images: Array, mask: Array, xp: Any) -> Array:
    """``(B, c)`` estimates of ``r Var(mean_a t_C)`` for each color class ``C``, from the
    images ``images[b, :, a, C] = J_b v_{a,C}`` ``(B, n, r, c)`` of the probes of ``r >= 2``
    repetitions (random signs ``(B, n, r)``, classes ``mask`` ``(n, c)``). Every sum over a
    class is a product with ``mask``.

    With ``A = J_CC`` and ``O`` its off-diagonal part, ``Var(t_C) = ||O||_F^2 + tr(O^2)``
    for Rademacher signs (the diagonal does not vary), ``= ||O||_F^2 (2 - q_C)`` with
    ``q_C = sum_{i<j} (A_ij - A_ji)^2 / sum_{i<j} (A_ij^2 + A_ji^2)`` in ``[0, 2]`` (0 for a
    symmetric block, 1 for uncorrelated ``A_ij``, ``A_ji``).

    - ``||O||_F^2`` is estimated without bias, and exactly 0 for a diagonal block, by the
      entries' spread: ``e_ai = v_ai (J v_a)_i`` is ``A_ii`` plus ``sum_{j != i} A_ij v_ai
      v_aj``, of variance ``sum_{j != i} A_ij^2``, so ``N_C = sum_{i in C} s_i^2`` (the sample
      variance of ``e_ai`` over the repetitions).
    - ``q`` is pooled over the whole matrix: ``v_{a,C}^T J v_{b,D} - v_{b,D}^T J v_{a,C}`` (the
      same repetition ``a = b`` for two classes ``C != D``, whose signs are independent; two
      repetitions for ``C = D``) has the mean square ``sum (J_ij - J_ji)^2`` over the pairs
      ``i in C``, ``j in D`` (halved for ``C = D``), with no diagonal in it and exactly 0
      for a symmetric ``J`` (a Hessian); ``||(J v_{a,D})_C||^2`` has the mean
      ``sum (J_ij^2)`` over ``i in C``, ``j in D``. ``q = min(Q / P, 1)`` from their sums: a
      ratio of many terms, where a class's own pairs give one term each. Capped at 1 (never
      below ``N_C``), it is conservative where the classes' blocks are more antisymmetric
      than ``J``, and the class variances ``s_C^2`` (unbiased) still bound the result from
      below where they are more symmetric.
    - A class whose repetitions carry the same signs up to a global sign (probability
      ``2^((r - 1)(1 - |C|))``: small classes, Hessians at small ``n``) holds one term, not
      ``r``, and shows no spread: its variance is ``Var(t_C)``, with ``||O||_F^2`` estimated
      as the share ``rho = sum N / sum F`` of the other classes' images ``F_C = mean_a
      ||(J v_{a,C})_C||^2`` (unbiased for ``||A||_F^2``) that is off the diagonal (1, the
      single-term bound ``2 ||A||_F^2``, when no class of two or more elements shows spread).
    """
    batch, n, reps, num = images.shape
    classes = xp.matrix_transpose(mask)  # (c, n)
    own = xp.sum(images * mask[:, None, :], axis=-1)  # (J v_{a, color(i)})_i, (B, n, r)
    entries = signs * own
    centered = entries - xp.mean(entries, axis=-1)[..., None]
    spread = xp.sum(centered * centered, axis=-1) / (reps - 1)  # s_i^2, (B, n)
    off = spread @ mask  # N_C, (B, c)
    norms = xp.sum(own * own, axis=-1) / reps  # (B, n)
    full = norms @ mask  # F_C, (B, c)
    # Q: v_{a,C}^T J v_{a,D} (one repetition, two classes), v_{a,C}^T J v_{e,C} (one class).
    weighted = xp.reshape(signs[..., None] * images, (batch, n, reps * num))
    by_rep = xp.reshape(classes @ weighted, (batch, num, reps, num))  # [b, C, a, D]
    skew = by_rep - xp.permute_dims(by_rep, (0, 3, 2, 1))
    between = xp.sum(skew * skew, axis=(-3, -2, -1)) / (2 * reps)
    pairs = xp.reshape(signs[..., :, None] * own[..., None, :], (batch, n, reps * reps))
    by_class = xp.reshape(classes @ pairs, (batch, num, reps, reps))  # [b, C, a, e]
    inner = by_class - xp.matrix_transpose(by_class)
    within = xp.sum(inner * inner, axis=(-3, -2, -1)) / (2 * reps * (reps - 1))
    outside = xp.sum(images * images, axis=(-3, -2, -1)) / reps - xp.sum(norms, axis=-1)
    mass = xp.sum(off, axis=-1) + outside  # P
    some = mass > 0
    share = (between + within) / xp.where(some, mass, xp.ones_like(mass))
    factor = 2 - xp.minimum(share, xp.ones_like(share))  # 2 - q, (B,)
    # Classes of two or more elements whose repetitions agree up to sign.
    size = xp.sum(mask, axis=0)
    agree = xp.abs(classes @ (signs * signs[..., :1]))  # (B, c, r)
    alike = xp.all(agree >= size[:, None] - 0.5, axis=-1) & (size > 1)  # (B, c)
    seen = xp.where(alike | (size < 2), xp.zeros_like(off), xp.ones_like(off))
    seen_full = xp.sum(seen * full, axis=-1)
    known = seen_full > 0
    rho = xp.where(
        known,
        xp.sum(seen * off, axis=-1) / xp.where(known, seen_full, xp.ones_like(seen_full)),
        xp.ones_like(seen_full),
    )
    alone = reps * rho[..., None] * full  # r Var(t_C) / (2 - q) of a class seen once
    return factor[..., None] * xp.where(alike, alone, off)


def _probes_and_mask(colors: Array, signs: Array, num_colors: int | None) -> tuple[Array, Array]:
    """Probing's probes ``(B, n, r * c)`` (see :func:`probe_matrix`) and the ``(n, c)`` classes."""
    xp = namespace(signs)
    check_probes(signs, "signs", xp)
    batch, n, reps = signs.shape
    mask = _color_mask(colors, n, num_colors, signs, xp)
    probes = signs[..., None] * mask[:, None, :]  # (B, n, r, c)
    return xp.reshape(probes, (batch, n, reps * mask.shape[-1])), mask


def _color_mask(colors: Array, n: int, num_colors: int | None, like: Array, xp: Any) -> Array:
    """``(n, c)`` indicator of the color classes, in the namespace, dtype and device of ``like``."""
    if num_colors is not None and (not is_int(num_colors) or num_colors < 1):
        raise PatternError(f"num_colors={num_colors!r} must be a positive integer.")
    where = device(like)
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
        mask = xp.asarray(host[:, None] == np.arange(num), device=where)
        return xp.astype(mask, like.dtype)
    if colors.ndim != 1 or colors.shape[0] != n:
        raise PatternError(
            f"colors must have shape (n,) = ({n},), one color per input element; "
            f"got shape {tuple(colors.shape)}."
        )
    if not xp.isdtype(colors.dtype, "integral"):
        raise PatternTypeError(f"colors must hold integers 0 .. c-1; got dtype {colors.dtype}.")
    num = int(xp.max(colors)) + 1 if num_colors is None else int(num_colors)
    labels = xp.arange(num, dtype=colors.dtype, device=where)
    return xp.astype(colors[:, None] == labels, like.dtype)
