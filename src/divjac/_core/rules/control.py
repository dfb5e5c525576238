"""Control flow: nested programs, branches and loops (least fixpoints with one round limit).

A backend gives these rules its nested programs as functions from input to output dependency
sets (params ``program``, ``branches``, ``body``), so the rules never see a jaxpr or a graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._deps import Deps, dense, equal, union
from ._op import Op
from .movement import broadcast_to, concatenate, reshape, slice_
from .reductions import reduce

__all__ = [
    "MAX_FIXPOINT_ROUNDS",
    "UNROLL_SCAN",
    "call_rule",
    "cond_rule",
    "custom_rule",
    "fixpoint",
    "same",
    "scan_rule",
    "while_rule",
]

MAX_FIXPOINT_ROUNDS = 64
"""Loops: a fixpoint on the carried dependency sets, conservative after this many rounds."""

UNROLL_SCAN = 16
"""Scans of at most this length are unrolled (exact per-iteration patterns)."""

Program = Callable[[Sequence[Deps]], list[Deps]]


def same(a: Deps, b: Deps) -> bool:
    """Whether two dependency sets are equal."""
    return equal(a, b)


def fixpoint(body: Program, init: Sequence[Deps], extra: Sequence[Deps]) -> list[Deps]:
    """Least fixpoint of ``carry = init | body(carry)``; conservative (every carry depends on
    everything, ``extra`` included) if it does not settle in :data:`MAX_FIXPOINT_ROUNDS`."""
    carry = list(init)
    for _ in range(MAX_FIXPOINT_ROUNDS):
        new = [union(c, n) for c, n in zip(carry, body(carry), strict=True)]
        if all(same(a, b) for a, b in zip(carry, new, strict=True)):
            return new
        carry = new
    return [dense(c.shape, *carry, *extra) for c in carry]


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
    ``(*body_consts, *carry)``), ``n_cond`` and ``n_body`` (the counts of constants)."""
    p = op.params
    body: Program = p["body"]
    consts = list(op.ins[p["n_cond"] : p["n_cond"] + p["n_body"]])
    init = op.ins[p["n_cond"] + p["n_body"] :]
    return fixpoint(lambda carry: body([*consts, *carry]), init, consts)


def scan_rule(op: Op) -> list[Deps]:
    """A scan: inputs ``(*consts, *carry, *xs)``, outputs ``(*carry, *ys)``.

    Params: ``body`` (a program of ``(*consts, *carry, *x)`` to ``(*carry, *y)``), ``n_consts``,
    ``n_carry``, ``length``, ``reverse``. Unrolled up to :data:`UNROLL_SCAN` steps, else a
    fixpoint with every step's ``x`` the union over all steps.
    """
    p = op.params
    body: Program = p["body"]
    n_consts, n_carry, length = p["n_consts"], p["n_carry"], p["length"]
    consts = list(op.ins[:n_consts])
    init = list(op.ins[n_consts : n_consts + n_carry])
    xs = op.ins[n_consts + n_carry :]
    n_ys = len(op.out_shapes) - n_carry
    if length <= UNROLL_SCAN:
        carry: list[Deps] = init
        steps: list[list[Deps]] = []
        for i in range(length - 1, -1, -1) if p["reverse"] else range(length):
            x_i = [
                reshape(
                    slice_(x, [i] + [0] * (len(x.shape) - 1), [i + 1, *x.shape[1:]]), x.shape[1:]
                )
                for x in xs
            ]
            out = body([*consts, *carry, *x_i])
            carry = out[:n_carry]
            steps.append(out[n_carry:])
        if p["reverse"]:
            steps = steps[::-1]
        stacked = [
            concatenate([reshape(step[k], (1, *step[k].shape)) for step in steps], 0)
            for k in range(n_ys)
        ]
        return [*carry, *stacked]
    x_any = [reduce(x, [0]) for x in xs]
    carry = fixpoint(lambda c: body([*consts, *c, *x_any])[:n_carry], init, [*consts, *x_any])
    ys = body([*consts, *carry, *x_any])[n_carry:]
    return [*carry, *(broadcast_to(y, s) for y, s in zip(ys, op.out_shapes[n_carry:], strict=True))]


def custom_rule(op: Op) -> list[Deps]:
    """A function with a custom derivative: its ``primal`` program and its derivative rule
    (``derive``: the outputs' dependency sets through it, ``None`` if it cannot be followed:
    then the dense fallback)."""
    primal = op.params["primal"](op.ins)
    derived = op.params["derive"]()
    if derived is None:
        return op.dense()
    return [union(a, b) for a, b in zip(primal, derived, strict=True)]
