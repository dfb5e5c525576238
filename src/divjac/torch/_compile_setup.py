"""The setup of a call evaluated ahead of ``torch.compile``'s trace, as a constant.

Under ``torch.compile`` the setup of a call (tracing, detection, planning, seeds: what depends
on shapes and static arguments only) is evaluated once per compilation, eagerly, as a constant
(:meth:`~divjac.torch._backend.TorchBackend.ahead`); dynamo traces only the passes, all by
``torch.func``. The constant is sound while dynamo's own guards hold: it traces the same
function in the passes, so it guards on what the setup read of it (shapes, dtypes, modules and
their modes).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from ._compat import mark_constant_result, outside_compile_tracing, pytree

__all__: list[str] = []

R = TypeVar("R")


class Ahead:
    """Whether a setup is being evaluated ahead of a compiler's trace (then not compiling)."""

    active = False


def compiling() -> bool:
    """Whether dynamo is tracing the call (not evaluating a setup ahead of it)."""
    return torch.compiler.is_compiling() and not Ahead.active


def constant(fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)`` evaluated when dynamo traces the call, once, as a constant.

    Dynamo passes the leaves of ``args`` one by one (tensors by their values in the example
    inputs, modules, functions and classes as themselves, the rest as Python constants), with
    the tree of their positions; frozen dataclasses travel as their class and fields. The
    result comes back the same way: its plain values as constants, and each of its other
    objects (tensors, functions, classes) as a constant of its own, which dynamo can use.
    """
    parts = pytree.tree_map(_fields, args, is_leaf=_is_dataclass)
    leaves = pytree.tree_leaves(parts)
    count = iter(range(len(leaves)))
    result = _evaluate(fn, pytree.tree_map(lambda _: next(count), parts), *leaves)
    objects = pytree.tree_map(
        lambda a: _unsourced(_TAKE[a[1]]()) if _is_kept(a) else a, result, is_leaf=_is_kept
    )
    return cast(R, pytree.tree_map(_dataclass, objects, is_leaf=_is_fields)[0])


@mark_constant_result
def _evaluate(fn: Callable[..., Any], positions: tuple[Any, ...], *leaves: Any) -> Any:
    parts = pytree.tree_map(lambda i: leaves[i], positions)
    args = pytree.tree_map(_dataclass, parts, is_leaf=_is_fields)
    Ahead.active = True
    try:
        # Outside dynamo's tracing context: a trace of the setup makes fake tensors of its own
        # (with dynamo's, found by make_fx, a parameter was a foreign real tensor: the fake
        # trace always failed, and the function was taken for one that needs its values).
        with outside_compile_tracing():
            result = fn(*args)
    finally:
        Ahead.active = False

    def keep(a: Any) -> Any:
        if a is None or type(a) in (bool, int, float, str, torch.dtype, torch.device):
            return a
        slot = next(_NEXT_SLOT) % len(_SLOTS)
        _SLOTS[slot] = a
        return [_KEPT, slot]

    return pytree.tree_map(keep, pytree.tree_map(_fields, (result,), is_leaf=_is_dataclass))


def _taker(slot: int) -> Callable[[], Any]:
    """The constant function that takes the object in ``slot``: one per slot, each of its own
    name, as dynamo names a tensor constant after the function that made it."""

    def take() -> Any:
        return _SLOTS[slot]

    name = f"_divjac_setup_object_{slot}"
    take.__name__ = take.__qualname__ = name
    take.__code__ = take.__code__.replace(co_name=name)
    return mark_constant_result(take)


def _unsourced(a: Any) -> Any:
    """A tensor constant as an intermediate (an alias): dynamo cannot guard a constant
    (``torch.func`` transforms check the type of their inputs)."""
    return a.detach() if isinstance(a, torch.Tensor) else a


def _is_dataclass(a: Any) -> bool:
    """A frozen dataclass (an immutable value, such as a spec or a plan)."""
    params = getattr(type(a), "__dataclass_params__", None)
    return params is not None and params.frozen and not isinstance(a, type)


def _fields(a: Any) -> Any:
    if not _is_dataclass(a):
        return a
    names = [f.name for f in dataclasses.fields(a)]
    values = [pytree.tree_map(_fields, getattr(a, n), is_leaf=_is_dataclass) for n in names]
    return [_FIELDS, type(a), names, values]  # lists: dynamo rebuilds no dict of a constant


def _is_fields(a: Any) -> bool:
    return isinstance(a, list) and len(a) == 4 and a[0] == _FIELDS


def _is_kept(a: Any) -> bool:
    return isinstance(a, list) and len(a) == 2 and a[0] == _KEPT


def _dataclass(a: Any) -> Any:
    if not _is_fields(a):
        return a
    values = [pytree.tree_map(_dataclass, v, is_leaf=_is_fields) for v in a[3]]
    return a[1](**dict(zip(a[2], values, strict=True)))


# Marks a dataclass as its class and fields, and an object kept apart (in _constant).
_FIELDS = "divjac:dataclass"
_KEPT = "divjac:kept"
# The objects of setups' results (tensors, classes) on their way to dynamo, each in its slot
# (a ring: a slot is reused 1024 setups later, long after dynamo took its object).
_SLOTS: list[Any] = [None] * 1024
_NEXT_SLOT = itertools.count()
_TAKE = tuple(_taker(slot) for slot in range(len(_SLOTS)))


def prepared(
    setup: Callable[..., R], spec: Any, args: tuple[Any, ...], kwargs: dict[str, Any], static: Any
) -> R:
    """``setup`` of the call of ``spec`` at ``args`` and ``kwargs``, prepared again."""
    from .._call import prepare

    return setup(prepare(spec, args, kwargs), *static)
