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
    namespace,
    single_term_stderr,
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
    repetitions is ``sum_C Var(t_C) / r``, estimated without bias by ``sum_C s_C^2 / r`` with
    ``s_C^2`` the sample variance of ``t_C`` over the repetitions. This pooled estimate has up to
    ``c (r - 1)`` degrees of freedom instead of the ``r - 1`` of the sample variance of the
    repetitions' totals (two repetitions, the usual plan, would give a single one):
    Satterthwaite's (1946) ``nu = (r - 1) (sum_C Var(t_C))^2 / sum_C Var(t_C)^2``. Plugging in
    ``s_C^2`` would bias it low (``E[s_C^4] = Var(t_C)^2 (r + 1) / (r - 1)`` for normal terms);
    correcting both sums gives ``nu_hat = (r + 1) (sum_C s_C^2)^2 / sum_C s_C^4 - 2``, clipped
    to ``[r - 1, c (r - 1)]`` (exactly ``r - 1`` when one class carries all the variance). The
    standard error is ``kappa(nu_hat) sqrt(sum_C s_C^2 / r)`` (package docstring). With one
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
    xp = namespace(signs)
    probes, mask = _probes_and_mask(colors, signs, num_colors)
    products = apply(matvec, probes)
    batch, _, reps = signs.shape
    per_color = xp.reshape(column_dots(probes, products), (batch, reps, mask.shape[-1]))
    estimate = xp.mean(xp.sum(per_color, axis=-1), axis=-1)
    if exact:
        return estimate, xp.zeros_like(estimate)
    if reps == 1:
        return estimate, single_term_stderr(products * mask, xp)
    deviations = per_color - xp.mean(per_color, axis=-2)[..., None, :]
    class_variance = xp.sum(deviations * deviations, axis=-2) / (reps - 1)  # s_C^2, (B, c)
    total = xp.sum(class_variance, axis=-1)
    squares = xp.sum(class_variance * class_variance, axis=-1)
    spread = squares > 0  # else every s_C is 0, and so is the standard error
    ratio = total * total / xp.where(spread, squares, xp.ones_like(squares))
    dof = xp.where(spread, (reps + 1) * ratio - 2, xp.zeros_like(ratio))
    lowest, highest = reps - 1, (reps - 1) * mask.shape[-1]
    dof = xp.minimum(xp.maximum(dof, xp.full_like(dof, lowest)), xp.full_like(dof, highest))
    return estimate, t_factor(dof) * xp.sqrt(total / reps)


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
