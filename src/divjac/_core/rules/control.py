"""Control flow: nested programs, branches and loops.

A backend gives these rules its nested programs as functions from input to output dependency
sets (params ``program``, ``branches``, ``body``), so the rules never see a jaxpr or a graph. A
loop body must accept inputs of any label count: the loop rules run it once with a label per
input element (its *local pattern*, a boolean matrix) and then work on that pattern, never
running the body again: a scan's steps are products of local patterns (exact over every step,
:func:`scan_rule`), and a fixpoint costs what its dependency sets cost.

A fixpoint ``carry = base | R carry`` (``R`` the carry-to-carry local pattern) is the closure of
``R``: carried elements in one strongly connected group of ``R`` share their sets (one round
settles a shift or a rotation), and the rounds run over the condensed, acyclic graph. Past
:data:`MAX_FIXPOINT_ROUNDS` rounds only the groups that can still grow are widened, to the union
over their weakly connected part of ``R`` (a bound on what they can reach): never to ``dense``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import scipy.sparse as sp
from scipy.sparse import csgraph

from ._deps import (
    Deps,
    Shape,
    arange,
    compose,
    empty,
    equal,
    from_labels,
    gather,
    index_map,
    union,
)
from ._op import Op
from .movement import concatenate, reshape, split
from .reductions import reduce

__all__ = [
    "MAX_FIXPOINT_ROUNDS",
    "SCAN_ENTRY_BUDGET",
    "call_rule",
    "cond_rule",
    "custom_rule",
    "fixpoint",
    "same",
    "scan_rule",
    "while_rule",
]

MAX_FIXPOINT_ROUNDS = 64
"""Loops: rounds of a fixpoint over the condensed carry graph; past them, the groups of carried
elements that can still grow are widened to the union over their weakly connected part."""

SCAN_ENTRY_BUDGET = 1 << 23
"""Scans are unrolled (exact) over as many steps as fit in this many entries of their local
pattern; the remaining steps (if any) share one fixpoint, their ``xs`` merged."""

Program = Callable[[Sequence[Deps]], list[Deps]]


def same(a: Deps, b: Deps) -> bool:
    """Whether two dependency sets are equal."""
    return equal(a, b)


def _flat(deps: Sequence[Deps], n_labels: int) -> Deps:
    """The elements of ``deps``, flattened and stacked in order."""
    if not deps:
        return empty((0,), n_labels)
    return concatenate([reshape(d, (d.size,)) for d in deps], 0)


def _unflat(flat: Deps, shapes: Sequence[Shape]) -> list[Deps]:
    pieces = split(flat, 0, [math.prod(s) for s in shapes])
    return [reshape(p, s) for p, s in zip(pieces, shapes, strict=True)]


def _pairs(matrix: sp.csr_array) -> tuple[np.ndarray, np.ndarray]:
    coo = matrix.tocoo()
    return coo.row.astype(np.int64), coo.col.astype(np.int64)


class _Body:
    """A loop body as its local pattern: a boolean matrix from its input elements to its output
    elements, found by one run of the body with a label per element of each *live* input.

    The inputs of ``body`` are ``(*fixed, *varying)``: ``fixed`` (the loop's constants) are the
    same at every iteration, the ``varying`` (carry, the step's ``xs``) change. Live are the
    varying inputs marked in ``live`` and the constants that depend on labels; the others depend
    on nothing at any iteration. The columns of :attr:`local` are the live inputs' elements
    (constants first), its rows the outputs' elements, all flattened and stacked in order.
    """

    def __init__(
        self,
        body: Program,
        fixed: Sequence[Deps],
        varying: Sequence[Shape],
        live: Sequence[bool],
        out_shapes: Sequence[Shape],
        n_labels: int,
    ) -> None:
        self.n_labels = n_labels
        self.live = list(live)
        self.out_shapes = [tuple(s) for s in out_shapes]
        fixed_live = [d for d in fixed if not d.is_empty]
        live_varying = [s for s, v in zip(varying, live, strict=True) if v]
        shapes = [*(d.shape for d in fixed_live), *live_varying]
        sizes = [math.prod(s) for s in shapes]
        n_local = sum(sizes)
        offsets = np.cumsum([0, *sizes])
        seeds = iter(
            from_labels(s, np.arange(size) + off, n_local)
            for s, size, off in zip(shapes, sizes, offsets[:-1], strict=True)
        )
        ins = [next(seeds) if not d.is_empty else empty(d.shape, n_local) for d in fixed]
        ins += [next(seeds) if v else empty(s, n_local) for s, v in zip(varying, live, strict=True)]
        outs = body(ins) if n_local else [empty(s, 0) for s in self.out_shapes]
        self.local = sp.csr_array(sp.vstack([d.matrix() for d in outs], format="csr"), dtype=bool)
        self.n_fixed = int(offsets[len(fixed_live)])
        self.fixed_in = _flat(fixed_live, n_labels)
        self.out_offsets = np.cumsum([0, *(math.prod(s) for s in self.out_shapes)])

    def block(self, out: slice, cols: slice) -> sp.csr_array:
        """The pattern from the varying live columns ``cols`` to the output elements ``out``."""
        lo, hi = cols.start + self.n_fixed, cols.stop + self.n_fixed
        return sp.csr_array(self.local[out][:, lo:hi])

    def __call__(self, varying: Sequence[Deps]) -> list[Deps]:
        """The outputs' dependency sets for these varying inputs (the dead ones are ignored)."""
        stacked = _flat([d for d, v in zip(varying, self.live, strict=True) if v], self.n_labels)
        n_out = int(self.out_offsets[-1])
        flat = union(
            compose((n_out,), *_pairs(self.local[:, : self.n_fixed]), self.fixed_in),
            compose((n_out,), *_pairs(self.local[:, self.n_fixed :]), stacked, n_in=stacked.size),
        )
        return _unflat(flat, self.out_shapes)

    def carry_graph(self, n_carry: int) -> tuple[np.ndarray, np.ndarray]:
        """The pattern of the first outputs (the new carry, ``n_carry`` elements) on the first
        varying inputs (the carry)."""
        return _pairs(self.block(slice(0, n_carry), slice(0, n_carry)))


def _closure(base: Deps, rows: np.ndarray, cols: np.ndarray) -> Deps:
    """Least fixpoint of ``c = base | R c`` on flat elements (``R``: ``c[rows]`` reads ``c[cols]``)."""
    n = base.size
    if base.is_empty or not len(rows):
        return base
    graph = sp.csr_array((np.ones(len(rows), bool), (rows, cols)), shape=(n, n))
    n_groups, group = csgraph.connected_components(graph, directed=True, connection="strong")
    sets = compose((n_groups,), group, np.arange(n), base)
    edges = np.unique(np.stack([group[rows], group[cols]]), axis=1)
    edges = edges[:, edges[0] != edges[1]]
    for _ in range(MAX_FIXPOINT_ROUNDS):
        grown = union(sets, compose((n_groups,), edges[0], edges[1], sets))
        if same(grown, sets):
            return gather(sets, group)
        changed, sets = np.diff(grown.matrix().indptr) != np.diff(sets.matrix().indptr), grown
    # Groups that reach none of the changed ones have settled; the others are widened.
    reverse = sp.csr_array(
        (np.ones(edges.shape[1] + int(changed.sum()), bool),
         (np.concatenate([edges[1], np.full(int(changed.sum()), n_groups)]),
          np.concatenate([edges[0], np.flatnonzero(changed)]))),
        shape=(n_groups + 1, n_groups + 1),
    )  # fmt: skip
    growing = np.zeros(n_groups + 1, bool)
    growing[csgraph.breadth_first_order(reverse, n_groups, return_predecessors=False)] = True
    n_parts, part = csgraph.connected_components(
        sp.csr_array((np.ones(edges.shape[1], bool), (edges[0], edges[1])), shape=(n_groups,) * 2),
        directed=True,
        connection="weak",
    )
    widened = gather(compose((n_parts,), part, np.arange(n_groups), sets), part)
    src = np.where(growing[:n_groups], np.arange(n_groups) + n_groups, np.arange(n_groups))
    return gather(index_map((n_groups,), [sets, widened], src), group)


def _fixpoint(step: _Body, carry: Sequence[Deps], xs: Sequence[Deps]) -> list[Deps]:
    """Least fixpoint of ``carry = init | step(carry, xs)[:n_carry]`` (``xs`` the same every
    iteration)."""
    if not carry:
        return []
    shapes = [c.shape for c in carry]
    outside = step([*(empty(s, c.n_labels) for s, c in zip(shapes, carry, strict=True)), *xs])
    base = _flat([union(c, o) for c, o in zip(carry, outside, strict=False)], carry[0].n_labels)
    return _unflat(_closure(base, *step.carry_graph(base.size)), shapes)


def fixpoint(body: Program, init: Sequence[Deps], consts: Sequence[Deps] = ()) -> list[Deps]:
    """Least fixpoint of ``carry = init | body(*consts, *carry)``: what a loop of any number of
    iterations can carry (widened where it has not settled in :data:`MAX_FIXPOINT_ROUNDS`)."""
    if not init:
        return []
    shapes = [c.shape for c in init]
    step = _Body(body, consts, shapes, [True] * len(init), shapes, init[0].n_labels)
    return _fixpoint(step, init, [])


def call_rule(op: Op) -> list[Deps]:
    """A nested program applied to the inputs (params ``program``)."""
    program: Program = op.params["program"]
    return program(op.ins)


def cond_rule(op: Op) -> list[Deps]:
    """Any of the ``branches`` (programs of the operands, ``op.ins[1:]``) may run: their union."""
    branches: Sequence[Program] = op.params["branches"]
    outs = [branch(op.ins[1:]) for branch in branches]
    return [union(*parts) for parts in zip(*outs, strict=True)]


def while_rule(op: Op) -> list[Deps]:
    """A loop: inputs ``(*cond_consts, *body_consts, *carry)``; params ``body`` (a program of
    ``(*body_consts, *carry)``), ``n_cond`` and ``n_body`` (the counts of constants). Its trip
    count is unknown: the least fixpoint."""
    p = op.params
    consts = list(op.ins[p["n_cond"] : p["n_cond"] + p["n_body"]])
    return fixpoint(p["body"], op.ins[p["n_cond"] + p["n_body"] :], consts)


def _along_steps(sizes: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """For each element of one step's slices (of ``sizes``, stacked): its position at step 0 in
    the stacked, flattened arrays of ``length`` steps, and its stride from one step to the next."""
    offsets = np.cumsum([0, *sizes])
    which = np.repeat(np.arange(len(sizes)), sizes)
    within = np.arange(offsets[-1]) - offsets[which]
    return length * offsets[which] + within, np.asarray(sizes, np.int64)[which]


def _canonical(m: sp.csr_array) -> sp.csr_array:
    m = sp.csr_array(m, dtype=bool)
    m.sum_duplicates()
    m.sort_indices()
    return m


def _unrolled(
    step: _Body,
    n_c: int,
    y_layout: tuple[np.ndarray, np.ndarray],
    x_layout: tuple[np.ndarray, np.ndarray],
    order: np.ndarray,
    init: np.ndarray,
) -> tuple[int, np.ndarray, np.ndarray]:
    """The local pattern of the first ``T`` steps of a scan (steps in ``order``, the position
    of each step's slice): ``(T, rows, cols)``.

    ``T`` is the number of steps whose pattern fits in :data:`SCAN_ENTRY_BUDGET` entries. Rows:
    the carry after ``T`` steps (``n_c``), then the ``ys`` (stacked, flattened, laid out as
    ``y_layout`` says: :func:`_along_steps`); columns: the live constants (``n_k``), the
    initial carry (``n_c``; only its elements ``init`` are followed: the others depend on no
    label), then the live ``xs`` (stacked, flattened, laid out as ``x_layout``).
    With ``A``, ``C`` the body's patterns from the carry to the new carry and to ``y``, the
    states ``Z_t = A Z_{t-1} | K`` (columns: the constants, the initial carry, the ``x`` of
    ``t`` steps back) give every step's carry and ``W_t = C Z_t`` its ``y``. The states become
    periodic (a shift, a rotation) or constant (a local recurrence that has spread): each
    distinct state costs one sparse product of local patterns, whatever the number of steps.
    """
    length, n_y = len(order), len(y_layout[0])
    n_k = step.n_fixed
    n_x = step.local.shape[1] - n_k - n_c
    lagged = n_k + n_c  # columns from here on: an x (of the current step, in Z_0 and W_0)
    carry, ys = slice(0, n_c), slice(n_c, n_c + n_y)
    a = step.block(carry, slice(0, n_c))
    c = step.block(ys, slice(0, n_c))
    b_rows, b_cols = _pairs(step.block(carry, slice(n_c, n_c + n_x)))
    k_rows, k_cols = _pairs(sp.csr_array(step.local[carry][:, :n_k]))
    ky_rows, ky_cols = _pairs(sp.csr_array(step.local[ys][:, :n_k]))
    dy_rows, dy_cols = _pairs(step.block(ys, slice(n_c, n_c + n_x)))
    fixed_y = len(ky_rows) + len(dy_rows)

    state = _canonical(
        sp.csr_array(
            (np.ones(len(init) + len(b_rows), bool),
             (np.concatenate([init, b_rows]),
              np.concatenate([n_k + init, lagged + b_cols]))),
            shape=(n_c, lagged + n_x),
        )
    )  # fmt: skip
    const = sp.csr_array((np.ones(len(k_rows), bool), (k_rows, k_cols)), shape=state.shape)
    states: list[tuple[np.ndarray, np.ndarray]] = []  # the pairs of the distinct Z_t
    outs: list[tuple[np.ndarray, np.ndarray]] = []  # and of their W_t
    seen: dict[tuple[bytes, bytes], int] = {}
    key = (state.indptr.tobytes(), state.indices.tobytes())
    spent = lags = 0  # entries of the steps so far (about), of the lags every later y has
    while key not in seen and len(states) <= length and spent <= SCAN_ENTRY_BUDGET:
        seen[key] = len(states)
        states.append(_pairs(state))
        outs.append(_pairs(sp.csr_array(c @ state)))
        spent += len(outs[-1][0]) + len(states[-1][0]) + lags + fixed_y
        lags += int((outs[-1][1] >= lagged).sum())
        state = _canonical(sp.csr_array(a @ state) + const)
        key = (state.indptr.tobytes(), state.indices.tobytes())
    # Z_t = Z_{t - period} from ``first`` on; without a repeat, only the states made are known.
    first = seen.get(key, len(states))
    horizon = length if key in seen else min(length, len(states) - 1)
    t = np.arange(horizon + 1)
    at = np.where(t < len(states), t, first + (t - first) % max(len(states) - first, 1))

    def own_and_lag(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        lag = np.array([int((cols >= lagged).sum()) for _, cols in pairs], np.int64)
        return np.array([len(cols) for _, cols in pairs], np.int64)[at] - lag[at], lag[at]

    own_y, lag_y = own_and_lag(outs)
    own_z, lag_z = own_and_lag(states)
    # Entries of T steps: every y_t (its own, K_y, D_y, the lags of the steps before), Z_T's.
    per_y = own_y[:-1] + fixed_y + np.concatenate([[0], np.cumsum(lag_y[:-2])])
    total = np.concatenate([[0], np.cumsum(per_y)]) + own_z
    total += np.concatenate([[0], np.cumsum(lag_z[:-1])])
    steps = int(np.flatnonzero(total <= SCAN_ENTRY_BUDGET).max(initial=0))

    y_start, y_stride = y_layout
    x_start, x_stride = x_layout

    def y_rows(r: np.ndarray, at_steps: np.ndarray) -> np.ndarray:
        return n_c + y_start[r][None, :] + order[at_steps][:, None] * y_stride[r][None, :]

    def x_cols(c_: np.ndarray, at_steps: np.ndarray) -> np.ndarray:
        return lagged + x_start[c_][None, :] + order[at_steps][:, None] * x_stride[c_][None, :]

    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    done = np.arange(steps)
    for t_ in range(steps):
        r, c_ = outs[at[t_]]
        own = c_ < lagged
        pairs.append((y_rows(r[own], done[t_ : t_ + 1]), c_[own][None, :]))
        later = done[t_ + 1 :]  # their y reads the x of t_ + 1 steps back through W_t_
        pairs.append((y_rows(r[~own], later), x_cols(c_[~own] - lagged, later - 1 - t_)))
        zr, zc = states[at[t_]]
        back = zc >= lagged  # the final carry reads the x of step steps - 1 - t_ through Z_t_
        pairs.append((zr[back][None, :], x_cols(zc[back] - lagged, done[steps - 1 - t_ :][:1])))
    zr, zc = states[at[steps]]
    pairs.append((zr[zc < lagged], zc[zc < lagged]))
    pairs.append((y_rows(ky_rows, done), np.broadcast_to(ky_cols, (steps, len(ky_cols)))))
    pairs.append((y_rows(dy_rows, done), x_cols(dy_cols, done)))
    both = [np.broadcast_arrays(r, c_) for r, c_ in pairs]
    return (
        steps,
        np.concatenate([r.ravel() for r, _ in both]),
        np.concatenate([c_.ravel() for _, c_ in both]),
    )


def scan_rule(op: Op) -> list[Deps]:
    """A scan: inputs ``(*consts, *carry, *xs)``, outputs ``(*carry, *ys)``.

    Params: ``body`` (a program of ``(*consts, *carry, *x)`` to ``(*carry, *y)``), ``n_consts``,
    ``n_carry``, ``length``, ``reverse``. Exact: the body's local pattern unrolled over the
    steps (:func:`_unrolled`), applied to the inputs in one sparse product; steps past
    :data:`SCAN_ENTRY_BUDGET` entries end in a fixpoint with their ``xs`` merged (sound).
    """
    p = op.params
    n_consts, n_carry, length = p["n_consts"], p["n_carry"], p["length"]
    consts = list(op.ins[:n_consts])
    init = list(op.ins[n_consts : n_consts + n_carry])
    xs = op.ins[n_consts + n_carry :]
    c_shapes = [c.shape for c in init]
    y_shapes = [s[1:] for s in op.out_shapes[n_carry:]]
    live_xs = [not x.is_empty for x in xs]
    step = _Body(
        p["body"],
        consts,
        [*c_shapes, *(x.shape[1:] for x in xs)],
        [True] * n_carry + live_xs,
        [*c_shapes, *y_shapes],
        op.n_labels,
    )
    n_c = sum(math.prod(s) for s in c_shapes)
    y_layout = _along_steps([math.prod(s) for s in y_shapes], length)
    x_layout = _along_steps(
        [math.prod(x.shape[1:]) for x, live in zip(xs, live_xs, strict=True) if live], length
    )
    order = np.arange(length)[::-1] if p["reverse"] else np.arange(length)
    followed = np.flatnonzero(np.diff(_flat(init, op.n_labels).matrix().indptr))
    steps, rows, cols = _unrolled(step, n_c, y_layout, x_layout, order, followed)
    live_in = [*(d for d in consts if not d.is_empty), *init, *(x for x in xs if not x.is_empty)]
    flat = compose((n_c + length * len(y_layout[0]),), rows, cols, _flat(live_in, op.n_labels))
    outs = _unflat(flat, [*c_shapes, *op.out_shapes[n_carry:]])
    carry, ys = outs[:n_carry], outs[n_carry:]
    if steps < length:  # the remaining steps: one fixpoint, their xs merged
        rest = order[steps:]
        merged = [reduce(gather(x, arange(x.shape)[rest]), [0]) for x in xs]
        carry = _fixpoint(step, carry, merged)
        later = np.isin(np.arange(length), rest)
        for k, y in enumerate(step([*carry, *merged])[n_carry:]):
            src = np.where(later.reshape(-1, *[1] * len(y.shape)), arange(y.shape), -1)
            ys[k] = union(ys[k], gather(y, src))
    return [*carry, *ys]


def custom_rule(op: Op) -> list[Deps]:
    """A function with a custom derivative: its ``primal`` program and its derivative rule
    (``derive``: the outputs' dependency sets through it, ``None`` if it cannot be followed:
    then the dense fallback)."""
    primal = op.params["primal"](op.ins)
    derived = op.params["derive"]()
    if derived is None:
        return op.dense()
    return [union(a, b) for a, b in zip(primal, derived, strict=True)]
