"""Tracing a batched function into an ATen graph and detecting its per-sample pattern (cached).

The function is traced batch-first with ``make_fx`` on fake tensors (no memory, no compute), with
functionalization (no aliasing or in-place mutation left in the graph) and PyTorch's
decompositions for the operations the interpreter has no rule for. Shapes, dtypes and the static
arguments key a per-transform cache, like ``torch.compile`` guards: a second call with the same
shapes reuses the graph and its detections. A function whose control flow depends on values
(``if x.sum() > 0``) cannot be traced on fake tensors; it is then traced on the actual values
(and not cached: the pattern holds for the branch taken at this input).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import torch
from torch import nn

from .._core import deps as D, detection
from .._core.detection import LRU, EntryLimit, Propagated
from .._errors import DivjacError
from ._interpret import Interpreter, decompositions, is_convolution

__all__ = ["CACHE", "TensorSpec", "Traced", "find_modules", "quiet_batch_norm", "trace"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor the traced function returned."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(eq=False)
class Traced(detection.Traced):
    """The ATen graph of a batched function, batch-first in and out, with cached detections.

    ``pass_elements`` is twice the largest intermediate (memory planning).

    Attributes:
        gm: graph whose inputs are the tensor leaves of ``(args, kwargs)``, the differentiated
            one with its batch axis moved first (or a leading batch of one added).
        x_pos: position of the differentiated leaf among the graph inputs.
        module_refs: weak references to the modules the function may run (part of the cache
            key, so the same for every call that reuses this trace).
    """

    gm: torch.fx.GraphModule
    x_pos: int
    module_refs: tuple[weakref.ref[nn.Module], ...]

    def modules(self) -> list[nn.Module]:
        """The modules the function may run (alive while a call runs it)."""
        return [m for m in (r() for r in self.module_refs) if m is not None]

    @functools.cached_property
    def has_convolution(self) -> bool:
        """Whether the graph convolves (its reverse mode is then the slower one under vmap)."""
        return any(
            node.op == "call_function" and is_convolution(node.target)
            for node in self.gm.graph.nodes
        )

    def _propagate(self, seeded: D.Deps, limit: EntryLimit | None) -> Propagated:
        interp = Interpreter(seeded.n_labels, limit=limit)
        n_inputs = sum(1 for node in self.gm.graph.nodes if node.op == "placeholder")
        in_deps = [
            seeded if i == self.x_pos else D.empty((), seeded.n_labels) for i in range(n_inputs)
        ]
        with outside_transforms():  # the rules compute on plain tensors, under any transform
            out = interp.run(self.gm, in_deps)
        interp.warn_fallbacks()
        return Propagated(out, frozenset(interp.fallbacks))


# --- modules reachable from the function ----------------------------------------------------


def find_modules(fun: Callable[..., Any], leaves: Sequence[Any]) -> list[nn.Module]:
    """The ``nn.Module`` s a call may run: ``fun`` itself (or its ``self``), the modules it
    closes over or names as globals (following closed-over functions a few levels down), and
    module arguments.

    Their train/eval modes are part of the trace cache key, and their batch normalization
    layers are kept from updating running statistics while divjac traces and differentiates.
    """
    found: list[nn.Module] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.append(obj)
            return
        if depth <= 0 or not callable(obj):
            return
        visit(getattr(obj, "__self__", None), depth - 1)
        if isinstance(obj, functools.partial):
            for a in (obj.func, *obj.args, *obj.keywords.values()):
                visit(a, depth - 1)
        func = getattr(obj, "__func__", obj)
        for cell in getattr(func, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                visit(cell.cell_contents, depth - 1)
        code = getattr(func, "__code__", None)
        if code is not None:
            names = getattr(func, "__globals__", {})
            for name in code.co_names:
                value = names.get(name)
                if isinstance(value, nn.Module) or hasattr(value, "__code__"):
                    visit(value, depth - 1)

    visit(fun, 3)
    for leaf in leaves:
        visit(leaf, 0)
    return found


@contextlib.contextmanager
def outside_transforms() -> Iterator[None]:
    """Leave any active ``torch.func`` transforms for a while (tracing works on plain tensors)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    with temporarily_clear_interpreter_stack():
        yield


def _modes(modules: Sequence[nn.Module]) -> tuple[tuple[bool, ...], ...]:
    return tuple(tuple(m.training for m in module.modules()) for module in modules)


@contextlib.contextmanager
def quiet_batch_norm(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Batch normalization in training mode, without updating the running statistics.

    Training-mode outputs use the batch statistics either way; the in-place update of the
    running statistics would be repeated by every pass (and ``torch.func`` transforms refuse
    in-place updates of captured buffers).
    """
    changed = [
        m
        for module in modules
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]
    for m in changed:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in changed:
            m.track_running_stats = True


# --- tracing --------------------------------------------------------------------------------


CACHE: LRU[Traced] = LRU(64)
"""Traced functions, shared by all transforms (parameters are not kept alive by it)."""


def _key(
    fun: Any,
    static: tuple[Any, ...],
    leaves: Sequence[Any],
    dynamic: Sequence[bool],
    treedef: Any,
    modules: Sequence[nn.Module],
) -> Hashable | None:
    """The cache key; functions and modules are held weakly (the cache keeps no model alive,
    and a new module at a recycled address is not mistaken for a dead one)."""
    try:
        key = (
            _weak(fun),
            static,
            treedef,
            tuple(
                (tuple(leaf.shape), leaf.dtype, leaf.device) if dyn else _weak(leaf)
                for leaf, dyn in zip(leaves, dynamic, strict=True)
            ),
            tuple(weakref.ref(m) for m in modules),
            _modes(modules),
        )
        hash(key)
    except TypeError:
        return None
    return key


def _weak(obj: Any) -> Any:
    """A weak reference to a function or module (equal while alive), else ``obj`` itself."""
    if not (callable(obj) or isinstance(obj, nn.Module)):
        return obj
    try:
        return weakref.WeakMethod(obj) if inspect.ismethod(obj) else weakref.ref(obj)
    except TypeError:  # builtins cannot be weakly referenced (and are never freed)
        return obj


def _is_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` wrapper (its values are not plain data)."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def trace(
    fun: Callable[..., Any],
    leaves: list[Any],
    treedef: Any,
    *,
    x_leaf: int,
    batch_axis: int | None,
    has_aux: bool,
    modules: Sequence[nn.Module],
) -> Traced:
    """Trace ``fun`` batch-first in the leaf ``x_leaf`` of its ``(args, kwargs)`` (cached).

    ``leaves`` and ``treedef`` are the flattened ``(args, kwargs)``. Tensor leaves are graph
    inputs; everything else is static and part of the cache key (with the train/eval modes of
    ``modules``), like ``jax.jit``'s. Results are cached in :data:`CACHE`.
    """
    dynamic = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    key = _key(fun, (x_leaf, batch_axis, has_aux), leaves, dynamic, treedef, modules)
    cached = CACHE.get(key) if key is not None else None
    if cached is not None:
        return cached
    x_pos = sum(dynamic[:x_leaf])
    tensors = [leaf for leaf, d in zip(leaves, dynamic, strict=True) if d]
    out_tree: list[Any] = []

    def batch_first(*dyn_leaves: torch.Tensor) -> torch.Tensor:
        it = iter(dyn_leaves)
        full = [next(it) if d else leaf for leaf, d in zip(leaves, dynamic, strict=True)]
        xb = full[x_leaf]
        full[x_leaf] = xb[0] if batch_axis is None else torch.movedim(xb, 0, batch_axis)
        call_args, call_kwargs = pytree.tree_unflatten(full, treedef)
        out = fun(*call_args, **call_kwargs)
        out_tree.append(
            pytree.tree_map(
                lambda a: TensorSpec(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a,
                out,
            )
        )
        y = out[0] if has_aux and isinstance(out, tuple | list) and len(out) == 2 else out
        if not isinstance(y, torch.Tensor) or (has_aux and not isinstance(out, tuple | list)):
            return torch.zeros(0)  # reported by the caller from out_tree
        if batch_axis is None:
            return y[None]
        return torch.movedim(y, batch_axis, 0) if y.ndim > batch_axis else y

    def shapes(t: torch.Tensor, i: int) -> tuple[int, ...]:
        return detection.batch_first_shape(t.shape, batch_axis) if i == x_pos else tuple(t.shape)

    with outside_transforms(), quiet_batch_norm(modules):
        gm, for_all_values = _trace_graph(batch_first, tensors, x_pos, batch_axis, out_tree)
    if not for_all_values:
        key = None
    _drop_parameters(gm)
    out_val = next(n for n in gm.graph.nodes if n.op == "output").args[0].meta["val"]
    sizes = [
        v.numel()
        for n in gm.graph.nodes
        for v in pytree.tree_leaves(n.meta.get("val"))
        if isinstance(v, torch.Tensor)
    ]
    traced = Traced(
        x_shape=detection.batch_first_shape(tuple(tensors[x_pos].shape), batch_axis),
        out_shape=tuple(out_val.shape),
        out_tree=out_tree[0],
        pass_elements=2 * max(sizes, default=0),
        gm=gm,
        x_pos=x_pos,
        module_refs=tuple(weakref.ref(m) for m in modules),
    )
    if key is not None:
        CACHE.put(key, traced)
    return traced


def _trace_graph(
    fn: Callable[..., torch.Tensor],
    tensors: Sequence[torch.Tensor],
    x_pos: int,
    batch_axis: int | None,
    out_tree: list[Any],
) -> tuple[torch.fx.GraphModule, bool]:
    """The functional graph of ``fn`` and whether it holds for every value (fake tracing).

    Fake tensors first, with autograd as the caller has it, then without it (some modules trace
    only so); if both fail (value-dependent control flow or shapes), the actual values.
    Functionalization removes in-place mutation and aliasing from the graph.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize

    def shape(t: torch.Tensor, i: int) -> tuple[int, ...]:
        return (
            detection.batch_first_shape(tuple(t.shape), batch_axis)
            if i == x_pos
            else tuple(t.shape)
        )

    def real(t: torch.Tensor, i: int) -> torch.Tensor:
        t = t.detach()
        if i != x_pos:
            return t
        return t[None] if batch_axis is None else torch.movedim(t, batch_axis, 0)

    errors: list[Exception] = []
    for mode in ("fake", "real"):
        if mode == "real" and any(_is_wrapped(t) for t in tensors):
            break  # under a torch.func transform the values are not plain data
        for grad in (torch.is_grad_enabled(), False):
            out_tree.clear()
            try:
                with torch.set_grad_enabled(grad):
                    if mode == "fake":
                        with FakeTensorMode(allow_non_fake_inputs=True):
                            inputs = [
                                torch.empty(shape(t, i), dtype=t.dtype, device=t.device)
                                for i, t in enumerate(tensors)
                            ]
                    else:
                        inputs = [real(t, i) for i, t in enumerate(tensors)]
                    gm = make_fx(
                        dispatch_functionalize(fn, FunctionalTensorMode()),
                        tracing_mode=mode,
                        decomposition_table=decompositions(),
                        _allow_non_fake_inputs=True,
                        _error_on_data_dependent_ops=False,
                    )(*inputs)
                _check_static(gm)
                return gm, mode == "fake"
            except DivjacError:
                raise
            except Exception as err:
                errors.append(err)
    raise errors[-1] if len(errors) > 2 else errors[0]


def _drop_parameters(gm: torch.fx.GraphModule) -> None:
    """Replace parameter constants by meta tensors: detection never reads their values, and
    the cache must not keep a model's weights alive."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        const = getattr(gm, str(node.target), None)
        if isinstance(const, torch.Tensor) and (
            isinstance(const, nn.Parameter)
            or const.requires_grad
            or str(node.target).startswith("_param_constant")
        ):
            name = str(node.target)
            delattr(gm, name)
            setattr(gm, name, torch.empty(const.shape, dtype=const.dtype, device="meta"))


def _check_static(gm: torch.fx.GraphModule) -> None:
    """Refuse graphs with data-dependent (symbolic) shapes; they are traced on values instead."""
    for node in gm.graph.nodes:
        for v in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.SymInt) or (
                isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape)
            ):
                raise ValueError("data-dependent shape")
