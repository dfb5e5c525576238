"""Graph colorings that compress sparse per-sample Jacobians.

A per-sample Jacobian sparsity pattern is a boolean scipy sparse matrix ``P`` of shape
``(n_out, n_in)``. Three colorings compress it (Curtis, Powell & Reid 1974; Coleman & Moré 1983;
survey: Gebremedhin, Manne & Pothen 2005, "What color is your Jacobian?"):

* **column coloring** (forward mode): columns ``j != j'`` may share a color only if no row has
  nonzeros in both. The conflict graph is the pattern of ``P^T P``. With the seed matrix ``S``
  (one-hot colors, ``S[j, colors[j]] = 1``), ``C = J @ S`` holds every nonzero of ``J`` once:
  ``J[i, j] = C[i, colors[j]]``.
* **row coloring** (reverse mode): the same on ``P^T``; ``R = S^T @ J``.
* **diagonal coloring** (for the trace, square ``P``): ``j != j'`` may share a color only if
  ``P[j, j'] == P[j', j] == 0``. The conflict graph is the pattern of ``P + P^T``, far smaller
  than ``P^T P``: a 3x3 'same' convolution on C channels needs 4C diagonal colors, 9C column colors.

Colorings are greedy (first fit) over a few vertex orders, keeping the one with the fewest colors;
the natural order, optimal on row-major image stencils, colors columns straight from ``P`` without
forming ``P^T P``, and a clique lower bound stops the search as soon as it is provably optimal.
For the probing trace estimator (Tang & Saad 2012; Stathopoulos, Laeuchli & Orginos 2013) the
diagonal pattern is restricted to pairs within a Chebyshev distance on the sample's grid.

This module imports NumPy and SciPy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, TypeAlias, cast

import numpy as np
import scipy.sparse as sp
from numpy.typing import ArrayLike, NDArray

from .._errors import (
    InternalError,
    NonSquareJacobianError,
    NumProbesError,
    PatternError,
    PatternTypeError,
)

__all__ = [
    "MAX_CONFLICT_PAIRS",
    "MAX_DISTANCE2_WORK",
    "ORDERS",
    "SMALLEST_LAST_MAX_EDGES",
    "as_pattern",
    "column_coloring",
    "diagonal_coloring",
    "greedy_coloring",
    "is_valid_column_coloring",
    "is_valid_diagonal_coloring",
    "is_valid_row_coloring",
    "lattice_coloring",
    "lattice_pattern",
    "probing_coloring",
    "restrict_to_distance",
    "row_coloring",
    "vertex_order",
]

SparseLike: TypeAlias = "sp.sparray | sp.spmatrix"
OrderName: TypeAlias = Literal["natural", "largest_first", "smallest_last"]
IntArray: TypeAlias = NDArray[np.int64]

#: Vertex orders tried by the colorings, in order of preference on ties.
ORDERS: tuple[OrderName, ...] = ("natural", "largest_first", "smallest_last")

#: Upper bound on the work (and memory) spent building a column / row conflict graph: the sum
#: over distinct rows of ``nnz_row ** 2``, the number of pairs the product ``P^T P`` enumerates.
#: Above it the graph is not built and only the ``"natural"`` order is tried, by a distance-2
#: greedy that never forms ``P^T P`` (see :data:`MAX_DISTANCE2_WORK`).
MAX_CONFLICT_PAIRS: int = 200_000_000

#: Bound on the work of the graph-free distance-2 greedy used for the ``"natural"`` order of
#: column / row colorings: ``nnz * ceil(n_colors / 64)`` over the distinct rows (about a second
#: per 10 million). Past it the trivial coloring ``arange(n)`` is returned (always valid).
MAX_DISTANCE2_WORK: int = 50_000_000

#: The ``"smallest_last"`` order is only computed on conflict graphs with at most this many
#: (undirected) edges; it is skipped on larger ones (each of its ``n`` steps runs a few NumPy
#: calls, so on big graphs it costs more than the greedy passes it tries to improve).
SMALLEST_LAST_MAX_EDGES: int = 2_000_000

_ORDER_NAMES = frozenset(ORDERS)


# --------------------------------------------------------------------------------------------
# Input normalisation
# --------------------------------------------------------------------------------------------


def as_pattern(pattern: SparseLike) -> sp.csr_array:
    """Return ``pattern`` as a canonical boolean CSR array (a new object; the input is untouched).

    Canonical means: stored ``False`` / zero entries dropped, duplicates merged, column indices
    sorted within each row.

    Args:
        pattern: a 2-D scipy sparse matrix or array of any format and dtype.

    Returns:
        A ``scipy.sparse.csr_array`` of dtype ``bool`` with the same shape.

    Raises:
        PatternTypeError: if ``pattern`` is not a scipy sparse matrix or array.
        PatternError: if ``pattern`` is not 2-D.

    Example:
        >>> import scipy.sparse as sp
        >>> p = as_pattern(sp.coo_array(([1.0, 0.0, 2.0], ([0, 0, 1], [1, 0, 1])), shape=(2, 2)))
        >>> p.toarray()
        array([[False,  True],
               [False,  True]])
    """
    if not sp.issparse(pattern):
        raise PatternTypeError(
            f"pattern must be a scipy sparse matrix or array, got {type(pattern).__name__}; "
            "wrap a dense array with scipy.sparse.csr_array(...)."
        )
    if len(pattern.shape) != 2:
        raise PatternError(f"pattern must be 2-D (n_out, n_in), got shape {pattern.shape}.")
    out = sp.csr_array(pattern)
    out = out.astype(bool) if out.dtype != np.bool_ else out.copy()
    out.sum_duplicates()
    out.eliminate_zeros()
    out.sort_indices()
    return out


def _as_colors(colors: ArrayLike, n: int | None, what: str) -> IntArray:
    arr = np.asarray(colors)
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        length = "" if n is None else f" of length {n}"
        raise PatternError(f"{what} must be a 1-D array{length}, got shape {arr.shape}.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PatternTypeError(f"{what} must hold integers, got dtype {arr.dtype}.")
    return arr.astype(np.int64, copy=False)


def _check_orders(orders: Sequence[str]) -> tuple[OrderName, ...]:
    names = (orders,) if isinstance(orders, str) else tuple(orders)
    if not names or any(o not in _ORDER_NAMES for o in names):
        raise PatternError(
            f"orders must be a non-empty sequence of names from {ORDERS}, got {orders!r}."
        )
    return cast("tuple[OrderName, ...]", names)


def _row_ids(indptr: NDArray[np.integer], n_rows: int) -> IntArray:
    """Row index of every stored entry, in CSR order."""
    return np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(indptr))


def _symmetric_graph(adjacency: SparseLike) -> sp.csr_array:
    a = as_pattern(adjacency)
    if a.shape[0] != a.shape[1]:
        raise PatternError(f"adjacency must be square, got shape {a.shape}.")
    return as_pattern(a + a.T)


def _degrees(graph: sp.csr_array) -> IntArray:
    """Number of neighbours of each vertex, self-loops excluded."""
    has_loop = graph.diagonal().astype(np.int64)
    return np.diff(graph.indptr).astype(np.int64) - has_loop


# --------------------------------------------------------------------------------------------
# Greedy coloring and vertex orders
# --------------------------------------------------------------------------------------------


def _greedy(indptr: NDArray[np.integer], indices: NDArray[np.integer], order: IntArray) -> IntArray:
    """First-fit coloring; the graph must be symmetric (self-loops are harmless)."""
    n = indptr.shape[0] - 1
    # `n` marks "not colored yet": stamping forbidden[n] is harmless, and the scanned prefix
    # forbidden[: deg + 1] only reaches index n when the vertex is its own neighbour.
    colors = np.full(n, n, dtype=np.int64)
    forbidden = np.full(n + 1, -1, dtype=np.int64)
    ptr = indptr.tolist()
    for v in order.tolist():
        lo = ptr[v]
        hi = ptr[v + 1]
        if lo == hi:
            colors[v] = 0
            continue
        forbidden[colors[indices[lo:hi]]] = v
        # deg neighbours forbid at most deg colors, so a free one lies in [0, deg].
        colors[v] = (forbidden[: hi - lo + 1] != v).argmax()
    return colors


def _smallest_last(
    indptr: NDArray[np.integer], indices: NDArray[np.integer], degrees: IntArray
) -> IntArray:
    """Degeneracy order (Matula & Beck 1983): repeatedly remove a vertex of minimum degree.

    The minimum is found with a two-level (sqrt-blocked) minimum, so each of the n steps costs
    O(sqrt(n) + degree) inside a handful of NumPy calls. Ties go to the lowest vertex index.
    """
    n = degrees.shape[0]
    block = max(32, math.isqrt(n))
    n_blocks = -(-n // block)
    removed_mark = 4 * n + 16  # stays above every live degree after at most n decrements
    deg = np.full(n_blocks * block, removed_mark, dtype=np.int64)
    deg[:n] = degrees
    block_min = deg.reshape(n_blocks, block).min(axis=1)
    removal = np.empty(n, dtype=np.int64)
    ptr = indptr.tolist()
    for step in range(n):
        b = int(block_min.argmin())
        lo = b * block
        v = lo + int(deg[lo : lo + block].argmin())
        removal[step] = v
        deg[v] = removed_mark
        nb = indices[ptr[v] : ptr[v + 1]]
        if nb.size:
            deg[nb] -= 1
            # degrees only decrease outside block b, so a running minimum stays exact there
            np.minimum.at(block_min, nb // block, deg[nb])
        block_min[b] = deg[lo : lo + block].min()
    return removal[::-1].copy()


def _order(graph: sp.csr_array, name: str, degrees: IntArray | None = None) -> IntArray:
    n = graph.shape[0]
    if name == "natural":
        return np.arange(n, dtype=np.int64)
    if degrees is None:
        degrees = _degrees(graph)
    if name == "largest_first":
        return np.argsort(-degrees, kind="stable").astype(np.int64)
    if name == "smallest_last":
        return _smallest_last(graph.indptr, graph.indices, degrees)
    raise InternalError(f"vertex order {name!r} reached _order unchecked")


def vertex_order(adjacency: SparseLike, name: OrderName) -> IntArray:
    """Vertex order for greedy coloring of the undirected graph ``adjacency``.

    Orders (Gebremedhin, Manne & Pothen 2005, section 4):

    * ``"natural"``: ``0, 1, ..., n - 1``. Optimal on lattices flattened row-major, e.g. images
      under convolution stencils.
    * ``"largest_first"``: by degree, descending; ties keep index order (Welsh & Powell 1967).
    * ``"smallest_last"``: degeneracy order (Matula & Beck 1983): the reverse of repeatedly
      removing a vertex of minimum remaining degree. Greedy in this order uses at most
      ``degeneracy + 1`` colors.

    Args:
        adjacency: square scipy sparse matrix; it is symmetrised (``A + A^T``) and its diagonal is
            ignored.
        name: ``"natural"``, ``"largest_first"`` or ``"smallest_last"``.

    Returns:
        A permutation of ``range(n)`` as an int64 array.

    Raises:
        PatternError: if ``adjacency`` is not square or ``name`` is unknown.

    Example:
        >>> import scipy.sparse as sp
        >>> star = sp.csr_array(([1, 1, 1], ([3, 3, 3], [0, 1, 2])), shape=(4, 4))
        >>> vertex_order(star, "largest_first")
        array([3, 0, 1, 2])
    """
    if name not in _ORDER_NAMES:
        raise PatternError(f"unknown vertex order {name!r}; choose one of {ORDERS}.")
    return _order(_symmetric_graph(adjacency), name)


def greedy_coloring(adjacency: SparseLike, order: ArrayLike) -> IntArray:
    """Greedy (first-fit) coloring of an undirected graph, visiting vertices in ``order``.

    Each vertex gets the smallest color not used by an already colored neighbour, so the colors
    are contiguous ``0 .. k - 1`` and ``k <= max_degree + 1``.

    Args:
        adjacency: square scipy sparse matrix; it is symmetrised (``A + A^T``) and its diagonal is
            ignored.
        order: a permutation of ``range(n)``, e.g. from :func:`vertex_order`.

    Returns:
        int64 array of length ``n``: the color of every vertex.

    Raises:
        PatternError: if ``adjacency`` is not square or ``order`` is not a permutation of
            ``range(n)``.

    Example:
        >>> import scipy.sparse as sp
        >>> path = sp.csr_array(([1, 1], ([0, 1], [1, 2])), shape=(3, 3))
        >>> greedy_coloring(path, [0, 1, 2])
        array([0, 1, 0])
    """
    graph = _symmetric_graph(adjacency)
    n = graph.shape[0]
    perm = np.asarray(order)
    if (
        perm.shape != (n,)
        or (n and not np.issubdtype(perm.dtype, np.integer))
        or not np.array_equal(np.sort(perm), np.arange(n))
    ):
        raise PatternError(
            f"order must be a permutation of range({n}) (one entry per vertex), got an array of "
            f"shape {perm.shape} and dtype {perm.dtype}."
        )
    return _greedy(graph.indptr, graph.indices, perm.astype(np.int64))


def _clique_lower_bound(graph: sp.csr_array, starts: Sequence[int]) -> int:
    """Size of the largest of a few greedily grown cliques: a lower bound on any coloring.

    From each start vertex, repeatedly add the lowest-index vertex adjacent to every member.
    On row-major lattices started at vertex 0 this finds the corner box, the maximum clique.
    """
    indptr, indices = graph.indptr, graph.indices
    best = 1 if graph.shape[0] else 0
    for s in dict.fromkeys(starts):
        cand = np.setdiff1d(indices[indptr[s] : indptr[s + 1]], [s])
        size = 1
        while cand.size:
            v = cand[0]
            cand = np.intersect1d(cand[1:], indices[indptr[v] : indptr[v + 1]], assume_unique=True)
            size += 1
        best = max(best, size)
    return best


def _best_greedy(
    graph: sp.csr_array,
    orders: tuple[OrderName, ...],
    lower_bound: int = 1,
    degrees: IntArray | None = None,
) -> IntArray:
    """Greedy over every order; fewest colors wins, ties go to the earlier order.

    Stops early once ``lower_bound`` colors (a proven minimum) are reached: no later order can
    then do strictly better, so the result is the same as trying them all.
    """
    if degrees is None:
        degrees = _degrees(graph)
    n_edges = int(degrees.sum()) // 2
    runnable = [
        o for o in orders if o != "smallest_last" or n_edges <= SMALLEST_LAST_MAX_EDGES
    ] or ["natural"]
    best = _greedy(graph.indptr, graph.indices, _order(graph, runnable[0], degrees))
    for name in runnable[1:]:
        if _count(best) <= lower_bound:
            break
        colors = _greedy(graph.indptr, graph.indices, _order(graph, name, degrees))
        if _count(colors) < _count(best):
            best = colors
    return best


def _count(colors: IntArray) -> int:
    """Number of colors of a contiguous coloring."""
    return int(colors.max()) + 1 if colors.size else 0


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
    entry_rows = _row_ids(p.indptr, n_rows)
    start = p.indptr.astype(np.int64)
    pos = np.arange(p.nnz, dtype=np.int64) - start[entry_rows] + start[rep_of_row[entry_rows]]
    same_nnz = np.array_equal(nnz_row, nnz_row[rep_of_row])
    if not (same_nnz and np.array_equal(p.indices, p.indices[pos])):
        return p[rows]
    return p[np.sort(rows[first])]


def _distance2_greedy(p: sp.csr_array, order: IntArray) -> IntArray | None:
    """First-fit column coloring read straight off the pattern, without forming ``P^T P``.

    Every row keeps the set of colors its already-colored columns use, as the bits of a Python
    int; a column takes the lowest color absent from the union over its rows. This is exactly
    greedy coloring of the conflict graph in ``order``, in O(nnz * words) work and
    O(n_rows * words) memory (``words = ceil(n_colors / 64)``). Returns ``None`` as soon as
    ``nnz * words`` exceeds :data:`MAX_DISTANCE2_WORK`.
    """
    n_rows, n_cols = p.shape
    if p.nnz > MAX_DISTANCE2_WORK:
        return None
    csc = p.tocsc()
    colptr = csc.indptr.tolist()
    row_index = csc.indices.tolist()
    used = [0] * n_rows
    colors = [0] * n_cols
    color_limit = 64  # re-check the work bound each time the colors outgrow another word
    for j in order.tolist():
        rows = row_index[colptr[j] : colptr[j + 1]]
        taken = 0
        for r in rows:
            taken |= used[r]
        bit = (taken + 1) & ~taken  # lowest color not taken
        color = bit.bit_length() - 1
        if color >= color_limit:
            color_limit += 64
            if p.nnz * (color_limit // 64) > MAX_DISTANCE2_WORK:
                return None
        colors[j] = color
        for r in rows:
            used[r] |= bit
    return np.array(colors, dtype=np.int64)


def _column_coloring_canonical(p: sp.csr_array, orders: tuple[OrderName, ...]) -> IntArray:
    n_in = p.shape[1]
    if p.nnz == 0:
        return np.zeros(n_in, dtype=np.int64)
    if int(np.diff(p.indptr).max()) == n_in:
        # a full row makes every pair of columns conflict: n colors are needed
        return np.arange(n_in, dtype=np.int64)
    distinct = _distinct_nonempty_rows(p)
    nnz_row = np.diff(distinct.indptr).astype(np.int64)
    lower_bound = int(nnz_row.max())  # every row's columns form a clique
    graph_allowed = int((nnz_row * nnz_row).sum()) <= MAX_CONFLICT_PAIRS
    conflicts: tuple[sp.csr_array, IntArray] | None = None  # the graph P^T P and its degrees
    best: IntArray | None = None
    for name in orders if graph_allowed else ("natural",):
        colors = None
        if name == "natural" and conflicts is None:
            colors = _distance2_greedy(distinct, np.arange(n_in, dtype=np.int64))
        if colors is None:
            if not graph_allowed:
                continue
            if conflicts is None:
                conflicts = _conflict_graph(distinct)
            graph, degrees = conflicts
            if name == "smallest_last" and int(degrees.sum()) // 2 > SMALLEST_LAST_MAX_EDGES:
                continue
            colors = _greedy(graph.indptr, graph.indices, _order(graph, name, degrees))
        if best is None or _count(colors) < _count(best):
            best = colors
        if _count(best) <= lower_bound:
            break
    if best is None:  # every order was skipped (too large): natural, or trivial without a graph
        if conflicts is None:
            return np.arange(n_in, dtype=np.int64)
        graph = conflicts[0]
        best = _greedy(graph.indptr, graph.indices, np.arange(n_in, dtype=np.int64))
    return best


def _conflict_graph(p: sp.csr_array) -> tuple[sp.csr_array, IntArray]:
    """The column conflict graph, the pattern of ``P^T P``, and its degrees."""
    # float32 data: sums of positive counts never cancel to a dropped zero
    weighted = sp.csr_array((np.ones(p.nnz, np.float32), p.indices, p.indptr), shape=p.shape)
    graph = sp.csr_array(weighted.T.tocsr() @ weighted)
    return graph, _degrees(graph)


def column_coloring(pattern: SparseLike, *, orders: Sequence[OrderName] = ORDERS) -> IntArray:
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
    * Short cuts: an empty pattern gives color 0 everywhere; a full row gives
      ``arange(n_in)`` (optimal). If nothing is affordable (see :data:`MAX_DISTANCE2_WORK`),
      the trivial ``arange(n_in)`` is returned: always valid.

    Args:
        pattern: ``(n_out, n_in)`` scipy sparse matrix, any format; its stored nonzeros count.
        orders: vertex orders to try (see :func:`vertex_order`); the fewest colors wins, ties go
            to the earlier order. ``"smallest_last"`` is skipped on graphs with more than
            :data:`SMALLEST_LAST_MAX_EDGES` edges; if every order is skipped, ``"natural"`` is
            used.

    Returns:
        int64 array of length ``n_in`` with contiguous colors ``0 .. k - 1``.

    Example:
        >>> import scipy.sparse as sp
        >>> p = sp.csr_array([[1, 1, 0], [0, 1, 1]])
        >>> column_coloring(p)
        array([0, 1, 0])
    """
    return _column_coloring_canonical(as_pattern(pattern), _check_orders(orders))


def row_coloring(pattern: SparseLike, *, orders: Sequence[OrderName] = ORDERS) -> IntArray:
    """Color the rows of ``pattern`` so that same-colored rows share no nonzero column.

    The column coloring of ``pattern.T``: with the one-hot ``S[i, row_colors[i]] = 1``, the
    compressed ``R = S.T @ J`` (one VJP per color) holds every nonzero of ``J``:
    ``J[i, j] = R[row_colors[i], j]``. Same short cuts and limits as :func:`column_coloring`.

    Args:
        pattern: ``(n_out, n_in)`` scipy sparse matrix, any format.
        orders: vertex orders to try, as in :func:`column_coloring`.

    Returns:
        int64 array of length ``n_out`` with contiguous colors ``0 .. k - 1``.

    Example:
        >>> import scipy.sparse as sp
        >>> p = sp.csr_array([[1, 0], [1, 1], [0, 1]])
        >>> row_coloring(p)
        array([0, 1, 0])
    """
    return _column_coloring_canonical(as_pattern(as_pattern(pattern).T), _check_orders(orders))


def diagonal_coloring(pattern: SparseLike, *, orders: Sequence[OrderName] = ORDERS) -> IntArray:
    """Color the indices of a square pattern so that the compressed Jacobian reveals its diagonal.

    Indices ``j != j'`` share a color only if ``P[j, j'] == P[j', j] == 0``. Then with the
    one-hot ``S[j, colors[j]] = 1`` and ``C = J @ S``, ``C[j, colors[j]] == J[j, j]``: the exact
    trace costs one JVP per color. The conflict
    graph is the pattern of ``P + P^T`` (at most twice the size of ``P``), so no size guard is
    needed; a pattern whose graph is complete gives ``arange(n)`` at once. The orders stop early
    once a greedily found clique's size is reached.

    Args:
        pattern: ``(n, n)`` scipy sparse matrix, any format.
        orders: vertex orders to try, as in :func:`column_coloring`.

    Returns:
        int64 array of length ``n`` with contiguous colors ``0 .. k - 1``.

    Raises:
        NonSquareJacobianError: (a ``ValueError``) if the pattern is not square.

    Example:
        >>> import scipy.sparse as sp
        >>> tridiagonal = sp.diags_array([1, 1, 1], offsets=[-1, 0, 1], shape=(4, 4), dtype=bool)
        >>> diagonal_coloring(tridiagonal)
        array([0, 1, 0, 1])
    """
    orders_ = _check_orders(orders)
    p = as_pattern(pattern)
    n_out, n_in = p.shape
    if n_out != n_in:
        raise NonSquareJacobianError(
            f"a diagonal coloring needs a square pattern, got n_out={n_out} rows and "
            f"n_in={n_in} columns (shape {p.shape}); use column_coloring or row_coloring for "
            "the whole Jacobian."
        )
    graph = as_pattern(p + p.T)
    n_edges_directed = graph.nnz - int(graph.diagonal().sum())
    if n_edges_directed == 0:
        return np.zeros(n_in, dtype=np.int64)
    if n_edges_directed == n_in * (n_in - 1):
        return np.arange(n_in, dtype=np.int64)
    degrees = _degrees(graph)
    starts = [0, int(degrees.argmin()), int(degrees.argmax()), n_in - 1]
    return _best_greedy(
        graph, orders_, lower_bound=_clique_lower_bound(graph, starts), degrees=degrees
    )


# --------------------------------------------------------------------------------------------
# Validity checks
# --------------------------------------------------------------------------------------------


def _no_repeated_color_per_row(p: sp.csr_array, colors: IntArray) -> bool:
    if p.nnz == 0:
        return True
    k = int(colors.max()) + 1
    keys = _row_ids(p.indptr, p.shape[0]) * k + colors[p.indices]
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
    c = _as_colors(colors, p.shape[1], "colors")
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
    c = _as_colors(row_colors, pt.shape[1], "row_colors")
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
    c = _as_colors(colors, p.shape[1], "colors")
    if c.size and int(c.min()) < 0:
        return False
    rows = _row_ids(p.indptr, p.shape[0])
    off = rows != p.indices
    return not bool(np.any(c[rows[off]] == c[p.indices[off]]))


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
    rows = _row_ids(p.indptr, p.shape[0])
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
    orders_ = _check_orders(orders)
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
    farthest = _chebyshev(_row_ids(p.indptr, n), p.indices, shape_).max(initial=0)
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
