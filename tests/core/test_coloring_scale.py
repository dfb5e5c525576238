"""Colorings at image scale: the box coloring of stencils, valid on every pattern, and no
size at which a coloring gives up (never the trivial one past a work limit)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from divjac._core import coloring as col
from divjac._core.coloring import _box, _graph, _jacobian
from divjac._core.pattern import SparsityPattern
from divjac._errors import PatternError


def n_colors(colors: np.ndarray) -> int:
    return int(colors.max()) + 1 if colors.size else 0


def band(n_out: int, n_in: int, offsets: range) -> sp.csr_array:
    """Output ``o`` reads inputs ``o + d`` for ``d`` in ``offsets``, clipped to ``[0, n_in)``."""
    mask = np.zeros((n_out, n_in), dtype=bool)
    for o in range(n_out):
        for d in offsets:
            if 0 <= o + d < n_in:
                mask[o, o + d] = True
    return sp.csr_array(mask)


def conv2d(
    h: int, w: int, kh: int, kw: int, c_in: int, c_out: int, mode: str
) -> tuple[sp.csr_array, tuple[int, ...], tuple[int, ...]]:
    """Pattern of a 2-D convolution, channels last, every output channel reading every input
    channel; ``'same'`` (clipped at the borders; even kernels reach one further back) or
    ``'valid'``. Returns the pattern and the input and output shapes."""
    if mode == "same":
        rows = band(h, h, range(-(kh // 2), kh - kh // 2))
        cols = band(w, w, range(-(kw // 2), kw - kw // 2))
        ho, wo = h, w
    else:
        ho, wo = h - kh + 1, w - kw + 1
        rows, cols = band(ho, h, range(kh)), band(wo, w, range(kw))
    channels = sp.csr_array(np.ones((c_out, c_in), dtype=bool))
    p = sp.csr_array(sp.kron(rows, sp.kron(cols, channels)), dtype=bool)
    return p, (h, w, c_in), (ho, wo, c_out)


def brute_column_valid(mask: np.ndarray, colors: np.ndarray) -> bool:
    """No row holds two columns of one color (checked pair by pair)."""
    for row in mask:
        seen = colors[np.flatnonzero(row)]
        if len(set(seen.tolist())) != len(seen):
            return False
    return True


def brute_diagonal_valid(mask: np.ndarray, colors: np.ndarray) -> bool:
    i, j = np.nonzero(mask)
    off = i != j
    return not bool(np.any(colors[i[off]] == colors[j[off]]))


# ------------------------------------------------------------------------------------------
# the box coloring of stencils: optimal, and valid on clipped borders
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("h", "w", "kh", "kw", "c_in", "c_out", "mode"),
    [
        (12, 12, 3, 3, 1, 1, "same"),
        (12, 12, 11, 11, 1, 1, "same"),  # the kernel nearly as large as the image
        (13, 9, 4, 2, 1, 1, "same"),  # even kernels, a rectangular image
        (9, 14, 5, 3, 3, 2, "same"),  # several channels in and out
        (10, 7, 3, 4, 2, 3, "valid"),
        (6, 6, 6, 6, 1, 1, "valid"),  # one output reads the whole image
    ],
)
def test_box_coloring_of_a_stencil_is_valid_and_optimal(
    h: int, w: int, kh: int, kw: int, c_in: int, c_out: int, mode: str
) -> None:
    p, in_shape, out_shape = conv2d(h, w, kh, kw, c_in, c_out, mode)
    mask = p.toarray()
    colors = col.column_coloring(p, shape=in_shape)
    assert n_colors(colors) == kh * kw * c_in == mask.sum(axis=1).max()  # the clique bound
    assert brute_column_valid(mask, colors)
    assert col.is_valid_column_coloring(p, colors)
    row_colors = col.row_coloring(p, shape=out_shape)
    assert n_colors(row_colors) == mask.sum(axis=0).max()
    assert brute_column_valid(mask.T, row_colors)
    np.testing.assert_array_equal(np.unique(colors), np.arange(n_colors(colors)))
    if mode == "same" and c_in == c_out:
        diagonal = col.diagonal_coloring(p, shape=in_shape)
        assert brute_diagonal_valid(mask, diagonal)
        # never more than the greedy orders without the grid
        assert n_colors(diagonal) <= n_colors(col.diagonal_coloring(p))


def test_pattern_colors_use_the_sample_shapes() -> None:
    p, in_shape, out_shape = conv2d(24, 20, 11, 11, 1, 1, "same")
    pattern = SparsityPattern(p, in_shape, out_shape, batch_size=1)
    assert pattern.n_colors == pattern.n_row_colors == 121
    assert col.is_valid_column_coloring(p, pattern.colors)
    assert col.is_valid_row_coloring(p, pattern.row_colors)
    assert col.is_valid_diagonal_coloring(p, pattern.diagonal_colors)
    assert pattern.n_diagonal_colors == 36  # a clique of 6 x 6: optimal


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_box_colorings_are_valid_on_random_patterns(data: st.DataObject) -> None:
    grid = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    n_in = math.prod(grid)
    n_out = data.draw(st.integers(0, 12))
    mask = data.draw(hnp.arrays(np.bool_, (n_out, n_in)))
    p = sp.csr_array(mask)
    colors = col.column_coloring(p, shape=grid)
    assert brute_column_valid(mask, colors)
    assert n_colors(colors) <= n_colors(col.column_coloring(p))
    sides = _box.column_sides(col.as_pattern(p), grid)
    assert brute_column_valid(mask, _box.residue_colors(grid, sides))  # the box itself
    square = data.draw(hnp.arrays(np.bool_, (n_in, n_in)))
    q = sp.csr_array(square)
    diagonal = col.diagonal_coloring(q, shape=grid)
    assert brute_diagonal_valid(square, diagonal)
    assert n_colors(diagonal) <= n_colors(col.diagonal_coloring(q))
    sides = _box.diagonal_sides(col.as_pattern(q), grid)
    assert brute_diagonal_valid(square, _box.residue_colors(grid, sides))
    row_colors = col.row_coloring(q, shape=grid)
    assert brute_column_valid(square.T, row_colors)


def test_a_shape_of_the_wrong_size_is_refused() -> None:
    p = sp.csr_array(np.eye(6, dtype=bool))
    with pytest.raises(PatternError, match="6"):
        col.column_coloring(p, shape=(2, 2))
    with pytest.raises(PatternError, match="6"):
        col.diagonal_coloring(p, shape=(7,))


# ------------------------------------------------------------------------------------------
# no size gives up: past the work limits the colorings stay greedy, never trivial
# ------------------------------------------------------------------------------------------


def test_past_every_work_limit_the_coloring_is_not_trivial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p, in_shape, _ = conv2d(16, 16, 5, 5, 1, 1, "same")
    # every work limit of the colorings set small (the old distance-2 limit included)
    monkeypatch.setattr(_jacobian, "MAX_CONFLICT_PAIRS", 10)
    monkeypatch.setattr(_jacobian, "MAX_DISTANCE2_WORK", 10, raising=False)
    monkeypatch.setattr(_graph, "SMALLEST_LAST_MAX_EDGES", 1)  # read there, not in col
    for colors in (col.column_coloring(p), col.row_coloring(p)):
        assert n_colors(colors) == 25
        assert col.is_valid_column_coloring(p, colors)
    assert n_colors(col.column_coloring(p, shape=in_shape)) == 25
