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
import itertools
import operator
import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .._core import detection
from .._errors import UnsupportedOperationError
from ._compat import dict_version

__all__ = [
    "Reached",
    "any_dead",
    "changed_lists",
    "library",
    "mark_logs",
    "module_signature",
    "reach",
]

# Containers longer than this are not walked (their contents are not guarded).
_MAX_ITEMS = 64
# Steps from the function through closures, globals, attributes and containers (modules are
# walked whole, with their submodules).
_DEPTH = 5
# Values recorded as they are (hashable, and compared by value).
_ATOMS = frozenset(
    {bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout}
)
# Packages whose objects and functions are not walked (their state is not the caller's).
_LIBRARIES = frozenset({"torch", "numpy", "scipy", "builtins", "functools", "typing", "abc"})
_MODULE_STATE = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping


# --- telling fast that nothing changed -----------------------------------------------------------

# Kinds of checks (first item of each).
_VALUE, _TENSOR, _TUPLE, _REF, _SAME, _EMPTY = range(6)  # what a slot holds
_DICT, _LIST, _OBJECT, _FUNCTION, _CLASS, _MODULE, _META = range(6, 13)  # objects
# The dicts of a module whose contents the walk reads.
_MODULE_DICTS = ("_parameters", "_buffers", "_modules", "_forward_pre_hooks", "_forward_hooks")


class _Tag(int):
    """An integer of a signature that is no value the function reaches: an object's ``id``, a
    container's length (equal to and hashed as the integer; told apart from numbers by type)."""

    __slots__ = ()


def _version(d: dict[Any, Any]) -> int:
    return int(dict_version(d))


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


def _full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _holds(slot: tuple[Any, ...], value: Any) -> bool:
    """Whether ``value`` is what :meth:`_Walk.slot` recorded as ``slot``."""
    kind = slot[0]
    if kind == _REF:
        return slot[1]() is value
    if kind == _VALUE:
        return type(value) is slot[1] and bool(value == slot[2])
    if kind == _TENSOR:
        ref = slot[2]
        return (
            isinstance(value, torch.Tensor)
            and (value.shape, value.dtype, value.device) == slot[1]
            and (ref is None or ref() is value)
        )
    if kind == _SAME:
        return value is slot[1] and (slot[2] is None or _version(value) == slot[2])
    if kind == _TUPLE:
        parts = slot[1]
        return type(value) is tuple and len(value) == len(parts) and all(map(_holds, parts, value))
    return False  # _EMPTY: checked where a slot may be empty


class Checks:
    """What tells, without walking again, that a walk of :func:`reach` would find what it
    found: every dict it read has the same version (CPython's tag of a dict's state, unique
    across dicts and changes), every other slot it read (closure cells, defaults, globals,
    class attributes, list items) holds the same object (numbers and strings: an equal one;
    floating-point tensors: one of the same shape, dtype and device), and its tensors have
    their shape, dtype and device. About 0.1 us per module attribute dict and per tensor,
    against several microseconds per module for the walk. Weak references to modules,
    functions, tensors and objects: a check keeps alive only dicts and lists it met outside
    modules (and classes)."""

    __slots__ = ("_meta", "_modules", "_others")

    def __init__(self, items: list[tuple[Any, ...]]) -> None:
        metas = [item for item in items if item[0] == _META]
        self._meta = (tuple(item[1] for item in metas), [item[2:] for item in metas])
        modules = [item for item in items if item[0] == _MODULE]
        self._modules = (
            tuple(item[1] for item in modules),
            [item[2] for item in modules],
            [item[3] for item in modules],
            [v for item in modules for v in item[4:]],
        )
        self._others = [item for item in items if item[0] not in (_META, _MODULE)]

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
        nested = itertools.chain.from_iterable(map(_module_dicts, dicts))
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
_module_dicts = operator.itemgetter(*_MODULE_DICTS)
_meta_of = operator.attrgetter("shape", "dtype", "device")


def _object_holds(item: tuple[Any, ...]) -> bool:
    kind = item[0]
    if kind == _FUNCTION:
        return _function_holds(item)
    if kind == _DICT:
        return bool(_version(item[1]) == item[2])
    if kind == _OBJECT:
        obj = item[1]()
        return obj is not None and type(obj) is item[2] and _version(vars(obj)) == item[3]
    if kind == _CLASS:
        attrs = vars(item[1])
        return tuple(attrs) == item[2] and all(map(operator.is_, attrs.values(), item[3]))
    if kind == _LIST:
        lst, items = item[1], item[2]
        if items is None:
            return len(lst) > _MAX_ITEMS
        return len(lst) == len(items) and all(
            (type(v) in _ATOMS) if slot is None else _holds(slot, v)
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
        if slot[0] == _EMPTY:
            if _full(cell):
                return False
        elif not _full(cell) or not _holds(slot, cell.cell_contents):
            return False
    if not (_holds(defaults, fn.__defaults__) and _holds(kwdefaults, fn.__kwdefaults__)):
        return False
    scope = fn.__globals__
    now = _version(scope)
    if now == version[0]:
        return True
    for name, slot in found:  # some global changed: are those the code names the same?
        if slot[0] == _EMPTY:
            if name in scope:
                return False
        elif name not in scope or not _holds(slot, scope[name]):
            return False
    version[0] = now
    return True


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
    their classes, lists, tuples and dicts (up to :data:`_MAX_ITEMS` items), to a depth of
    :data:`_DEPTH`; modules with all their submodules, parameters, buffers and attributes.
    Library objects (torch, NumPy: optimizers, arrays) are not followed: they count by
    identity.

    With ``record``, the walk also records :class:`Checks`: how to tell, much faster than by
    walking again, that nothing it read has changed (``None`` where it met what they cannot
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


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """The global and attribute names a code object and the functions defined in it use."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_code_names(const))
    return tuple(dict.fromkeys(names))


def library(obj: Any) -> bool:
    """Whether a class or function belongs to a library (see :data:`_LIBRARIES`)."""
    return _library_module(getattr(obj, "__module__", None))


@functools.lru_cache(maxsize=1024)
def _library_module(name: str | None) -> bool:
    return str(name or "").partition(".")[0] in _LIBRARIES


@functools.lru_cache(maxsize=1024)
def _own_bases(cls: Any) -> tuple[type, ...]:
    """The classes of ``cls.__mro__`` outside libraries (those whose code is walked)."""
    return tuple(base for base in cls.__mro__ if not library(base))


def _atoms(values: tuple[Any, ...]) -> bool:
    return len(values) <= _MAX_ITEMS and all(map(_ATOMS.__contains__, map(type, values)))


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
        self.names: set[str] = {"__call__"}  # the code walked names these
        self.done: set[tuple[int, str]] = set()  # (class, name) followed
        self.objects: list[tuple[Any, int]] = []  # plain objects: finished at the end

    def visit(self, obj: Any, depth: int) -> None:
        sig = self.sig
        kind = type(obj)
        if kind in _ATOMS or isinstance(obj, enum.Enum | np.generic):
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
            self.lists.append(
                None if log else tuple(v if type(v) in _ATOMS else id(v) for v in obj)
            )
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
            self.checks.append((_META, weakref.ref(t), t.shape, t.dtype, t.device))
        self.tensors[id(t)] = t
        self.ids.append(id(t))
        self.sig.extend((t.shape, t.dtype, t.device))
        if identity:
            self.sig.append(_Tag(id(t)))
            self.identified.append(t)

    def container(
        self, obj: list[Any] | tuple[Any, ...] | dict[Any, Any], depth: int, *, log: bool = False
    ) -> None:
        if log:
            # A log the function appends to: only the objects in it count, not its numbers
            # and strings, nor its length.
            if len(obj) <= _MAX_ITEMS:
                for value in obj:
                    if type(value) not in _ATOMS:
                        self.visit(value, depth - 1)
            return
        self.sig.append(_Tag(len(obj)))
        if len(obj) > _MAX_ITEMS:
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
        names = _code_names(code)
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
                elif type(value) in _ATOMS and not name.startswith("__"):
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
        if m._forward_pre_hooks or m._forward_hooks:
            sig.append((tuple(m._forward_pre_hooks), tuple(m._forward_hooks)))
        for name, value in vars(m).items():
            if name in _MODULE_STATE:
                continue
            sig.append(name)
            kind = type(value)
            if kind in _ATOMS or (kind is tuple and _atoms(value)):
                sig.append(value)  # most attributes (sizes, flags): no call of visit
            else:
                self.visit(value, depth - 1)
        for tensors in (m._parameters, m._buffers):
            for name, t in tensors.items():
                if t is None:
                    sig.extend((name, None))
                else:  # as self.tensor(t, identity=True), inlined: most of a module's cost
                    key = id(t)
                    self.tensors[key] = t
                    self.ids.append(key)
                    self.identified.append(t)
                    sig.extend((name, t.shape, t.dtype, t.device, key))
                    if self.record:
                        self.checks.append((_META, weakref.ref(t), t.shape, t.dtype, t.device))
        cls: Any = type(m)
        if _own_bases(cls):
            self.klass(cls, depth)
        for name, child in m._modules.items():
            sig.append(name)
            self.visit(child, depth)

    def plain_object(self, obj: Any, depth: int) -> None:
        self.objects.append((obj, depth))
        for name, value in vars(obj).items():
            if type(value) not in _ATOMS:
                self.sig.append(name)
                self.visit(value, depth - 1)

    # --- recording what Checks needs --------------------------------------------------------

    def slot(self, value: Any) -> tuple[Any, ...]:
        """How to tell that a slot (a cell, a default, a global, a class attribute) still holds
        what the walk read there: the same value (numbers, strings), a tensor of the same
        shape, dtype and device (the same one if it is an integer or boolean tensor), or the
        same object."""
        kind = type(value)
        if kind in _ATOMS or isinstance(value, enum.Enum | np.generic):
            return (_VALUE, kind, value)
        if isinstance(value, torch.Tensor):
            floating = value.is_floating_point() or value.is_complex()
            meta = (value.shape, value.dtype, value.device)
            return (_TENSOR, meta, None if floating else weakref.ref(value))
        if kind is tuple:
            return (_TUPLE, tuple(map(self.slot, value)))
        try:
            return (_REF, weakref.ref(value))
        except TypeError:  # a dict, a list: held (kept alive) by the check
            return (_SAME, value, _version(value) if isinstance(value, dict) else None)

    def check_object(self, obj: Any, *, log: bool = False) -> None:
        """What tells that an object walked by :meth:`visit` (not a module, not a function)
        still holds what the walk read from it (of a ``log``, the objects in it)."""
        checks = self.checks
        if isinstance(obj, dict):
            checks.append((_DICT, obj, _version(obj)))
        elif isinstance(obj, list):
            short = len(obj) <= _MAX_ITEMS
            items = tuple(None if log and type(v) in _ATOMS else self.slot(v) for v in obj)
            checks.append((_LIST, obj, items if short else None))
        elif isinstance(obj, functools.partial):
            checks.append((_DICT, obj.keywords, _version(obj.keywords)))
        elif isinstance(obj, tuple | types.MethodType | types.FunctionType):
            pass  # immutable (functions are checked by check_function)
        elif hasattr(obj, "__dict__"):
            try:
                checks.append((_OBJECT, weakref.ref(obj), type(obj), _version(vars(obj))))
            except TypeError:
                self.checkable = False

    def check_function(self, fn: types.FunctionType, names: tuple[str, ...]) -> None:
        scope = fn.__globals__
        cells = tuple(
            self.slot(cell.cell_contents) if _full(cell) else (_EMPTY,)
            for cell in fn.__closure__ or ()
        )
        found = tuple(
            (name, self.slot(scope[name]) if name in scope else (_EMPTY,)) for name in names
        )
        self.checks.append(
            (
                _FUNCTION,
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
        self.checks.append((_CLASS, cls, tuple(attrs), tuple(attrs.values())))

    def check_module(self, m: nn.Module) -> None:
        d = m.__dict__
        self.checks.append(
            (
                _MODULE,
                weakref.ref(m),
                type(m),
                _version(d),
                *(_version(d[name]) for name in _MODULE_DICTS),
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
                if type(value) in _ATOMS and name in self.names:
                    self.sig.append(name)
                    self.sig.append(value)
        self.sig.append(torch.is_grad_enabled())
