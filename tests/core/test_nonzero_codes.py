"""The compact codes of a pattern's nonzeros decode to its rows and columns."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

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
