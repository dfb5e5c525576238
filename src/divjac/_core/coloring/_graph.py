"""Input checks, greedy (first-fit) coloring and vertex orders (Gebremedhin, Manne & Pothen 2005).

Every coloring of the package is a greedy coloring of a conflict graph in one of the vertex
orders here; the inputs (sparsity patterns, colors, order names) are checked here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, TypeAlias, cast

import numpy as np
import scipy.sparse as sp
from numpy.typing import ArrayLike, NDArray

from ..._errors import InternalError, PatternError, PatternTypeError

__all__ = [
    "ORDERS",
    "SMALLEST_LAST_MAX_EDGES",
    "IntArray",
    "OrderName",
    "SparseLike",
    "as_pattern",
    "greedy_coloring",
    "vertex_order",
]

SparseLike: TypeAlias = "sp.sparray | sp.spmatrix"
OrderName: TypeAlias = Literal["natural", "largest_first", "smallest_last"]
IntArray: TypeAlias = NDArray[np.int64]

#: Vertex orders tried by the colorings, in order of preference on ties.
ORDERS: tuple[OrderName, ...] = ("natural", "largest_first", "smallest_last")

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


def as_colors(colors: ArrayLike, n: int | None, what: str) -> IntArray:
    arr = np.asarray(colors)
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        length = "" if n is None else f" of length {n}"
        raise PatternError(f"{what} must be a 1-D array{length}, got shape {arr.shape}.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PatternTypeError(f"{what} must hold integers, got dtype {arr.dtype}.")
    return arr.astype(np.int64, copy=False)


def check_orders(orders: Sequence[str]) -> tuple[OrderName, ...]:
    names = (orders,) if isinstance(orders, str) else tuple(orders)
    if not names or any(o not in _ORDER_NAMES for o in names):
        raise PatternError(
            f"orders must be a non-empty sequence of names from {ORDERS}, got {orders!r}."
        )
    return cast("tuple[OrderName, ...]", names)


def row_ids(indptr: NDArray[np.integer], n_rows: int) -> IntArray:
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


def greedy(indptr: NDArray[np.integer], indices: NDArray[np.integer], order: IntArray) -> IntArray:
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
    return greedy(graph.indptr, graph.indices, perm.astype(np.int64))


def clique_lower_bound(graph: sp.csr_array, starts: Sequence[int]) -> int:
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


def best_greedy(
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
    best = greedy(graph.indptr, graph.indices, _order(graph, runnable[0], degrees))
    for name in runnable[1:]:
        if count(best) <= lower_bound:
            break
        colors = greedy(graph.indptr, graph.indices, _order(graph, name, degrees))
        if count(colors) < count(best):
            best = colors
    return best


def count(colors: IntArray) -> int:
    """Number of colors of a contiguous coloring."""
    return int(colors.max()) + 1 if colors.size else 0
