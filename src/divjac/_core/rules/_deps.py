"""The dependency-set type and the primitives every rule is built of.

Every intermediate array of a traced program carries, for each of its elements (row-major), the
set of *labels* it depends on, held as one boolean SciPy CSR matrix of shape
``(size, n_labels)``. The primitives here gather rows (index maps), take unions and apply local
Jacobian patterns (boolean sparse products); every rule of the other modules is made of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from ..._errors import InternalError

__all__ = [
    "Deps",
    "Layout",
    "Shape",
    "Shared",
    "arange",
    "compose",
    "dense",
    "empty",
    "equal",
    "from_labels",
    "from_samples",
    "gather",
    "index_map",
    "per_sample",
    "union",
    "with_shape",
]


Shape = tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """Where the samples of a batch are in a flat (row-major) array: element
    ``r = (o * batch + b) * inner + i`` belongs to sample ``b``, at position ``o * inner + i``
    within it (``outer * inner`` positions per sample).

    The batch axis of ``(B, ...)`` is ``Layout(1, B, size // B)``; a batch axis moved inside
    (``(H, B, W)``), or merged with its neighbours by a reshape (``(B * H, W)``), is another
    ``outer`` / ``inner`` split of the same kind.
    """

    outer: int
    batch: int
    inner: int

    @property
    def per_sample(self) -> int:
        return self.outer * self.inner

    def sample_of(self, r: np.ndarray) -> np.ndarray:
        """The sample of each flat element ``r``."""
        return (r // self.inner) % self.batch

    def within(self, r: np.ndarray) -> np.ndarray:
        """The per-sample position of each flat element ``r``."""
        return (r // (self.batch * self.inner)) * self.inner + r % self.inner

    def by_sample(self, values: np.ndarray) -> np.ndarray:
        """A value per flat element rearranged ``(batch, per_sample)``: row ``b`` holds sample
        ``b``'s values in per-sample order (a view where NumPy can make one)."""
        return (
            values.reshape(self.outer, self.batch, self.inner)
            .transpose(1, 0, 2)
            .reshape(self.batch, self.per_sample)
        )


@dataclass(frozen=True, eq=False)
class Shared:
    """The dependency sets of an array whose samples all depend alike on their own sample.

    Element ``(b, q)`` (sample ``b``, per-sample position ``q`` of ``layout``) depends on the
    position labels of row ``q`` of ``rows`` (columns ``< positions``) and, where the row's last
    column is set, on the label of its own sample, ``positions + b``. One matrix of
    ``per_sample`` rows stands for the ``batch`` copies the full matrix would hold, so
    propagating it costs what one sample costs.
    """

    layout: Layout
    rows: sp.csr_array
    positions: int


@dataclass(frozen=True, eq=False)
class Deps:
    """The dependency sets of every element of one array.

    Held either in full (``full``: one row per element) or, while every sample of a batch
    depends alike on its own sample only, once for all samples (``shared``, see
    :class:`Shared`). The rules never see the difference: the primitives of this module keep
    the shared form wherever they can prove it exact (the index maps act alike on every sample
    and keep each one to itself) and fall back to the full form elsewhere.

    Attributes:
        shape: the array's shape.
        n_labels: number of labels (columns).
        full: boolean ``(prod(shape), n_labels)`` matrix, row ``e`` holding the labels element
            ``e`` (row-major) depends on; ``None`` when ``shared`` holds them or when no element
            depends on anything.
        shared: the dependency sets held once for all samples, or ``None``.
    """

    shape: Shape
    n_labels: int
    full: sp.csr_array | None = None
    shared: Shared | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_empty(self) -> bool:
        return self.full is None and self.shared is None

    @property
    def nnz(self) -> int:
        """Dependency entries of all elements (of all samples)."""
        if self.shared is not None:
            return self.shared.layout.batch * int(self.shared.rows.nnz)
        return 0 if self.full is None else int(self.full.nnz)

    @property
    def stored(self) -> int:
        """Dependency entries held in memory."""
        if self.shared is not None:
            return int(self.shared.rows.nnz)
        return self.nnz

    @functools.cached_property
    def csr(self) -> sp.csr_array | None:
        """The full boolean ``(size, n_labels)`` matrix (``None``: no dependence)."""
        if self.shared is None:
            return self.full
        return _expand(self.shared, self.size)

    def matrix(self) -> sp.csr_array:
        """The dependency matrix, with explicit empty rows when there is no dependence."""
        csr = self.csr
        if csr is None:
            return sp.csr_array((self.size, self.n_labels), dtype=bool)
        return csr


def _make(shape: Sequence[int], n_labels: int, csr: sp.csr_array | None) -> Deps:
    shape = tuple(int(s) for s in shape)
    if csr is None or csr.nnz == 0:
        return Deps(shape, n_labels, None)
    if csr.shape != (math.prod(shape), n_labels):
        raise InternalError(f"dependency matrix {csr.shape} does not fit shape {shape}")
    return Deps(shape, n_labels, csr)


def _make_shared(shape: Sequence[int], layout: Layout, rows: sp.csr_array, positions: int) -> Deps:
    shape = tuple(int(s) for s in shape)
    if rows.nnz == 0:
        return Deps(shape, positions + layout.batch, None)
    if layout.batch == 1:  # every split of one sample is the same layout
        layout = Layout(1, 1, layout.per_sample)
    if rows.shape != (layout.per_sample, positions + 1) or layout.per_sample * layout.batch != (
        math.prod(shape)
    ):
        raise InternalError(f"shared dependency rows {rows.shape} do not fit shape {shape}")
    return Deps(shape, positions + layout.batch, None, Shared(layout, rows, positions))


def _expand(shared: Shared, size: int) -> sp.csr_array:
    """The full matrix of shared dependency sets: each sample's copy of its rows, with the
    own-sample column turned into the sample's label."""
    lay, positions = shared.layout, shared.positions
    r = np.arange(size, dtype=np.int64)
    rows = _gather_rows(shared.rows, lay.within(r))
    cols = rows.indices.astype(np.int64)
    own = np.flatnonzero(cols == positions)
    if len(own):
        entry_row = np.searchsorted(rows.indptr, own, side="right") - 1
        cols[own] = positions + lay.sample_of(entry_row)
    out = sp.csr_array(
        (rows.data, cols, rows.indptr), shape=(size, positions + lay.batch)
    )  # the own column is the last one: the rows stay sorted
    out.has_sorted_indices = True
    return out


def _full(deps: Deps) -> Deps:
    """``deps`` held in full."""
    return deps if deps.shared is None else _make(deps.shape, deps.n_labels, deps.csr)


def with_shape(deps: Deps, shape: Sequence[int]) -> Deps:
    """The same dependency sets, of an array reshaped (row-major) to ``shape``."""
    shape = tuple(int(s) for s in shape)
    if math.prod(shape) != deps.size:
        raise InternalError(f"cannot reshape dependency sets of {deps.shape} to {shape}")
    return dataclasses.replace(deps, shape=shape)


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


def from_samples(
    shape: Sequence[int], batch: int, labels: np.ndarray | None, n_positions: int
) -> Deps:
    """Seed an array of ``shape``, ``batch`` samples first (``(batch, *sample)``, or one sample
    without a batch axis): element ``(b, j)`` depends on the label of its sample ``b`` and on
    the position label ``labels[j]`` (none where it is ``-1``, or without ``labels``).

    The labels are the positions ``0 .. n_positions - 1`` followed by the samples
    ``n_positions .. n_positions + batch - 1``; held shared (one matrix for all samples, see
    :class:`Shared`).
    """
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape) // batch
    own = np.full(n, n_positions, np.int64)
    if labels is None:
        cols = own[:, None]
    else:
        cols = np.stack([np.asarray(labels, np.int64).reshape(n), own], axis=1)
    rows, slot = np.nonzero(cols >= 0)
    matrix = sp.csr_array(
        (np.ones(len(rows), bool), (rows, cols[rows, slot])), shape=(n, n_positions + 1)
    )
    return _make_shared(shape, Layout(1, batch, n), matrix, n_positions)


def arange(shape: Sequence[int]) -> np.ndarray:
    """Flat row-major positions of an array of ``shape``, in that shape."""
    return np.arange(math.prod(shape), dtype=np.int64).reshape(tuple(shape))


# Rows are gathered this many entries at a time (bounds the int64 temporaries).
_GATHER_CHUNK = 1 << 22


def _gather_rows(csr: sp.csr_array, src: np.ndarray) -> sp.csr_array:
    """Rows ``csr[src[r]]`` for every ``r`` (an empty row where ``src[r] < 0``).

    Indices are int32 where they fit; the entry positions are computed a chunk of rows at a
    time, so the temporaries stay small next to the result.
    """
    indptr = csr.indptr
    valid = src >= 0
    safe = np.where(valid, src, 0)
    starts = indptr[safe].astype(np.int64)
    lengths = np.where(valid, indptr[safe + 1] - starts, 0)
    new_indptr = np.zeros(len(src) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_indptr[1:])
    total = int(new_indptr[-1])
    index_type = np.int32 if max(total, csr.shape[1]) < np.iinfo(np.int32).max else np.int64
    indices = np.empty(total, dtype=index_type)
    step = max(1, _GATHER_CHUNK * len(src) // max(total, 1))
    for lo in range(0, len(src), step):
        hi = min(lo + step, len(src))
        first, last = new_indptr[lo], new_indptr[hi]
        pos = np.repeat(starts[lo:hi] - new_indptr[lo:hi], lengths[lo:hi])
        pos += np.arange(first, last, dtype=np.int64)
        indices[first:last] = csr.indices[pos]
    out = sp.csr_array(
        (np.ones(total, dtype=bool), indices, new_indptr.astype(index_type)),
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
    return index_map(src.shape, [deps], src)


def index_map(out_shape: Sequence[int], sources: Sequence[Deps], src: np.ndarray) -> Deps:
    """Like :func:`gather` over several inputs: ``src`` indexes their rows stacked in order."""
    out_shape = tuple(int(s) for s in out_shape)
    n_labels = sources[0].n_labels
    if all(s.is_empty for s in sources):
        return empty(out_shape, n_labels)
    src = np.asarray(src, dtype=np.int64).ravel()
    shared = _shared_of(sources)
    if shared is not None:
        found = _shared_map(out_shape, sources, shared, src)
        if found is not None:
            return found
    if len(sources) == 1:
        stacked = _full(sources[0]).matrix()
        if len(src) == stacked.shape[0] and np.array_equal(src, np.arange(len(src))):
            return _make(out_shape, n_labels, stacked)  # the identity map: no copy
    else:
        stacked = sp.vstack([s.matrix() for s in sources], format="csr")
    return _make(out_shape, n_labels, _gather_rows(stacked, src))


def _shared_of(deps: Iterable[Deps]) -> Shared | None:
    """One of the shared forms, if every non-empty one of ``deps`` is shared over the same batch
    and labels (else ``None``: the full form is needed)."""
    found = None
    for d in deps:
        if d.is_empty:
            continue
        sh = d.shared
        if sh is None:
            return None
        if found is None:
            found = sh
        elif (sh.layout.batch, sh.positions) != (found.layout.batch, found.positions):
            return None
    return found


def _candidates(shape: Shape, batch: int, hints: Iterable[Layout]) -> list[Layout]:
    """Layouts a batch of ``batch`` samples may have in an array of ``shape``: the ``hints``
    (the inputs'), then the batch as the major or minor factor of any axis it divides."""
    size = math.prod(shape)
    found = [h for h in hints if h.per_sample * h.batch == size]
    for k, n in enumerate(shape):
        if n % batch == 0:
            before, after = math.prod(shape[:k]), math.prod(shape[k + 1 :])
            found.append(Layout(before, batch, n // batch * after))
            found.append(Layout(before * (n // batch), batch, after))
    return list(dict.fromkeys(found))


def _shared_map(
    out_shape: Shape, sources: Sequence[Deps], shared: Shared, src: np.ndarray
) -> Deps | None:
    """:func:`index_map` in the shared form, or ``None`` where it would not be exact: some
    output element reads another sample than its own, or the samples read differently."""
    batch = shared.layout.batch
    if len(sources) == 1:
        lay_in = shared.layout
        for lay in _candidates(out_shape, batch, [lay_in]):
            first = _blocked(src, lay, lay_in)
            if first is not None:
                return _make_shared(
                    out_shape, lay, _gather_rows(shared.rows, first), shared.positions
                )
    # The sample and the per-sample row (of the stacked shared rows) of every stacked input row.
    samples, within, blocks, offset = [], [], [], 0
    for s in sources:
        if s.is_empty:
            samples.append(np.full(s.size, -1, np.int64))
            within.append(np.full(s.size, -1, np.int64))
            continue
        sh = s.shared
        if sh is None:
            raise InternalError("a full dependency matrix among shared ones")
        r = np.arange(s.size, dtype=np.int64)
        samples.append(sh.layout.sample_of(r))
        within.append(sh.layout.within(r) + offset)
        blocks.append(sh.rows)
        offset += sh.layout.per_sample
    valid = src >= 0
    safe = np.where(valid, src, 0)
    sample = np.where(valid, np.concatenate(samples)[safe], -1)
    row = np.where(valid, np.concatenate(within)[safe], -1)
    for lay in _candidates(out_shape, batch, [s.shared.layout for s in sources if s.shared]):
        by = lay.by_sample(sample)
        if not ((by == np.arange(batch)[:, None]) | (by < 0)).all():
            continue
        rows = lay.by_sample(row)
        if not (rows == rows[0]).all():
            return None
        stacked = blocks[0] if len(blocks) == 1 else sp.vstack(blocks, format="csr")
        return _make_shared(out_shape, lay, _gather_rows(stacked, rows[0]), shared.positions)
    return None


def per_sample(rule: Callable[[Deps], Deps], deps: Deps, out_shape: Sequence[int]) -> Deps | None:
    """``rule`` applied to every sample of a batch at the cost of one sample.

    For an operation that acts on every index of the leading axis alike and on it alone (a
    convolution's batch axis, the free batch axis of a product with a constant): ``rule``
    maps the dependency sets of one sample, ``(1, *deps.shape[1:])``, to those of its output,
    ``(1, *out_shape[1:])``. ``None`` where ``deps`` is not held shared with its samples on the
    leading axis (then the caller applies its rule to the whole batch).
    """
    sh = deps.shared
    out_shape = tuple(int(s) for s in out_shape)
    lay = None if sh is None else sh.layout
    if sh is None or lay is None or lay.outer != 1 or deps.shape[:1] != (lay.batch,):
        return None
    one = Deps((1, *deps.shape[1:]), sh.positions + 1, sh.rows)
    out = rule(one)
    if out.is_empty:
        return empty(out_shape, deps.n_labels)
    n = math.prod(out_shape[1:])
    return _make_shared(out_shape, Layout(1, lay.batch, n), out.matrix(), sh.positions)


def union(*deps: Deps) -> Deps:
    """Element-wise union of dependency sets of arrays of one shape."""
    present = [d for d in deps if not d.is_empty]
    if not present:
        return deps[0]
    if len(present) == 1:
        return present[0]
    shared = [d.shared for d in present if d.shared is not None]
    if len(shared) == len(present) and all(
        (sh.layout, sh.positions) == (shared[0].layout, shared[0].positions) for sh in shared
    ):
        rows = shared[0].rows
        for sh in shared[1:]:
            rows = rows + sh.rows
        return _make_shared(
            present[0].shape, shared[0].layout, sp.csr_array(rows), shared[0].positions
        )
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
    out_shape = tuple(int(s) for s in out_shape)
    if deps.is_empty:
        return empty(out_shape, deps.n_labels)
    rows, cols = np.asarray(rows).ravel(), np.asarray(cols).ravel()
    n_out = math.prod(out_shape)
    n_in = deps.size if n_in is None else n_in
    if deps.shared is not None and n_in == deps.size:
        found = _shared_compose(
            out_shape, rows.astype(np.int64, copy=False), cols.astype(np.int64, copy=False),
            deps.shared,
        )  # fmt: skip
        if found is not None:
            return found
    held = _full(deps).matrix()
    relabelled = _relabelled(n_out, rows, cols, held)
    if relabelled is not None:
        return _make(out_shape, deps.n_labels, relabelled)
    local = sp.csr_array((np.ones(len(rows), dtype=bool), (rows, cols)), shape=(n_out, n_in))
    return _make(out_shape, deps.n_labels, sp.csr_array(local @ held))


def _relabelled(
    n_out: int, rows: np.ndarray, cols: np.ndarray, held: sp.csr_array
) -> sp.csr_array | None:
    """:func:`compose` without a sparse product, where each input element depends on one label
    of its own, maybe with the last label shared by all (one sample's input, seeded per
    position and with its sample's label), and the pairs, relabelled, are already in CSR order
    (rows nondecreasing, labels increasing within each row: a stencil's pairs from
    :func:`~divjac._core.rules.conv.window_pairs`): the pattern is the pairs, int32 where they
    fit, the shared label after each nonempty row's. ``None`` otherwise (the product is
    needed)."""
    n_in, n_labels = held.shape
    per_row = int(held.indptr[1]) if n_in else 0
    last = n_labels - 1
    if len(rows) == 0 or per_row not in (1, 2) or not held.has_sorted_indices:
        return None
    if not np.array_equal(held.indptr, np.arange(n_in + 1) * per_row):
        return None
    own = held.indices[::per_row]
    if per_row == 2 and not (held.indices[1::2] == last).all():
        return None
    labels = own[cols]
    if (rows[1:] < rows[:-1]).any():
        return None
    if ((rows[1:] == rows[:-1]) & (labels[1:] <= labels[:-1])).any():
        return None
    shared = per_row - 1  # 1: the last label follows every nonempty row's own labels
    fits = len(rows) + n_out < np.iinfo(np.int32).max and n_labels < np.iinfo(np.int32).max
    dtype = np.int32 if fits else np.int64
    counts = np.bincount(rows, minlength=n_out)
    nonempty = (counts > 0).astype(dtype)
    indptr = np.zeros(n_out + 1, dtype)
    np.cumsum(counts + shared * nonempty, out=indptr[1:])
    if not shared:
        indices = labels.astype(dtype, copy=False)
    else:
        indices = np.empty(int(indptr[-1]), dtype)
        before = np.cumsum(nonempty, dtype=dtype) - nonempty  # nonempty rows before each row
        at = np.arange(len(rows), dtype=dtype)
        at += before[rows]
        indices[at] = labels
        indices[indptr[1:][counts > 0] - 1] = last
    data = np.ones(len(indices), dtype=bool)
    return sp.csr_array((data, indices, indptr), shape=(n_out, n_labels))


def _shared_compose(
    out_shape: Shape, rows: np.ndarray, cols: np.ndarray, shared: Shared
) -> Deps | None:
    """:func:`compose` in the shared form, or ``None`` where it would not be exact: some output
    element reads another sample than its own, or the samples' local patterns differ."""
    lay_in, batch = shared.layout, shared.layout.batch
    candidates = _candidates(out_shape, batch, [lay_in])
    for lay in candidates:
        q0 = _blocked(rows, lay, lay)
        p0 = None if q0 is None else _blocked(cols, lay, lay_in)
        if q0 is not None and p0 is not None:
            return _shared_product(out_shape, lay, q0, p0, shared)
    sample = lay_in.sample_of(cols)
    for lay in candidates:
        if not np.array_equal(sample, lay.sample_of(rows)):
            continue
        q, p = lay.within(rows), lay_in.within(cols)
        first = sample == 0
        q0, p0 = q[first], p[first]
        if not _same_pairs_per_sample(sample, q, p, q0, p0, batch, shared.rows.shape[0]):
            return None
        return _shared_product(out_shape, lay, q0, p0, shared)
    return None


def _shared_product(
    out_shape: Shape, lay: Layout, q0: np.ndarray, p0: np.ndarray, shared: Shared
) -> Deps:
    """One sample's local pattern (pairs ``(q0, p0)``) applied to the shared rows."""
    local = sp.csr_array(
        (np.ones(len(q0), dtype=bool), (q0, p0)),
        shape=(lay.per_sample, shared.layout.per_sample),
    )
    return _make_shared(out_shape, lay, sp.csr_array(local @ shared.rows), shared.positions)


def _blocked(index: np.ndarray, lay: Layout, lay_in: Layout) -> np.ndarray | None:
    """Sample 0's part of ``index`` (flat indices into an array of layout ``lay_in``, ``-1``:
    none), if ``index`` comes in ``lay.batch`` equal blocks, block ``b`` reading sample ``b``
    exactly as block 0 reads sample 0 (else ``None``).

    The cheap common case of :func:`_shared_map` and :func:`_shared_compose` (a batch axis
    first, the index arrays built sample by sample): no division, only comparisons.
    """
    batch = lay.batch
    if lay.outer != 1 or lay_in.outer != 1 or len(index) % batch:
        return None
    blocks = index.reshape(batch, -1)
    first = blocks[0]
    if len(first) and (first.max() >= lay_in.inner or first.min() < -1):
        return None
    shift = np.arange(batch, dtype=np.int64)[:, None] * lay_in.inner
    none = first < 0
    if not ((blocks == np.where(none, -1, first + shift)).all()):
        return None
    return first


def _same_pairs_per_sample(
    sample: np.ndarray,
    q: np.ndarray,
    p: np.ndarray,
    q0: np.ndarray,
    p0: np.ndarray,
    batch: int,
    n_p: int,
) -> bool:
    """Whether every sample's set of local pairs ``(q, p)`` is sample 0's ``(q0, p0)``."""
    if batch == 1:
        return True
    if len(sample) % batch == 0:
        # Usual case: the pairs come sample by sample, each in the same order.
        by = sample.reshape(batch, -1)
        if (by == np.arange(batch)[:, None]).all() and (
            (q.reshape(batch, -1) == q0).all() and (p.reshape(batch, -1) == p0).all()
        ):
            return True
    span = (int(q.max(initial=0)) + 1) * n_p
    key0 = np.unique(q0 * n_p + p0)
    keys = np.unique(sample * span + q * n_p + p)
    counts = np.bincount(keys // span, minlength=batch)
    if not (counts == len(key0)).all():
        return False
    return bool((keys.reshape(batch, -1) % span == key0).all())


def dense(out_shape: Sequence[int], *deps: Deps) -> Deps:
    """Conservative rule: every output element depends on every label any input depends on."""
    n_labels = deps[0].n_labels
    found = [_labels(d) for d in deps if not d.is_empty]
    if not found:
        return empty(out_shape, n_labels)
    labels = np.unique(np.concatenate(found))
    one = sp.csr_array(
        (np.ones(len(labels), bool), labels, np.array([0, len(labels)])), shape=(1, n_labels)
    )
    return gather(Deps((1,), n_labels, one), np.zeros(tuple(out_shape), np.int64))


def _labels(deps: Deps) -> np.ndarray:
    """Every label some element of ``deps`` depends on."""
    sh = deps.shared
    if sh is None:
        return np.asarray(deps.matrix().indices, np.int64)
    cols = np.unique(np.asarray(sh.rows.indices, np.int64))
    if len(cols) and cols[-1] == sh.positions:  # the own column: every sample's label
        cols = np.concatenate([cols[:-1], sh.positions + np.arange(sh.layout.batch)])
    return cols


def equal(a: Deps, b: Deps) -> bool:
    """Whether two dependency sets are equal."""
    if a.is_empty or b.is_empty:
        return a.is_empty == b.is_empty
    if a.shared is not None and b.shared is not None and a.shared.layout == b.shared.layout:
        ma, mb = a.shared.rows, b.shared.rows
    else:
        ma, mb = a.matrix(), b.matrix()
    return bool(ma.nnz == mb.nnz and (ma != mb).nnz == 0)
