"""Telling fast that nothing a walk of :func:`divjac.torch._trace_keys.reach` read has changed:
:class:`Checks`, which a memo of a trace compares instead of walking again (like
``torch.compile``'s guards)."""

from __future__ import annotations

import functools
import itertools
import operator
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ._compat import dict_version, module_dicts

__all__ = ["Checks", "any_dead"]

# Containers longer than this are not walked (their contents are not guarded).
MAX_ITEMS = 64
# Values recorded as they are (hashable, and compared by value).
ATOMS = frozenset(
    {bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout}
)

# Kinds of checks (first item of each).
VALUE, TENSOR, TUPLE, REF, SAME, EMPTY = range(6)  # what a slot holds
DICT, LIST, OBJECT, FUNCTION, CLASS, MODULE, META = range(6, 13)  # objects


def _version(d: dict[Any, Any]) -> int:
    return int(dict_version(d))


def full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _holds(slot: tuple[Any, ...], value: Any) -> bool:
    """Whether ``value`` is what :meth:`_Walk.slot` recorded as ``slot``."""
    kind = slot[0]
    if kind == REF:
        return slot[1]() is value
    if kind == VALUE:
        return type(value) is slot[1] and bool(value == slot[2])
    if kind == TENSOR:
        ref = slot[2]
        return (
            isinstance(value, torch.Tensor)
            and (value.shape, value.dtype, value.device) == slot[1]
            and (ref is None or ref() is value)
        )
    if kind == SAME:
        return value is slot[1] and (slot[2] is None or _version(value) == slot[2])
    if kind == TUPLE:
        parts = slot[1]
        return type(value) is tuple and len(value) == len(parts) and all(map(_holds, parts, value))
    return False  # _EMPTY: checked where a slot may be empty


class Checks:
    """What tells, without walking again, that a walk of :func:`reach` would find what it
    found: every dict it read has the same version (CPython's tag of a dict's state, unique
    across dicts and changes), every other slot it read (closure cells, defaults, globals,
    class attributes, list items) holds the same object (numbers and strings: an equal one;
    floating-point tensors: one of the same shape, dtype and device), and its tensors have
    their shape, dtype and device. A check reads one version per module attribute dict and
    one shape per tensor, where the walk visits every attribute. Weak references to modules,
    functions, tensors and objects: a check keeps alive only dicts and lists it met outside
    modules (and classes)."""

    __slots__ = ("_meta", "_modules", "_others")

    def __init__(self, items: list[tuple[Any, ...]]) -> None:
        metas = [item for item in items if item[0] == META]
        self._meta = (tuple(item[1] for item in metas), [item[2:] for item in metas])
        modules = [item for item in items if item[0] == MODULE]
        self._modules = (
            tuple(item[1] for item in modules),
            [item[2] for item in modules],
            [item[3] for item in modules],
            [v for item in modules for v in item[4:]],
        )
        self._others = [item for item in items if item[0] not in (META, MODULE)]

    def hold(self) -> bool:
        # Tensors, then modules, each in a few passes of C-level iteration (map, ==).
        refs, metas = self._meta
        tensors = list(map(_deref, refs))
        if any(map(_is_none, tensors)) or list(map(_meta_of, tensors)) != metas:
            return False
        refs, classes, versions, inner = self._modules
        modules = list(map(_deref, refs))
        if any(map(_is_none, modules)) or list(map(type, modules)) != classes:
            return False
        dicts = list(map(_dict_of, modules))
        if list(map(dict_version, dicts)) != versions:
            return False
        nested = itertools.chain.from_iterable(map(module_dicts, dicts))
        if list(map(dict_version, nested)) != inner:
            return False
        return all(map(_object_holds, self._others))


def any_dead(refs: Sequence[weakref.ref[Any]]) -> bool:
    """Whether one of the weak references ``refs`` is dead (in C-level iteration; plain
    ``weakref.ref`` objects: their own ``__call__`` is called, not a subclass's)."""
    return any(map(_is_none, map(_deref, refs)))


_deref = weakref.ref.__call__
_is_none = functools.partial(operator.is_, None)
_dict_of = operator.attrgetter("__dict__")
_meta_of = operator.attrgetter("shape", "dtype", "device")


def _object_holds(item: tuple[Any, ...]) -> bool:
    kind = item[0]
    if kind == FUNCTION:
        return _function_holds(item)
    if kind == DICT:
        return bool(_version(item[1]) == item[2])
    if kind == OBJECT:
        obj = item[1]()
        return obj is not None and type(obj) is item[2] and _version(vars(obj)) == item[3]
    if kind == CLASS:
        attrs = vars(item[1])
        return tuple(attrs) == item[2] and all(map(operator.is_, attrs.values(), item[3]))
    if kind == LIST:
        lst, items = item[1], item[2]
        if items is None:
            return len(lst) > MAX_ITEMS
        return len(lst) == len(items) and all(
            (type(v) in ATOMS) if slot is None else _holds(slot, v)
            for slot, v in zip(items, lst, strict=True)
        )
    return False


def _function_holds(item: tuple[Any, ...]) -> bool:
    _, ref, code, cells, defaults, kwdefaults, version, found = item
    fn = ref()
    if fn is None or fn.__code__ is not code:
        return False
    closure = fn.__closure__ or ()
    for slot, cell in zip(cells, closure, strict=True):
        if slot[0] == EMPTY:
            if full(cell):
                return False
        elif not full(cell) or not _holds(slot, cell.cell_contents):
            return False
    if not (_holds(defaults, fn.__defaults__) and _holds(kwdefaults, fn.__kwdefaults__)):
        return False
    scope = fn.__globals__
    now = _version(scope)
    if now == version[0]:
        return True
    for name, slot in found:  # some global changed: are those the code names the same?
        if slot[0] == EMPTY:
            if name in scope:
                return False
        elif name not in scope or not _holds(slot, scope[name]):
            return False
    version[0] = now
    return True
