"""Many-to-one maps along axes: reductions, cumulative operations, sorts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._deps import Deps, arange, compose, empty, gather, union
from ._op import Op
from .movement import broadcast_to, reshape

__all__ = [
    "cumulative",
    "cumulative_rule",
    "reduce",
    "reduce_rule",
    "sort_along",
    "sort_rule",
    "spread",
]


def reduce(deps: Deps, axes: Sequence[int], *, keepdims: bool = False) -> Deps:
    """Reduction over ``axes`` (sum, max, product, ...): union along those axes."""
    axes = tuple(sorted(a % max(len(deps.shape), 1) for a in axes))
    kept = tuple(1 if i in axes else s for i, s in enumerate(deps.shape))
    out_shape = kept if keepdims else tuple(s for i, s in enumerate(deps.shape) if i not in axes)
    if not axes:
        return deps
    if deps.is_empty:
        return empty(out_shape, deps.n_labels)
    target = np.broadcast_to(arange(kept), deps.shape).ravel()
    return compose(out_shape, target, np.arange(deps.size), deps)


def spread(deps: Deps, axes: Sequence[int]) -> Deps:
    """Each element depends on its whole line along ``axes`` (an unknown position on them)."""
    return broadcast_to(reduce(deps, axes, keepdims=True), deps.shape)


def sort_along(deps: Deps, axis: int, out_shape: Sequence[int] | None = None) -> Deps:
    """Sorting-like operations (sort, top-k, softmax): each element depends on its whole line
    along ``axis``; ``out_shape`` may have another length on ``axis`` (the ``k`` of top-k)."""
    if out_shape is None:
        return spread(deps, [axis])
    return broadcast_to(reduce(deps, [axis], keepdims=True), out_shape)


def cumulative(deps: Deps, axis: int, *, reverse: bool = False) -> Deps:
    """Cumulative sum / product / max along ``axis``: element k depends on elements <= k.

    Computed by log-step doubling (union with copies shifted by 1, 2, 4, ...), so the cost is
    ``log2(length)`` unions rather than one product per prefix.
    """
    if not deps.shape:  # a 0-d operand (PyTorch's axis 0 of length one)
        return deps
    axis = axis % len(deps.shape)
    length = deps.shape[axis]
    idx = arange(deps.shape)
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


# --- rules over an operation ---------------------------------------------------------------------


def reduce_rule(op: Op) -> list[Deps]:
    """Reduction of the first input over ``axes`` (every output: values, indices, ...).

    Params: ``axes``. Each output is the reduction reshaped to its shape (kept axes or not).
    """
    reduced = reduce(op.ins[0], op.params["axes"], keepdims=True)
    return [reshape(reduced, s) for s in op.out_shapes]


def cumulative_rule(op: Op) -> list[Deps]:
    """Cumulative operation along ``axis`` (``reverse``: from the end); other outputs (indices)
    have the same dependencies."""
    out = cumulative(op.ins[0], op.params["axis"], reverse=op.params.get("reverse", False))
    return [out for _ in op.out_shapes]


def sort_rule(op: Op) -> list[Deps]:
    """Sorting-like along ``axis``: output ``k`` reads the whole line of input ``k`` (operands
    sorted together; a single input for every output: values and indices of a top-k)."""
    axis = op.params["axis"]
    return [
        sort_along(op.ins[min(k, len(op.ins) - 1)], axis, s) for k, s in enumerate(op.out_shapes)
    ]
