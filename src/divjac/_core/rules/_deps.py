"""The dependency-set type and the primitives every rule is built of.

Every intermediate array of a traced program carries, for each of its elements (row-major), the
set of *labels* it depends on, held as one boolean SciPy CSR matrix of shape
``(size, n_labels)``. The primitives here gather rows (index maps), take unions and apply local
Jacobian patterns (boolean sparse products); every rule of the other modules is made of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from ..._errors import InternalError

__all__ = [
    "Deps",
    "Shape",
    "arange",
    "compose",
    "dense",
    "empty",
    "from_labels",
    "gather",
    "index_map",
    "union",
]


Shape = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Deps:
    """The dependency sets of every element of one array.

    Attributes:
        shape: the array's shape.
        n_labels: number of labels (columns).
        csr: boolean ``(prod(shape), n_labels)`` matrix, row ``e`` holding the labels element ``e``
            (row-major) depends on; ``None`` when no element depends on anything.
    """

    shape: Shape
    n_labels: int
    csr: sp.csr_array | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_empty(self) -> bool:
        return self.csr is None

    def matrix(self) -> sp.csr_array:
        """The dependency matrix, with explicit empty rows when there is no dependence."""
        if self.csr is None:
            return sp.csr_array((self.size, self.n_labels), dtype=bool)
        return self.csr


def _make(shape: Sequence[int], n_labels: int, csr: sp.csr_array | None) -> Deps:
    shape = tuple(int(s) for s in shape)
    if csr is None or csr.nnz == 0:
        return Deps(shape, n_labels, None)
    if csr.shape != (math.prod(shape), n_labels):
        raise InternalError(f"dependency matrix {csr.shape} does not fit shape {shape}")
    return Deps(shape, n_labels, csr)


def empty(shape: Sequence[int], n_labels: int) -> Deps:
    """Dependency sets of an array that depends on nothing (constants, integers, ...)."""
    return _make(shape, n_labels, None)


def from_labels(shape: Sequence[int], labels: np.ndarray, n_labels: int) -> Deps:
    """Seed dependency sets: element ``e`` depends on the labels ``labels[e]`` (``-1``: none).

    Args:
        shape: the array's shape.
        labels: integer array of shape ``(size,)`` or ``(size, k)``.
        n_labels: total number of labels.
    """
    labels = np.asarray(labels, dtype=np.int64).reshape(math.prod(shape), -1)
    rows, slot = np.nonzero(labels >= 0)
    cols = labels[rows, slot]
    csr = sp.csr_array((np.ones(len(rows), bool), (rows, cols)), shape=(math.prod(shape), n_labels))
    return _make(shape, n_labels, csr)


def arange(shape: Sequence[int]) -> np.ndarray:
    """Flat row-major positions of an array of ``shape``, in that shape."""
    return np.arange(math.prod(shape), dtype=np.int64).reshape(tuple(shape))


def _gather_rows(csr: sp.csr_array, src: np.ndarray) -> sp.csr_array:
    """Rows ``csr[src[r]]`` for every ``r`` (an empty row where ``src[r] < 0``)."""
    indptr = csr.indptr.astype(np.int64, copy=False)
    valid = src >= 0
    safe = np.where(valid, src, 0)
    starts = indptr[safe]
    lengths = np.where(valid, indptr[safe + 1] - starts, 0)
    new_indptr = np.zeros(len(src) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_indptr[1:])
    total = int(new_indptr[-1])
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - new_indptr[:-1], lengths)
    out = sp.csr_array(
        (np.ones(total, dtype=bool), csr.indices[pos], new_indptr),
        shape=(len(src), csr.shape[1]),
    )
    out.has_sorted_indices = True
    return out


def gather(deps: Deps, src: np.ndarray) -> Deps:
    """Element ``r`` of the output (shape ``src.shape``) is element ``src[r]`` of the input.

    ``src`` holds flat row-major input indices, ``-1`` where the output element depends on nothing
    (padding, out-of-bounds fill).
    """
    src = np.asarray(src, dtype=np.int64)
    if deps.csr is None:
        return empty(src.shape, deps.n_labels)
    return _make(src.shape, deps.n_labels, _gather_rows(deps.csr, src.ravel()))


def index_map(out_shape: Sequence[int], sources: Sequence[Deps], src: np.ndarray) -> Deps:
    """Like :func:`gather` over several inputs: ``src`` indexes their rows stacked in order."""
    n_labels = sources[0].n_labels
    if all(s.is_empty for s in sources):
        return empty(out_shape, n_labels)
    if len(sources) == 1:
        return gather(sources[0], np.asarray(src).reshape(tuple(out_shape)))
    stacked = sp.vstack([s.matrix() for s in sources], format="csr")
    return gather(Deps((stacked.shape[0],), n_labels, stacked), np.asarray(src).reshape(out_shape))


def union(*deps: Deps) -> Deps:
    """Element-wise union of dependency sets of arrays of one shape."""
    present = [d for d in deps if not d.is_empty]
    if not present:
        return deps[0]
    if len(present) == 1:
        return present[0]
    total = present[0].matrix()
    for d in present[1:]:
        total = total + d.matrix()
    return _make(present[0].shape, present[0].n_labels, sp.csr_array(total))


def compose(
    out_shape: Sequence[int],
    rows: np.ndarray,
    cols: np.ndarray,
    deps: Deps,
    *,
    n_in: int | None = None,
) -> Deps:
    """Output element ``r`` depends on the union of input elements ``c`` over all pairs ``(r, c)``.

    This applies a local Jacobian pattern ``L`` (given by its nonzero pairs) to the input's
    dependency sets: ``L @ deps``, a boolean sparse product.
    """
    if deps.csr is None:
        return empty(out_shape, deps.n_labels)
    n_out = math.prod(out_shape)
    n_in = deps.size if n_in is None else n_in
    local = sp.csr_array(
        (np.ones(len(rows), dtype=bool), (np.asarray(rows, np.int64), np.asarray(cols, np.int64))),
        shape=(n_out, n_in),
    )
    return _make(out_shape, deps.n_labels, sp.csr_array(local @ deps.csr))


def dense(out_shape: Sequence[int], *deps: Deps) -> Deps:
    """Conservative rule: every output element depends on every label any input depends on."""
    n_labels = deps[0].n_labels
    rows = [d.csr for d in deps if d.csr is not None]
    if not rows:
        return empty(out_shape, n_labels)
    labels = np.unique(np.concatenate([r.indices for r in rows]))
    one = sp.csr_array(
        (np.ones(len(labels), bool), labels, np.array([0, len(labels)])), shape=(1, n_labels)
    )
    return gather(Deps((1,), n_labels, one), np.zeros(tuple(out_shape), np.int64))
