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

A pattern that is a box stencil on a grid (a same-shape convolution, a blur, a
finite-difference operator: each row's columns are every grid point within fixed offsets of the
row's own, clipped at the borders) needs no per-nonzero constant at all: :func:`stencil`
recognizes it, and a program finds each nonzero's row from the rows' pointers and the row of
every ``BLOCK``-th nonzero, and its column from the row's box (:class:`Stencil`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["BLOCK", "Codes", "Stencil", "block_rows", "encode", "stencil"]

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


def block_rows(indptr: np.ndarray, nnz: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
    """The row of every ``BLOCK``-th nonzero (in ``dtype``) and the most rows past its block's
    first row that any nonzero lies."""
    starts = (np.searchsorted(indptr, np.arange(0, nnz, BLOCK), side="right") - 1).astype(dtype)
    last = np.searchsorted(indptr, max(nnz - 1, 0), side="right") - 1
    return starts, int(np.diff(starts, append=last).max(initial=0))


def encode(indptr: np.ndarray, cols: np.ndarray) -> Codes:
    """The codes of the CSR nonzeros ``(indptr, cols)`` (see the module), in integers of
    ``cols``'s type where not narrower; two passes over the nonzeros, a chunk of rows at a
    time."""
    nnz, dtype = cols.size, cols.dtype
    n_padded = -(-nnz // BLOCK) * BLOCK
    starts, span = block_rows(indptr, nnz, dtype)
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


def _chunks(
    indptr: np.ndarray, dtype: np.dtype, entries: int | None = None
) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(lo, hi, rows)``: the rows of the nonzeros ``lo:hi``, whole rows at a time (about
    ``entries`` nonzeros, :data:`_CHUNK_ENTRIES` by default)."""
    n_rows, counts = len(indptr) - 1, np.diff(indptr)
    size = _CHUNK_ENTRIES if entries is None else entries
    per_chunk = max(1, size // max(int(counts.max(initial=1)), 1))
    for a in range(0, n_rows, per_chunk):
        b = min(a + per_chunk, n_rows)
        lo, hi = int(indptr[a]), int(indptr[b])
        if hi > lo:
            yield lo, hi, np.repeat(np.arange(a, b, dtype=dtype), counts[a:b])


@dataclass(frozen=True)
class Stencil:
    """The pattern on the grid ``shape`` (rows' and columns' alike, row-major) whose row ``r``
    holds every column ``c`` of the grid with ``lo[a] <= c[a] - r[a] <= hi[a]`` on each axis
    ``a``; its CSR order enumerates the rows, then each row's box, row-major."""

    shape: tuple[int, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    def span(self, axis: int) -> tuple[np.ndarray, np.ndarray]:
        """The first column and the number of columns along ``axis`` of the rows at each
        position of that axis."""
        size, i = self.shape[axis], np.arange(self.shape[axis])
        start = np.maximum(i + self.lo[axis], 0)
        end = np.minimum(i + self.hi[axis], size - 1)
        return start, np.maximum(end - start + 1, 0)

    def box(self) -> int:
        """The most nonzeros a row holds (its whole box)."""
        return math.prod(h - low + 1 for low, h in zip(self.lo, self.hi, strict=True))

    def counts(self) -> np.ndarray:
        """The nonzeros of each row (int64, ``prod(shape)``)."""
        out = np.ones((), np.int64)
        for a in range(len(self.shape)):
            out = np.multiply.outer(out, self.span(a)[1])
        return out.reshape(-1)


def stencil(indptr: np.ndarray, cols: np.ndarray, shape: tuple[int, ...]) -> Stencil | None:
    """The :class:`Stencil` that the CSR pattern ``(indptr, cols)`` (columns sorted and unique
    within each row) is on the grid ``shape``, or ``None``. The offsets are the extremes of
    ``c - r`` over the nonzeros; the pattern is that stencil where every row holds as many
    nonzeros as its box (all of them then, being unique and within it). One pass over the
    nonzeros, a chunk of rows at a time (a sixteenth of the codes' chunks: a few MB of
    temporaries in the columns' integers)."""
    n = int(np.prod(shape, dtype=np.int64))
    if len(indptr) != n + 1 or cols.size == 0 or n == 0:
        return None
    lo = np.full(len(shape), np.iinfo(np.int64).max)
    hi = np.full(len(shape), np.iinfo(np.int64).min)
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    for lo_nz, hi_nz, row in _chunks(indptr, cols.dtype, _CHUNK_ENTRIES // 16):
        col = cols[lo_nz:hi_nz]
        for a, (stride, size) in enumerate(zip(strides, shape, strict=True)):
            gap = col // stride % size - row // stride % size  # along axis a
            lo[a], hi[a] = min(lo[a], int(gap.min())), max(hi[a], int(gap.max()))
    found = Stencil(tuple(shape), tuple(lo.tolist()), tuple(hi.tolist()))
    return found if np.array_equal(found.counts(), np.diff(indptr)) else None
