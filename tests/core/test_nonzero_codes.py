"""The compact codes of a pattern's nonzeros decode to its rows and columns; a box stencil is
recognized as one, and never a pattern that is not."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import assume, given, strategies as st

from divjac._core import nonzero_codes


def decoded(codes: nonzero_codes.Codes, nnz: int) -> tuple[np.ndarray, np.ndarray]:
    rows = (np.repeat(codes.starts.astype(np.int64), nonzero_codes.BLOCK) + codes.rows)[:nnz]
    cols = codes.cols[:nnz].astype(np.int64)
    return rows, rows + cols if codes.offsets else cols


def band(n: int, width: int) -> sp.csr_array:
    return sp.csr_array(sp.diags_array([1] * (2 * width + 1), offsets=range(-width, width + 1),
                                       shape=(n, n), dtype=bool))  # fmt: skip


def scattered(shape: tuple[int, int], n: int) -> sp.csr_array:
    """About ``n`` nonzeros at random places (SciPy's floor has no ``random_array(rng=)``)."""
    rng = np.random.default_rng(0)
    rows, cols = rng.integers(0, shape[0], n), rng.integers(0, shape[1], n)
    pattern = sp.csr_array((np.ones(n, dtype=bool), (rows, cols)), shape=shape)
    pattern.sum_duplicates()
    return pattern


@pytest.mark.parametrize(
    ("pattern", "rows_type", "cols_type"),
    [
        (band(300, 2), np.uint8, np.int8),  # offsets -2 .. 2
        (band(3000, 200), np.uint8, np.int16),
        # empty rows: a block spans many rows
        (scattered((100_000, 40_000), 4000), np.uint16, np.int32),  # offsets past int16: the columns themselves
        (sp.csr_array((4, 3), dtype=bool), np.uint8, np.uint8),  # no nonzero
    ],
)  # fmt: skip
def test_the_codes_decode_to_the_nonzeros(
    monkeypatch: pytest.MonkeyPatch, pattern: sp.csr_array, rows_type, cols_type
) -> None:
    monkeypatch.setattr(nonzero_codes, "_CHUNK_ENTRIES", 100)  # many chunks of rows
    pattern.sort_indices()
    indptr, cols = pattern.indptr.astype(np.int32), pattern.indices.astype(np.int32)
    codes = nonzero_codes.encode(indptr, cols)
    assert codes.rows.dtype == rows_type and codes.cols.dtype == cols_type
    rows, got = decoded(codes, cols.size)
    np.testing.assert_array_equal(rows, np.repeat(np.arange(len(indptr) - 1), np.diff(indptr)))
    np.testing.assert_array_equal(got, cols)


# --- stencils -----------------------------------------------------------------------------------


def box(shape: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]) -> sp.csr_array:
    """The box stencil's pattern by brute force: every row, every offset of the box, kept where
    it lands on the grid."""
    n = int(np.prod(shape))
    own = np.unravel_index(np.arange(n), shape)
    rows, cols = [], []
    for offset in np.ndindex(*(h - low + 1 for low, h in zip(lo, hi, strict=True))):
        other = [c + low + o for c, low, o in zip(own, lo, offset, strict=True)]
        inside = np.all([(c >= 0) & (c < s) for c, s in zip(other, shape, strict=True)], axis=0)
        rows.append(np.arange(n)[inside])
        cols.append(np.ravel_multi_index(tuple(c[inside] for c in other), shape))
    rows_, cols_ = np.concatenate(rows), np.concatenate(cols)
    pattern = sp.csr_array((np.ones(rows_.size, bool), (rows_, cols_)), shape=(n, n))
    pattern.sort_indices()
    return pattern


@st.composite
def stencils(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A grid of 1 to 3 axes and a box of offsets on it (not always holding the row itself)."""
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    lo = tuple(draw(st.integers(-4, 2)) for _ in shape)
    hi = tuple(low + draw(st.integers(0, 4)) for low in lo)
    return shape, lo, hi


def csr(pattern: sp.csr_array) -> tuple[np.ndarray, np.ndarray]:
    return pattern.indptr.astype(np.int32), pattern.indices.astype(np.int32)


@given(stencils())
def test_a_box_stencil_is_recognized(case) -> None:
    shape, lo, hi = case
    pattern = box(shape, lo, hi)
    assume(pattern.nnz > 0)
    found = nonzero_codes.stencil(*csr(pattern), shape)
    assert found is not None
    assert (box(shape, found.lo, found.hi) != pattern).nnz == 0
    np.testing.assert_array_equal(found.counts(), np.diff(pattern.indptr))


@given(stencils(), st.integers(0, 10**6), st.booleans())
def test_a_pattern_that_is_not_its_stencil_is_never_taken_for_one(case, at: int, add: bool) -> None:
    """One nonzero removed from a box stencil, or one added: the pattern is no stencil, or the
    stencil found is that pattern exactly (a missed nonzero would be a wrong Jacobian)."""
    shape, lo, hi = case
    dense = box(shape, lo, hi).toarray()
    places = np.flatnonzero(~dense if add else dense)
    assume(places.size > 0)
    dense.flat[places[at % places.size]] = add
    pattern = sp.csr_array(dense)
    assume(pattern.nnz > 0)
    found = nonzero_codes.stencil(*csr(pattern), shape)
    if found is not None:
        assert (box(shape, found.lo, found.hi) != pattern).nnz == 0


def test_stencil_reads_the_nonzeros_a_chunk_of_rows_at_a_time(monkeypatch) -> None:
    monkeypatch.setattr(nonzero_codes, "_CHUNK_ENTRIES", 50)
    pattern = box((20, 30, 2), (-2, -3, -1), (2, 3, 1))
    found = nonzero_codes.stencil(*csr(pattern), (20, 30, 2))
    assert found == nonzero_codes.Stencil((20, 30, 2), (-2, -3, -1), (2, 3, 1))
    assert nonzero_codes.stencil(*csr(pattern), (600, 2)) is None  # another grid
    assert nonzero_codes.stencil(*csr(pattern), (1200,)) is None
