"""The warnings of a function traced again at every call (:class:`~divjac.RetraceWarning`):
what it reaches cannot be cached, running it changes what it reaches, or a Python number
argument takes a new value at every call. Each warns once per function, at the third time."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

from .._errors import RetraceWarning, warn_at_caller
from ._trace_keys import Reached

__all__ = ["check_own_changes", "warn_numbers_retraced", "warn_uncached"]


# Per function: how many of its traces changed what it reaches, and how many could not be
# cached (each warned about at the third).
_OWN_CHANGES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_UNCACHED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _third(counts: weakref.WeakKeyDictionary[Any, int], fun: Callable[..., Any]) -> bool:
    """Count one more for ``fun`` (by its code, for closures made anew); whether it is the
    third (never for a callable that cannot be weakly referenced)."""
    owner = _owner(fun)
    try:
        count = counts.get(owner, 0) + 1
        counts[owner] = count
    except TypeError:  # not weakly referenceable
        return False
    return count == 3


def warn_uncached(fun: Callable[..., Any], reached: Reached) -> None:
    """Warn (once per function) when its traces cannot be cached, call after call."""
    if reached.keyable or not _third(_UNCACHED, fun):
        return
    warn_at_caller(
        f"divjac: {_name(fun)} reaches an object of type {reached.opaque} that divjac can neither "
        "follow, nor hold by a weak reference, nor compare by value, so it cannot tell whether "
        "it changed: the function is traced again at every call (slow). Keep such objects out "
        "of what the transformed function reaches (pass what it reads as arguments).",
        RetraceWarning,
    )


# Per function: its last new trace's call and reach with their Python numbers set apart, those
# numbers, and how many new traces in a row only new numbers made.
_NUMBER_RETRACES: weakref.WeakKeyDictionary[Any, tuple[Any, tuple[Any, ...], int]] = (
    weakref.WeakKeyDictionary()
)


def _numbers_apart(call: tuple[Any, ...], signature: tuple[Any, ...]) -> tuple[Any, ...]:
    """``(the call and signature with their Python numbers replaced by their types, those
    numbers)``: the call's integers and floats, the signature's floats (the integers a function
    reaches are mostly dimensions and sizes, which change the program: not a value to pass as
    a tensor)."""
    options, treedef, leaves = call
    kinds = [(int, float)] * len(leaves) + [(float,)] * len(signature)
    values = (*leaves, *signature)
    numbers = tuple(v for v, k in zip(values, kinds, strict=True) if type(v) in k)
    shape = tuple(type(v) if type(v) in k else v for v, k in zip(values, kinds, strict=True))
    return (options, treedef, shape), numbers


def warn_numbers_retraced(
    fun: Callable[..., Any], call: tuple[Any, ...], before: Reached, after: Reached
) -> None:
    """At a new trace of ``fun`` (``before`` and ``after``: what it reached before and after
    running), warn (once per function) at the third new trace in a row that only new values
    of Python numbers made: arguments, or floats the function reaches (a closure cell, a
    global, a module attribute) that changed since its last trace ran. Numbers are traced as
    constants (as ``torch.compile`` specializes them), so an ODE loop passing ``t`` as a float
    traces at every step. Not where running the function changes what it reaches (a counter
    it increments, in this call or in one outside divjac): :func:`check_own_changes` warns."""
    shape, numbers = _numbers_apart(call, before.signature)
    owner = _owner(fun)
    if not numbers or after.signature != before.signature:
        with contextlib.suppress(TypeError):
            _NUMBER_RETRACES.pop(owner, None)
        return
    try:
        last = _NUMBER_RETRACES.get(owner)
        again = last is not None and last[0] == shape and last[1] != numbers
        count = last[2] + 1 if again and last is not None else 1
        _NUMBER_RETRACES[owner] = (shape, numbers, count)
    except TypeError:  # not weakly referenceable, or an unhashable argument
        return
    if count != 3:
        return
    warn_at_caller(
        f"divjac: {_name(fun)} was traced again at each of its last 3 calls because a Python "
        "number took a new value (an argument, or a float it reaches: a closure cell, a global, "
        "a module attribute): divjac traces Python numbers as constants (as torch.compile "
        "specializes them), so each new value costs a new trace (tens of milliseconds; a small "
        "CNF's call 40 ms against 1 ms). Pass it as a tensor (t = torch.tensor(t), or of shape "
        "(B,)), or keep it in a tensor the function reads (a buffer, updated in place): a "
        "tensor is traced once whatever its values.",
        RetraceWarning,
    )


def check_own_changes(fun: Callable[..., Any], before: Reached, after: Reached) -> None:
    """Warn (once per function) when running ``fun`` changes the state it reaches, trace after
    trace: its next call cannot reuse the trace (the cache key changed), nor any later one."""
    if after.signature == before.signature or not _third(_OWN_CHANGES, fun):
        return
    pairs = zip(before.signature, after.signature, strict=False)
    changed = next((i for i, (a, b) in enumerate(pairs) if a != b), len(before.signature))
    names = [v for v in before.signature[:changed] if isinstance(v, str)]
    where = f" (near {names[-1]!r})" if names else ""
    warn_at_caller(
        f"divjac: running {_name(fun)} changes the state it reaches{where}: a module attribute, a "
        "value in a closure, a global or a dict, a tensor replaced. divjac's cached trace is "
        "keyed by that state, so the function is traced again at every call (slow). Keep "
        "counters, caches and logs out of what the transformed function reaches.",
        RetraceWarning,
    )


def _owner(fun: Callable[..., Any]) -> Any:
    """What counts per function: its code (for closures made anew at every call)."""
    return getattr(fun, "__code__", None) or getattr(fun, "__func__", fun)


def _name(fun: Callable[..., Any]) -> str:
    return str(getattr(fun, "__qualname__", type(fun).__qualname__))
