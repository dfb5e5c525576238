"""``DistributedDataParallel``: divjac's transforms of a DDP-wrapped module, synchronized as a
forward of the wrapper is.

DDP all-reduces gradients from hooks on its parameters' gradient accumulators, which only its
forward arms (``prepare_for_backward``); it also broadcasts rank 0's buffers (batch norm
statistics) before each forward. divjac cannot trace the wrapper itself (its forward runs
collectives), so a transform of ``ddp`` traces and differentiates ``ddp.module`` and runs each
whole call (every pass of it) inside the wrapper's forward machinery: buffers are broadcast once,
and the backward of a loss built on the result all-reduces each gradient exactly once, as after
``ddp(x)``; under ``ddp.no_sync()`` gradients accumulate locally, as DDP's do. With
``find_unused_parameters=False`` (DDP's default) DDP waits for every parameter's gradient, and a
divergence never reaches the output layer's bias: such a call raises :class:`~divjac.DDPError`
(naming the parameters) rather than leave the step unsynchronized.

A function that runs a module a live DDP wrapper owns, transformed directly
(``divergence(ddp.module)``, or a closure calling it), would train each rank on its own
gradients: every pass of such a call raises :class:`~divjac.DDPError` with the fix
(:func:`check_synchronized`, from the backend's ``linearize``), except inside the wrapper's own
forward (a module whose ``forward`` calls divjac, wrapped in DDP) and where nothing is
synchronized (grad mode off, ``no_sync()``, one process).
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import distributed as dist, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .._errors import DDPError
from ._compat import active_ddp_module, ddp_forward, ddp_lacks, pytree, transforms_mode
from ._refusals import functorch_refusals

__all__ = ["check_synchronized", "transform", "unwrapped"]

Transform = Callable[..., Any]

_PATTERN = (
    "wrap a module whose forward computes the divergence instead: class Loss(nn.Module) with "
    "forward(x) returning divergence(self.net)(x), trained as DistributedDataParallel(Loss(net))"
)


def unwrapped(f: Any) -> Any:
    """The module a DDP wrapper holds (what is traced), else ``f``: for transforms whose results
    carry no gradient (a sparsity pattern)."""
    return f.module if isinstance(f, DDP) else f


def transform(
    make: Callable[..., Transform], backend: Any, f: Any, /, *args: Any, **kwargs: Any
) -> Transform:
    """``make(backend, f, *args, **kwargs)`` (a transform of :mod:`divjac._transforms` or
    :mod:`divjac._divergence`); for a DDP wrapper, that of ``f.module``, each call run inside
    the wrapper's forward machinery. ``torch.func``'s refusals of an ``autograd.Function`` are
    named (:mod:`divjac.torch._refusals`); the call runs in :func:`transforms_mode`."""
    if isinstance(f, DDP):
        call = _synchronized(f, make(backend, f.module, *args, **kwargs), make.__name__)
    else:
        call = make(backend, f, *args, **kwargs)

    @functools.wraps(call)
    def refusing(*args: Any, **kwargs: Any) -> Any:
        with functorch_refusals(make.__name__), transforms_mode():
            return call(*args, **kwargs)

    return refusing


def _synchronized(ddp: DDP, inner: Transform, fname: str) -> Transform:
    missing = ddp_lacks(ddp)
    if missing:
        raise DDPError(
            f"{fname}(ddp): this torch's DistributedDataParallel lacks {missing}, which "
            f"divjac runs its calls through to synchronize gradients exactly once per step. "
            f"Instead, {_PATTERN}."
        )
    pre_forward, inside, post_forward = ddp_forward(ddp)

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            args, kwargs = pre_forward(*args, **kwargs)
            with inside():
                out = inner(*args, **kwargs)
            if _syncs(ddp) and not (ddp.find_unused_parameters or ddp.static_graph):
                _check_reached(ddp, out, fname)
            return post_forward(out)

    return call


def _syncs(ddp: DDP) -> bool:
    """Whether a backward after a forward of ``ddp`` now all-reduces gradients."""
    return (
        torch.is_grad_enabled()
        and ddp.require_backward_grad_sync
        and dist.is_initialized()
        and dist.get_world_size(ddp.process_group) > 1
    )


def _check_reached(ddp: DDP, out: Any, fname: str) -> None:
    """Raise :class:`DDPError` if a parameter DDP reduces is not on the result's graph: DDP
    (``find_unused_parameters=False``) would wait for its gradient and skip the all-reduce of its
    bucket. A divergence never depends on the output layer's bias, for one."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [
        t.grad_fn
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
    unreached = [
        name
        for name, p in ddp.module.named_parameters()
        if p.requires_grad and name not in ddp.parameters_to_ignore and id(p) not in reached
    ]
    if unreached:
        raise DDPError(
            f"{fname}(ddp): the result does not depend on the parameters {unreached}, so "
            "DistributedDataParallel(find_unused_parameters=False) would wait for their "
            "gradients and leave this step's gradients unsynchronized. Construct it with "
            "find_unused_parameters=True (or static_graph=True), or compute the output too "
            "(value_and_divergence(ddp)) if the loss uses it."
        )


# The DDP wrapper that owns a module (weakly), or None, as the last search of the live
# wrappers found it; and the reference count of the DDP classes then (every instance holds one).
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[DDP] | None] = weakref.WeakKeyDictionary()
_SEARCHED = [-1]


def check_synchronized(modules: Callable[[], Sequence[nn.Module]]) -> None:
    """Raise :class:`DDPError` if a pass of a function running ``modules()`` would leave the
    gradients of a live DDP wrapper that owns one of them unsynchronized: outside its forward,
    while a backward would synchronize. (``modules`` is called only in a distributed run.)"""
    if not (dist.is_available() and dist.is_initialized()):
        return
    owner = _owner(modules())
    if owner is None or not _syncs(owner) or active_ddp_module() is owner:
        return
    name = type(owner.module).__name__
    raise DDPError(
        f"divjac: the function runs a {name} wrapped in DistributedDataParallel, outside the "
        "wrapper's forward: gradients of a loss built on this result would never be "
        "all-reduced (each rank would train on its own). Transform the wrapper: "
        "divergence(ddp)(x) (or jacobian(ddp), value_and_divergence(ddp), ...) synchronizes "
        f"them exactly once per step, as ddp(x) does. Or {_PATTERN}."
    )


def _owner(modules: Sequence[nn.Module]) -> DDP | None:
    """The live DDP wrapper holding one of ``modules`` (or being one).

    The live wrappers are searched again (one pass over the referrers of the DDP classes: an
    instance refers to its class, tens of ms) only when one may have come: the classes'
    reference count moved, a module no search has seen comes, or a module's wrapper died."""
    classes: list[type] = [DDP]
    for cls in classes:  # DDP and every subclass of it
        classes.extend(cls.__subclasses__())
    count = sum(sys.getrefcount(cls) for cls in classes)
    if count != _SEARCHED[0] or any(_stale(m) for m in modules):
        for m in modules:
            _OWNERS[m] = None
        for ddp in (o for o in gc.get_referrers(*classes) if isinstance(o, DDP)):
            ref = weakref.ref(ddp)
            _OWNERS[ddp] = ref
            for m in ddp.module.modules():
                _OWNERS[m] = ref
        _SEARCHED[0] = count
    for m in modules:
        held = _OWNERS[m]
        owner = None if held is None else held()
        if owner is not None:
            return owner
    return None


def _stale(module: nn.Module) -> bool:
    """Whether no search has seen ``module``, or its wrapper died since."""
    if module not in _OWNERS:
        return True
    held = _OWNERS[module]
    return held is not None and held() is None
