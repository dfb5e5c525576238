"""Dependency sets of array elements and the rules that propagate them (NumPy/SciPy only).

Sparsity detection is abstract interpretation: every intermediate array of the traced program
carries, for each of its elements (row-major), the set of *labels* it depends on, held as one
boolean SciPy CSR matrix of shape ``(size, n_labels)``. A rule maps the dependency sets of an
operation's inputs to those of its outputs; it only looks at shapes and static parameters, never
at values, so a pattern holds for every input of those shapes.

The rules here are written once and shared by the JAX (jaxpr) and PyTorch (ATen graph) backends.
Every rule is vectorized (index arithmetic and sparse products); none loops over elements.
Rules may over-approximate (a dependency that is structurally possible but numerically zero),
they never under-approximate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

Shape = tuple[int, ...]

__all__ = [
    "Deps",
    "axis_map",
    "batched_dense",
    "broadcast_in_dim",
    "broadcast_to",
    "compose",
    "concatenate",
    "conv",
    "cumulative",
    "dense",
    "dot_general",
    "elementwise",
    "empty",
    "from_labels",
    "gather",
    "index_map",
    "pad",
    "reduce",
    "reshape",
    "rev",
    "slice_",
    "sort_along",
    "spread",
    "stack",
    "transpose",
    "union",
    "window",
    "window_pairs",
    "window_transposed",
]


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
        raise AssertionError(f"dependency matrix {csr.shape} does not fit shape {shape}")
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


def _arange(shape: Sequence[int]) -> np.ndarray:
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


# --- index maps: each output element reads at most one input element ---------------------------


def reshape(deps: Deps, shape: Sequence[int]) -> Deps:
    """Reshape (row-major): the dependency rows are unchanged."""
    return Deps(tuple(int(s) for s in shape), deps.n_labels, deps.csr)


def transpose(deps: Deps, permutation: Sequence[int]) -> Deps:
    """``transpose(x, permutation)``."""
    return gather(deps, np.transpose(_arange(deps.shape), tuple(permutation)))


def broadcast_to(deps: Deps, shape: Sequence[int]) -> Deps:
    """NumPy broadcasting of ``deps.shape`` (right-aligned) to ``shape``."""
    shape = tuple(int(s) for s in shape)
    if deps.shape == shape:
        return deps
    return gather(deps, np.broadcast_to(_arange(deps.shape), shape))


def broadcast_in_dim(deps: Deps, shape: Sequence[int], broadcast_dimensions: Sequence[int]) -> Deps:
    """XLA ``broadcast_in_dim``: operand axis ``i`` becomes output axis ``broadcast_dimensions[i]``."""
    expanded = [1] * len(shape)
    for axis, size in zip(broadcast_dimensions, deps.shape, strict=True):
        expanded[axis] = size
    return broadcast_to(reshape(deps, expanded), shape)


def slice_(
    deps: Deps,
    start: Sequence[int],
    limit: Sequence[int],
    strides: Sequence[int] | None = None,
) -> Deps:
    """``x[start:limit:strides]`` on every axis."""
    steps = strides if strides is not None else [1] * len(start)
    index = tuple(slice(a, b, s) for a, b, s in zip(start, limit, steps, strict=True))
    return gather(deps, _arange(deps.shape)[index])


def rev(deps: Deps, axes: Sequence[int]) -> Deps:
    """Reverse the order of elements along ``axes``."""
    return gather(deps, np.flip(_arange(deps.shape), tuple(axes)))


def concatenate(deps: Sequence[Deps], axis: int) -> Deps:
    """Concatenation along ``axis``."""
    offsets = np.cumsum([0] + [d.size for d in deps])
    src = np.concatenate(
        [_arange(d.shape) + off for d, off in zip(deps, offsets, strict=False)], axis
    )
    return index_map(src.shape, deps, src)


def stack(deps: Sequence[Deps], axis: int) -> Deps:
    """Stacking along a new axis ``axis`` (of the output)."""
    axis = axis % (len(deps[0].shape) + 1)
    expanded = [reshape(d, (*d.shape[:axis], 1, *d.shape[axis:])) for d in deps]
    return concatenate(expanded, axis)


def pad(deps: Deps, value: Deps, config: Sequence[tuple[int, int, int]]) -> Deps:
    """XLA ``pad``: ``config[i] = (low, high, interior)``, low/high may be negative (cropping).

    Padded elements depend on the (scalar) padding ``value``.
    """
    n = deps.size
    grown = []
    for size, (lo, hi, interior) in zip(deps.shape, config, strict=True):
        grown.append(max(lo, 0) + size + max(size - 1, 0) * interior + max(hi, 0))
    src = np.full(grown, n, dtype=np.int64)
    placed = tuple(
        slice(max(lo, 0), max(lo, 0) + max(size - 1, 0) * (interior + 1) + 1, interior + 1)
        for size, (lo, _, interior) in zip(deps.shape, config, strict=True)
    )
    if n:
        src[placed] = _arange(deps.shape)
    crop = tuple(
        slice(max(-lo, 0), length - max(-hi, 0))
        for length, (lo, hi, _) in zip(grown, config, strict=True)
    )
    src = src[crop]
    return index_map(src.shape, [deps, reshape(value, (1,))], src)


# --- many-to-one maps ---------------------------------------------------------------------------


def elementwise(out_shape: Sequence[int], *deps: Deps) -> Deps:
    """Element-wise operation with NumPy broadcasting: union of the broadcast inputs."""
    return union(*(broadcast_to(d, out_shape) for d in deps))


def reduce(deps: Deps, axes: Sequence[int], *, keepdims: bool = False) -> Deps:
    """Reduction over ``axes`` (sum, max, product, ...): union along those axes."""
    axes = tuple(sorted(a % max(len(deps.shape), 1) for a in axes))
    kept = tuple(1 if i in axes else s for i, s in enumerate(deps.shape))
    out_shape = kept if keepdims else tuple(s for i, s in enumerate(deps.shape) if i not in axes)
    if not axes:
        return deps
    if deps.csr is None:
        return empty(out_shape, deps.n_labels)
    target = np.broadcast_to(_arange(kept), deps.shape).ravel()
    return compose(out_shape, target, np.arange(deps.size), deps)


def spread(deps: Deps, axes: Sequence[int]) -> Deps:
    """Each element depends on its whole line along ``axes`` (an unknown position on them)."""
    return broadcast_to(reduce(deps, axes, keepdims=True), deps.shape)


def sort_along(deps: Deps, axis: int) -> Deps:
    """Sorting-like operations: each element depends on its whole line along ``axis``."""
    return spread(deps, [axis])


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


def batched_dense(deps: Deps, n_core: int, out_shape: Sequence[int], n_core_out: int) -> Deps:
    """Leading axes are a batch; within one batch entry, outputs depend on all core elements.

    For batched linear algebra and FFTs: the last ``n_core`` input axes and the last
    ``n_core_out`` output axes are the core; the leading axes must agree.
    """
    lead = deps.shape[: len(deps.shape) - n_core]
    per_batch = reduce(deps, range(len(lead), len(deps.shape)))
    src = np.broadcast_to(_arange(lead).reshape(lead + (1,) * n_core_out), tuple(out_shape))
    return gather(per_batch, src)


def cumulative(deps: Deps, axis: int, *, reverse: bool = False) -> Deps:
    """Cumulative sum / product / max along ``axis``: element k depends on elements <= k.

    Computed by log-step doubling (union with copies shifted by 1, 2, 4, ...), so the cost is
    ``log2(length)`` unions rather than one product per prefix.
    """
    axis = axis % len(deps.shape)
    length = deps.shape[axis]
    idx = _arange(deps.shape)
    pos = np.arange(length).reshape([-1 if i == axis else 1 for i in range(len(deps.shape))])
    out = deps
    shift = 1
    while shift < length:
        if reverse:
            shifted = np.where(pos + shift < length, np.roll(idx, -shift, axis), -1)
        else:
            shifted = np.where(pos - shift >= 0, np.roll(idx, shift, axis), -1)
        out = union(out, gather(out, shifted))
        shift *= 2
    return out


def window_pairs(
    in_shape: Sequence[int],
    window_dimensions: Sequence[int],
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    base_dilation: Sequence[int] | None = None,
    window_dilation: Sequence[int] | None = None,
) -> tuple[Shape, np.ndarray, np.ndarray]:
    """Output shape and the (output, input) flat index pairs of a sliding window.

    XLA ``reduce_window`` geometry (also that of a convolution's spatial axes): output position
    ``o`` and window tap ``k`` read the input position ``p = o * stride + k * window_dilation - lo``
    of the base-dilated input, which is a real element when ``p`` is a multiple of the base
    dilation. The pairs of all axes are combined as a Cartesian product (windows are boxes).
    """
    ndim = len(in_shape)
    base_dilation = base_dilation or [1] * ndim
    window_dilation = window_dilation or [1] * ndim
    rows = np.zeros(1, np.int64)
    cols = np.zeros(1, np.int64)
    out_shape = []
    for size, k, stride, (lo, hi), bdil, wdil in zip(
        in_shape,
        window_dimensions,
        window_strides,
        padding,
        base_dilation,
        window_dilation,
        strict=True,
    ):
        dilated = (size - 1) * bdil + 1 if size else 0
        span = (k - 1) * wdil + 1
        n_out = max((dilated + lo + hi - span) // stride + 1, 0) if size or lo + hi else 0
        out_shape.append(n_out)
        o = np.arange(n_out)[:, None]
        p = o * stride + np.arange(k)[None, :] * wdil - lo
        ok = (p >= 0) & (p < dilated) & (p % bdil == 0)
        o_axis = np.broadcast_to(o, p.shape)[ok]
        i_axis = p[ok] // bdil
        rows = (rows[:, None] * n_out + o_axis[None, :]).ravel()
        cols = (cols[:, None] * size + i_axis[None, :]).ravel()
    return tuple(out_shape), rows, cols


def window(
    deps: Deps,
    window_dimensions: Sequence[int],
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    base_dilation: Sequence[int] | None = None,
    window_dilation: Sequence[int] | None = None,
) -> Deps:
    """Windowed reduction (pooling, ``reduce_window``): union over each window."""
    out_shape, rows, cols = window_pairs(
        deps.shape, window_dimensions, window_strides, padding, base_dilation, window_dilation
    )
    return compose(out_shape, rows, cols, deps)


def window_transposed(
    source: Deps,
    base_shape: Sequence[int],
    window_dimensions: Sequence[int],
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
) -> Deps:
    """Scatter of window outputs back to the base positions they cover (max-pool gradient)."""
    _, rows, cols = window_pairs(base_shape, window_dimensions, window_strides, padding)
    return compose(base_shape, cols, rows, source)


def conv(
    lhs: Deps,
    rhs: Deps,
    *,
    out_shape: Sequence[int],
    lhs_spec: Sequence[int],
    rhs_spec: Sequence[int],
    out_spec: Sequence[int],
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
) -> Deps:
    """General dilated convolution (XLA ``conv_general_dilated`` semantics).

    ``*_spec`` give the axis order ``(batch, feature, *spatial)`` of lhs and out, and
    ``(out_feature, in_feature, *spatial)`` of rhs. Output ``(n, co, o)`` reads, for every input
    feature of ``co``'s group and every kernel tap, one input position (the window geometry of
    :func:`window_pairs`). The kernel's own dependencies (rare: a kernel computed from the
    input) reach every output of its output feature.
    """
    lhs_spec, rhs_spec, out_spec = tuple(lhs_spec), tuple(rhs_spec), tuple(out_spec)
    n_spatial = len(lhs_spec) - 2
    canon_out = tuple(out_shape[a] for a in out_spec)
    n_out, c_out = canon_out[0], canon_out[1]
    # Index arrays are built in the canonical order and permuted to the out layout, so that
    # the (large) dependency matrices are never transposed.
    to_out = [int(a) for a in np.argsort(out_spec)]
    parts = []
    if not lhs.is_empty:
        native = np.transpose(_arange(lhs.shape), lhs_spec)  # canonical -> native flat index
        n_in, c_in = native.shape[0], native.shape[1]
        spatial = native.shape[2:]
        g = feature_group_count
        # The union over each group's input features, per sample and position.
        group_rows = np.broadcast_to(
            _arange((n_in, g, 1, *spatial)), (n_in, g, c_in // g, *spatial)
        )
        grouped = compose((n_in * g, *spatial), group_rows.ravel(), native.ravel(), lhs)
        kernel = [rhs.shape[a] for a in rhs_spec[2:]]
        win_shape, rows, cols = window_pairs(
            (n_in * g, *spatial),
            [1, *kernel],
            [1, *window_strides],
            [(0, 0), *padding],
            [1, *(lhs_dilation or [1] * n_spatial)],
            [1, *(rhs_dilation or [1] * n_spatial)],
        )
        stenciled = compose(win_shape, rows, cols, grouped)
        co = np.arange(c_out)
        group = co // (c_out // g)
        batch_group = co // (c_out // batch_group_count)
        n = np.arange(n_out)[:, None] + batch_group[None, :] * (n_in // batch_group_count)
        base = (n * g + group[None, :]) * math.prod(win_shape[1:])
        src = base[(...,) + (None,) * n_spatial] + _arange(win_shape[1:])[None, None]
        parts.append(gather(stenciled, np.transpose(src, to_out)))
    if not rhs.is_empty:
        per_feature = reduce(transpose(rhs, rhs_spec), range(1, n_spatial + 2))
        co_index = np.broadcast_to(
            np.arange(c_out).reshape((1, c_out) + (1,) * n_spatial), canon_out
        )
        parts.append(gather(per_feature, np.transpose(co_index, to_out)))
    if not parts:
        return empty(out_shape, lhs.n_labels)
    return union(*parts)


# A constant operand's own zeros are used when it is at most this dense (else the cheaper
# structural rule applies: a dense constant gains nothing).
_CONSTANT_DENSITY = 0.5


def dot_general(
    lhs: Deps,
    rhs: Deps,
    *,
    contracting: tuple[Sequence[int], Sequence[int]],
    batch: tuple[Sequence[int], Sequence[int]],
    lhs_value: np.ndarray | None = None,
    rhs_value: np.ndarray | None = None,
) -> Deps:
    """XLA ``dot_general``: output axes are (batch, lhs free, rhs free).

    An output element depends on its lhs row and its rhs column, i.e. each operand reduced over
    its contracting axes and broadcast over the other operand's free axes. When one operand is a
    known constant (``*_value``, e.g. the interpolation matrix of a resize, a mask), its zeros
    are used: ``out[b, i, k]`` then depends on ``lhs[b, i, j]`` only where ``rhs[b, j, k] != 0``.
    """
    (lc, rc), (lb, rb) = contracting, batch
    lhs_free = [a for a in range(len(lhs.shape)) if a not in lc and a not in lb]
    rhs_free = [a for a in range(len(rhs.shape)) if a not in rc and a not in rb]
    out_shape = (
        tuple(lhs.shape[a] for a in lb)
        + tuple(lhs.shape[a] for a in lhs_free)
        + tuple(rhs.shape[a] for a in rhs_free)
    )
    if rhs.is_empty and _sparse_constant(rhs_value):
        assert rhs_value is not None
        return _dot_with_constant(
            lhs, rhs_value, (lb, lhs_free, lc), (rb, rc, rhs_free), out_shape, True
        )
    if lhs.is_empty and _sparse_constant(lhs_value):
        assert lhs_value is not None
        return _dot_with_constant(
            rhs, lhs_value, (rb, rhs_free, rc), (lb, lc, lhs_free), out_shape, False
        )

    def spread(
        operand: Deps,
        contract: Sequence[int],
        bdims: Sequence[int],
        free: Sequence[int],
        first: bool,
    ) -> Deps:
        if operand.is_empty:
            return empty(out_shape, operand.n_labels)
        kept = [a for a in range(len(operand.shape)) if a not in contract]
        reduced = reduce(operand, contract)
        order = [kept.index(a) for a in (*bdims, *free)]
        moved = np.transpose(_arange(reduced.shape), order)
        n_other = len(rhs_free) if first else len(lhs_free)
        if first:
            expanded = moved.reshape(moved.shape + (1,) * n_other)
        else:
            nb = len(bdims)
            expanded = moved.reshape(moved.shape[:nb] + (1,) * n_other + moved.shape[nb:])
        return gather(reduced, np.broadcast_to(expanded, out_shape))

    return union(spread(lhs, lc, lb, lhs_free, True), spread(rhs, rc, rb, rhs_free, False))


def _sparse_constant(value: np.ndarray | None) -> bool:
    if value is None or value.size == 0:
        return False
    return bool(np.count_nonzero(value) <= _CONSTANT_DENSITY * value.size)


def _dot_with_constant(
    operand: Deps,
    constant: np.ndarray,
    operand_axes: tuple[Sequence[int], Sequence[int], Sequence[int]],
    constant_axes: tuple[Sequence[int], Sequence[int], Sequence[int]],
    out_shape: tuple[int, ...],
    operand_first: bool,
) -> Deps:
    """``dot_general`` of a dependency-carrying operand with a constant, using its zeros.

    ``operand_axes`` are (batch, free, contracting) axes of the operand, ``constant_axes`` the
    constant's (batch, contracting, free). In canonical form the operand is ``(nb, ni, nj)``,
    the constant ``(nb, nj, nk)`` and output element ``(b, i, k)`` reads ``(b, i, j)`` for every
    ``j`` with ``constant[b, j, k] != 0`` (``(b, k, i)`` order when the constant comes first).
    """
    if operand.is_empty:
        return empty(out_shape, operand.n_labels)
    ob, of, oc = operand_axes
    cb, cc, cf = constant_axes
    nb = math.prod(operand.shape[a] for a in ob)
    ni = math.prod(operand.shape[a] for a in of)
    nj = math.prod(operand.shape[a] for a in oc)
    nk = math.prod(constant.shape[a] for a in cf)
    canon = reshape(transpose(operand, [*ob, *of, *oc]), (nb * ni * nj,))
    mask = np.transpose(constant != 0, [*cb, *cc, *cf]).reshape(nb, nj, nk)
    b, j, k = np.nonzero(mask)
    i = np.arange(ni)
    bb, jj, kk = (np.repeat(v, ni) for v in (b, j, k))
    ii = np.tile(i, len(b))
    cols = (bb * ni + ii) * nj + jj
    if operand_first:  # output (b, i, k)
        rows = (bb * ni + ii) * nk + kk
    else:  # output (b, k, i): the constant's free axes come first
        rows = (bb * nk + kk) * ni + ii
    return compose(out_shape, rows, cols, canon)


def axis_map(deps: Deps, axis: int, size: int, rows: np.ndarray, cols: np.ndarray) -> Deps:
    """A local map along one axis: output index ``rows[k]`` reads input index ``cols[k]``.

    The other axes are unchanged; the output has length ``size`` on ``axis``. Applied once per
    axis, it gives every separable window: adaptive pooling (windows of varying size), pooling
    geometry taken from the output shape, and the transposed maps of their gradients.
    """
    axis = axis % len(deps.shape)
    pre = math.prod(deps.shape[:axis])
    n = deps.shape[axis]
    post = math.prod(deps.shape[axis + 1 :])
    out_shape = (*deps.shape[:axis], int(size), *deps.shape[axis + 1 :])
    rows = np.asarray(rows, np.int64)
    cols = np.asarray(cols, np.int64)
    p = np.arange(pre, dtype=np.int64)[:, None, None]
    q = np.arange(post, dtype=np.int64)[None, None, :]
    out_idx = ((p * size + rows[None, :, None]) * post + q).ravel()
    in_idx = ((p * n + cols[None, :, None]) * post + q).ravel()
    return compose(out_shape, out_idx, in_idx, deps)
