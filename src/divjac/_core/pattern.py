"""Per-sample sparsity patterns: seeding a batched input, reading a batched output, colorings.

The batch is handled with two kinds of labels. Input element ``(b, j)`` (sample ``b``, flat
per-sample index ``j``) gets the label ``j`` (its *position*) and the label ``n + b`` (its
*sample*). After propagation, output element ``(b', i)``

* depends on positions ``j``: the union over samples of the per-sample patterns ``J_b[i, j]``;
* depends on samples ``b``: the batch is independent iff every output element of sample ``b'``
  depends on sample ``b'`` only.

Both are exact projections of the full ``(B*n_out, B*n_in)`` pattern (projections commute with
unions), so one propagation gives the per-sample pattern and decides batch coupling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import scipy.sparse as sp

from .._errors import InternalError, NonSquareJacobianError
from . import coloring
from .rules import Deps, from_samples

__all__ = ["BatchLayout", "Coupling", "SparsityPattern", "read_out", "seed"]


@dataclass(frozen=True)
class BatchLayout:
    """Where the batch is in an array: ``shape`` with the batch on ``batch_axis`` (or none)."""

    shape: tuple[int, ...]
    batch_axis: int | None

    @property
    def batch_size(self) -> int:
        return 1 if self.batch_axis is None else self.shape[self.batch_axis]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        if self.batch_axis is None:
            return self.shape
        return self.shape[: self.batch_axis] + self.shape[self.batch_axis + 1 :]

    @property
    def sample_size(self) -> int:
        return math.prod(self.sample_shape)

    def indices(self) -> tuple[np.ndarray, np.ndarray]:
        """Sample index ``b`` and per-sample flat index ``j`` of every element (row-major)."""
        size = math.prod(self.shape)
        if self.batch_axis is None:
            return np.zeros(size, np.int64), np.arange(size, dtype=np.int64)
        moved = np.moveaxis(np.arange(size).reshape(self.shape), self.batch_axis, 0)
        flat = moved.reshape(self.batch_size, -1)
        b = np.empty(size, np.int64)
        j = np.empty(size, np.int64)
        b[flat] = np.arange(self.batch_size)[:, None]
        j[flat] = np.arange(self.sample_size)[None, :]
        return b, j


def seed(layout: BatchLayout, *, per_sample: bool) -> Deps:
    """Dependency sets of the differentiated input (batch first, or no batch).

    With ``per_sample=False`` only the sample labels are seeded (enough to decide coupling:
    every element then depends on about one label).
    """
    if layout.batch_axis not in (None, 0):
        raise InternalError("the differentiated input is seeded batch first")
    n = layout.sample_size
    labels = np.arange(n) if per_sample else None
    return from_samples(layout.shape, layout.batch_size, labels, n if per_sample else 0)


@dataclass(frozen=True)
class Coupling:
    """Evidence of batch coupling: output sample ``out_sample`` depends on ``in_sample``."""

    out_sample: int
    in_sample: int
    n_pairs: int


def read_out(
    out: Deps, out_layout: BatchLayout, in_layout: BatchLayout, *, per_sample: bool
) -> tuple[sp.csr_array | None, Coupling | None]:
    """Per-sample pattern (``n_out x n_in`` boolean CSR, or ``None``) and coupling evidence."""
    n_in = in_layout.sample_size if per_sample else 0
    n_out = out_layout.sample_size
    sh = out.shared
    if sh is not None and out_layout.batch_axis in (None, 0) and sh.layout.outer == 1:
        # Every output sample depends on its own input sample only, all alike.
        pattern = sp.csr_array(sh.rows[:, :n_in]) if per_sample else None
        if pattern is not None:
            pattern.sum_duplicates()
        return pattern, None
    m = out.matrix().tocoo()
    b_out, i_out = out_layout.indices()
    rows, cols = np.asarray(m.row, np.int64), np.asarray(m.col, np.int64)
    is_sample = cols >= n_in
    other = np.flatnonzero(is_sample & ((cols - n_in) != b_out[rows]))
    coupling = None
    if len(other) and out_layout.batch_axis is not None:
        k = other[0]
        coupling = Coupling(int(b_out[rows[k]]), int(cols[k] - n_in), len(other))
    pattern = None
    if per_sample:
        pos = ~is_sample
        pattern = sp.csr_array(
            (np.ones(int(pos.sum()), bool), (i_out[rows[pos]], cols[pos])), shape=(n_out, n_in)
        )
        pattern.sum_duplicates()
    return pattern, coupling


@dataclass(frozen=True, eq=False)
class SparsityPattern:
    """Per-sample Jacobian sparsity of a batched function, shared by every sample.

    Attributes:
        csr: boolean ``(n_out, n_in)`` SciPy CSR matrix; ``csr[i, j]`` is True when output element
            ``i`` of a sample may depend on input element ``j`` of the same sample (row-major
            flat indices over the per-sample shapes). Never misses a true nonzero.
        in_shape: per-sample input shape.
        out_shape: per-sample output shape.
        batch_size: number of samples the pattern was detected with.
        coupling: ``None`` when every output sample depends only on its own input sample;
            otherwise an example of cross-sample dependence.
        dense_fallbacks: operations without a sparsity rule (handled as dense).
    """

    csr: sp.csr_array
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    batch_size: int
    coupling: Coupling | None = None
    dense_fallbacks: frozenset[str] = field(default_factory=frozenset)

    @property
    def is_batch_independent(self) -> bool:
        """True when no output of sample b depends on an input of another sample."""
        return self.coupling is None

    @property
    def shape(self) -> tuple[int, int]:
        return self.csr.shape

    @property
    def nnz(self) -> int:
        return int(self.csr.nnz)

    @property
    def density(self) -> float:
        """Fraction of structurally nonzero entries of the per-sample Jacobian."""
        size = self.csr.shape[0] * self.csr.shape[1]
        return self.nnz / size if size else 0.0

    @property
    def is_square(self) -> bool:
        return self.in_shape == self.out_shape

    @cached_property
    def colors(self) -> np.ndarray:
        """Column coloring (forward mode): color of each input element."""
        return coloring.column_coloring(self.csr, shape=self.in_shape)

    @cached_property
    def row_colors(self) -> np.ndarray:
        """Row coloring (reverse mode): color of each output element."""
        return coloring.row_coloring(self.csr, shape=self.out_shape)

    @cached_property
    def diagonal_colors(self) -> np.ndarray:
        """Diagonal coloring (trace): same-colored j != j' have J[j, j'] = J[j', j] = 0."""
        if not self.is_square:
            raise NonSquareJacobianError(
                "the diagonal coloring needs a square per-sample Jacobian; this one maps "
                f"{self.in_shape} to {self.out_shape}: use colors (columns) or row_colors (rows) "
                "for a rectangular Jacobian"
            )
        return coloring.diagonal_coloring(self.csr, shape=self.in_shape)

    @cached_property
    def with_diagonal(self) -> SparsityPattern:
        """The pattern with its diagonal added (square only): the columns (rows) of one color of
        its column (row) coloring hold no diagonal entry but their own, so the same
        compressed passes read both ``J_ii`` and the norms of the columns (rows)."""
        if not self.is_square:
            raise NonSquareJacobianError(
                f"with_diagonal needs a square per-sample Jacobian; this one maps {self.in_shape} "
                f"to {self.out_shape}"
            )
        eye = sp.eye_array(self.csr.shape[0], dtype=bool, format="csr")
        csr = sp.csr_array((self.csr + eye).astype(bool))
        return SparsityPattern(
            csr, self.in_shape, self.out_shape, self.batch_size, self.coupling, self.dense_fallbacks
        )

    @property
    def n_colors(self) -> int:
        return _count(self.colors)

    @property
    def n_row_colors(self) -> int:
        return _count(self.row_colors)

    @property
    def n_diagonal_colors(self) -> int:
        return _count(self.diagonal_colors)

    def todense(self) -> np.ndarray:
        """Dense boolean ``(*out_shape, *in_shape)`` array (small patterns only)."""
        return self.csr.toarray().reshape(self.out_shape + self.in_shape)

    def __repr__(self) -> str:
        n_out, n_in = self.csr.shape
        parts = [
            f"{n_out}x{n_in}",
            f"nnz={self.nnz}",
            f"density={self.density:.3g}",
            f"batch_independent={self.is_batch_independent}",
        ]
        return f"SparsityPattern({', '.join(parts)})"


def _count(colors: np.ndarray) -> int:
    return int(colors.max()) + 1 if len(colors) else 0
