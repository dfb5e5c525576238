"""Contractions (``dot_general``) and batched linear algebra."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._deps import Deps, arange, compose, empty, gather, union
from .movement import reshape, transpose
from .reductions import reduce

__all__ = ["batched_dense", "dot_general"]


def batched_dense(deps: Deps, n_core: int, out_shape: Sequence[int], n_core_out: int) -> Deps:
    """Leading axes are a batch; within one batch entry, outputs depend on all core elements.

    For batched linear algebra and FFTs: the last ``n_core`` input axes and the last
    ``n_core_out`` output axes are the core; the leading axes must agree.
    """
    lead = deps.shape[: len(deps.shape) - n_core]
    per_batch = reduce(deps, range(len(lead), len(deps.shape)))
    src = np.broadcast_to(arange(lead).reshape(lead + (1,) * n_core_out), tuple(out_shape))
    return gather(per_batch, src)


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
    if rhs.is_empty and rhs_value is not None and _sparse_constant(rhs_value):
        return _dot_with_constant(
            lhs, rhs_value, (lb, lhs_free, lc), (rb, rc, rhs_free), out_shape, True
        )
    if lhs.is_empty and lhs_value is not None and _sparse_constant(lhs_value):
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
        moved = np.transpose(arange(reduced.shape), order)
        n_other = len(rhs_free) if first else len(lhs_free)
        if first:
            expanded = moved.reshape(moved.shape + (1,) * n_other)
        else:
            nb = len(bdims)
            expanded = moved.reshape(moved.shape[:nb] + (1,) * n_other + moved.shape[nb:])
        return gather(reduced, np.broadcast_to(expanded, out_shape))

    return union(spread(lhs, lc, lb, lhs_free, True), spread(rhs, rc, rb, rhs_free, False))


def _sparse_constant(value: np.ndarray) -> bool:
    if value.size == 0:
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
