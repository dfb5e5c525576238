"""What both frameworks' walks of the caller's Python state share (no framework imported).

A transform keys its cached trace of the caller's function on the state that function reaches
(closures, defaults, the globals and module attributes its code names): JAX's eager transforms
in :mod:`divjac.jax._trace_reuse`, torch's in :mod:`divjac.torch._trace_keys`. Both walks read code
objects the same way (:func:`code_names`) and draw the same line between the caller's state,
which they walk, and a library's definitions, which count by identity
(:data:`LIBRARIES`, :data:`OWN`, :func:`library_module`, :func:`pure_module`, :func:`library_definition`).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

__all__ = [
    "IMPURE",
    "LIBRARIES",
    "OWN",
    "code_names",
    "library_definition",
    "library_module",
    "pure_module",
]

LIBRARIES = frozenset(
    {
        "_operator",
        "abc",
        "builtins",
        "cmath",
        "collections",
        "dataclasses",
        "einops",
        "equinox",
        "flax",
        "functools",
        "itertools",
        "jax",
        "jaxlib",
        "math",
        "numpy",
        "operator",
        "optax",
        "scipy",
        "torch",
        "typing",
    }
)
"""Top-level packages whose definitions are a library's, not the caller's state: their
modules, classes and functions count by identity and are not walked (:func:`library_module`),
and their functions are pure given their arguments unless :data:`IMPURE` (:func:`pure_module`).
"""

OWN = "divjac"
"""divjac itself: its definitions are pure given their arguments (:func:`pure_module`), but the
functions it makes are walked (:func:`library_module` is false: a transform's function holds
the caller's function and its state)."""

IMPURE = ("numpy.random", "random", "secrets", "time", "os")
"""Modules (and their submodules) of global state: a call of their functions is not pure given
its arguments, whatever :data:`LIBRARIES` says."""


@functools.lru_cache(maxsize=1024)
def library_module(name: str | None) -> bool:
    """Whether the module named ``name`` belongs to one of :data:`LIBRARIES`."""
    return str(name or "").partition(".")[0] in LIBRARIES


def pure_module(name: object) -> bool:
    """Whether the module named ``name`` belongs to :data:`LIBRARIES` or to :data:`OWN`, and
    not to :data:`IMPURE`: its functions are pure given their arguments."""
    if not isinstance(name, str):
        return False
    if any(name == m or name.startswith(m + ".") for m in IMPURE):
        return False
    return library_module(name) or name.partition(".")[0] == OWN


def library_definition(v: Any) -> bool:
    """Whether ``v`` is what a pure library's module defines under its name (``jnp.tanh``,
    ``torch.tanh``, ``np.float32``, ``math.sin``): never an instance such a library's classes
    make for the caller (an Equinox or Flax layer), nor a closure it returns."""
    module = getattr(v, "__module__", None)
    name = getattr(v, "__qualname__", None) or getattr(v, "__name__", None)
    if not pure_module(module) or not isinstance(name, str):
        return False
    found: Any = sys.modules.get(str(module))
    for part in name.split("."):
        found = getattr(found, part, None)
    return found is v


@functools.lru_cache(maxsize=4096)
def code_names(code: types.CodeType) -> tuple[str, ...]:
    """The global and attribute names a code object and the code nested in it (the functions
    and comprehensions it defines) use, each once, in the order first used."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(code_names(const))
    return tuple(dict.fromkeys(names))
