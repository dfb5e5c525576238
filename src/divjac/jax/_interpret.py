"""Sparsity detection for JAX: abstract interpretation of a jaxpr over dependency sets.

The walker of this module follows a jaxpr equation by equation; each primitive is one lookup in
the table of :mod:`divjac.jax._table` (a rule of :mod:`divjac._core.rules` and its parameter
extractor; the rules users register are entries of it). Nested programs (``jit``, ``remat``,
``custom_jvp`` / ``custom_vjp``, ``cond``, ``while``, ``scan``) are followed. A primitive
without a rule never raises and never under-approximates: its pattern is derived from its own
JVP or VJP rule (:mod:`divjac.jax._derive`), else its outputs depend on everything its inputs
depend on, with a :class:`~divjac.DenseFallbackWarning` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core import rules as D
from .._core.detection import EntryLimit
from .._core.rules import Deps, Op
from . import _compat
from ._derive import per_slice, via_jvp, via_vjp
from ._jaxpr import Scope, concrete, is_inexact, shape
from ._table import TABLE

__all__ = ["Interpreter", "last_uses"]


def last_uses(jaxpr: Any) -> list[list[Any]]:
    """Per equation, the variables no later equation reads (its inputs read for the last time,
    its outputs never read), the program's outputs excepted: their dependency sets are
    released once it ran, so that a detection holds only what is still to be read."""
    kept = {v for v in jaxpr.outvars if not isinstance(v, _compat.Literal)}
    last: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        last.update((v, i) for v in eqn.invars if not isinstance(v, _compat.Literal))
        last.update((v, i) for v in eqn.outvars)
    done: list[list[Any]] = [[] for _ in jaxpr.eqns]
    for var, i in last.items():
        if var not in kept:
            done[i].append(var)
    return done


def live_equations(jaxpr: Any) -> list[bool]:
    """Per equation, whether the program's outputs read what it makes. Dead equations (the
    value of a loss whose gradient is the function) are not propagated: their dependency sets
    would be paid for, and a dense one would end a screening that the output never sees."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, _compat.Literal)}
    live = [False] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(v in needed for v in eqn.outvars):
            live[i] = True
            needed.update(v for v in eqn.invars if not isinstance(v, _compat.Literal))
    return live


class Interpreter:
    """Propagates dependency sets through jaxprs.

    Args:
        n_labels: number of labels (columns of every dependency matrix).
        limit: abort with :class:`~divjac._core.detection.TooDense` once an intermediate is
            past it (used to skip sparse detection where it cannot pay off).

    Attributes:
        fallbacks: names of primitives that had no rule (handled as dense).
        has_custom_vjp: whether a ``custom_vjp`` function was met (forward mode cannot
            differentiate it; the caller should prefer reverse mode).
        read_consts: positions of the constants of the outermost program (``run(...,
            captured=True)``) whose values detection read: the result depends on them.
        deriving: the equations whose pattern is being derived from their own derivative
            rules (a rule that applies its own primitive again is abandoned).
    """

    def __init__(self, n_labels: int, *, limit: EntryLimit | None = None) -> None:
        self.n_labels = n_labels
        self.limit = limit
        self.fallbacks: set[str] = set()
        self.has_custom_vjp = False
        self.read_consts: set[int] = set()
        self.deriving: set[tuple[str, int]] = set()

    def local(self, n_labels: int) -> Interpreter:
        """An interpreter of other labels that shares what is being derived."""
        local = Interpreter(n_labels)
        local.deriving = self.deriving
        return local

    def run(
        self,
        jaxpr: Any,
        in_deps: Sequence[Deps],
        consts: Sequence[Any] | None = None,
        in_values: Sequence[np.ndarray | None] | None = None,
        *,
        captured: bool = False,
    ) -> list[Deps]:
        """Dependency sets of the outputs of ``jaxpr`` given those of its inputs.

        With ``captured``, ``jaxpr`` is the traced program and its constants are what the
        function captured: the reads of their values are recorded in :attr:`read_consts`.
        """
        jaxpr, closed_consts = _compat.open_jaxpr(jaxpr)
        consts = closed_consts if consts is None else list(consts)
        scope = Scope(self, jaxpr)
        for position, (var, const) in enumerate(zip(jaxpr.constvars, consts, strict=True)):
            if isinstance(const, Deps):
                scope.deps[var] = const
            elif is_inexact(var.aval):
                pass  # captured floating-point arrays are weights: never read
            elif captured:  # indices, masks: read when a rule needs them, and recorded
                scope.captured[var] = (position, const)
            else:
                scope.values.set(var, concrete(const))
        for i, (var, dep) in enumerate(zip(jaxpr.invars, in_deps, strict=True)):
            scope.deps[var] = dep
            if in_values is not None and in_values[i] is not None:
                scope.values.set(var, in_values[i])
        live = live_equations(jaxpr)
        for eqn, done, alive in zip(jaxpr.eqns, last_uses(jaxpr), live, strict=True):
            ins = [scope.read(v) for v in eqn.invars] if alive else []
            # (constants and parameters: nothing depends on the labels)
            if alive and (
                not all(d.is_empty for d in ins) or eqn.primitive.name in ("while", "scan")
            ):
                outs = self._eqn(scope, eqn, ins)
                for var, dep in zip(eqn.outvars, outs, strict=True):
                    if is_inexact(var.aval) and not dep.is_empty:
                        if self.limit is not None:
                            self.limit.check(dep, eqn.primitive.name)
                        scope.deps[var] = dep
            del ins
            for var in done:
                scope.release(var)
        return [scope.read(v) for v in jaxpr.outvars]

    def warn_fallbacks(self) -> None:
        """Emit one :class:`DenseFallbackWarning` naming every primitive without a rule."""
        D.warn_fallbacks(self.fallbacks, kind="JAX primitive")

    def _eqn(self, scope: Scope, eqn: Any, ins: list[Deps]) -> list[Deps]:
        name = eqn.primitive.name
        op = Op(
            name,
            ins,
            [shape(v.aval) for v in eqn.outvars],
            self.n_labels,
            params=eqn.params,
            values=lambda i: scope.value(eqn.invars[i]),
            fallbacks=self.fallbacks,
        )
        entry = TABLE.get(name)
        if entry is not None:
            rule, extract = entry
            return list(rule(op.replace(params=extract(self, scope, eqn))))
        # No rule: the primitive's own derivative rules, traced, give a precise pattern.
        derived = via_jvp(self, scope, eqn)
        if derived is None:
            derived = via_vjp(self, scope, eqn)
        if derived is not None:
            return derived
        self.fallbacks.add(name)
        sliced = per_slice(scope, eqn)
        return sliced if sliced is not None else op.dense()
