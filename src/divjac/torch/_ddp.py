"""``DistributedDataParallel``: divjac's transforms of a DDP-wrapped module, synchronized as a
forward of the wrapper is.

DDP all-reduces gradients from hooks on its parameters' gradient accumulators, which only its
forward arms (``prepare_for_backward``); it also broadcasts rank 0's buffers (batch norm
statistics) before each forward. divjac cannot trace the wrapper itself (its forward runs
collectives), so a transform of ``ddp`` traces and differentiates ``ddp.module`` and runs each
whole call (every pass of it) inside the wrapper's forward machinery: buffers are broadcast once,
and the backward of a loss built on the result all-reduces each gradient exactly once, as after
``ddp(x)``; under ``ddp.no_sync()`` gradients accumulate locally, as DDP's do.

A module that a live DDP wrapper owns, transformed directly (``divergence(ddp.module)``), would
train each rank on its own gradients: its calls raise :class:`~divjac.DDPError` with the fix, except
inside the wrapper's own forward (a module whose ``forward`` calls divjac, wrapped in DDP) and
where nothing is synchronized (grad mode off, ``no_sync()``, one process).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import distributed as dist, nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import _pytree as pytree

from .._errors import DDPError

__all__ = ["transform", "unwrapped"]

Transform = Callable[..., Any]

# What a call needs of the wrapper's forward (torch 2.13): DDP.forward is these, around the
# module's forward.
_MACHINERY = ("_pre_forward", "_post_forward", "_inside_ddp_forward", "_use_python_reducer")

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
    :mod:`divjac._divergence`); for a DDP wrapper, that of ``f.module`` called inside the
    wrapper's forward machinery; for a module a live DDP wrapper owns, guarded against training
    unsynchronized."""
    fname = make.__name__
    if isinstance(f, DDP):
        return _synchronized(f, make(backend, f.module, *args, **kwargs), fname)
    inner = make(backend, f, *args, **kwargs)
    if isinstance(f, nn.Module):
        owner = _owner(f)
        if owner is not None:
            return _guarded(owner, f, inner, fname)
    return inner


def _synchronized(ddp: DDP, inner: Transform, fname: str) -> Transform:
    missing = [name for name in _MACHINERY if not hasattr(ddp, name)]
    if missing:
        raise DDPError(
            f"{fname}(ddp): this torch's DistributedDataParallel lacks {missing}, which divjac "
            f"runs its calls through to synchronize gradients exactly once per step. Instead, "
            f"{_PATTERN}."
        )

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
            args, kwargs = ddp._pre_forward(*args, **kwargs)
            inside = (
                contextlib.nullcontext() if ddp._use_python_reducer else ddp._inside_ddp_forward()
            )
            with inside:
                out = inner(*args, **kwargs)
            if _syncs(ddp) and not (ddp.find_unused_parameters or ddp.static_graph):
                _check_reached(ddp, out, fname)
            return ddp._post_forward(out)

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
            f"(value_and_divergence(ddp)) if the loss uses it."
        )


# The DDP wrapper that owns a module (weakly), or None; found once per module.
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[DDP] | None] = weakref.WeakKeyDictionary()


def _owner(module: nn.Module) -> DDP | None:
    """The live DDP wrapper holding ``module`` (or a module above it). Searched the first time a
    module is transformed while a process group is up (one pass over the referrers of the DDP
    classes: an instance refers to its class), then remembered: a wrapper made later is not
    seen."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if module not in _OWNERS:
        classes: list[type] = [DDP]
        for cls in classes:  # DDP and every subclass of it
            classes.extend(cls.__subclasses__())
        wrappers = (o for o in gc.get_referrers(*classes) if isinstance(o, DDP))
        found = next((o for o in wrappers if any(m is module for m in o.module.modules())), None)
        _OWNERS[module] = None if found is None else weakref.ref(found)
    ref = _OWNERS[module]
    return None if ref is None else ref()


def _guarded(owner: DDP, module: nn.Module, inner: Transform, fname: str) -> Transform:
    owner_ref = weakref.ref(owner)

    def call(*args: Any, **kwargs: Any) -> Any:
        ddp = owner_ref()
        if ddp is not None and _syncs(ddp) and DDP._active_ddp_module is not ddp:
            name = type(module).__name__
            raise DDPError(
                f"{fname}: this {name} is wrapped in DistributedDataParallel, and gradients "
                f"of a loss built on {fname}(module) are never all-reduced (each rank would "
                f"train on its own). Pass the wrapper: {fname}(ddp)(x) synchronizes them "
                f"exactly once per step. Or {_PATTERN}."
            )
        return inner(*args, **kwargs)

    return call
