"""What a call of a function reaches, as the cache key of its trace (like ``torch.compile``'s
guards): :func:`reach` walks it and gives its signature.

The signature holds the modules (class, train/eval mode, plain Python attributes, hooks, and the
identity, shape, dtype and device of their parameters and buffers), and the tensors, scalars,
containers and objects reachable from the function's closure, globals, defaults and ``self``
(of plain objects, the scalar attributes its code names; of lists, their items, numbers
included: the dimensions a list gives ``movedim`` or ``permute`` change the program), and the
grad mode. Tensor values are not part of it. A list that the function's own call changes (a log
it appends to) counts by the objects in it alone, not by its numbers nor its length
(:func:`changed_lists`, :func:`mark_logs`): logging a call does not re-trace the next one.
"""

from __future__ import annotations

import enum
import functools
import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .._core import detection
from .._core.user_state import code_names, library_module
from .._errors import UnsupportedOperationError
from ._checks import (
    ATOMS,
    CLASS,
    DICT,
    EMPTY,
    FUNCTION,
    LIST,
    MAX_ITEMS,
    META,
    MODULE,
    OBJECT,
    REF,
    SAME,
    TENSOR,
    TUPLE,
    VALUE,
    Checks,
    _version,
    full,
)
from ._compat import RNN_WEIGHT_CACHE, dict_version, module_dicts

__all__ = [
    "Reached",
    "changed_lists",
    "library",
    "mark_logs",
    "module_signature",
    "reach",
]

# Steps from the function through closures, globals, attributes and containers (modules are
# walked whole, with their submodules).
_DEPTH = 5
_MODULE_STATE = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping


class _Tag(int):
    """An integer of a signature that is no value the function reaches: an object's ``id``, a
    container's length (equal to and hashed as the integer; told apart from numbers by type)."""

    __slots__ = ()


def _is_value(obj: Any) -> bool:
    """Whether ``obj`` is a value: its class defines both equality and hashing, which
    Python's data model reserves for immutable objects (``inspect.Signature``, paths, frozen
    dataclasses), so that an equal one stands for it in a signature."""
    kind = type(obj)
    if kind.__eq__ is object.__eq__ or kind.__hash__ in (None, object.__hash__):
        return False
    try:
        hash(obj)
    except TypeError:  # an unhashable part
        return False
    return True


_SAME_AS = object()  # a signature's mark: the tensor reached at this place was reached before


@dataclass(frozen=True)
class Reached:
    """What a call of a function reaches, and its signature.

    Attributes:
        modules: the modules found (each with its submodules).
        tensors: every tensor found, by ``id``.
        ids: the ``id`` of every tensor found, in the order found.
        identified: the objects the signature identifies by ``id`` (modules, parameters,
            buffers, integer and boolean tensors, objects not walked).
        signature: hashable; equal for two calls when everything found is the same, up to the
            values of floating-point tensors and the identity of those outside modules.
        checks: with ``record``, what tells that nothing the walk read has changed.
        lists: per list met, in the order met, what its items were (numbers and strings
            themselves, other objects by ``id``; ``None`` for a log).
        opaque: the type of the first object found that the signature cannot tell apart
            from another (neither walked, nor weakly referenceable, nor a value): the call
            cannot be cached (``keyable`` is false); ``None``: none found.
    """

    modules: tuple[nn.Module, ...]
    tensors: dict[int, torch.Tensor]
    ids: tuple[int, ...]
    identified: tuple[Any, ...]
    signature: tuple[Hashable, ...]
    checks: Checks | None = None
    lists: tuple[tuple[Any, ...] | None, ...] = ()
    opaque: str | None = None

    @property
    def keyable(self) -> bool:
        return self.opaque is None


# Per function (its code, the function of a method, or the callable itself; weakly): the
# positions, in the order :func:`reach` meets lists, of the lists its own calls change.
_LOGS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _owner(fun: Any) -> Any:
    return getattr(fun, "__code__", None) or getattr(fun, "__func__", fun)


def _logs_of(fun: Any) -> frozenset[int]:
    try:
        return _LOGS.get(_owner(fun), frozenset())
    except TypeError:  # not weakly referenceable
        return frozenset()


def changed_lists(before: Reached, after: Reached) -> frozenset[int]:
    """The positions of the lists that changed between two walks of the same function (the
    ones its call changed: logs), none when the walks met different lists."""
    if len(before.lists) != len(after.lists):
        return frozenset()
    return frozenset(
        i
        for i, (a, b) in enumerate(zip(before.lists, after.lists, strict=True))
        if a is not None and a != b
    )


def mark_logs(fun: Any, positions: frozenset[int]) -> bool:
    """Count the lists at ``positions`` of the walks of ``fun`` as its logs from now on;
    whether ``fun`` can have logs (a callable that cannot be weakly referenced cannot)."""
    try:
        owner = _owner(fun)
        _LOGS[owner] = _LOGS.get(owner, frozenset()) | positions
    except TypeError:
        return False
    return True


def reach(fun: Callable[..., Any], static: Sequence[Any], *, record: bool = False) -> Reached:
    """The state a call of ``fun`` with the non-tensor arguments ``static`` may depend on.

    Followed from ``fun`` (a function, bound method, ``functools.partial``, module or callable
    object) and the arguments: closure cells, defaults, the globals its code names, ``self``,
    attributes of objects (the scalar ones when the code walked names them), the functions of
    their classes, lists, tuples and dicts (up to :data:`MAX_ITEMS` items), to a depth of
    :data:`_DEPTH`; modules with all their submodules, parameters, buffers and attributes.
    Library objects (torch, NumPy: optimizers, arrays) are not followed: they count by
    identity.

    With ``record``, the walk also records :class:`Checks`: how to tell, without walking
    again, that nothing it read has changed (``None`` where it met what they cannot
    check).
    """
    walk = _Walk(record=record, logs=_logs_of(fun))
    walk.visit(fun, _DEPTH)
    for leaf in static:
        walk.visit(leaf, 2)
    walk.finish()
    checks = walk.checks if record and walk.checkable else None
    return Reached(
        modules=tuple(walk.modules),
        tensors=walk.tensors,
        ids=tuple(walk.ids),
        identified=tuple(walk.identified),
        signature=tuple(walk.sig),
        checks=None if checks is None else Checks(checks),
        lists=tuple(walk.lists),
        opaque=walk.opaque,
    )


def module_signature(module: nn.Module) -> Hashable:
    walk = _Walk()
    walk.visit(module, _DEPTH)
    walk.finish()
    return tuple(walk.sig)


def library(obj: Any) -> bool:
    """Whether a class or function belongs to a library (one of
    :data:`~divjac._core.user_state.LIBRARIES`): not walked, counted by identity."""
    return library_module(getattr(obj, "__module__", None))


@functools.lru_cache(maxsize=1024)
def _own_bases(cls: Any) -> tuple[type, ...]:
    """The classes of ``cls.__mro__`` outside libraries (those whose code is walked)."""
    return tuple(base for base in cls.__mro__ if not library(base))


def _atoms(values: tuple[Any, ...]) -> bool:
    return len(values) <= MAX_ITEMS and all(map(ATOMS.__contains__, map(type, values)))


class _Walk:
    """One walk of :func:`reach` (appends to ``sig`` in a deterministic order; with ``record``,
    to ``checks`` what :class:`Checks` needs)."""

    def __init__(self, *, record: bool = False, logs: frozenset[int] = frozenset()) -> None:
        self.record = record
        self.logs = logs
        self.lists: list[tuple[Any, ...] | None] = []  # see Reached.lists
        self.checks: list[tuple[Any, ...]] = []
        self.checkable = dict_version is not None
        self.opaque: str | None = None  # a type: the signature misses an object of it
        self.sig: list[Any] = []  # hashable values
        self.modules: list[nn.Module] = []
        self.tensors: dict[int, torch.Tensor] = {}
        self.ids: list[int] = []
        self.identified: list[Any] = []
        self.seen: set[int] = set()
        self.first: dict[int, tuple[int, bool]] = {}  # by tensor: first place, whether plain
        self.names: set[str] = {"__call__"}  # the code walked names these
        self.done: set[tuple[int, str]] = set()  # (class, name) followed
        self.objects: list[tuple[Any, int]] = []  # plain objects: finished at the end

    def visit(self, obj: Any, depth: int) -> None:
        sig = self.sig
        kind = type(obj)
        if kind in ATOMS or isinstance(obj, enum.Enum | np.generic):
            sig.append(obj)
            return
        if isinstance(obj, torch.Tensor):
            self.tensor(obj, identity=not (obj.is_floating_point() or obj.is_complex()))
            return
        if kind is tuple and _atoms(obj):
            sig.append(obj)  # kernel sizes, paddings: whatever the depth
            return
        if isinstance(obj, torch.jit.ScriptModule | torch.jit.ScriptFunction):
            raise UnsupportedOperationError(
                f"the function reaches a TorchScript {kind.__name__} (torch.jit.script or "
                "torch.jit.trace). TorchScript runs its own autograd graph: PyTorch's "
                "forward-mode derivatives through it are silently dropped (torch.func.jacfwd "
                "of a scripted MLP is wrong, and its second derivatives are zero), so divjac's "
                "forward passes, Laplacians and sparsity would be wrong. Pass the module or "
                "function before scripting (TorchScript is deprecated; torch.compile of the "
                "step that calls divjac is supported)."
            )
        if isinstance(obj, type | types.ModuleType | types.BuiltinFunctionType) or (
            isinstance(obj, types.FunctionType) and library(obj)
        ):
            sig.append(obj)  # by identity (long-lived); not walked
            return
        if id(obj) in self.seen:
            return
        if isinstance(obj, nn.Module):
            self.module(obj, depth)
            return
        if depth <= 0:
            return
        self.seen.add(id(obj))
        sig.append(kind)
        log = False
        if isinstance(obj, list):
            log = len(self.lists) in self.logs
            self.lists.append(None if log else tuple(v if type(v) in ATOMS else id(v) for v in obj))
        if self.record:
            self.check_object(obj, log=log)
        if isinstance(obj, list | tuple | dict):
            self.container(obj, depth, log=log)
        elif isinstance(obj, types.FunctionType):
            self.function(obj, depth)
        elif isinstance(obj, types.MethodType):
            self.visit(obj.__self__, depth)
            self.visit(obj.__func__, depth)
        elif isinstance(obj, functools.partial):
            for value in (obj.func, *obj.args, *obj.keywords.items()):
                self.visit(value, depth - 1)
        elif isinstance(obj, detection.Traced):  # divjac's own trace (of a call): by identity
            sig.append(_Tag(id(obj)))
            self.identified.append(obj)
        elif hasattr(obj, "__dict__") and not library(kind):
            self.plain_object(obj, depth)
        else:  # not walked (a NumPy array, an optimizer): by identity when it can be
            try:
                weakref.ref(obj)
            except TypeError:
                if _is_value(obj) or kind is object:
                    # A value (inspect.Signature, a path): by its value; a bare object() (a
                    # sentinel, stateless): by identity, held by the key.
                    sig.append(obj)
                    return
                # Neither walked nor identified (a library object with __slots__, e.g. an
                # OpInfo SampleInput): the signature cannot tell two of them apart.
                self.checkable = False
                self.opaque = self.opaque or f"{kind.__module__}.{kind.__qualname__}"
                return
            sig.append(_Tag(id(obj)))
            self.identified.append(obj)

    def tensor(self, t: torch.Tensor, *, identity: bool) -> None:
        if self.record:
            self.checks.append((META, weakref.ref(t), t.shape, t.dtype, t.device))
        self.again(id(t), plain=not identity)
        self.tensors[id(t)] = t
        self.ids.append(id(t))
        self.sig.extend((t.shape, t.dtype, t.device))
        if identity:
            self.sig.append(_Tag(id(t)))
            self.identified.append(t)

    def again(self, key: int, *, plain: bool) -> None:
        """Mark a tensor reached again where this place or its first is plain (a floating-point
        tensor outside modules, in the signature by its shape alone): the signature names the
        first place (a trace captured both as one constant: a module's buffer passed as the
        first ``t``), and the walk cannot be checked (checks compare plain places by shape)."""
        first = self.first.setdefault(key, (len(self.ids), plain))
        if first[0] != len(self.ids) and (plain or first[1]):
            self.sig.append((_SAME_AS, first[0]))
            self.checkable = False

    def container(
        self, obj: list[Any] | tuple[Any, ...] | dict[Any, Any], depth: int, *, log: bool = False
    ) -> None:
        if log:
            # A log the function appends to: only the objects in it count, not its numbers
            # and strings, nor its length.
            if len(obj) <= MAX_ITEMS:
                for value in obj:
                    if type(value) not in ATOMS:
                        self.visit(value, depth - 1)
            return
        self.sig.append(_Tag(len(obj)))
        if len(obj) > MAX_ITEMS:
            return
        if isinstance(obj, dict):
            for key, value in obj.items():
                self.visit(key, 0)
                self.visit(value, depth - 1)
        else:
            for value in obj:
                self.visit(value, depth - 1)

    def function(self, fn: types.FunctionType, depth: int) -> None:
        code = fn.__code__
        self.sig.append(code)
        names = code_names(code)
        self.names.update(names)
        if self.record:
            self.check_function(fn, names)
        for cell in fn.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                self.sig.append(None)
                continue
            self.visit(value, depth - 1)
        for value in fn.__defaults__ or ():
            self.visit(value, depth - 1)
        for item in (fn.__kwdefaults__ or {}).items():
            self.visit(item, depth - 1)
        scope = fn.__globals__
        for name in names:
            value = scope.get(name, scope)
            if value is scope:
                continue
            self.sig.append(name)
            self.visit(value, depth - 1)

    def klass(self, cls: type, depth: int, named: set[str] | None = None) -> None:
        """The functions (properties, static and class methods) and scalar attributes of
        ``cls`` and its bases outside libraries; with ``named``, only those of these names."""
        for base in _own_bases(cls):
            if named is None and id(base) in self.seen:
                continue
            self.seen.add(id(base))
            if self.record:
                self.check_class(base)
            for name, value in vars(base).items():
                if named is not None and (name not in named or (id(base), name) in self.done):
                    continue
                self.done.add((id(base), name))
                if isinstance(value, staticmethod | classmethod):
                    value = value.__func__
                elif isinstance(value, property):
                    value = value.fget
                if isinstance(value, types.FunctionType):
                    self.visit(value, depth - 1)
                elif type(value) in ATOMS and not name.startswith("__"):
                    self.sig.append(name)
                    self.sig.append(value)

    def module(self, m: nn.Module, depth: int) -> None:
        self.seen.add(id(m))
        self.modules.append(m)
        self.identified.append(m)
        sig = self.sig
        if self.record:
            self.check_module(m)
        sig.extend((type(m), _Tag(id(m)), m.training))
        parameters, buffers, children, pre_hooks, hooks = module_dicts(vars(m))
        if pre_hooks or hooks:
            sig.append((tuple(pre_hooks), tuple(hooks)))
        # A recurrent layer's cache of its weights, which its forward refreshes from its
        # parameters (held by the walk): functional_call leaves it on the tensors last passed (a
        # trace's own, whose weak references then compared elementwise: "FunctionalTensor on its
        # own").
        skipped = RNN_WEIGHT_CACHE if isinstance(m, nn.RNNBase) else frozenset()
        for name, value in vars(m).items():
            if name in _MODULE_STATE or name in skipped:
                continue
            sig.append(name)
            kind = type(value)
            if kind in ATOMS or (kind is tuple and _atoms(value)):
                sig.append(value)  # most attributes (sizes, flags): no call of visit
            else:
                self.visit(value, depth - 1)
        for tensors in (parameters, buffers):
            for name, t in tensors.items():
                if t is None:
                    sig.extend((name, None))
                else:  # as self.tensor(t, identity=True), inlined: most of a module's cost
                    key = id(t)
                    if self.first.setdefault(key, (len(self.ids), False))[1]:
                        self.again(key, plain=False)  # reached before as a plain tensor
                    self.tensors[key] = t
                    self.ids.append(key)
                    self.identified.append(t)
                    sig.extend((name, t.shape, t.dtype, t.device, key))
                    if self.record:
                        self.checks.append((META, weakref.ref(t), t.shape, t.dtype, t.device))
        cls: Any = type(m)
        if _own_bases(cls):
            self.klass(cls, depth)
        for name, child in children.items():
            sig.append(name)
            self.visit(child, depth)

    def plain_object(self, obj: Any, depth: int) -> None:
        self.objects.append((obj, depth))
        for name, value in vars(obj).items():
            if type(value) not in ATOMS:
                self.sig.append(name)
                self.visit(value, depth - 1)

    # --- recording what Checks needs --------------------------------------------------------

    def slot(self, value: Any) -> tuple[Any, ...]:
        """How to tell that a slot (a cell, a default, a global, a class attribute) still holds
        what the walk read there: the same value (numbers, strings), a tensor of the same
        shape, dtype and device (the same one if it is an integer or boolean tensor), or the
        same object."""
        kind = type(value)
        if kind in ATOMS or isinstance(value, enum.Enum | np.generic):
            return (VALUE, kind, value)
        if isinstance(value, torch.Tensor):
            floating = value.is_floating_point() or value.is_complex()
            meta = (value.shape, value.dtype, value.device)
            return (TENSOR, meta, None if floating else weakref.ref(value))
        if kind is tuple:
            return (TUPLE, tuple(map(self.slot, value)))
        try:
            return (REF, weakref.ref(value))
        except TypeError:  # a dict, a list: held (kept alive) by the check
            return (SAME, value, _version(value) if isinstance(value, dict) else None)

    def check_object(self, obj: Any, *, log: bool = False) -> None:
        """What tells that an object walked by :meth:`visit` (not a module, not a function)
        still holds what the walk read from it (of a ``log``, the objects in it)."""
        checks = self.checks
        if isinstance(obj, dict):
            checks.append((DICT, obj, _version(obj)))
        elif isinstance(obj, list):
            short = len(obj) <= MAX_ITEMS
            items = tuple(None if log and type(v) in ATOMS else self.slot(v) for v in obj)
            checks.append((LIST, obj, items if short else None))
        elif isinstance(obj, functools.partial):
            checks.append((DICT, obj.keywords, _version(obj.keywords)))
        elif isinstance(obj, tuple | types.MethodType | types.FunctionType):
            pass  # immutable (functions are checked by check_function)
        elif hasattr(obj, "__dict__"):
            try:
                checks.append((OBJECT, weakref.ref(obj), type(obj), _version(vars(obj))))
            except TypeError:
                self.checkable = False

    def check_function(self, fn: types.FunctionType, names: tuple[str, ...]) -> None:
        scope = fn.__globals__
        cells = tuple(
            self.slot(cell.cell_contents) if full(cell) else (EMPTY,)
            for cell in fn.__closure__ or ()
        )
        found = tuple(
            (name, self.slot(scope[name]) if name in scope else (EMPTY,)) for name in names
        )
        self.checks.append(
            (
                FUNCTION,
                weakref.ref(fn),
                fn.__code__,
                cells,
                self.slot(fn.__defaults__),
                self.slot(fn.__kwdefaults__),
                [_version(scope)],  # refreshed when the names still hold what they held
                found,
            )
        )

    def check_class(self, cls: type) -> None:
        attrs = vars(cls)  # held: a class holds its attributes anyway
        self.checks.append((CLASS, cls, tuple(attrs), tuple(attrs.values())))

    def check_module(self, m: nn.Module) -> None:
        d = m.__dict__
        self.checks.append(
            (
                MODULE,
                weakref.ref(m),
                type(m),
                _version(d),
                *map(_version, module_dicts(d)),
            )
        )

    def finish(self) -> None:
        """Follow, on the classes of plain objects, the methods and properties that the walked
        code names (until no new name appears), then record the scalar attributes it names: a
        step counter or a learning rate the function never reads does not re-trace it."""
        while True:
            found = len(self.names), len(self.objects)
            for obj, depth in list(self.objects):
                self.klass(type(obj), depth, self.names)
            if (len(self.names), len(self.objects)) == found:
                break
        for obj, _ in self.objects:
            for name, value in vars(obj).items():
                if type(value) in ATOMS and name in self.names:
                    self.sig.append(name)
                    self.sig.append(value)
        self.sig.append(torch.is_grad_enabled())
