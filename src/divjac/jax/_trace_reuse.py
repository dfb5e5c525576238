"""What an eager call's trace of the caller's function depends on, checked without tracing.

An eager transform traces ``f`` at every call so that it sees ``f``'s current closures and
weights (:mod:`divjac.jax._eager`). Where ``f`` is cheap, that trace is most of the call
(``bench_jax_eager`` measures it on FFJORD's ODE function). :func:`state` walks
the Python state ``f``'s code can reach (its closure, defaults and the globals and module
attributes its code names, recursively through the user's own functions) and returns it as a
comparable value: while it is unchanged, along with the arguments' structure and types and
JAX's tracing configuration, a new trace would give the same program, so the last one is
reused.

The walk knows a few kinds of values and refuses the rest (``None``: the call traces ``f``
again, as without this check):

- Python scalars, strings, ``None`` and ``Ellipsis``: by type and value;
- JAX arrays (immutable): by identity; NumPy arrays (mutable) by their bytes, up to 1 MiB;
- tuples, lists, dicts, sets: by their contents (so an entry replaced in place is seen);
- the user's functions (``def``, ``lambda``): by their code object, defaults, closure cells
  and the globals their code (and nested code) names, recursively; ``functools.partial`` by
  its function and arguments; a bound method by its function and its ``self``;
- modules, functions and classes of libraries whose functions are pure given their arguments
  (:data:`~divjac._core.user_state.LIBRARIES` and divjac, less
  :data:`~divjac._core.user_state.IMPURE`: JAX, NumPy except ``numpy.random``, SciPy,
  ``math``, Equinox, Flax, Optax, divjac, the standard library's functional modules, ...): by
  identity; the user's own modules by the attributes the code names;
- a tracer of an outer transformation, an object of any other type (a Flax ``nnx`` module, an
  Equinox module, a random-number generator), a class of the user's: unknown.

So ``f`` reading a global counter, a NumPy random generator or a mutable object re-traces at
every call, and a changed closure or global is always seen. As under ``jax.jit``, Python side
effects of ``f`` (a ``print``) run when it is traced, not at every call.
"""

from __future__ import annotations

import builtins
import functools
import types
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from .._core.user_state import code_names, library_definition, pure_module
from . import _compat

__all__ = ["state"]

_LIMIT = 4096
"""Values walked at most; beyond it the state is unknown."""

_SCALARS = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))


class _Unknown(Exception):
    """The state reaches a value this walk cannot vouch for."""


def state(f: Any) -> tuple[Hashable, list[jax.Array]] | None:
    """A value equal between two calls only if tracing ``f`` (at the same argument structure
    and types) would give the same program, and the JAX arrays it names by identity (the
    caller keeps them alive while it keeps the value, so that no other array takes their
    ``id``); ``None`` where it cannot tell."""
    walk = _Walk()
    try:
        return (_trace_context(), walk.value(f)), walk.arrays
    except (_Unknown, RecursionError):
        return None


def _trace_context() -> Hashable:
    """JAX's configuration that tracing depends on (64-bit mode, dtype promotion, default
    device, precision), as ``jax.jit`` keys its own cache on it."""
    try:
        return _compat.trace_context()
    except ImportError as error:  # pragma: no cover - a JAX without it: always re-trace
        raise _Unknown from error


class _Walk:
    def __init__(self) -> None:
        self.seen: dict[int, int] = {}  # id -> position, for cycles and shared values
        self.arrays: list[jax.Array] = []
        self.count = 0

    def value(self, v: Any) -> Hashable:
        self.count += 1
        if self.count > _LIMIT:
            raise _Unknown
        if isinstance(v, _SCALARS):
            return (type(v), v.hex() if isinstance(v, float) else v)
        if isinstance(v, _compat.Tracer):
            raise _Unknown
        if isinstance(v, jax.Array):
            self.arrays.append(v)
            return ("array", id(v))
        key = id(v)
        if key in self.seen:
            return ("seen", self.seen[key])
        self.seen[key] = len(self.seen)
        return self._compound(v)

    def _compound(self, v: Any) -> Hashable:
        if isinstance(v, np.ndarray):
            if v.nbytes > 2**20 or v.dtype == object:
                raise _Unknown
            return ("numpy", v.shape, v.dtype.str, v.tobytes())
        if isinstance(v, np.generic):
            return ("numpy scalar", v.dtype.str, v.tobytes())
        if type(v) in (tuple, list):
            return (type(v), tuple(self.value(x) for x in v))
        if type(v) in (set, frozenset):
            return (type(v), frozenset(self.value(x) for x in v))
        if type(v) is dict:
            return (dict, tuple((self.value(k), self.value(x)) for k, x in v.items()))
        if isinstance(v, types.ModuleType):
            if not pure_module(v.__name__):
                raise _Unknown  # the user's modules only through the names code uses
            return ("module", id(v))
        if library_definition(v):
            return ("library", id(v))
        if isinstance(v, functools.partial):
            return ("partial", self.value(v.func), self.value(v.args), self.value(v.keywords))
        if isinstance(v, types.MethodType):
            return ("method", self.value(v.__func__), self.value(v.__self__))
        if isinstance(v, types.FunctionType):
            return self._function(v)
        if pure_module(type(v).__module__) and hasattr(v, "__wrapped__"):
            # A library's wrapper of the user's function (jax.jit, jax.custom_jvp): its rules too.
            inside = getattr(v, "__dict__", None) or {"__wrapped__": v.__wrapped__}
            return ("wrapper", type(v), self.value(dict(inside)))
        raise _Unknown

    def _function(self, f: types.FunctionType) -> Hashable:
        cells = tuple(self.value(c.cell_contents) for c in f.__closure__ or ())
        return (
            "function",
            f.__code__,
            cells,
            self.value(f.__defaults__),
            self.value(f.__kwdefaults__),
            self._names(f.__code__, f.__globals__),
        )

    def _names(self, code: types.CodeType, namespace: dict[str, Any]) -> Hashable:
        """The globals ``code`` (and the code nested in it) names, and the attributes it names
        of the user's modules among them."""
        names = frozenset(code_names(code))
        found: list[Hashable] = []
        for name in sorted(names):
            if name in namespace:
                value = namespace[name]
                if isinstance(value, types.ModuleType) and pure_module(value.__name__):
                    for a in names:  # np.random.uniform: a library's module of global state
                        inner = getattr(value, a, None)
                        if isinstance(inner, types.ModuleType) and not pure_module(inner.__name__):
                            raise _Unknown
                    found.append((name, "module", id(value)))
                elif isinstance(value, types.ModuleType):
                    attributes = tuple(
                        (a, self.value(getattr(value, a)))
                        for a in sorted(names)
                        if hasattr(value, a)
                    )
                    found.append((name, "user module", id(value), attributes))
                else:
                    found.append((name, self.value(value)))
            elif hasattr(builtins, name):
                found.append((name, "builtin"))
        return tuple(found)
