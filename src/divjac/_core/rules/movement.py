"""Data movement: each output element reads at most one input element (index maps).

Reshape, transpose, broadcasting, slicing, reversal, padding, concatenation, tiling, and the
element-wise rule (the union of the broadcast inputs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from ._deps import Deps, arange, gather, index_map, union, with_shape
from ._op import Op

__all__ = [
    "broadcast_in_dim",
    "broadcast_in_dim_rule",
    "broadcast_to",
    "concatenate",
    "concatenate_rule",
    "elementwise",
    "elementwise_rule",
    "identity_rule",
    "nothing_rule",
    "pad",
    "pad_rule",
    "reshape",
    "reshape_rule",
    "rev",
    "rev_rule",
    "slice_",
    "slice_rule",
    "split",
    "split_rule",
    "stack",
    "stack_rule",
    "tile",
    "tile_rule",
    "transpose",
    "transpose_rule",
    "unstack",
    "unstack_rule",
]


def reshape(deps: Deps, shape: Sequence[int]) -> Deps:
    """Reshape (row-major): the dependency rows are unchanged."""
    return with_shape(deps, shape)


def transpose(deps: Deps, permutation: Sequence[int]) -> Deps:
    """``transpose(x, permutation)``."""
    return gather(deps, np.transpose(arange(deps.shape), tuple(permutation)))


def broadcast_to(deps: Deps, shape: Sequence[int]) -> Deps:
    """NumPy broadcasting of ``deps.shape`` (right-aligned) to ``shape``."""
    shape = tuple(int(s) for s in shape)
    if deps.shape == shape:
        return deps
    return gather(deps, np.broadcast_to(arange(deps.shape), shape))


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
    return gather(deps, arange(deps.shape)[index])


def rev(deps: Deps, axes: Sequence[int]) -> Deps:
    """Reverse the order of elements along ``axes``."""
    return gather(deps, np.flip(arange(deps.shape), tuple(axes)))


def concatenate(deps: Sequence[Deps], axis: int) -> Deps:
    """Concatenation along ``axis``."""
    offsets = np.cumsum([0] + [d.size for d in deps])
    src = np.concatenate(
        [arange(d.shape) + off for d, off in zip(deps, offsets, strict=False)], axis
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
        src[placed] = arange(deps.shape)
    crop = tuple(
        slice(max(-lo, 0), length - max(-hi, 0))
        for length, (lo, hi, _) in zip(grown, config, strict=True)
    )
    src = src[crop]
    return index_map(src.shape, [deps, reshape(value, (1,))], src)


def elementwise(out_shape: Sequence[int], *deps: Deps) -> Deps:
    """Element-wise operation with NumPy broadcasting: union of the broadcast inputs."""
    return union(*(broadcast_to(d, out_shape) for d in deps))


def tile(deps: Deps, reps: Sequence[int]) -> Deps:
    """``np.tile(x, reps)``."""
    return gather(deps, np.tile(arange(deps.shape), tuple(reps)))


def split(deps: Deps, axis: int, sizes: Sequence[int]) -> list[Deps]:
    """Consecutive pieces of ``sizes`` along ``axis``."""
    bounds = np.cumsum([0, *sizes])
    pieces = []
    for lo, hi in itertools.pairwise(bounds):
        start = [0] * len(deps.shape)
        limit = list(deps.shape)
        start[axis], limit[axis] = int(lo), int(hi)
        pieces.append(slice_(deps, start, limit))
    return pieces


def unstack(deps: Deps, axis: int) -> list[Deps]:
    """The slices along ``axis``, each without it (``jnp.unstack``, ``torch.unbind``)."""
    positions = arange(deps.shape)
    return [gather(deps, np.take(positions, k, axis)) for k in range(deps.shape[axis])]


# --- rules over an operation ---------------------------------------------------------------------


def elementwise_rule(op: Op) -> list[Deps]:
    """Element-wise (with broadcasting): every output is the union of the broadcast inputs."""
    return [elementwise(s, *op.ins) for s in op.out_shapes]


def nothing_rule(op: Op) -> list[Deps]:
    """Outputs whose derivative is zero wherever it exists (comparisons, rounding, ...)."""
    return [op.empty(k) for k in range(len(op.out_shapes))]


def identity_rule(op: Op) -> list[Deps]:
    """Output ``k`` is input ``k`` (broadcast to its shape); outputs past the inputs: nothing."""
    return [
        broadcast_to(op.ins[k], s) if k < len(op.ins) else op.empty(k)
        for k, s in enumerate(op.out_shapes)
    ]


def reshape_rule(op: Op) -> list[Deps]:
    """Row-major reshape, after a ``permutation`` of the input (if given)."""
    x = op.ins[0]
    if op.params.get("permutation"):
        x = transpose(x, op.params["permutation"])
    return [reshape(x, op.out_shapes[0])]


def transpose_rule(op: Op) -> list[Deps]:
    """Params: ``permutation``."""
    return [transpose(op.ins[0], op.params["permutation"])]


def broadcast_in_dim_rule(op: Op) -> list[Deps]:
    """Params: ``dimensions`` (the output axis of every input axis)."""
    return [broadcast_in_dim(op.ins[0], op.out_shapes[0], op.params["dimensions"])]


def rev_rule(op: Op) -> list[Deps]:
    """Params: ``axes`` (reversed)."""
    return [rev(op.ins[0], op.params["axes"])]


def slice_rule(op: Op) -> list[Deps]:
    """Params: ``start``, ``limit``, ``strides`` (or ``None``)."""
    p = op.params
    return [slice_(op.ins[0], p["start"], p["limit"], p.get("strides"))]


def pad_rule(op: Op) -> list[Deps]:
    """Inputs: operand, padding value. Params: ``config`` (``(low, high, interior)`` per axis)."""
    return [pad(op.ins[0], op.ins[1], op.params["config"])]


def concatenate_rule(op: Op) -> list[Deps]:
    """Params: ``axis``."""
    return [concatenate(op.ins, op.params["axis"])]


def stack_rule(op: Op) -> list[Deps]:
    """Params: ``axis`` (of the output)."""
    return [stack(op.ins, op.params["axis"])]


def tile_rule(op: Op) -> list[Deps]:
    """Params: ``reps``."""
    return [tile(op.ins[0], op.params["reps"])]


def split_rule(op: Op) -> list[Deps]:
    """Params: ``axis``, ``sizes``."""
    return split(op.ins[0], op.params["axis"], op.params["sizes"])


def unstack_rule(op: Op) -> list[Deps]:
    """Params: ``axis``; output ``k`` is the slice ``k`` along it."""
    return unstack(op.ins[0], op.params["axis"])
