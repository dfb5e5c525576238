"""What a rule sees of one operation, and the parts every interpreter shares.

A rule is one typed function, ``Rule = Callable[[Op], Sequence[Deps]]``: from an :class:`Op` (the
dependency sets of the inputs, the output shapes, the static parameters, the constant values of
the inputs that do not depend on the labels) to the dependency sets of every output. A backend's
interpreter is a table from its operation names to ``(rule, parameter extractor)`` and a walker of
its program; what the walkers share lives here: constant folding (:class:`Folded`, with its
cycle guard and :data:`FOLD_LIMIT`), the fallback bookkeeping and its warning
(:func:`warn_fallbacks`), and the rules users register (:class:`Registry`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from ..._errors import DenseFallbackWarning, RuleError, warn_at_caller
from ._deps import Deps, Shape, dense, empty

__all__ = [
    "FOLD_LIMIT",
    "Folded",
    "Op",
    "Registry",
    "Rule",
    "RuleError",
    "dense_rule",
    "foldable",
    "generation",
    "warn_fallbacks",
]

FOLD_LIMIT = 1 << 22
"""Constant folding (of gather indices, masks, ...) is limited to results of this many elements."""


def _unknown(i: int) -> np.ndarray | None:
    return None


@dataclass(frozen=True, eq=False)
class Op:
    """One operation, as a rule sees it.

    Attributes:
        name: the operation's name (a JAX primitive, an ATen operation); the fallback names it.
        ins: the dependency sets of the inputs.
        out_shapes: the shape of every output.
        n_labels: number of labels (columns of every dependency matrix).
        params: static parameters (axes, strides, ...), as the rule's table entry extracts them.
        values: the constant value of input ``i`` (folded when first asked), ``None`` if unknown;
            read it through :meth:`value`.
        fallbacks: where the names of operations handled by the dense fallback are recorded.
        wanted: which outputs need dependency sets (default: all); the others (integer
            results: indices, seeds) may be returned empty; read it through :meth:`wants`.
    """

    name: str
    ins: Sequence[Deps]
    out_shapes: Sequence[Shape]
    n_labels: int
    params: Mapping[str, Any] = field(default_factory=dict)
    values: Callable[[int], np.ndarray | None] = _unknown
    fallbacks: set[str] = field(default_factory=set)
    wanted: Sequence[bool] | None = None

    def wants(self, k: int) -> bool:
        """Whether output ``k`` needs its dependency sets (it has a derivative)."""
        return self.wanted is None or self.wanted[k]

    def value(self, i: int) -> np.ndarray | None:
        """The value of input ``i`` if it is a constant known at detection time, else ``None``.

        An input that depends on the labels has no known value.
        """
        if not self.ins[i].is_empty:
            return None
        return self.values(i)

    def dense(self) -> list[Deps]:
        """The fallback: every output depends on everything any input depends on (recorded)."""
        self.fallbacks.add(self.name)
        return [
            dense(s, *self.ins) if self.wants(k) else self.empty(k)
            for k, s in enumerate(self.out_shapes)
        ]

    def empty(self, k: int = 0) -> Deps:
        """Empty dependency sets of output ``k`` (an output without derivative)."""
        return empty(self.out_shapes[k], self.n_labels)

    def replace(self, **changes: Any) -> Op:
        """A copy with some fields changed (``ins``, ``out_shapes``, ``params``, ...)."""
        return dataclasses.replace(self, **changes)


Rule = Callable[[Op], Sequence[Deps]]
"""A sparsity rule: the dependency sets of every output of an operation, in order."""


def dense_rule(op: Op) -> list[Deps]:
    """The fallback of an operation without a rule (see :meth:`Op.dense`)."""
    return op.dense()


K = TypeVar("K", bound=Hashable)


class Folded(Generic[K]):
    """Constant values of a program's variables, folded when first asked.

    ``fold(key)`` computes a variable's value from those of its producer's inputs (asking this
    object again); a variable being folded reads as unknown meanwhile, which breaks cycles.
    Known values (inputs, constants) are given with :meth:`set`.
    """

    def __init__(self, fold: Callable[[K], Any]) -> None:
        self._fold = fold
        self._known: dict[K, Any] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._known

    def set(self, key: K, value: Any) -> None:
        self._known[key] = value

    def get(self, key: K) -> Any:
        if key in self._known:
            return self._known[key]
        self._known[key] = None  # guards against cycles while folding
        value = self._fold(key)
        self._known[key] = value
        return value


def foldable(sizes: Iterable[int]) -> bool:
    """Whether results of these sizes are small enough to fold (:data:`FOLD_LIMIT`)."""
    return all(s <= FOLD_LIMIT for s in sizes)


def warn_fallbacks(fallbacks: Iterable[str], *, kind: str) -> None:
    """Emit one :class:`~divjac.DenseFallbackWarning` naming every operation without a rule, at
    the caller's line (``kind`` names the operations: ``"JAX primitive"``)."""
    names = ", ".join(sorted(fallbacks))
    if names:
        noun = kind.split()[-1]
        warn_at_caller(
            f"divjac has no sparsity rule for the {kind}(s) {names}; their outputs were assumed "
            "to depend on all of their inputs. Results stay correct, but the pattern may be "
            "denser than the truth (and a batch may look coupled). Please report the "
            f"{noun} name to the divjac issue tracker, or give it a rule with register_rule.",
            DenseFallbackWarning,
        )


_GENERATION = itertools.count(1)
_current = 0


def generation() -> int:
    """A number that changes whenever a rule is registered (detections cached before it are
    stale: they are keyed on it)."""
    return _current


class Registry:
    """The rules users register for operations of their own, by operation name.

    Args:
        kind: what the names are (``"JAX primitive"``), for error messages.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._rules: dict[str, Rule] = {}

    def register(self, name: str, rule: Rule) -> None:
        """Use ``rule`` for the operation ``name`` from now on (replacing a built-in one)."""
        global _current
        if not callable(rule):
            raise RuleError(
                f"register_rule: rule must be a callable Op -> list[Deps], got {type(rule)!r}"
            )
        self._rules[name] = rule
        _current = next(_GENERATION)

    def get(self, name: str) -> Rule | None:
        """The rule registered for ``name``, checked (:meth:`apply`) when it runs."""
        rule = self._rules.get(name)
        if rule is None:
            return None
        return lambda op: self.apply(rule, op)

    def apply(self, rule: Rule, op: Op) -> list[Deps]:
        """Run a registered rule, checking that it returned one fitting result per output."""
        result: Any = rule(op)
        listed = isinstance(result, list | tuple)
        out: list[Any] = list(result) if listed else [result]
        shapes = [tuple(s) for s in op.out_shapes]
        if (
            not listed
            or len(out) != len(shapes)
            or not all(
                isinstance(d, Deps) and d.shape == s and d.n_labels == op.n_labels
                for d, s in zip(out, shapes, strict=False)
            )
        ):
            got = [d.shape if isinstance(d, Deps) else type(d).__name__ for d in out]
            said = str(got) if listed else f"{got[0]} (not a list)"
            raise RuleError(
                f"the sparsity rule registered for the {self.kind} {op.name} returned {said}; it "
                f"must return one Deps per output, of the shapes {shapes} (with op.n_labels "
                "labels): build them from op.ins with the functions of divjac.rules."
            )
        return out
