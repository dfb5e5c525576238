"""The one module that reads JAX's private or version-dependent API.

divjac interprets jaxprs: it reads the types of their variables, the programs nested in an
equation's parameters and how a loop splits its operands. These change between JAX releases
(JAX 0.12 merged ``ClosedJaxpr`` into ``Jaxpr``, whose constants it now carries, and describes a
``scan``'s operands by flat trees, ``ft_in``, instead of ``num_consts`` and ``num_carry``). Every
other module of divjac reaches them through the names and accessors below, so that a new JAX
release means one file to read; each version branch is here, keyed on what the installed JAX has
(feature detection), not on its version number. ``tests/jax/test_compat_seam.py`` fails if a
private JAX name, or a read of a parameter listed in :data:`VERSIONED_PARAMS`, appears elsewhere.

The other parameters of an equation (``dimension_numbers``, ``axes``, ...) are those of the public
``jax.lax`` function that binds it and are read where they are used.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
from jax.extend import core as _core

__all__ = [
    "VERSIONED_PARAMS",
    "Jaxpr",
    "Literal",
    "Primitive",
    "ScanParts",
    "Tracer",
    "Var",
    "bind_params",
    "branches",
    "called",
    "closed_jaxpr",
    "custom_jvp_rule",
    "is_batch",
    "is_differentiation",
    "is_program",
    "jaxpr_as_fun",
    "linear_solve_parts",
    "nested_programs",
    "open_jaxpr",
    "scan_parts",
    "sub_jaxprs",
    "trace_context",
    "unwrap",
    "while_parts",
    "without_consts",
]

Tracer = jax.core.Tracer
Jaxpr = _core.Jaxpr
Literal = _core.Literal
Primitive = _core.Primitive
Var = _core.Var
jaxpr_as_fun = _core.jaxpr_as_fun

# The parameters whose names or types have changed between JAX releases, or that hold nested
# programs (whose type has): read only through the accessors of this module.
VERSIONED_PARAMS = frozenset(
    ["jaxpr", "call_jaxpr", "fun_jaxpr", "jvp_jaxpr_fun", "fwd_jaxpr_thunk", "bwd", "branches",
     "cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts", "num_consts", "num_carry",
     "jaxprs", "const_lengths", "linear", "ft_in", "ft_out"]
)  # fmt: skip

# JAX 0.12 on: one class, a ``Jaxpr`` carrying its constants (``ClosedJaxpr`` is its alias).
_CONSTS_IN_JAXPR = _core.ClosedJaxpr is _core.Jaxpr


def is_program(value: Any) -> bool:
    """Whether ``value`` is a jaxpr, open or closed."""
    return isinstance(value, _core.Jaxpr | _core.ClosedJaxpr)


def open_jaxpr(program: Any) -> tuple[Any, list[Any]]:
    """``(jaxpr, consts)`` of a jaxpr, open or closed: ``jaxpr.constvars`` take ``consts``."""
    if _CONSTS_IN_JAXPR:
        return program, list(program.consts)
    if isinstance(program, _core.ClosedJaxpr):
        return program.jaxpr, list(program.consts)
    return program, []


def closed_jaxpr(jaxpr: Any, consts: list[Any]) -> Any:
    """The closed program of ``jaxpr`` whose ``constvars`` take ``consts``."""
    if _CONSTS_IN_JAXPR:
        return jaxpr.with_consts(consts)
    return _core.ClosedJaxpr(jaxpr, consts)


def without_consts(program: Any) -> Any:
    """The jaxpr of a closed program without its constants' values (what a cache may keep
    without pinning them): :func:`closed_jaxpr` with the constants rebuilds the program."""
    if _CONSTS_IN_JAXPR:
        return program.with_consts([])
    return program.jaxpr


def nested_programs(eqn: Any) -> Iterator[tuple[Any, list[Any]]]:
    """``(jaxpr, consts)`` of every program held by the equation's parameters."""
    for param in eqn.params.values():
        for sub in param if isinstance(param, tuple | list) else (param,):
            if is_program(sub):
                yield open_jaxpr(sub)


def sub_jaxprs(eqn: Any) -> Iterable[Any]:
    """The (open) jaxprs of the programs nested in the equation."""
    return _core.jaxprs_in_params(eqn.params)


def called(eqn: Any) -> Any:
    """The program a call-like equation runs (``jit``, ``remat``, ``custom_jvp_call``, ...)."""
    p = eqn.params
    return p.get("jaxpr", p.get("call_jaxpr", p.get("fun_jaxpr")))


def branches(eqn: Any) -> list[Any]:
    """The programs of a ``cond``'s branches (its operands after the index)."""
    return list(eqn.params["branches"])


def custom_jvp_rule(eqn: Any) -> Any:
    """The rule of a ``custom_jvp_call`` (a wrapped function with its ``debug_info``), or
    ``None``."""
    return eqn.params.get("jvp_jaxpr_fun")


class ScanParts(NamedTuple):
    """A ``scan``: its body, and its operands ``[*consts, *carry, *xs]``."""

    body: Any
    n_consts: int
    n_carry: int
    length: int
    reverse: bool


def scan_parts(eqn: Any) -> ScanParts:
    """The parts of a ``scan`` equation."""
    p = eqn.params
    if "num_consts" in p:
        n_consts, n_carry = p["num_consts"], p["num_carry"]
    else:  # JAX 0.12 on: the operands' flat trees, (consts, carry, xs)
        consts, carry, _ = p["ft_in"].unpack()
        n_consts, n_carry = len(list(consts)), len(list(carry))
    return ScanParts(p["jaxpr"], n_consts, n_carry, int(p["length"]), bool(p["reverse"]))


def while_parts(eqn: Any) -> tuple[Any, int, int]:
    """A ``while``'s body, and the numbers of its condition's and its body's constants (its
    operands are ``[*cond consts, *body consts, *carry]``)."""
    p = eqn.params
    return p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"]


def linear_solve_parts(eqn: Any) -> tuple[Any, Any]:
    """A ``custom_linear_solve``'s constant counts and programs, each with the fields
    ``matvec``, ``vecmat``, ``solve`` and ``transpose_solve``."""
    return eqn.params["const_lengths"], eqn.params["jaxprs"]


def bind_params(eqn: Any) -> dict[str, Any]:
    """The keyword arguments that bind the equation's primitive again."""
    return eqn.primitive.get_bind_params(eqn.params)


def is_differentiation(leaf: Any) -> bool:
    """Whether ``leaf`` is a tracer of a differentiation (``jvp``, ``linearize``, ``grad``)."""
    return type(leaf).__name__ in ("JVPTracer", "LinearizeTracer")


def is_batch(leaf: Any) -> bool:
    """Whether ``leaf`` is a tracer of ``vmap``."""
    return type(leaf).__name__ == "BatchTracer"


def unwrap(leaf: Any) -> Any:
    """The value a tracer wraps: a differentiation's primal, a ``vmap``'s batched value;
    ``None`` for other tracers."""
    if is_differentiation(leaf):
        return leaf.primal
    return getattr(leaf, "val", None)


def trace_context() -> Hashable:
    """JAX's configuration that tracing depends on (64-bit mode, dtype promotion, default
    device, precision), as ``jax.jit`` keys its own cache on it.

    Raises:
        ImportError: the installed JAX has no such key.
    """
    from jax._src.config import trace_context as context

    return context()
