"""Contractions (``dot_general``), batched linear algebra and solves, FFTs.

Batched linear algebra (factorizations, inverses, eigen-decompositions, FFTs) is independent
along its leading (batch) axes and dense within one batch entry; solves and triangular solves
keep the columns of their right-hand side apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ._deps import Deps, arange, compose, dense, empty, gather, union
from ._op import Op
from .movement import broadcast_to, reshape, transpose
from .reductions import cumulative, reduce

__all__ = [
    "batched_dense",
    "batched_rule",
    "dot_general",
    "dot_rule",
    "fft_rule",
    "linear_solve_rule",
    "solve_rule",
    "triangular_solve_rule",
]


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
            lhs, rhs_value, (lb, lhs_free, lc), (rb, rc, rhs_free), out_shape, operand_first=True
        )
    if lhs.is_empty and lhs_value is not None and _sparse_constant(lhs_value):
        return _dot_with_constant(
            rhs, lhs_value, (rb, rhs_free, rc), (lb, lc, lhs_free), out_shape, operand_first=False
        )

    def spread(
        operand: Deps,
        contract: Sequence[int],
        bdims: Sequence[int],
        free: Sequence[int],
        *,
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

    return union(
        spread(lhs, lc, lb, lhs_free, first=True), spread(rhs, rc, rb, rhs_free, first=False)
    )


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
    *,
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


# --- rules over an operation ---------------------------------------------------------------------


def dot_rule(op: Op) -> list[Deps]:
    """``dot_general`` of the first two inputs (params ``contracting``, ``batch``), plus the
    third input if there is one (a bias, broadcast); the zeros of a constant operand are used."""
    lhs, rhs = op.ins[0], op.ins[1]
    out = dot_general(
        lhs,
        rhs,
        contracting=op.params["contracting"],
        batch=op.params["batch"],
        lhs_value=op.value(0),
        rhs_value=op.value(1),
    )
    if len(op.ins) > 2:
        out = union(out, broadcast_to(op.ins[2], out.shape))
    return [reshape(out, s) for s in op.out_shapes]


def batched_rule(op: Op) -> list[Deps]:
    """Independent along the ``lead`` leading axes (a batch, heads); within one entry of them,
    every output element depends on every input element.

    Params: ``lead`` (default: all but the last two axes of the first input, the matrix axes).
    An input or output whose leading axes differ is handled by the dense fallback.
    """
    present = [d for d in op.ins if not d.is_empty]
    lead = op.params.get("lead")
    if lead is None:
        lead = len(op.ins[0].shape) - 2
    if lead < 0:
        return op.dense()
    results = []
    for k, s in enumerate(op.out_shapes):
        if not op.wants(k):
            results.append(op.empty(k))
            continue
        batch = tuple(s[:lead])
        if len(s) < lead or any(len(d.shape) < lead or d.shape[:lead] != batch for d in present):
            if math.prod(s):
                op.fallbacks.add(op.name)
            results.append(dense(s, *op.ins))
            continue
        parts = [batched_dense(d, len(d.shape) - lead, s, len(s) - lead) for d in present]
        results.append(union(empty(s, op.n_labels), *parts))
    return results


def fft_rule(op: Op) -> list[Deps]:
    """A discrete Fourier transform over ``axes``: dense along them, independent elsewhere
    (the output may have another length on them: real transforms)."""
    x = op.ins[0]
    line = reduce(x, op.params["axes"], keepdims=True)
    return [broadcast_to(line, s) for s in op.out_shapes]


def triangular_solve_rule(op: Op) -> list[Deps]:
    """``op(a) x = b`` (``left``) or ``x op(a) = b`` with a triangular ``op(a)`` (``lower``
    after any transposition): substitution.

    Solving with a lower triangular matrix from the left, ``x[i, j]`` depends on ``b[k, j]``
    for ``k <= i`` (a prefix along the rows); the other cases are the suffix or the columns.
    Every element depends on its batch entry's whole matrix. Inputs: ``a``, ``b``.
    """
    a, b = op.ins[0], op.ins[1]
    lower = op.params["lower"]
    if op.params["left"]:
        solved = cumulative(b, -2, reverse=not lower)
    else:
        solved = cumulative(b, -1, reverse=lower)
    out = op.out_shapes[0]
    return [union(solved, batched_dense(a, 2, out, 2))]


def solve_rule(op: Op) -> list[Deps]:
    """``A X = B`` (``left``; ``X A = B`` otherwise): a column (row) of ``X`` reads the same
    column (row) of ``B`` and all of ``A`` of its batch entry; the other outputs
    (factorizations, a copy of ``A``) read ``A`` alone.

    Inputs: ``A``, ``B``. Params: ``left``, ``vector`` (``B`` is a (batch of) vector(s)).
    """
    a, rhs = op.ins[0], op.ins[1]
    n_a = len(a.shape)
    vector = op.params.get("vector", False)
    axis = len(rhs.shape) - 1 if vector else len(rhs.shape) - (2 if op.params["left"] else 1)
    whole_a = reduce(a, [n_a - 2, n_a - 1], keepdims=True)
    solution = [broadcast_to(reduce(rhs, [axis], keepdims=True), op.out_shapes[0])]
    if not a.is_empty:
        reduced = reshape(whole_a, whole_a.shape[:-1]) if vector else whole_a
        solution.append(broadcast_to(reduced, op.out_shapes[0]))
    results = [union(*solution)]
    for k, s in enumerate(op.out_shapes[1:], 1):
        results.append(broadcast_to(whole_a, s) if op.wants(k) and not a.is_empty else op.empty(k))
    return results


Program = Callable[[Sequence[Deps]], list[Deps]]


def linear_solve_rule(op: Op) -> list[Deps]:
    """A solve given by programs (JAX ``custom_linear_solve``).

    Inputs: the programs' constants (``n_consts`` of them), then the right-hand sides. Params:
    ``solve`` (right-hand sides -> solutions) and ``matvec`` (solutions -> products), both
    closed over their constants, ``n_consts`` and ``matrix_moves`` (the matvec's constants depend on
    the labels). ``x = A^{-1} b`` gives ``dx = A^{-1} (db - dA x)``: the matrix's dependencies
    go through the matvec (``dA x``) and the solve, which keeps batched solves per entry.
    """
    solve: Program = op.params["solve"]
    matvec: Program = op.params["matvec"]
    solved = solve(op.ins[op.params["n_consts"] :])
    if op.params["matrix_moves"]:
        moved = solve(matvec(solved))
        solved = [union(s, m) for s, m in zip(solved, moved, strict=True)]
    return solved
