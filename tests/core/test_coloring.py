"""Tests of divjac._core.coloring: validity, optimal counts on stencils, compression round trips."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from divjac import NonSquareJacobianError, NumProbesError
from divjac._core import coloring as col
from divjac._core.coloring import _graph, _jacobian
from divjac._errors import DivjacError, PatternError, PatternTypeError

FORMATS = ("csr_array", "csr_matrix", "csc", "coo", "lil")


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def to_format(dense: np.ndarray, fmt: str) -> sp.sparray | sp.spmatrix:
    if fmt == "csr_matrix":
        return sp.csr_matrix(dense)
    return sp.csr_array(dense).asformat(fmt.removesuffix("_array"))


def band(n: int, radius: int) -> sp.csr_array:
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    return sp.csr_array(np.abs(i - j) <= radius)


def conv_pattern(h: int, w: int, c: int, radius: int) -> sp.csr_array:
    """Per-sample Jacobian pattern of a 'same' conv stack with receptive radius `radius`.

    Channels-last flattening (h, w, c), row-major: output (h, w, c) depends on every input
    (h', w', c') with |h - h'| <= radius and |w - w'| <= radius.
    """
    dense_c = sp.csr_array(np.ones((c, c), dtype=bool))
    return sp.csr_array(sp.kron(band(h, radius), sp.kron(band(w, radius), dense_c)), dtype=bool)


def n_colors(colors: np.ndarray) -> int:
    return int(colors.max()) + 1 if colors.size else 0


def assert_contiguous(colors: np.ndarray, n: int) -> None:
    assert colors.shape == (n,)
    assert np.issubdtype(colors.dtype, np.integer)
    np.testing.assert_array_equal(np.unique(colors), np.arange(n_colors(colors)))


def random_jacobian(mask: np.ndarray, seed: int = 0) -> np.ndarray:
    """float64 matrix with nonzeros exactly on `mask`, values in [1, 2) (no cancellation)."""
    values = np.random.default_rng(seed).uniform(1.0, 2.0, size=mask.shape)
    return np.where(mask, values, 0.0)


def seed(colors: np.ndarray) -> np.ndarray:
    """One-hot seed matrix ``S[j, colors[j]] = 1`` of shape ``(n, n_colors)``."""
    return np.eye(n_colors(colors), dtype=np.float64)[colors]


def check_column_roundtrip(mask: np.ndarray, colors: np.ndarray) -> None:
    """Every nonzero J[i, j] is read back from C = J S at C[i, colors[j]]."""
    jac = random_jacobian(mask)
    compressed = jac @ seed(colors)
    rows, cols = np.nonzero(mask)
    np.testing.assert_array_equal(compressed[rows, colors[cols]], jac[rows, cols])


def check_row_roundtrip(mask: np.ndarray, row_colors: np.ndarray) -> None:
    """Every nonzero J[i, j] is read back from R = S^T J at R[row_colors[i], j]."""
    jac = random_jacobian(mask, seed=1)
    compressed = seed(row_colors).T @ jac
    rows, cols = np.nonzero(mask)
    np.testing.assert_array_equal(compressed[row_colors[rows], cols], jac[rows, cols])


def check_diagonal_roundtrip(mask: np.ndarray, colors: np.ndarray) -> None:
    """Every J[j, j] is read back from C = J S at C[j, colors[j]]."""
    jac = random_jacobian(mask, seed=2)
    compressed = jac @ seed(colors)
    diagonal = compressed[np.arange(len(colors)), colors] if len(colors) else np.zeros(0)
    np.testing.assert_array_equal(diagonal, np.diag(jac))


def brute_valid_diagonal(mask: np.ndarray, colors: np.ndarray) -> bool:
    n = mask.shape[0]
    return all(colors[i] != colors[j] for i in range(n) for j in range(n) if i != j and mask[i, j])


def chebyshev(i: int, j: int, shape: tuple[int, ...]) -> int:
    a, b = np.unravel_index(i, shape), np.unravel_index(j, shape)
    return max((abs(int(x) - int(y)) for x, y in zip(a, b, strict=True)), default=0)


@st.composite
def masks(draw: st.DrawFn, *, square: bool, max_side: int = 9) -> np.ndarray:
    n_out = draw(st.integers(0, max_side))
    n_in = n_out if square else draw(st.integers(0, max_side))
    kind = draw(st.sampled_from(["random", "random", "random", "empty", "dense", "diagonal"]))
    if kind == "empty":
        return np.zeros((n_out, n_in), dtype=bool)
    if kind == "dense":
        return np.ones((n_out, n_in), dtype=bool)
    if kind == "diagonal":
        return np.eye(n_out, n_in, dtype=bool)
    return draw(hnp.arrays(np.bool_, (n_out, n_in)))


# ------------------------------------------------------------------------------------------
# column / row / diagonal colorings on random patterns
# ------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(mask=masks(square=False), fmt=st.sampled_from(FORMATS))
def test_column_coloring_is_valid(mask: np.ndarray, fmt: str) -> None:
    colors = col.column_coloring(to_format(mask, fmt))
    assert_contiguous(colors, mask.shape[1])
    assert col.is_valid_column_coloring(sp.csr_array(mask), colors)
    check_column_roundtrip(mask, colors)
    if mask.any():
        assert n_colors(colors) >= mask.sum(axis=1).max()  # each row is a clique
    else:
        assert n_colors(colors) == min(1, mask.shape[1])


@settings(max_examples=150, deadline=None)
@given(mask=masks(square=False), fmt=st.sampled_from(FORMATS))
def test_row_coloring_is_valid(mask: np.ndarray, fmt: str) -> None:
    row_colors = col.row_coloring(to_format(mask, fmt))
    assert_contiguous(row_colors, mask.shape[0])
    assert col.is_valid_row_coloring(sp.csr_array(mask), row_colors)
    check_row_roundtrip(mask, row_colors)
    if mask.any():
        assert n_colors(row_colors) >= mask.sum(axis=0).max()


@settings(max_examples=150, deadline=None)
@given(mask=masks(square=True), fmt=st.sampled_from(FORMATS))
def test_diagonal_coloring_is_valid(mask: np.ndarray, fmt: str) -> None:
    colors = col.diagonal_coloring(to_format(mask, fmt))
    assert_contiguous(colors, mask.shape[0])
    assert col.is_valid_diagonal_coloring(sp.csr_array(mask), colors)
    assert brute_valid_diagonal(mask, colors)
    check_diagonal_roundtrip(mask, colors)
    # first fit never needs more than max_degree + 1 colors on the conflict graph P + P^T
    conflicts = (mask | mask.T) & ~np.eye(mask.shape[0], dtype=bool)
    assert n_colors(colors) <= conflicts.sum(axis=1).max(initial=0) + 1


@pytest.mark.parametrize(
    ("shape", "fill", "expected_columns", "expected_rows"),
    [
        ((0, 0), False, 0, 0),
        ((0, 4), False, 1, 0),
        ((3, 0), False, 0, 1),
        ((3, 4), False, 1, 1),  # empty: everything shares color 0
        ((3, 4), True, 4, 3),  # dense: every column (row) needs its own color
        ((1, 6), True, 6, 1),  # a single full row
        ((6, 1), True, 1, 6),  # a single full column
    ],
)
def test_edge_cases(
    shape: tuple[int, int], fill: bool, expected_columns: int, expected_rows: int
) -> None:
    mask = np.full(shape, fill)
    p = sp.csr_array(mask)
    colors, row_colors = col.column_coloring(p), col.row_coloring(p)
    assert n_colors(colors) == expected_columns
    assert n_colors(row_colors) == expected_rows
    assert_contiguous(colors, shape[1])
    assert_contiguous(row_colors, shape[0])
    check_column_roundtrip(mask, colors)
    check_row_roundtrip(mask, row_colors)


def test_diagonal_edge_cases() -> None:
    for n in (0, 1, 5):
        assert n_colors(col.diagonal_coloring(sp.csr_array((n, n), dtype=bool))) == min(n, 1)
        assert n_colors(col.diagonal_coloring(sp.csr_array(np.ones((n, n))))) == n
        assert n_colors(col.diagonal_coloring(sp.eye_array(n, format="csr"))) == min(n, 1)
    # one dense row makes that index conflict with all others, but the others not with each other
    mask = np.eye(5, dtype=bool)
    mask[2] = True
    colors = col.diagonal_coloring(sp.csr_array(mask))
    assert n_colors(colors) == 2
    assert colors[2] != colors[0]
    check_diagonal_roundtrip(mask, colors)


def test_full_row_short_cut_is_valid_and_optimal() -> None:
    mask = np.eye(6, 8, dtype=bool)
    mask[3] = True
    colors = col.column_coloring(sp.csr_array(mask))
    np.testing.assert_array_equal(colors, np.arange(8))
    check_column_roundtrip(mask, colors)


def test_stored_zeros_and_duplicates_are_handled() -> None:
    # entries: (0, 0) twice, an explicit zero at (0, 1), (1, 1)
    p = sp.coo_array(([1.0, 1.0, 0.0, 1.0], ([0, 0, 0, 1], [0, 0, 1, 1])), shape=(2, 2))
    canonical = col.as_pattern(p)
    np.testing.assert_array_equal(canonical.toarray(), np.eye(2, dtype=bool))
    assert canonical.nnz == 2
    colors = col.column_coloring(p)
    assert n_colors(colors) == 1
    check_column_roundtrip(canonical.toarray(), colors)


def test_as_pattern_does_not_modify_input_and_rejects_dense() -> None:
    p = sp.csr_array(([1.0, 0.0], [1, 0], [0, 1, 2]), shape=(2, 2))
    col.as_pattern(p)
    assert p.nnz == 2
    np.testing.assert_array_equal(p.indices, [1, 0])
    with pytest.raises(PatternTypeError, match="scipy sparse") as info:
        col.as_pattern(np.ones((2, 2)))
    assert isinstance(info.value, DivjacError) and isinstance(info.value, TypeError)
    with pytest.raises(PatternError, match="2-D") as error:
        col.as_pattern(sp.coo_array(np.ones(3)))
    assert isinstance(error.value, DivjacError) and isinstance(error.value, ValueError)
    with pytest.raises(PatternError, match="1-D"):
        col.is_valid_column_coloring(sp.csr_array(np.ones((2, 2))), np.zeros((2, 2), np.int64))


def test_all_formats_give_the_same_colors() -> None:
    mask = np.random.default_rng(3).random((15, 12)) < 0.25
    expected = col.column_coloring(sp.csr_array(mask))
    for fmt in (*FORMATS, "dok", "bsr", "dia"):
        np.testing.assert_array_equal(col.column_coloring(to_format(mask, fmt)), expected)


# ------------------------------------------------------------------------------------------
# optimal counts on convolution stencils
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize(
    ("radius", "diag_per_channel", "col_per_channel"), [(1, 4, 9), (3, 16, 49)]
)
def test_conv_stencil_counts_are_optimal(
    channels: int, radius: int, diag_per_channel: int, col_per_channel: int
) -> None:
    p = conv_pattern(16, 16, channels, radius)
    diag = col.diagonal_coloring(p)
    cols = col.column_coloring(p)
    rows = col.row_coloring(p)
    assert n_colors(diag) == diag_per_channel * channels
    assert n_colors(cols) == col_per_channel * channels
    assert n_colors(rows) == col_per_channel * channels
    assert col.is_valid_diagonal_coloring(p, diag)
    assert col.is_valid_column_coloring(p, cols)
    assert col.is_valid_row_coloring(p, rows)
    mask = p.toarray()
    check_diagonal_roundtrip(mask, diag)
    check_column_roundtrip(mask, cols)
    check_row_roundtrip(mask, rows)


def test_three_layer_stack_on_32x32x3_matches_the_design_numbers() -> None:
    p = conv_pattern(32, 32, 3, 3)
    assert n_colors(col.diagonal_coloring(p)) == 48
    assert n_colors(col.column_coloring(p)) == 147


@pytest.mark.parametrize("channels", [1, 2, 3])
def test_natural_order_is_optimal_on_king_graph(channels: int) -> None:
    p = conv_pattern(9, 7, channels, 1)
    colors = col.greedy_coloring(p, col.vertex_order(p, "natural"))
    assert n_colors(colors) == 4 * channels
    assert col.is_valid_diagonal_coloring(p, colors)


def test_rectangular_stencil_row_and_column_counts() -> None:
    # stride-2 1-D conv with a width-3 kernel: output o reads inputs 2o-1, 2o, 2o+1
    n_out, n_in = 8, 16
    mask = np.zeros((n_out, n_in), dtype=bool)
    for o in range(n_out):
        mask[o, max(0, 2 * o - 1) : 2 * o + 2] = True
    p = sp.csr_array(mask)
    assert n_colors(col.column_coloring(p)) == 3
    assert n_colors(col.row_coloring(p)) == 2  # rows o, o+1 share input 2o+1


# ------------------------------------------------------------------------------------------
# greedy coloring and vertex orders
# ------------------------------------------------------------------------------------------


@st.composite
def graphs(draw: st.DrawFn, max_n: int = 12) -> np.ndarray:
    n = draw(st.integers(0, max_n))
    upper = np.triu(draw(hnp.arrays(np.bool_, (n, n))), 1)
    return upper | upper.T


def crown_graph(n: int) -> np.ndarray:
    """a_i = 2i, b_i = 2i + 1, a_i ~ b_j iff i != j: natural order needs n colors, optimum 2."""
    adj = np.zeros((2 * n, 2 * n), dtype=bool)
    for i, j in itertools.product(range(n), repeat=2):
        if i != j:
            adj[2 * i, 2 * j + 1] = adj[2 * j + 1, 2 * i] = True
    return adj


@settings(max_examples=100, deadline=None)
@given(adj=graphs(), data=st.data())
def test_greedy_coloring_is_proper_in_any_order(adj: np.ndarray, data: st.DataObject) -> None:
    n = adj.shape[0]
    order = np.array(data.draw(st.permutations(range(n))), dtype=np.int64)
    loops = adj | np.eye(n, dtype=bool)  # self-loops must be ignored
    colors = col.greedy_coloring(sp.csr_array(loops), order)
    assert_contiguous(colors, n)
    i, j = np.nonzero(adj)
    assert not np.any(colors[i] == colors[j])
    if n:
        assert n_colors(colors) <= adj.sum(axis=1).max() + 1
    # first fit: every vertex sees all smaller colors among its earlier-colored neighbours
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    for v in range(n):
        earlier = [u for u in np.flatnonzero(adj[v]) if position[u] < position[v]]
        assert set(range(colors[v])) <= {int(colors[u]) for u in earlier}


def test_greedy_coloring_symmetrises_the_adjacency() -> None:
    one_sided = sp.csr_array(([True], ([0], [1])), shape=(2, 2))  # edge stored as (0, 1) only
    np.testing.assert_array_equal(col.greedy_coloring(one_sided, [1, 0]), [1, 0])


def test_greedy_coloring_rejects_bad_orders() -> None:
    p = sp.csr_array(np.ones((3, 3)))
    for order in ([0, 1], [0, 1, 1], [0, 1, 3], [0.0, 1.0, 2.0]):
        with pytest.raises(PatternError, match="permutation of range"):
            col.greedy_coloring(p, order)
    with pytest.raises(PatternError, match="square"):
        col.greedy_coloring(sp.csr_array(np.ones((2, 3))), [0, 1])


def test_largest_first_order_is_by_degree_descending_and_stable() -> None:
    edges = [(0, 1), (1, 2), (1, 3), (4, 2), (4, 3), (4, 5), (4, 0)]
    rows, cols = zip(*edges, strict=True)
    p = sp.csr_array((np.ones(len(edges), dtype=bool), (rows, cols)), shape=(6, 6))
    # degrees: 0:2, 1:3, 2:2, 3:2, 4:4, 5:1
    np.testing.assert_array_equal(col.vertex_order(p, "largest_first"), [4, 1, 0, 2, 3, 5])
    np.testing.assert_array_equal(col.vertex_order(p, "natural"), np.arange(6))


@settings(max_examples=100, deadline=None)
@given(adj=graphs())
def test_smallest_last_is_a_degeneracy_order(adj: np.ndarray) -> None:
    n = adj.shape[0]
    order = col.vertex_order(sp.csr_array(adj), "smallest_last")
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    # removing vertices from the back of the order, each removed vertex has minimum degree
    # in the graph induced by the vertices not yet removed
    for k in range(n, 0, -1):
        alive = order[:k]
        sub_degrees = adj[np.ix_(alive, alive)].sum(axis=1)
        assert sub_degrees[-1] == sub_degrees.min()
    colors = col.greedy_coloring(sp.csr_array(adj), order)
    degeneracy = max(
        (adj[np.ix_(order[:k], order[:k])].sum(axis=1)[-1] for k in range(1, n + 1)), default=-1
    )
    assert n_colors(colors) <= degeneracy + 1


def test_vertex_order_rejects_unknown_names() -> None:
    with pytest.raises(PatternError, match="unknown vertex order 'random'"):
        col.vertex_order(sp.csr_array(np.ones((2, 2))), "random")  # type: ignore[arg-type]
    with pytest.raises(PatternError, match="orders must be a non-empty"):
        col.column_coloring(sp.csr_array(np.ones((2, 2))), orders=())
    with pytest.raises(PatternError, match="orders must be a non-empty"):
        col.diagonal_coloring(sp.csr_array(np.ones((2, 2))), orders=("natural", "bogus"))  # type: ignore[arg-type]


def test_best_order_wins_and_ties_go_to_the_first() -> None:
    adj = crown_graph(5)
    p = sp.csr_array(adj)
    natural = col.greedy_coloring(p, col.vertex_order(p, "natural"))
    smallest_last = col.greedy_coloring(p, col.vertex_order(p, "smallest_last"))
    assert n_colors(natural) == 5
    assert n_colors(smallest_last) == 2
    np.testing.assert_array_equal(col.diagonal_coloring(p), smallest_last)
    np.testing.assert_array_equal(col.diagonal_coloring(p, orders=("natural",)), natural)
    # tie: on the 1-D path, natural and largest_first both use 2 colors but differ
    path = sp.csr_array(band(6, 1))
    lf = col.greedy_coloring(path, col.vertex_order(path, "largest_first"))
    nat = col.greedy_coloring(path, col.vertex_order(path, "natural"))
    assert n_colors(lf) == n_colors(nat) == 2
    assert not np.array_equal(lf, nat)
    np.testing.assert_array_equal(
        col.diagonal_coloring(path, orders=("largest_first", "natural")), lf
    )
    np.testing.assert_array_equal(
        col.diagonal_coloring(path, orders=("natural", "largest_first")), nat
    )
    # tie above the clique bound (every order is tried): the 5-cycle needs 3 colors, clique 2
    ring = band(5, 1).toarray()
    ring[0, 4] = ring[4, 0] = True
    cycle = sp.csr_array(ring)
    sl = col.greedy_coloring(cycle, col.vertex_order(cycle, "smallest_last"))
    nat = col.greedy_coloring(cycle, np.arange(5))
    np.testing.assert_array_equal(nat, [0, 1, 0, 1, 2])
    np.testing.assert_array_equal(sl, [2, 1, 0, 1, 0])
    np.testing.assert_array_equal(col.diagonal_coloring(cycle), nat)
    np.testing.assert_array_equal(
        col.diagonal_coloring(cycle, orders=("smallest_last", "natural")), sl
    )


@settings(max_examples=150, deadline=None)
@given(mask=masks(square=True, max_side=12))
def test_diagonal_coloring_keeps_the_best_order(mask: np.ndarray) -> None:
    graph = sp.csr_array(mask | mask.T)
    per_order = [col.greedy_coloring(graph, col.vertex_order(graph, o)) for o in col.ORDERS]
    counts = [n_colors(c) for c in per_order]
    got = col.diagonal_coloring(sp.csr_array(mask))
    if mask.shape[0] > 0 and 0 < (graph.nnz - int(graph.diagonal().sum())) < mask.size - len(mask):
        # not a short-cut case: the result is the first order with the fewest colors
        np.testing.assert_array_equal(got, per_order[counts.index(min(counts))])
    assert n_colors(got) <= min(counts, default=0)


# ------------------------------------------------------------------------------------------
# guards and limits
# ------------------------------------------------------------------------------------------


def test_conflict_limit_skips_the_graph_and_never_falls_back_to_trivial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = conv_pattern(6, 6, 2, 1)
    assert n_colors(col.column_coloring(p)) == 18
    # too big for P^T P: the graph-free natural greedy still finds the optimum
    monkeypatch.setattr(_jacobian, "MAX_CONFLICT_PAIRS", 10)
    colors = col.column_coloring(p, orders=("largest_first", "smallest_last"))
    assert n_colors(colors) == 18
    np.testing.assert_array_equal(colors, col.greedy_coloring(p.T @ p, np.arange(72)))
    assert n_colors(col.row_coloring(p)) == 18
    check_column_roundtrip(p.toarray(), colors)


def test_distance2_greedy_beyond_64_colors(monkeypatch: pytest.MonkeyPatch) -> None:
    # one row holds 69 of the 70 columns: 69 colors, more than one 64-bit word
    mask = np.eye(5, 70, dtype=bool)
    mask[0, 2:] = True  # row 0: columns 0 and 2..69
    p = sp.csr_array(mask)
    monkeypatch.setattr(_jacobian, "MAX_CONFLICT_PAIRS", 0)  # force the graph-free path
    monkeypatch.setattr(_jacobian, "_GREEDY_COLUMNS", 8)  # and read the columns in blocks
    colors = col.column_coloring(p)
    assert n_colors(colors) == 69
    assert col.is_valid_column_coloring(p, colors)
    check_column_roundtrip(mask, colors)


@settings(max_examples=100, deadline=None)
@given(mask=masks(square=False, max_side=12), data=st.data())
def test_distance2_greedy_equals_greedy_on_the_conflict_graph(
    mask: np.ndarray, data: st.DataObject
) -> None:
    n_in = mask.shape[1]
    order = np.array(data.draw(st.permutations(range(n_in))), dtype=np.int64)
    p = sp.csr_array(mask)
    direct = _jacobian._distance2_greedy(col.as_pattern(p), order)
    assert direct is not None
    conflicts = sp.csr_array(mask.T.astype(np.int64) @ mask.astype(np.int64))
    np.testing.assert_array_equal(direct, col.greedy_coloring(conflicts, order))


def test_smallest_last_is_skipped_on_large_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    p = sp.csr_array(crown_graph(4))
    assert n_colors(col.diagonal_coloring(p)) == 2
    monkeypatch.setattr(_graph, "SMALLEST_LAST_MAX_EDGES", 3)
    assert n_colors(col.diagonal_coloring(p)) == 4  # natural and largest_first only
    only_sl = col.diagonal_coloring(p, orders=("smallest_last",))  # falls back to natural
    np.testing.assert_array_equal(only_sl, col.greedy_coloring(p, np.arange(8)))


def test_duplicate_rows_are_merged_without_changing_the_result() -> None:
    mask = np.random.default_rng(4).random((10, 14)) < 0.3
    repeated = np.repeat(mask, 3, axis=0)[np.random.default_rng(5).permutation(30)]
    merged = _jacobian._distinct_nonempty_rows(col.as_pattern(sp.csr_array(repeated)))
    expected_rows = {tuple(r) for r in mask if r.any()}
    assert merged.shape[0] == len(expected_rows)
    assert {tuple(r) for r in merged.toarray()} == expected_rows
    np.testing.assert_array_equal(
        col.column_coloring(sp.csr_array(repeated)), col.column_coloring(sp.csr_array(mask))
    )


def test_row_merging_survives_hash_collisions(monkeypatch: pytest.MonkeyPatch) -> None:
    class CollidingBitGenerator:
        def random_raw(self, size: int) -> np.ndarray:
            return np.zeros(size, dtype=np.uint64)  # every row hashes alike

    class CollidingRng:
        bit_generator = CollidingBitGenerator()

    mask = np.array([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]], dtype=bool)
    monkeypatch.setattr(np.random, "default_rng", lambda seed: CollidingRng())
    merged = _jacobian._distinct_nonempty_rows(col.as_pattern(sp.csr_array(mask)))
    np.testing.assert_array_equal(merged.toarray(), mask)  # collision detected: nothing merged
    colors = col.column_coloring(sp.csr_array(mask))
    assert col.is_valid_column_coloring(sp.csr_array(mask), colors)
    assert n_colors(colors) == 2  # conflicts 0-1, 1-2, 2-3: a path


# ------------------------------------------------------------------------------------------
# validity checks
# ------------------------------------------------------------------------------------------


def test_validity_checks_reject_invalid_colorings() -> None:
    p = sp.csr_array(np.array([[1, 1, 0], [0, 1, 1], [0, 0, 1]]))
    assert col.is_valid_column_coloring(p, [0, 1, 0])
    assert not col.is_valid_column_coloring(p, [0, 1, 1])
    assert not col.is_valid_column_coloring(p, [0, -1, 0])
    assert col.is_valid_row_coloring(p, [0, 1, 0])
    assert not col.is_valid_row_coloring(p, [0, 0, 1])
    assert col.is_valid_diagonal_coloring(p, [0, 1, 0])
    assert not col.is_valid_diagonal_coloring(p, [0, 0, 1])
    assert not col.is_valid_diagonal_coloring(p, [0, 1, 1])  # (1, 2) conflicts
    with pytest.raises(PatternError, match="length 3"):
        col.is_valid_column_coloring(p, [0, 1])
    with pytest.raises(PatternTypeError, match="integers"):
        col.is_valid_row_coloring(p, [0.0, 1.0, 0.0])


# ------------------------------------------------------------------------------------------
# non-square input
# ------------------------------------------------------------------------------------------


def test_diagonal_coloring_rejects_non_square() -> None:
    p = sp.csr_array(np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"n_out=3 rows and n_in=4 columns \(shape \(3, 4\)\)"):
        col.diagonal_coloring(p)
    with pytest.raises(NonSquareJacobianError):
        col.diagonal_coloring(p)
    with pytest.raises(NonSquareJacobianError, match=r"\(3, 4\)"):
        col.is_valid_diagonal_coloring(p, [0, 1, 2, 3])


# ------------------------------------------------------------------------------------------
# distance-limited patterns and probing
# ------------------------------------------------------------------------------------------

SMALL_SHAPES = [(5,), (2, 3), (3, 2, 2), (1, 4), (2, 1, 3), (4, 4), ()]


def brute_restrict(mask: np.ndarray, shape: tuple[int, ...], d: int) -> np.ndarray:
    out = np.zeros_like(mask)
    for i, j in zip(*np.nonzero(mask), strict=True):
        if chebyshev(int(i), int(j), shape) <= d:
            out[i, j] = True
    return out


@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from(SMALL_SHAPES), d=st.integers(0, 4), data=st.data())
def test_restrict_to_distance_matches_brute_force(
    shape: tuple[int, ...], d: int, data: st.DataObject
) -> None:
    n = math.prod(shape)
    mask = data.draw(hnp.arrays(np.bool_, (n, n)))
    got = col.restrict_to_distance(sp.coo_array(mask), shape, d)
    assert isinstance(got, sp.csr_array)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got.toarray(), brute_restrict(mask, shape, d))


@pytest.mark.parametrize("shape", SMALL_SHAPES)
@pytest.mark.parametrize("d", [0, 1, 2, 5])
def test_lattice_pattern_matches_brute_force(shape: tuple[int, ...], d: int) -> None:
    n = math.prod(shape)
    expected = np.array(
        [[chebyshev(i, j, shape) <= d for j in range(n)] for i in range(n)], dtype=bool
    ).reshape(n, n)
    got = col.lattice_pattern(shape, d)
    assert got.shape == (n, n)
    np.testing.assert_array_equal(got.toarray(), expected)


def test_distance_beyond_the_grid_keeps_the_full_pattern() -> None:
    mask = np.random.default_rng(6).random((12, 12)) < 0.5
    for d in (3, 4, 100):
        np.testing.assert_array_equal(
            col.restrict_to_distance(sp.csr_array(mask), (3, 4), d).toarray(), mask
        )
    assert col.lattice_pattern((3, 4), 3).nnz == 144
    with pytest.raises(
        PatternError, match=r"n = prod\(shape\) = 15 for shape \(3, 5\), got \(12, 12\)"
    ):
        col.restrict_to_distance(sp.csr_array(mask), (3, 5), 1)
    with pytest.raises(PatternError, match="non-negative integer"):
        col.lattice_pattern((3, 4), -1)
    with pytest.raises(PatternError, match="non-negative sizes"):
        col.lattice_pattern((3, -4), 1)
    with pytest.raises(PatternError, match=r"distance has 1 entries but the shape \(3, 4\)"):
        col.lattice_pattern((3, 4), (1,))


@pytest.mark.parametrize("shape", [(6,), (5, 4), (4, 3, 2), (8, 8), (7, 5, 3)])
@pytest.mark.parametrize("d", [0, 1, 2, 3])
def test_lattice_coloring_is_optimal_and_matches_greedy(shape: tuple[int, ...], d: int) -> None:
    pattern = col.lattice_pattern(shape, d)
    closed_form = col.lattice_coloring(shape, d)
    optimum = math.prod(min(d + 1, s) for s in shape)  # a box of that size is a clique
    assert n_colors(closed_form) == optimum
    assert_contiguous(closed_form, math.prod(shape))
    assert col.is_valid_diagonal_coloring(pattern, closed_form)
    check_diagonal_roundtrip(pattern.toarray(), closed_form)
    assert n_colors(col.diagonal_coloring(pattern)) == optimum


@pytest.mark.parametrize("shape", [(6,), (5, 4), (4, 3, 2), (8, 8)])
def test_probing_on_lattice_takes_the_largest_feasible_distance(shape: tuple[int, ...]) -> None:
    d_max = max(shape) - 1
    counts = [
        n_colors(col.diagonal_coloring(col.lattice_pattern(shape, d))) for d in range(d_max + 1)
    ]
    for max_colors in range(1, math.prod(shape) + 2):
        colors, d = col.probing_coloring(None, shape, max_colors=max_colors)
        expected = max(e for e in range(d_max + 1) if counts[e] <= max_colors)
        assert d == expected
        assert n_colors(colors) <= max_colors
        assert col.is_valid_diagonal_coloring(col.lattice_pattern(shape, d), colors)


def test_probing_with_a_pattern_matches_brute_force_search() -> None:
    shape = (8, 8, 2)
    p = conv_pattern(8, 8, 2, 3)
    counts = [
        n_colors(col.diagonal_coloring(col.restrict_to_distance(p, shape, d))) for d in range(8)
    ]
    assert counts == sorted(counts)  # monotone here, so the search must find the optimum
    assert counts[0] == 1
    assert counts[3] == counts[7] == 32  # the stencil reaches distance 3 in (h, w)
    for max_colors in (1, 2, 5, 8, 17, 18, 31, 32, 100):
        colors, d = col.probing_coloring(p, shape, max_colors=max_colors)
        expected = max(e for e in range(4) if counts[e] <= max_colors)
        assert d == expected, max_colors
        assert n_colors(colors) <= max_colors
        assert col.is_valid_diagonal_coloring(col.restrict_to_distance(p, shape, d), colors)
    # with room for everything: the farthest nonzero's distance and an exact coloring
    colors, d = col.probing_coloring(p, shape, max_colors=10**6)
    assert d == 3
    np.testing.assert_array_equal(colors, col.diagonal_coloring(p))


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(5,), (2, 3), (3, 2, 2), (4, 4)]),
    max_colors=st.integers(1, 8),
    data=st.data(),
)
def test_probing_respects_max_colors_on_random_patterns(
    shape: tuple[int, ...], max_colors: int, data: st.DataObject
) -> None:
    n = math.prod(shape)
    mask = data.draw(hnp.arrays(np.bool_, (n, n)))
    colors, d = col.probing_coloring(sp.csr_array(mask), shape, max_colors=max_colors)
    assert 0 <= d <= max(shape) - 1
    assert n_colors(colors) <= max_colors
    restricted = brute_restrict(mask, shape, d)
    assert brute_valid_diagonal(restricted, colors)
    counts = [
        n_colors(col.diagonal_coloring(sp.csr_array(brute_restrict(mask, shape, e))))
        for e in range(max(shape))
    ]
    if counts == sorted(counts):
        feasible = [e for e, k in enumerate(counts) if k <= max_colors]
        # the search stops at the farthest distance that still changes the pattern
        farthest = max(
            (chebyshev(int(i), int(j), shape) for i, j in zip(*np.nonzero(mask), strict=True)),
            default=0,
        )
        assert d == min(max(feasible), farthest)


def test_probing_rejects_bad_arguments() -> None:
    with pytest.raises(NumProbesError, match="max_colors must be a positive integer"):
        col.probing_coloring(None, (4, 4), max_colors=0)
    with pytest.raises(PatternError, match="prod"):
        col.probing_coloring(sp.csr_array(np.ones((3, 3))), (4, 4), max_colors=3)
    colors, d = col.probing_coloring(None, (0, 3), max_colors=3)
    assert colors.shape == (0,)
    assert d == 0
