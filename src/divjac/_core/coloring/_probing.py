"""Distance-limited patterns and colorings for the probing trace estimator.

Probing (Tang & Saad 2012; hierarchical probing: Stathopoulos, Laeuchli & Orginos 2013) colors
only the entries within a Chebyshev distance on the sample's grid when the exact diagonal
coloring needs more colors than the budget allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
from numpy.typing import NDArray

from ..._errors import NumProbesError, PatternError
from ._graph import ORDERS, IntArray, OrderName, SparseLike, as_pattern, check_orders, row_ids
from ._jacobian import diagonal_coloring

__all__ = [
    "Distance",
    "lattice_coloring",
    "lattice_pattern",
    "probing_coloring",
    "restrict_to_distance",
]


# --------------------------------------------------------------------------------------------
# Distance-limited patterns for probing
# --------------------------------------------------------------------------------------------


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    shape_ = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape_):
        raise PatternError(f"shape must hold non-negative sizes, got {tuple(shape)}.")
    return shape_


Distance = int | Sequence[int | None]
"""A Chebyshev distance on the sample grid: one int for every axis, or one per axis, where
``None`` keeps the whole axis (e.g. channels, which should never share a probe)."""


def _check_distance(distance: int) -> int:
    if int(distance) != distance or distance < 0:
        raise PatternError(f"distance must be a non-negative integer, got {distance!r}.")
    return int(distance)


def _axis_distances(shape: tuple[int, ...], distance: Distance) -> tuple[int, ...]:
    """One non-negative distance per axis (``None`` -> the whole axis)."""
    if isinstance(distance, int | np.integer):
        d = _check_distance(int(distance))
        return tuple(d for _ in shape)
    per_axis = tuple(distance)
    if len(per_axis) != len(shape):
        raise PatternError(
            f"distance has {len(per_axis)} entries but the shape {shape} has {len(shape)} axes."
        )
    return tuple(
        max(size - 1, 0) if d is None else _check_distance(d)
        for size, d in zip(shape, per_axis, strict=True)
    )


def _within(
    rows: IntArray, cols: IntArray, shape: tuple[int, ...], dists: tuple[int, ...]
) -> NDArray[np.bool_]:
    """Whether flat indices ``rows`` and ``cols`` are within ``dists`` on every axis."""
    rows = rows.astype(np.int64)
    cols = cols.astype(np.int64)
    ok = np.ones(rows.shape, dtype=bool)
    for size, d in zip(reversed(shape), reversed(dists), strict=True):
        if size > 1:
            ok &= np.abs(rows % size - cols % size) <= d
            rows = rows // size
            cols = cols // size
    return ok


def _chebyshev(rows: IntArray, cols: IntArray, shape: tuple[int, ...]) -> IntArray:
    """Chebyshev distance between the row-major multi-indices of flat indices rows and cols."""
    rows = rows.copy()
    cols = cols.astype(np.int64)
    dist = np.zeros(rows.shape, dtype=np.int64)
    for size in reversed(shape):
        if size > 1:
            np.maximum(dist, np.abs(rows % size - cols % size), out=dist)
            rows //= size
            cols //= size
    return dist


def _pattern_for_shape(pattern: SparseLike, shape: tuple[int, ...]) -> sp.csr_array:
    p = as_pattern(pattern)
    n = math.prod(shape)
    if p.shape != (n, n):
        raise PatternError(
            f"pattern must have shape (n, n) with n = prod(shape) = {n} for shape {shape}, "
            f"got {p.shape}."
        )
    return p


def restrict_to_distance(
    pattern: SparseLike, shape: Sequence[int], distance: Distance
) -> sp.csr_array:
    """Keep the entries ``(i, j)`` whose grid positions lie within Chebyshev ``distance``.

    ``i`` and ``j`` are flat indices into a per-sample array of shape ``shape`` (row-major);
    ``(i, j)`` is kept when ``|i_axis - j_axis| <= distance_axis`` on every axis (``distance``
    is one int for all axes, or one per axis with ``None`` for a whole axis). A distance of at
    least ``size - 1`` on every axis keeps the whole pattern.

    Args:
        pattern: ``(n, n)`` scipy sparse matrix with ``n = prod(shape)``.
        shape: the per-sample array shape.
        distance: non-negative integer, or one per axis (``None``: the whole axis).

    Returns:
        The restricted pattern, a canonical boolean ``csr_array``.

    Raises:
        PatternError: on a pattern that does not match ``shape`` or a negative distance.

    Example:
        >>> import numpy as np, scipy.sparse as sp
        >>> restrict_to_distance(sp.csr_array(np.ones((4, 4))), (4,), 1).toarray().astype(int)
        array([[1, 1, 0, 0],
               [1, 1, 1, 0],
               [0, 1, 1, 1],
               [0, 0, 1, 1]])
    """
    shape_ = _check_shape(shape)
    dists = _axis_distances(shape_, distance)
    p = _pattern_for_shape(pattern, shape_)
    if all(d >= size - 1 for d, size in zip(dists, shape_, strict=True)):
        return p
    rows = row_ids(p.indptr, p.shape[0])
    keep = _within(rows, p.indices, shape_, dists)
    indptr = np.zeros(p.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows[keep], minlength=p.shape[0]), out=indptr[1:])
    return sp.csr_array(
        (np.ones(int(indptr[-1]), dtype=bool), p.indices[keep], indptr), shape=p.shape
    )


def lattice_pattern(shape: Sequence[int], distance: Distance) -> sp.csr_array:
    """Pattern of all pairs of grid points within Chebyshev ``distance`` (diagonal included).

    Built as the Kronecker product of one banded ``|a - b| <= distance`` matrix per axis, which
    is exactly the row-major Chebyshev ball.

    Args:
        shape: the per-sample array shape; ``n = prod(shape)``.
        distance: non-negative integer, or one per axis (``None``: the whole axis).

    Returns:
        ``(n, n)`` canonical boolean ``csr_array``.

    Example:
        >>> lattice_pattern((3,), 1).toarray().astype(int)
        array([[1, 1, 0],
               [1, 1, 1],
               [0, 1, 1]])
    """
    shape_ = _check_shape(shape)
    dists = _axis_distances(shape_, distance)
    out = sp.csr_array(np.ones((1, 1), dtype=bool))
    for size, d in zip(shape_, dists, strict=True):
        offsets = list(range(-min(d, size - 1), min(d, size - 1) + 1)) if size else [0]
        band = sp.diags_array(
            [np.ones(size - abs(o), dtype=bool) for o in offsets],
            offsets=offsets,
            shape=(size, size),
            dtype=bool,
        )
        out = sp.csr_array(sp.kron(out, band, format="csr"))
    return as_pattern(out)


def lattice_coloring(shape: Sequence[int], distance: Distance) -> IntArray:
    """Optimal diagonal coloring of :func:`lattice_pattern` ``(shape, distance)``, in closed form.

    A point with multi-index ``x`` gets the mixed-radix number of ``x_axis mod m_axis`` with
    ``m_axis = min(distance + 1, size_axis)``: same-colored points differ by a multiple of
    ``distance + 1`` along some axis. It uses ``prod(m_axis)`` colors, which is optimal since
    any ``m_0 x m_1 x ...`` box is a clique (the coloring of hierarchical probing, Stathopoulos,
    Laeuchli & Orginos 2013).

    Args:
        shape: the per-sample array shape.
        distance: non-negative integer, or one per axis (``None``: the whole axis).

    Returns:
        int64 array of length ``prod(shape)`` with contiguous colors.

    Example:
        >>> lattice_coloring((2, 3), 1)
        array([0, 1, 0, 2, 3, 2])
    """
    shape_ = _check_shape(shape)
    dists = _axis_distances(shape_, distance)
    n = math.prod(shape_)
    flat = np.arange(n, dtype=np.int64)
    colors = np.zeros(n, dtype=np.int64)
    stride = 1
    for size, d in zip(reversed(shape_), reversed(dists), strict=True):
        if size > 0:
            m = min(d + 1, size)
            colors += (flat % size % m) * stride
            flat //= size
            stride *= m
    return colors


def probing_coloring(
    pattern: SparseLike | None,
    shape: Sequence[int],
    *,
    max_colors: int,
    whole_axes: Sequence[int] = (),
    orders: Sequence[OrderName] = ORDERS,
) -> tuple[IntArray, int]:
    """Diagonal coloring of the largest distance-restricted pattern that fits in ``max_colors``.

    For the probing trace estimator (Tang & Saad 2012; hierarchical probing: Stathopoulos,
    Laeuchli & Orginos 2013): when the exact diagonal coloring needs too many colors, color only
    the entries within Chebyshev distance ``d`` on the sample grid (:func:`restrict_to_distance`)
    and take the largest ``d`` whose coloring has at most ``max_colors`` colors. The probe
    estimate ``sum_c v_c^T J v_c`` is then off only by entries farther apart than ``d``.

    With ``pattern=None`` the lattice of all pairs within ``d`` (:func:`lattice_pattern`) is
    colored optimally in closed form by :func:`lattice_coloring`, with ``prod(min(d + 1, size))``
    colors. With a pattern, :func:`diagonal_coloring` is used and ``d`` is searched by doubling
    then bisection, which assumes the color count does not decrease as ``d`` grows (true of the
    optimum, since the restricted patterns are nested, and of greedy in practice). The returned
    coloring always has at most ``max_colors`` colors and is valid for the returned distance; if
    the assumption failed, a larger feasible ``d`` could exist.

    ``d`` never exceeds the largest distance at which the restriction still changes the pattern
    (``max(shape) - 1``, or the farthest nonzero of ``pattern``): reaching it means the coloring
    is exact for the full pattern.

    Args:
        pattern: ``(n, n)`` scipy sparse matrix with ``n = prod(shape)``, or ``None``.
        shape: the per-sample array shape.
        max_colors: the largest number of colors (probes) allowed, at least 1.
        whole_axes: axes never split by the distance (channels: elements of one pixel should not
            share a probe); the distance ``d`` applies to the other axes.
        orders: vertex orders passed to :func:`diagonal_coloring`.

    Returns:
        ``(colors, distance)``: int64 colors of length ``n`` and the distance ``d`` used.

    Raises:
        NumProbesError: if ``max_colors < 1``.
        PatternError: if the pattern does not match ``shape``.

    Example:
        >>> colors, d = probing_coloring(None, (8, 8), max_colors=10)
        >>> d, int(colors.max()) + 1
        (2, 9)
    """
    shape_ = _check_shape(shape)
    if int(max_colors) != max_colors or max_colors < 1:
        raise NumProbesError(f"max_colors must be a positive integer, got {max_colors!r}.")
    orders_ = check_orders(orders)
    n = math.prod(shape_)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    whole = {int(a) % len(shape_) for a in whole_axes} if shape_ else set()
    split = [s for a, s in enumerate(shape_) if a not in whole]
    d_max = max(split, default=1) - 1

    def per_axis(d: int) -> tuple[int | None, ...]:
        return tuple(None if a in whole else d for a in range(len(shape_)))

    if pattern is None:
        good = 0
        fixed = math.prod(s for a, s in enumerate(shape_) if a in whole)
        for d in range(1, d_max + 1):  # prod(min(d + 1, s)) grows with d: stop at the first miss
            if fixed * math.prod(min(d + 1, s) for s in split) > max_colors:
                break
            good = d
        return lattice_coloring(shape_, per_axis(good)), good

    p = _pattern_for_shape(pattern, shape_)
    farthest = _chebyshev(row_ids(p.indptr, n), p.indices, shape_).max(initial=0)
    d_max = min(d_max, int(farthest))
    cache: dict[int, IntArray] = {}

    def fits(d: int) -> bool:
        colors = diagonal_coloring(restrict_to_distance(p, shape_, per_axis(d)), orders=orders_)
        cache[d] = colors
        return int(colors.max()) + 1 <= max_colors

    if not fits(0):  # even the whole axes alone need more colors: do not split them then
        return np.zeros(n, dtype=np.int64) if not whole else _fallback(shape_, max_colors), 0
    good, bad = 0, d_max + 1  # invariant: good fits; bad does not (or lies past d_max)
    step = 1
    while good < d_max:
        d = min(good + step, d_max)
        if not fits(d):
            bad = d
            break
        good = d
        step *= 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return cache[good], good


def _fallback(shape: tuple[int, ...], max_colors: int) -> IntArray:
    """Element ``j`` gets color ``j mod max_colors`` (any coloring keeps probing unbiased)."""
    return np.arange(math.prod(shape), dtype=np.int64) % max_colors
