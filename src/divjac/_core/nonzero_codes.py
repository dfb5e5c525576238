"""Compact host encodings of a CSR pattern's nonzeros, which a compiled program expands
elementwise (fused into the loops that read them: no gather, no temporary the size of the
nonzeros).

A program that builds a sparse Jacobian needs the row and the column of each of its ``nnz``
nonzeros. Embedded as constants they cost 8 bytes a nonzero, held and copied while the program
is lowered and compiled; made from the rows' counts by a repeat, they cost a scatter and a
cumulative sum, two temporaries of ``nnz`` integers. :func:`encode` keeps instead

- the row of every ``BLOCK``-th nonzero and, per nonzero, how many rows past its block's first
  it lies (one byte where a block spans fewer than 256 rows: 1 to 3 rows on a stencil);
- per nonzero, its offset ``col - row`` (one byte where every offset lies within +-127, two
  within +-32767: on a 2-D stencil, up to the kernel's half-height times the image's width;
  past that, the columns themselves).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["BLOCK", "Codes", "encode"]

BLOCK = 64
"""Nonzeros per block."""

# Nonzeros read at once by encode (bounds its temporaries)
_CHUNK_ENTRIES = 1 << 22


@dataclass(frozen=True)
class Codes:
    """The nonzero at ``p`` is in row ``starts[p // BLOCK] + rows[p]`` and column
    ``row + cols[p]``, or ``cols[p]`` where ``offsets`` is false (``rows`` and the offsets are
    padded to whole blocks, the columns themselves are not)."""

    starts: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    offsets: bool


def _narrowest(low: int, high: int, fallback: np.dtype) -> np.dtype:
    """The smallest integer type holding ``low .. high`` (unsigned where ``low >= 0``) if
    narrower than ``fallback``, else ``fallback``."""
    kinds = (np.uint8, np.uint16) if low >= 0 else (np.int8, np.int16)
    for kind in kinds:
        if np.iinfo(kind).min <= low and high <= np.iinfo(kind).max:
            return np.dtype(kind)
    return fallback


def encode(indptr: np.ndarray, cols: np.ndarray) -> Codes:
    """The codes of the CSR nonzeros ``(indptr, cols)`` (see the module), in integers of
    ``cols``'s type where not narrower; two passes over the nonzeros, a chunk of rows at a
    time."""
    nnz, dtype = cols.size, cols.dtype
    n_padded = -(-nnz // BLOCK) * BLOCK
    starts = (np.searchsorted(indptr, np.arange(0, nnz, BLOCK), side="right") - 1).astype(dtype)
    last = np.searchsorted(indptr, max(nnz - 1, 0), side="right") - 1
    span = int(np.diff(starts, append=last).max(initial=0))
    rows = np.zeros(n_padded, _narrowest(0, span, dtype))
    low = high = 0
    for lo, hi, row in _chunks(indptr, dtype):
        first = np.repeat(starts[lo // BLOCK : -(-hi // BLOCK)], BLOCK)  # its block's row
        rows[lo:hi] = row - first[lo % BLOCK : lo % BLOCK + hi - lo]
        offsets = cols[lo:hi] - row
        low, high = min(low, int(offsets.min())), max(high, int(offsets.max()))
    narrow = _narrowest(low, high, dtype)
    if narrow == dtype:
        return Codes(starts, rows, cols, False)
    codes = np.zeros(n_padded, narrow)
    for lo, hi, row in _chunks(indptr, dtype):
        codes[lo:hi] = cols[lo:hi] - row
    return Codes(starts, rows, codes, True)


def _chunks(indptr: np.ndarray, dtype: np.dtype) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(lo, hi, rows)``: the rows of the nonzeros ``lo:hi``, whole rows at a time."""
    n_rows, counts = len(indptr) - 1, np.diff(indptr)
    per_chunk = max(1, _CHUNK_ENTRIES // max(int(counts.max(initial=1)), 1))
    for a in range(0, n_rows, per_chunk):
        b = min(a + per_chunk, n_rows)
        lo, hi = int(indptr[a]), int(indptr[b])
        if hi > lo:
            yield lo, hi, np.repeat(np.arange(a, b, dtype=dtype), counts[a:b])
