"""Reading jaxprs for sparsity detection: shapes, concrete values, the variables of one scope."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from .._core import rules as D
from .._core.rules import Deps
from .._errors import InternalError
from . import _compat

__all__ = [
    "Runner",
    "Scope",
    "concrete",
    "evaluate",
    "is_inexact",
    "shape",
    "single_eqn_fun",
]


def is_inexact(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def shape(aval: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(aval, "shape", ()))


def concrete(value: Any) -> np.ndarray | None:
    """A NumPy copy of a concrete value, ``None`` for tracers and opaque values."""
    if isinstance(value, _compat.Tracer):
        return None
    try:
        return np.asarray(value)
    except Exception:
        return None


def single_eqn_fun(eqn: Any) -> tuple[Callable[..., list[Any]], list[Any]]:
    """The equation as a function of its variable inputs (literals stay inside)."""
    var_in = [v for v in eqn.invars if isinstance(v, _compat.Var)]
    params = _compat.bind_params(eqn)

    def fn(*args: Any) -> list[Any]:
        it = iter(args)
        full = [next(it) if isinstance(v, _compat.Var) else v.val for v in eqn.invars]
        out = eqn.primitive.bind(*full, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    return fn, var_in


def evaluate(eqn: Any, inputs: Sequence[Any]) -> list[np.ndarray] | None:
    """Evaluate one equation on concrete values (outside any surrounding trace)."""
    fn, _ = single_eqn_fun(eqn)
    values = [x for v, x in zip(eqn.invars, inputs, strict=True) if isinstance(v, _compat.Var)]
    try:
        with jax.ensure_compile_time_eval():
            return [np.asarray(o) for o in fn(*values)]
    except Exception:
        return None


class Runner(Protocol):
    """What the table's extractors and the derived rules use of the interpreter."""

    n_labels: int
    fallbacks: set[str]
    has_custom_vjp: bool
    read_consts: set[int]
    deriving: set[tuple[str, int]]

    def run(
        self,
        jaxpr: Any,
        in_deps: Sequence[Deps],
        consts: Sequence[Any] | None = None,
        in_values: Sequence[np.ndarray | None] | None = None,
        *,
        captured: bool = False,
    ) -> list[Deps]: ...

    def local(self, n_labels: int) -> Runner: ...


class Scope:
    """Dependency sets and known constant values of the variables of one jaxpr.

    Values are folded lazily (:class:`~divjac._core.rules.Folded`): a variable that does not
    depend on the labels gets the value of its equation on its inputs' values.
    """

    def __init__(self, interp: Runner, jaxpr: _compat.Jaxpr) -> None:
        self.interp = interp
        self.deps: dict[Any, Deps] = {}
        # Variables that depended on the labels and whose dependency sets were released
        # after their last use (:meth:`release`): they never fold, and cannot be read.
        self.released: set[Any] = set()
        self.values: D.Folded[Any] = D.Folded(self._fold)
        self.producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
        # Captured integer/boolean constants of the traced program, by variable: (position
        # among its constants, value); read lazily, and each read is recorded (the cache key).
        self.captured: dict[Any, tuple[int, Any]] = {}

    def read(self, var: Any) -> Deps:
        if isinstance(var, _compat.Literal):
            return D.empty(shape(var.aval), self.interp.n_labels)
        found = self.deps.get(var)
        if found is None and var in self.released:
            raise InternalError(f"the dependency sets of {var} were read after their last use")
        return found if found is not None else D.empty(shape(var.aval), self.interp.n_labels)

    def release(self, var: Any) -> None:
        """Drop the dependency sets of ``var`` (no equation left reads them)."""
        if self.deps.pop(var, None) is not None:
            self.released.add(var)

    def value(self, var: Any) -> np.ndarray | None:
        """The constant value of ``var`` if it is known at trace time (folded lazily)."""
        if isinstance(var, _compat.Literal):
            return concrete(var.val)
        return self.values.get(var)

    def _fold(self, var: Any) -> np.ndarray | None:
        if var in self.captured:
            position, const = self.captured[var]
            self.interp.read_consts.add(position)
            return concrete(const)
        eqn = self.producers.get(var)
        if eqn is None or var in self.released or not self.read(var).is_empty or eqn.effects:
            return None
        if not D.foldable(math.prod(shape(v.aval)) for v in eqn.outvars):
            return None
        inputs = []
        for v in eqn.invars:
            val = self.value(v)
            if val is None:
                return None
            inputs.append(val)
        outs = evaluate(eqn, inputs)
        if outs is None:
            return None
        for v, out in zip(eqn.outvars, outs, strict=True):
            if v is not var:
                self.values.set(v, out)
        return outs[eqn.outvars.index(var)]
