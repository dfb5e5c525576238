"""Column, row and diagonal colorings of a per-sample Jacobian pattern, and their validity.

Column coloring (forward mode; Curtis, Powell & Reid 1974), row coloring (reverse mode) and
diagonal coloring (the trace; its conflict graph is the pattern of ``P + P^T``). The column
and row colorings guard against the blow-up of their conflict graph ``P^T P``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
from numpy.typing import ArrayLike

from ..._errors import NonSquareJacobianError
from . import _box, _graph
from ._graph import (
    ORDERS,
    IntArray,
    OrderName,
    SparseLike,
    _degrees,
    _order,
    as_colors,
    as_pattern,
    best_greedy,
    check_orders,
    clique_lower_bound,
    count,
    greedy,
    row_ids,
)

__all__ = [
    "MAX_CONFLICT_PAIRS",
    "column_coloring",
    "diagonal_coloring",
    "is_valid_column_coloring",
    "is_valid_diagonal_coloring",
    "is_valid_row_coloring",
    "row_coloring",
]

#: Upper bound on the work (and memory) spent building a column / row conflict graph: the sum
#: over distinct rows of ``nnz_row ** 2``, the number of pairs the product ``P^T P`` enumerates.
#: Above it the graph is not built and only the ``"natural"`` order is tried, by a distance-2
#: greedy that never forms ``P^T P`` (its work grows as ``nnz * ceil(n_colors / 64)``).
MAX_CONFLICT_PAIRS: int = 200_000_000

# Columns the distance-2 greedy reads from the pattern at once (bounds its Python lists).
_GREEDY_COLUMNS = 1 << 14


# --------------------------------------------------------------------------------------------
# Column, row and diagonal colorings
# --------------------------------------------------------------------------------------------


def _distinct_nonempty_rows(p: sp.csr_array) -> sp.csr_array:
    """The nonempty rows of a canonical CSR pattern, each distinct support kept once.

    Rows are grouped by a random 64-bit hash of their column sets, then every row is compared
    entry by entry with its group's representative; on any mismatch (a hash collision) the
    nonempty rows are returned unmerged. ``P^T P`` has the same pattern either way.
    """
    n_rows, n_cols = p.shape
    nnz_row = np.diff(p.indptr)
    rows = np.flatnonzero(nnz_row)
    if rows.size <= 1:
        return p[rows]
    weights = np.random.default_rng(0x5EED).bit_generator.random_raw(n_cols + 1)
    # uint64 sums wrap around silently, which is fine for a hash
    keys = np.add.reduceat(weights[p.indices], p.indptr[rows])
    keys += nnz_row[rows].astype(np.uint64) * weights[n_cols]
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    if first.size == rows.size:
        return p[rows]
    rep_of_row = np.arange(n_rows, dtype=np.int64)
    rep_of_row[rows] = rows[first[inverse]]
    entry_rows = row_ids(p.indptr, n_rows)
    start = p.indptr.astype(np.int64)
    pos = np.arange(p.nnz, dtype=np.int64) - start[entry_rows] + start[rep_of_row[entry_rows]]
    same_nnz = np.array_equal(nnz_row, nnz_row[rep_of_row])
    if not (same_nnz and np.array_equal(p.indices, p.indices[pos])):
        return p[rows]
    return p[np.sort(rows[first])]


def _distance2_greedy(p: sp.csr_array, order: IntArray) -> IntArray:
    """First-fit column coloring read straight off the pattern, without forming ``P^T P``.

    Every row keeps the set of colors its already-colored columns use, as the bits of a Python
    int; a column takes the lowest color absent from the union over its rows. This is exactly
    greedy coloring of the conflict graph in ``order``, in O(nnz * words) work and
    O(n_rows * words) memory (``words = ceil(n_colors / 64)``); the columns are read from the
    pattern :data:`_GREEDY_COLUMNS` at a time.
    """
    n_rows, n_cols = p.shape
    csc = p.tocsc()
    used = [0] * n_rows
    colors = np.zeros(n_cols, dtype=np.int64)
    for a in range(0, n_cols, _GREEDY_COLUMNS):
        columns = order[a : a + _GREEDY_COLUMNS]
        block = csc[:, columns]
        colptr = block.indptr.tolist()
        row_index = block.indices.tolist()
        found = []
        for j in range(len(columns)):
            rows = row_index[colptr[j] : colptr[j + 1]]
            taken = 0
            for r in rows:
                taken |= used[r]
            bit = (taken + 1) & ~taken  # lowest color not taken
            found.append(bit.bit_length() - 1)
            for r in rows:
                used[r] |= bit
        colors[columns] = found
    return colors


def _column_coloring_canonical(
    p: sp.csr_array, orders: tuple[OrderName, ...], shape: tuple[int, ...] | None
) -> IntArray:
    n_in = p.shape[1]
    if p.nnz == 0:
        return np.zeros(n_in, dtype=np.int64)
    max_row = int(np.diff(p.indptr).max())  # every row's columns form a clique
    if max_row == n_in:
        # a full row makes every pair of columns conflict: n colors are needed
        return np.arange(n_in, dtype=np.int64)
    if shape is None:
        return _greedy_column_coloring(p, orders, max_row)
    sides = _box.column_sides(p, shape)
    if math.prod(sides) <= max_row:  # a stencil: the box coloring is optimal
        return _box.residue_colors(shape, sides)
    best = _greedy_column_coloring(p, orders, max_row)
    return _box.residue_colors(shape, sides) if math.prod(sides) < count(best) else best


def _greedy_column_coloring(
    p: sp.csr_array, orders: tuple[OrderName, ...], lower_bound: int
) -> IntArray:
    """The fewest colors of a greedy column coloring over ``orders`` (only ``"natural"``, by
    the distance-2 greedy, when ``P^T P`` is too large to build)."""
    n_in = p.shape[1]
    distinct = _distinct_nonempty_rows(p)
    nnz_row = np.diff(distinct.indptr).astype(np.int64)
    graph_allowed = int((nnz_row * nnz_row).sum()) <= MAX_CONFLICT_PAIRS
    if not graph_allowed:
        return _distance2_greedy(distinct, np.arange(n_in, dtype=np.int64))
    conflicts: tuple[sp.csr_array, IntArray] | None = None  # the graph P^T P and its degrees
    best: IntArray | None = None
    for name in orders:
        if name == "natural" and conflicts is None:
            colors = _distance2_greedy(distinct, np.arange(n_in, dtype=np.int64))
        else:
            if conflicts is None:
                conflicts = _conflict_graph(distinct)
            graph, degrees = conflicts
            if name == "smallest_last" and int(degrees.sum()) // 2 > _graph.SMALLEST_LAST_MAX_EDGES:
                continue
            colors = greedy(graph.indptr, graph.indices, _order(graph, name, degrees))
        if best is None or count(colors) < count(best):
            best = colors
        if count(best) <= lower_bound:
            break
    if best is None:  # every order was skipped (too large): natural
        best = _distance2_greedy(distinct, np.arange(n_in, dtype=np.int64))
    return best


def _conflict_graph(p: sp.csr_array) -> tuple[sp.csr_array, IntArray]:
    """The column conflict graph, the pattern of ``P^T P``, and its degrees."""
    # float32 data: sums of positive counts never cancel to a dropped zero
    weighted = sp.csr_array((np.ones(p.nnz, np.float32), p.indices, p.indptr), shape=p.shape)
    graph = sp.csr_array(weighted.T.tocsr() @ weighted)
    return graph, _degrees(graph)


def column_coloring(
    pattern: SparseLike,
    *,
    orders: Sequence[OrderName] = ORDERS,
    shape: Sequence[int] | None = None,
) -> IntArray:
    """Color the columns of ``pattern`` so that same-colored columns share no nonzero row.

    With the one-hot seed matrix ``S[j, colors[j]] = 1``, the compressed ``C = J @ S`` (one JVP
    per color) holds every nonzero of ``J``: ``J[i, j] = C[i, colors[j]]`` (Curtis, Powell &
    Reid 1974).

    How, and the guards against blow-up:

    * Duplicate rows are merged first (they add no conflicts). Every row's columns form a
      clique, so at least ``max(nnz per row)`` colors are needed; once an order reaches that
      bound the remaining orders are not tried (they could not win).
    * The ``"natural"`` order runs a distance-2 greedy straight on the pattern (per-row sets of
      used colors), never forming ``P^T P``; optimal on convolution stencils.
    * The other orders need the conflict graph, the pattern of ``P^T P``. It is built only if
      the number of pairs it enumerates (sum of squared row counts) is at most
      :data:`MAX_CONFLICT_PAIRS`; otherwise those orders are skipped and ``"natural"`` is used.
    * With the grid ``shape`` of the columns, the box coloring comes first (see
      :mod:`._box`: colors from the residues of the grid coordinates, valid by construction,
      in O(nnz) time and bounded memory). When its count reaches the clique bound (a stencil:
      a convolution, a blur, a finite-difference operator) it is returned at once; otherwise it
      is kept if it beats every greedy order.
    * Short cuts: an empty pattern gives color 0 everywhere; a full row gives
      ``arange(n_in)`` (optimal). No size gives up on coloring: past the limits the natural
      greedy (or the box) still runs.

    Args:
        pattern: ``(n_out, n_in)`` scipy sparse matrix, any format; its stored nonzeros count.
        orders: vertex orders to try (see :func:`vertex_order`); the fewest colors wins, ties go
            to the earlier order. ``"smallest_last"`` is skipped on graphs with more than
            :data:`SMALLEST_LAST_MAX_EDGES` edges; if every order is skipped, ``"natural"`` is
            used.
        shape: the grid of the columns (a sample's input shape, row-major); ``None``: no box
            coloring is tried.

    Returns:
        int64 array of length ``n_in`` with contiguous colors ``0 .. k - 1``.

    Raises:
        PatternError: if ``shape`` does not hold ``n_in`` elements.

    Example:
        >>> import scipy.sparse as sp
        >>> p = sp.csr_array([[1, 1, 0], [0, 1, 1]])
        >>> column_coloring(p)
        array([0, 1, 0])
    """
    p = as_pattern(pattern)
    grid = None if shape is None else _box.check_shape(shape, p.shape[1], "column shape")
    return _column_coloring_canonical(p, check_orders(orders), grid)


def row_coloring(
    pattern: SparseLike,
    *,
    orders: Sequence[OrderName] = ORDERS,
    shape: Sequence[int] | None = None,
) -> IntArray:
    """Color the rows of ``pattern`` so that same-colored rows share no nonzero column.

    The column coloring of ``pattern.T``: with the one-hot ``S[i, row_colors[i]] = 1``, the
    compressed ``R = S.T @ J`` (one VJP per color) holds every nonzero of ``J``:
    ``J[i, j] = R[row_colors[i], j]``. Same short cuts and limits as :func:`column_coloring`.

    Args:
        pattern: ``(n_out, n_in)`` scipy sparse matrix, any format.
        orders: vertex orders to try, as in :func:`column_coloring`.
        shape: the grid of the rows (a sample's output shape), as in :func:`column_coloring`.

    Returns:
        int64 array of length ``n_out`` with contiguous colors ``0 .. k - 1``.

    Raises:
        PatternError: if ``shape`` does not hold ``n_out`` elements.

    Example:
        >>> import scipy.sparse as sp
        >>> p = sp.csr_array([[1, 0], [1, 1], [0, 1]])
        >>> row_coloring(p)
        array([0, 1, 0])
    """
    p = as_pattern(as_pattern(pattern).T)
    grid = None if shape is None else _box.check_shape(shape, p.shape[1], "row shape")
    return _column_coloring_canonical(p, check_orders(orders), grid)


def diagonal_coloring(
    pattern: SparseLike,
    *,
    orders: Sequence[OrderName] = ORDERS,
    shape: Sequence[int] | None = None,
) -> IntArray:
    """Color the indices of a square pattern so that the compressed Jacobian reveals its diagonal.

    Indices ``j != j'`` share a color only if ``P[j, j'] == P[j', j] == 0``. Then with the
    one-hot ``S[j, colors[j]] = 1`` and ``C = J @ S``, ``C[j, colors[j]] == J[j, j]``: the exact
    trace costs one JVP per color. The conflict
    graph is the pattern of ``P + P^T`` (at most twice the size of ``P``), so no size guard is
    needed; a pattern whose graph is complete gives ``arange(n)`` at once. The orders stop early
    once a greedily found clique's size is reached. With the grid ``shape``, the box coloring
    (see :mod:`._box`) is returned at once when a box of its size is a clique (a stencil), and
    otherwise kept if it beats every greedy order.

    Args:
        pattern: ``(n, n)`` scipy sparse matrix, any format.
        orders: vertex orders to try, as in :func:`column_coloring`.
        shape: the grid of the indices (a sample's shape); ``None``: no box coloring is tried.

    Returns:
        int64 array of length ``n`` with contiguous colors ``0 .. k - 1``.

    Raises:
        NonSquareJacobianError: (a ``ValueError``) if the pattern is not square.
        PatternError: if ``shape`` does not hold ``n`` elements.

    Example:
        >>> import scipy.sparse as sp
        >>> tridiagonal = sp.diags_array([1, 1, 1], offsets=[-1, 0, 1], shape=(4, 4), dtype=bool)
        >>> diagonal_coloring(tridiagonal)
        array([0, 1, 0, 1])
    """
    orders_ = check_orders(orders)
    p = as_pattern(pattern)
    n_out, n_in = p.shape
    if n_out != n_in:
        raise NonSquareJacobianError(
            f"a diagonal coloring needs a square pattern, got n_out={n_out} rows and "
            f"n_in={n_in} columns (shape {p.shape}); use column_coloring or row_coloring for "
            "the whole Jacobian."
        )
    if shape is None:
        return _greedy_diagonal_coloring(p, orders_)
    grid = _box.check_shape(shape, n_in, "shape")
    sides = _box.diagonal_sides(p, grid)
    if _box.is_clique(p, grid, sides):  # a stencil: the box coloring is optimal
        return _box.residue_colors(grid, sides)
    best = _greedy_diagonal_coloring(p, orders_)
    return _box.residue_colors(grid, sides) if math.prod(sides) < count(best) else best


def _greedy_diagonal_coloring(p: sp.csr_array, orders: tuple[OrderName, ...]) -> IntArray:
    """The fewest colors of a greedy coloring of the graph ``P + P^T`` over ``orders``."""
    n_in = p.shape[0]
    graph = as_pattern(p + p.T)
    n_edges_directed = graph.nnz - int(graph.diagonal().sum())
    if n_edges_directed == 0:
        return np.zeros(n_in, dtype=np.int64)
    if n_edges_directed == n_in * (n_in - 1):
        return np.arange(n_in, dtype=np.int64)
    degrees = _degrees(graph)
    starts = [0, int(degrees.argmin()), int(degrees.argmax()), n_in - 1]
    return best_greedy(
        graph, orders, lower_bound=clique_lower_bound(graph, starts), degrees=degrees
    )


# --------------------------------------------------------------------------------------------
# Validity checks
# --------------------------------------------------------------------------------------------


def _no_repeated_color_per_row(p: sp.csr_array, colors: IntArray) -> bool:
    if p.nnz == 0:
        return True
    k = int(colors.max()) + 1
    keys = row_ids(p.indptr, p.shape[0]) * k + colors[p.indices]
    keys.sort()
    return not bool(np.any(keys[1:] == keys[:-1]))


def is_valid_column_coloring(pattern: SparseLike, colors: ArrayLike) -> bool:
    """Whether no row of ``pattern`` has two nonzeros in columns of the same color.

    Args:
        pattern: ``(n_out, n_in)`` scipy sparse matrix.
        colors: integer array of length ``n_in``.

    Returns:
        ``True`` if the coloring is valid (negative colors are invalid).

    Raises:
        PatternError: if ``colors`` is not a 1-D array of length ``n_in``.
        PatternTypeError: if ``colors`` does not hold integers.

    Example:
        >>> import scipy.sparse as sp
        >>> p = sp.csr_array([[1, 1, 0], [0, 1, 1]])
        >>> is_valid_column_coloring(p, [0, 1, 0]), is_valid_column_coloring(p, [0, 0, 1])
        (True, False)
    """
    p = as_pattern(pattern)
    c = as_colors(colors, p.shape[1], "colors")
    if c.size and int(c.min()) < 0:
        return False
    return _no_repeated_color_per_row(p, c)


def is_valid_row_coloring(pattern: SparseLike, row_colors: ArrayLike) -> bool:
    """Whether no column of ``pattern`` has two nonzeros in rows of the same color.

    Args:
        pattern: ``(n_out, n_in)`` scipy sparse matrix.
        row_colors: integer array of length ``n_out``.

    Returns:
        ``True`` if the coloring is valid (negative colors are invalid).

    Raises:
        PatternError: if ``row_colors`` is not a 1-D array of length ``n_out``.
        PatternTypeError: if ``row_colors`` does not hold integers.

    Example:
        >>> import scipy.sparse as sp
        >>> p = sp.csr_array([[1, 0], [1, 1], [0, 1]])
        >>> is_valid_row_coloring(p, [0, 1, 0]), is_valid_row_coloring(p, [0, 0, 1])
        (True, False)
    """
    pt = as_pattern(as_pattern(pattern).T)
    c = as_colors(row_colors, pt.shape[1], "row_colors")
    if c.size and int(c.min()) < 0:
        return False
    return _no_repeated_color_per_row(pt, c)


def is_valid_diagonal_coloring(pattern: SparseLike, colors: ArrayLike) -> bool:
    """Whether every off-diagonal nonzero ``(i, j)`` of a square pattern has different colors.

    Args:
        pattern: ``(n, n)`` scipy sparse matrix.
        colors: integer array of length ``n``.

    Returns:
        ``True`` if the coloring is valid (negative colors are invalid).

    Raises:
        NonSquareJacobianError: (a ``ValueError``) if the pattern is not square.
        PatternError: if ``colors`` is not a 1-D array of length ``n``.
        PatternTypeError: if ``colors`` does not hold integers.

    Example:
        >>> import scipy.sparse as sp
        >>> p = sp.csr_array([[1, 1, 0], [0, 1, 0], [0, 0, 1]])
        >>> is_valid_diagonal_coloring(p, [0, 1, 0]), is_valid_diagonal_coloring(p, [0, 0, 1])
        (True, False)
    """
    p = as_pattern(pattern)
    if p.shape[0] != p.shape[1]:
        raise NonSquareJacobianError(
            f"a diagonal coloring needs a square pattern, got shape {p.shape}."
        )
    c = as_colors(colors, p.shape[1], "colors")
    if c.size and int(c.min()) < 0:
        return False
    rows = row_ids(p.indptr, p.shape[0])
    off = rows != p.indices
    return not bool(np.any(c[rows[off]] == c[p.indices[off]]))
