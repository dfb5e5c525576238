"""Convolutions and sliding windows (pooling and its gradients)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._deps import Deps, Shape, arange, compose, empty, gather, per_sample, union
from ._op import Op
from .movement import transpose
from .reductions import reduce

__all__ = [
    "axis_map",
    "axis_maps_rule",
    "conv",
    "conv_rule",
    "window",
    "window_pairs",
    "window_rule",
    "window_transposed",
    "window_transposed_rule",
]


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
    dilation. The pairs of all axes are combined as a Cartesian product (windows are boxes), in
    CSR order (rows increasing, each row's inputs increasing), int32 where the flat indices fit;
    they are made a block of output positions at a time (bounded temporaries).
    """
    ndim = len(in_shape)
    base_dilation = base_dilation or [1] * ndim
    window_dilation = window_dilation or [1] * ndim
    taps, oks = [], []
    out_shape_list = []
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
        out_shape_list.append(n_out)
        p = np.arange(n_out)[:, None] * stride + np.arange(k)[None, :] * wdil - lo
        ok = (p >= 0) & (p < dilated) & (p % bdil == 0)
        taps.append(np.where(ok, p // bdil, 0))
        oks.append(ok)
    out_shape = tuple(out_shape_list)
    fits = max(math.prod(out_shape), math.prod(in_shape)) < np.iinfo(np.int32).max
    dtype = np.int32 if fits else np.int64
    total = math.prod(int(ok.sum()) for ok in oks)
    rows, cols = np.empty(total, dtype), np.empty(total, dtype)
    if total == 0:
        return out_shape, rows, cols
    out_strides = [math.prod(out_shape[a + 1 :]) for a in range(ndim)]
    in_strides = [math.prod(in_shape[a + 1 :]) for a in range(ndim)]
    per_first = math.prod(out_shape[1:]) * math.prod(t.shape[1] for t in taps)
    step = max(1, _PAIRS_BLOCK // max(per_first, 1))
    filled = 0
    for start in range(0, out_shape[0], step):
        block = range(start, min(start + step, out_shape[0]))
        r, c, m = np.zeros((), dtype), np.zeros((), dtype), np.ones((), bool)
        for a in range(ndim):
            o = np.arange(block.start, block.stop) if a == 0 else np.arange(out_shape[a])
            at_o = [1] * (2 * ndim)
            at_o[a] = len(o)
            at_ok = list(at_o)
            at_ok[ndim + a] = taps[a].shape[1]
            r = r + (o.astype(dtype) * dtype(out_strides[a])).reshape(at_o)
            c = c + (taps[a][o].astype(dtype) * dtype(in_strides[a])).reshape(at_ok)
            m = m & oks[a][o].reshape(at_ok)
        m = np.broadcast_to(m, np.broadcast_shapes(r.shape, c.shape, m.shape))
        n = int(m.sum())
        rows[filled : filled + n] = np.broadcast_to(r, m.shape)[m]
        cols[filled : filled + n] = np.broadcast_to(c, m.shape)[m]
        filled += n
    return out_shape, rows, cols


_PAIRS_BLOCK = 1 << 22
"""Window taps (pairs, before dropping those off the input) made at once by
:func:`window_pairs`."""


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
    if rhs.is_empty and batch_group_count == 1 and lhs_spec[0] == out_spec[0] == 0:
        # Each sample is convolved on its own, alike: convolve one.
        found = per_sample(
            lambda one: conv(
                one,
                empty(rhs.shape, one.n_labels),
                out_shape=(1, *out_shape[1:]),
                lhs_spec=lhs_spec,
                rhs_spec=rhs_spec,
                out_spec=out_spec,
                window_strides=window_strides,
                padding=padding,
                lhs_dilation=lhs_dilation,
                rhs_dilation=rhs_dilation,
                feature_group_count=feature_group_count,
            ),
            lhs,
            out_shape,
        )
        if found is not None:
            return found
    n_spatial = len(lhs_spec) - 2
    canon_out = tuple(out_shape[a] for a in out_spec)
    n_out, c_out = canon_out[0], canon_out[1]
    # Index arrays are built in the canonical order and permuted to the out layout, so that
    # the (large) dependency matrices are never transposed.
    to_out = [int(a) for a in np.argsort(out_spec)]
    parts = []
    if not lhs.is_empty:
        native = np.transpose(arange(lhs.shape), lhs_spec)  # canonical -> native flat index
        n_in, c_in = native.shape[0], native.shape[1]
        spatial = native.shape[2:]
        g = feature_group_count
        # The union over each group's input features, per sample and position.
        group_rows = np.broadcast_to(arange((n_in, g, 1, *spatial)), (n_in, g, c_in // g, *spatial))
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
        src = base[(...,) + (None,) * n_spatial] + arange(win_shape[1:])[None, None]
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


# --- rules over an operation ---------------------------------------------------------------------


def conv_rule(op: Op) -> list[Deps]:
    """Convolution of the inputs (lhs, rhs) with the keyword arguments of :func:`conv` as params
    (``out_shape`` is the output's)."""
    return [conv(op.ins[0], op.ins[1], out_shape=op.out_shapes[0], **op.params)]


def window_rule(op: Op) -> list[Deps]:
    """Windowed reduction of the first input (the arguments of :func:`window` as params)."""
    return [window(op.ins[0], **op.params)]


def window_transposed_rule(op: Op) -> list[Deps]:
    """Window outputs (the first input) scattered back over the windows of the output."""
    p = op.params
    out = op.out_shapes[0]
    return [
        window_transposed(op.ins[0], out, p["window_dimensions"], p["window_strides"], p["padding"])
    ]


def axis_maps_rule(op: Op) -> list[Deps]:
    """Separable windows: :func:`axis_map` applied to the first input along each axis in turn.

    Params: ``maps``, a list of ``(axis, size, rows, cols)``. Other outputs (indices): nothing.
    """
    x = op.ins[0]
    for axis, size, rows, cols in op.params["maps"]:
        x = axis_map(x, axis, size, rows, cols)
    return [x] + [op.empty(k) for k in range(1, len(op.out_shapes))]
