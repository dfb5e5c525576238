"""Box (lattice) colorings: a color per residue of the element's grid coordinates.

On the grid of a sample's shape, an element at coordinates ``x`` takes the color of
``x mod k`` (one residue per axis, ``prod(k)`` colors). For a column coloring, ``k[d]`` is one
more than the widest span, along axis ``d``, of the columns of any row: two columns sharing a
row then differ along every axis by less than ``k[d]``, and along some axis by a nonzero amount,
so their residues differ. For a diagonal coloring ``k[d]`` is one more than the largest
``|x_i[d] - x_j[d]|`` over the off-diagonal nonzeros ``(i, j)``. Either coloring is valid for
every pattern by construction (computing ``k`` is the O(nnz) check), and optimal on stencils
(a convolution, a blur, a finite-difference operator): there a row (a box of the grid) is a
clique of ``prod(k)`` elements. Memory stays bounded: entries are read in chunks of rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import scipy.sparse as sp

from ..._errors import PatternError
from ._graph import IntArray

__all__ = ["check_shape", "column_sides", "diagonal_sides", "is_clique", "residue_colors"]

# Entries read at once: bounds the temporaries of a box (a few int64 arrays of this length).
_CHUNK_ENTRIES = 1 << 22

# Largest box whose clique check (a dense box x box block of the pattern) is run.
_MAX_CLIQUE_CHECK = 4096


def check_shape(shape: Sequence[int] | None, n: int, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple (``None``: ``(n,)``); :class:`PatternError` unless it holds ``n``
    elements."""
    if shape is None:
        return (n,)
    dims = tuple(int(s) for s in shape)
    if math.prod(dims) != n or any(s < 0 for s in dims):
        raise PatternError(
            f"{what} must have as many elements as the pattern has {what.split()[0]}s ({n}); "
            f"got shape {dims}."
        )
    return dims


def _chunks(p: sp.csr_array) -> Iterator[tuple[IntArray, np.ndarray, np.ndarray]]:
    """``(rows, starts, indices)`` of the nonempty rows of ``p``, a chunk of rows at a time:
    the rows, where each starts within the chunk's ``indices``, and those indices."""
    counts = np.diff(p.indptr)
    rows = np.flatnonzero(counts)
    if rows.size == 0:
        return
    per_chunk = max(1, _CHUNK_ENTRIES // int(counts.max()))
    for a in range(0, rows.size, per_chunk):
        block = rows[a : a + per_chunk]
        lo, hi = int(p.indptr[block[0]]), int(p.indptr[block[-1] + 1])
        yield block, (p.indptr[block] - lo).astype(np.int64), p.indices[lo:hi]


def _coords(flat: np.ndarray, shape: tuple[int, ...]) -> list[np.ndarray]:
    """Grid coordinates of row-major flat indices, one int64 array per axis."""
    return list(np.unravel_index(flat.astype(np.int64, copy=False), shape))


def residue_colors(shape: tuple[int, ...], k: Sequence[int]) -> IntArray:
    """The color of every element of the grid ``shape``: its coordinates modulo ``k``, raveled
    (contiguous colors ``0 .. prod(k) - 1`` since ``k[d] <= shape[d]``)."""
    n = math.prod(shape)
    coords = np.unravel_index(np.arange(n, dtype=np.int64), shape)
    residues = tuple(c % m for c, m in zip(coords, k, strict=True))
    return np.ravel_multi_index(residues, tuple(k)).astype(np.int64)


def column_sides(p: sp.csr_array, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The sides ``k`` of the box column coloring of canonical ``p`` on the grid ``shape`` (the
    columns'): one more than the widest span of a row's columns along each axis."""
    span = np.zeros(len(shape), dtype=np.int64)
    for _, starts, indices in _chunks(p):
        for d, c in enumerate(_coords(indices, shape)):
            width = np.maximum.reduceat(c, starts) - np.minimum.reduceat(c, starts)
            span[d] = max(span[d], int(width.max()))
    return tuple((span + 1).tolist())


def diagonal_sides(p: sp.csr_array, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The sides ``k`` of the box diagonal coloring of square canonical ``p`` on the grid
    ``shape``: one more than the largest distance along each axis of a nonzero's row and
    column."""
    gap = np.zeros(len(shape), dtype=np.int64)
    for rows, starts, indices in _chunks(p):
        own = np.repeat(rows, np.diff(np.append(starts, indices.size)))
        for d, (a, b) in enumerate(zip(_coords(own, shape), _coords(indices, shape), strict=True)):
            gap[d] = max(gap[d], int(np.abs(a - b).max()))
    return tuple((gap + 1).tolist())


def is_clique(p: sp.csr_array, shape: tuple[int, ...], k: tuple[int, ...]) -> bool:
    """Whether a box of sides ``k`` of the grid is a clique of the diagonal conflict graph (the
    pattern of ``P + P^T``): then no coloring has fewer than ``prod(k)`` colors. The boxes at
    the grid's origin and centre are tried (none past :data:`_MAX_CLIQUE_CHECK` elements)."""
    size = math.prod(k)
    if size <= 1:
        return True
    if size > _MAX_CLIQUE_CHECK:
        return False
    box = np.indices(k).reshape(len(k), -1)
    for corner in ((0,) * len(k), tuple((s - m) // 2 for s, m in zip(shape, k, strict=True))):
        members = np.ravel_multi_index(tuple(box + np.array(corner)[:, None]), shape)
        block = p[members][:, members].toarray()
        block |= block.T
        np.fill_diagonal(block, True)
        if block.all():
            return True
    return False
