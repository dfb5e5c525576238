"""PyTorch's primitives for divjac's transforms, on ``torch.func``.

:class:`TorchBackend` runs the passes of :mod:`divjac.torch._passes` (in the kernels of
:mod:`divjac.torch._kernels`) and the second-order sweep of :mod:`divjac.torch._taylor.sweep`; under
``torch.compile`` the setup of a call is evaluated ahead of dynamo's trace
(:mod:`divjac.torch._compile_setup`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import torch
from torch import nn

from .._backend import Backend, Entries, Linear, Point
from .._core import settings
from .._core.detection import LRU
from .._core.plan import Chunks
from .._errors import CompileError, FastPathWarning, OptionError, warn_at_caller
from . import _ddp
from ._compat import (
    COMPILES,
    SPARSE_WARNINGS,
    inference_mode_enabled,
    is_compiled_module,
    is_generator,
    mark_constant_result,
    original_module,
    pytree,
    under_transform,
)
from ._compile_setup import Ahead, compiling, constant, prepared
from ._detect import trace
from ._kernels import differentiable_kernels
from ._passes import Passes, Tape, _checkpointed, on_graph, recomputed, split_aux
from ._resident import resident
from ._taylor import high as _taylor_high, sparse as _taylor_sparse, sweep as _taylor
from ._traced import TensorSpec, Traced

__all__ = ["BACKEND", "TorchBackend"]

R = TypeVar("R")

# Seed matrices (passes x elements) up to this size are built once and sliced by vmap.
_SEED_MATRIX_ELEMENTS = 1 << 22
# The seeds of recent plans (keyed by the coloring's identity, which the cached pattern keeps).
_SEEDS: LRU[tuple[Any, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = LRU(16)


@dataclass(frozen=True)
class _Indicator:
    """The indicator of a pass from its input: the input itself (a row of the seed matrix),
    or where the ``labels`` of the elements are the pass's index (a value, not a closure: it
    goes through :func:`constant`)."""

    labels: torch.Tensor | None
    dtype: torch.dtype

    def __call__(self, c: torch.Tensor) -> torch.Tensor:
        return c if self.labels is None else (self.labels == c).to(self.dtype)


@dataclass(frozen=True)
class _DiagonalSums:
    """The finish of a divergence pass: the pushed tangent masked by the (indicator) tangent
    itself, summed per sample."""

    batch_size: int

    def __call__(self, c: torch.Tensor, t: torch.Tensor, pushed: torch.Tensor) -> torch.Tensor:
        masked = pushed * t
        if masked.numel() == 0:  # empty samples
            return masked.new_zeros(self.batch_size)
        return masked.reshape(self.batch_size, -1).sum(1)


# Argument types that are leaves of torch's pytrees (no flattening needed).
_LEAVES = frozenset({torch.Tensor, nn.Parameter, int, float, bool, str, type(None)})


def _normal_tensors() -> contextlib.AbstractContextManager[Any]:
    """Leaves ``torch.inference_mode`` where it is on, for tensors that outlive the call."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(mode=False)
    return contextlib.nullcontext()


@functools.lru_cache(maxsize=16)
def _flat_tree(n: int) -> Any:
    """The tree of ``(args, kwargs)`` for ``n`` leaf arguments and no keywords (one object)."""
    return pytree.tree_structure((tuple(range(n)), {}))


def _trace(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argnum: int,
    batch_axis: int | None,
    has_aux: bool,
) -> Traced:
    if not kwargs and all(type(a) in _LEAVES for a in args):  # f(t, x): no tree to flatten
        leaves, treedef, x_leaf = list(args), _flat_tree(len(args)), argnum
    else:
        leaves, treedef = pytree.tree_flatten((args, kwargs))
        x_leaf = len(pytree.tree_leaves(args[:argnum]))
    traced = trace(fun, leaves, treedef, x_leaf=x_leaf, batch_axis=batch_axis, has_aux=has_aux)
    if Ahead.active:
        _check_compilable(traced)
    return traced


def _kept(backend: TorchBackend, setup: Callable[..., R], point: Point[Traced], static: Any) -> R:
    """``setup(point, *static)``, evaluated once per trace and context, as under
    ``torch.compile`` (once per compilation, sound under dynamo's guards). A setup reads the
    trace (structure, detections, measured directions), the spec and its static arguments,
    and of the call its context alone (:func:`_context`). Not the values of the tensors: the
    trace is the function's at the call's static arguments. A setup that raises is evaluated
    again at the next call (and raises again)."""
    call: Any = point  # a Call: its spec
    context = point.facts.get("context")
    if context is None:
        context = point.facts["context"] = _context(backend, point)
    key = (setup, static, call.spec.options, context)
    plans = point.traced.plans
    try:
        found = plans.get(key)
    except TypeError:  # an unhashable static argument: evaluated at every call
        return setup(point, *static)
    if found is None:
        found = (setup(point, *static),)
        plans.put(key, found)
    return cast(R, found[0])


def _context(backend: TorchBackend, point: Point[Traced]) -> tuple[Any, ...]:
    """What a kept setup reads of a call, worked out once per call (its setups run in the same
    context): the differentiated input's type, shape, dtype and device, whether the passes go
    on the autograd graph (grad mode, what requires grad), inference mode, a ``torch.func``
    transform around, and the memory the passes may use (the device's free memory,
    :func:`~divjac._core.settings.read`)."""
    xb = point.xb
    return (
        on_graph(point),
        torch.is_inference_mode_enabled(),
        not under_transform(),
        type(xb),
        xb.shape,
        xb.dtype,
        xb.device,
        backend.memory_available(xb),
        settings.read(),
    )


def _check_compilable(traced: Traced) -> None:
    """Raise :class:`CompileError` for what the passes cannot do under ``torch.compile`` (and
    :class:`DDPError` for modules that would train unsynchronized). The facts the compiled
    passes read of the trace are computed here (dynamo reads them as constants, and calls no
    method of the trace)."""
    _ddp.check_synchronized(traced.modules)
    differentiable_kernels(traced)
    _ = traced.forward_less  # (reverse passes read it: rows one by one)
    if traced.draws_random:
        what = "draws random numbers (dropout in training mode, randn)"
    elif traced.batch_norms:
        what = (
            "runs batch normalization in training mode (its running statistics are kept still "
            "in the passes)"
        )
    elif traced.runs_rnn:
        what = (
            "runs a recurrent layer (nn.LSTM, nn.GRU, nn.RNN), whose passes switch oneDNN and "
            "cuDNN off (their kernels have no forward derivative), which dynamo cannot trace"
        )
    elif traced.versioned:
        what = (
            "captures integer or boolean tensors (indices, masks) whose values sparsity "
            "detection reads, and dynamo does not guard on values"
        )
    else:
        return
    raise CompileError(
        f"divjac under torch.compile: the function {what}, which divjac's compiled passes do "
        "not support. Call the divjac transform outside the compiled region (or under "
        "torch.compiler.disable), or put the module in eval mode."
    )


@mark_constant_result  # evaluated by dynamo, which says what it raised
def _refuse_compile() -> None:
    raise CompileError(
        f"divjac under torch.compile needs 2.13 or a later torch (this is {torch.__version__}, "
        "whose dynamo cannot evaluate divjac's setup ahead of its trace: it passes no module or "
        "other object to a function marked assume_constant_result, pytorch/pytorch#173103). "
        "Call the divjac transform outside the compiled region (or under "
        "torch.compiler.disable), or upgrade to torch>=2.13."
    )


class TorchBackend(Backend[Traced]):
    """The transforms on torch tensors and modules (``torch.func.jvp``, ``vjp``, ``vmap``)."""

    array_noun = "tensor"
    param_grad_hint = "call .backward() on a loss built on the result"
    input_cast_hint = "x.float()"
    output_cast_hint = "cast integer or boolean results with .float()"
    randomness_example = "torch.Generator().manual_seed(0)"
    # Training through the exact divergence of an MLP d -> 256 -> 256 -> d, 2 threads: 1.2-1.3x
    # faster in the cache's chunks than in one chunk (d = 64, B = 256; d = 256, B = 64); JAX's
    # ran as fast as one chunk (and it keeps its default: one chunk under a gradient).
    cache_chunks_on_graph = True

    def is_array(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def is_array_spec(self, x: Any) -> bool:
        return isinstance(x, TensorSpec)

    def is_floating_input(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def is_floating_output(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point or dtype.is_complex

    def itemsize(self, x: torch.Tensor) -> int:
        return x.element_size()

    def asarray(self, x: Any, like: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.dtype == like.dtype and x.device == like.device:
            return x
        return torch.as_tensor(x, dtype=like.dtype, device=like.device)

    def differentiable(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor made under ``torch.inference_mode`` (an inference tensor), differentiated
        (or kept for a gradient: probes) outside it: a copy, which autograd records (torch
        refuses the tensor itself: no ``requires_grad_``, nothing saved for a backward), as
        users write by hand (``x.clone()``). Under ``torch.compile``, which traces no
        inference tensor: itself."""
        if not compiling() and x.is_inference() and not torch.is_inference_mode_enabled():
            return x.clone()
        return x

    def moveaxis(self, x: torch.Tensor, source: int, destination: int) -> torch.Tensor:
        return x if source == destination else torch.movedim(x, source, destination)

    def zeros_like(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def concatenate(self, arrays: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(arrays))

    def stack(self, arrays: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(list(arrays))

    def per_sample(self, fn: Callable[[torch.Tensor], Any], xb: torch.Tensor) -> torch.Tensor:
        return torch.func.vmap(fn)(xb)

    def map_stacked(
        self, fn: Callable[[torch.Tensor], torch.Tensor], xs: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        """Under ``torch.compile``, ``xs``'s leading axis is a batch axis (``vmap``, ``chunk``
        at a time: dynamo would unroll a loop into one program per element); eagerly, a loop."""
        if compiling():
            return torch.func.vmap(fn, chunk_size=chunk)(xs)
        return super().map_stacked(fn, xs, chunk)

    def functional(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """A ``torch.compile``d module (an ``OptimizedModule``) is its original module. Any
        other ``fun`` is returned from here, not from a call (dynamo, tracing this under
        ``torch.compile``, then keeps its source, which reading its closure needs)."""
        return cast(Callable[..., Any], original_module(fun)) if is_compiled_module(fun) else fun

    def recomputes_chunks(self, point: Point[Traced]) -> bool:
        """Passes on the autograd graph are checkpointed chunk by chunk (:func:`_checkpointed`)."""
        return recomputed(point)

    def rows_overhead_only(self, point: Point[Traced]) -> bool:
        """Eagerly (not under ``torch.compile``), in a convolution network: its rows share the
        forward pass recorded once, and ``vmap`` over its backward batches kernels that are
        large already (a convolution's) or whose batching rule is slower than the kernel run
        row by row (BatchNorm's backward in eval mode), so a batch of large rows runs slower than the same rows one by one."""
        return not compiling() and point.traced.has_convolution

    def memory_available(self, x: torch.Tensor) -> int | None:
        """The free memory of a CUDA device (``torch.cuda.mem_get_info``); ``None`` elsewhere."""
        if x.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(x.device)
        return int(free)

    def trace(
        self,
        fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        argnum: int,
        batch_axis: int | None,
        has_aux: bool,
    ) -> Traced:
        if compiling():
            if not COMPILES:
                _refuse_compile()
            return constant(_trace, fun, args, kwargs, argnum, batch_axis, has_aux)
        traced = _trace(fun, args, kwargs, argnum, batch_axis, has_aux)
        if not torch.is_grad_enabled() and traced.nests:
            warn_at_caller(
                "divjac: the function runs an nn.TransformerEncoder with enable_nested_tensor="
                "True in eval mode; without gradients (no_grad, inference_mode) and with a "
                "src_key_padding_mask, PyTorch runs its nested-tensor fast path, which returns "
                "zeros at the padded positions, while divjac differentiates (and returns) the "
                "path with gradients, whose values there are the layers' own: the value and "
                "the divergence of a padded sample differ from the fast path's. Build the "
                "encoder with enable_nested_tensor=False for one behaviour in every context, "
                "or mask the padded positions of the results.",
                FastPathWarning,
            )
        return traced

    def ahead(self, setup: Callable[..., R], point: Point[Traced], *static: Any) -> R:
        """Under ``torch.compile``: evaluated once, when dynamo traces the call, on the call
        prepared again from its (example) inputs. Eagerly: kept with the trace, per context
        (:func:`_kept`), so that a steady-state call plans nothing again."""
        if not compiling():
            return _kept(self, setup, point, static)
        call: Any = point  # a Call: its spec prepares it again
        return constant(prepared, setup, call.spec, call.args, call.kwargs, static)

    def prefer_reverse(self, point: Point[Traced], *, measure: bool = False) -> bool:
        """Columns where a linear solve broadcasts its matrix over a batch of right-hand sides
        (PyTorch's ``vmap`` of its gradient fails, torch 2.13). Otherwise, with ``measure``
        (many passes to come, at least :data:`MEASURED_FROM`), the direction a few timed
        passes of each find faster (:func:`_measured_reverse`, once per traced program and
        context); else rows, but columns for a convolution network: PyTorch's reverse mode runs
        one forward pass then batched backward passes, faster on dense layers (MLPs: ~20%),
        while its batched convolution backward is often the slower one (3-7x on a blur; a
        U-Net with attention and GroupNorm is the other way round, 1.5-1.7x). Rows, whatever
        their speed, where the program runs an operation whose forward derivative PyTorch
        computes inaccurately (:func:`~divjac.torch._aten.forward_derivative_inexact`:
        ``logcumsumexp``, off by ~1e-6 in float64)."""
        traced = point.traced
        if traced.solves_broadcast:
            return False
        if traced.forward_inexact:
            return True
        guess = not traced.has_convolution
        if not (measure and _measurable(point)):
            return guess
        key = (on_graph(point), torch.is_inference_mode_enabled(), point.xb.device)
        if key not in traced.directions:
            traced.directions[key] = _measured_reverse(self, point)
        return traced.directions[key]

    def forward_less(self, point: Point[Traced]) -> frozenset[str]:
        """The operations without a forward derivative, and, where a gradient will flow
        through the passes (:func:`on_graph`: training, ``grad_divergence``), those whose
        forward derivative PyTorch does not differentiate right (linalg solves, determinants)."""
        traced = point.traced
        if on_graph(point):
            return traced.forward_less | traced.forward_twice_wrong
        return traced.forward_less

    def pass_elements(self, point: Point[Traced]) -> int:
        """Where the passes go on the autograd graph (:func:`on_graph`), what a pass keeps
        for the backward, which recomputes it chunk by chunk (:func:`_checkpointed`):
        :attr:`~divjac.torch._traced.Traced.graph_elements` (under ``torch.compile``, whose
        partitioner decides, the program's own estimate)."""
        if recomputed(point):
            return point.traced.graph_elements
        return point.traced.pass_elements

    def checkpointed(self, chunks: Chunks) -> Callable[[Callable[..., R]], Callable[..., R]]:
        return _checkpointed(chunks)

    def pull_hessian_rows(self, point: Point[Traced]) -> bool:
        """Also where the gradient runs an operation whose forward derivative PyTorch computes
        inaccurately (:func:`~divjac.torch._aten.forward_derivative_inexact`)."""
        return bool(self.forward_less(point) or point.traced.forward_inexact)

    def linearize(self, point: Point[Traced], *, reverse: bool) -> Linear:
        """Rows on the autograd tape outside ``torch.func`` transforms, ``torch.compile`` and
        ``torch.inference_mode`` (which no tape records, not even under ``enable_grad``: its
        rows would all be zeros), else (and columns) by ``torch.func`` passes, which
        differentiate under inference mode too, inference tensors included. Under
        ``torch.compile`` the modules were checked synchronized when the setup traced the
        function (:func:`_check_compilable`)."""
        if compiling():
            return Passes(point, reverse)
        _ddp.check_synchronized(point.traced.modules)
        if reverse and not under_transform() and not inference_mode_enabled():
            return Tape(point)
        return Passes(point, reverse)

    def first_order_by_sweep(self) -> bool:
        """Under ``torch.compile``: a JVP in the program of a reverse sweep (see
        :func:`~divjac.torch._taylor.second_order_sweep`) of a function multiplying by a
        parameter crashes inductor (torch 2.13, a segmentation fault)."""
        return compiling()

    def second_order_sweep(
        self,
        f: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        *,
        weights: torch.Tensor | None,
        collapse: bool,
        traced: Traced | None = None,
        point: Point[Traced] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _taylor.second_order_sweep(
            f,
            x,
            directions,
            weights=weights,
            collapse=collapse,
            traced=traced,
            point=point,
        )

    def taylor_sweep(
        self,
        f: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        order: int,
        *,
        weights: torch.Tensor | None,
        chunk: int,
    ) -> torch.Tensor | None:
        """Chunks of ``chunk`` directions, one after the other; ``None`` where the program
        has an operation without a rule of :mod:`divjac.torch._taylor.high` (or cannot run)."""
        return _taylor_high.taylor_sweep(f, x, directions, order, weights=weights, chunk=chunk)

    def sparse_laplacian(
        self,
        f: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        passes: int,
        budget: int,
        point: Point[Traced] | None = None,
    ) -> torch.Tensor | None:
        return _taylor_sparse.sparse_laplacian(f, x, passes, budget, point)

    def grad_of_sum(
        self, fn: Callable[[torch.Tensor], Any], x: torch.Tensor, *, has_aux: bool
    ) -> Any:
        x = self.differentiable(x)
        if has_aux:
            tensors_only, rebuild = split_aux(fn)

            def summed_and_aux(x: torch.Tensor) -> tuple[torch.Tensor, Any]:
                values, tensors = tensors_only(x)
                return torch.sum(values), tensors

            grad, tensors = torch.func.grad(summed_and_aux, has_aux=True)(x)
            return grad, rebuild(tensors)
        return torch.func.grad(lambda x: torch.sum(fn(x)))(x)

    def indicators(
        self,
        colors: np.ndarray | None,
        n: int,
        n_passes: int,
        like: torch.Tensor,
        *,
        indexed: bool = True,
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """Small seed matrices are built once (and cached) and sliced by ``vmap``; larger ones
        are built one row per pass, from the pass index. No finish of this backend reads a
        pass's input (the divergence masks with the tangent), so ``indexed`` is not needed."""
        device, dtype = like.device, like.dtype
        key = (None if colors is None else id(colors), n, n_passes, device, dtype)
        cached = _SEEDS.get(key)
        if cached is not None and cached[0] is colors:
            return cached[1], cached[2]
        labels = np.arange(n) if colors is None else np.asarray(colors, np.int64)
        # Made as normal tensors even under inference_mode: a cached inference tensor would
        # fail every later call that records a graph (torch refuses to save one for backward).
        with _normal_tensors():
            labels_t = torch.as_tensor(labels, device=device)
            passes = torch.arange(n_passes, device=device)
            if n_passes * n <= _SEED_MATRIX_ELEMENTS:
                inputs = (labels_t[None, :] == passes[:, None]).to(dtype)
                indicator = _Indicator(None, dtype)
            else:
                inputs, indicator = passes, _Indicator(labels_t, dtype)
        _SEEDS.put(key, (colors, inputs, indicator))
        return inputs, indicator

    def arange(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.arange(n, device=like.device)

    def on_device(self, host: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return resident(host, like.device)

    def one_hot(self, i: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
        return (torch.arange(n, device=like.device) == i).to(like.dtype)

    def take_sample(self, rows: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        own = (torch.arange(rows.shape[0], device=rows.device) == i).to(rows.dtype)
        return (rows * own[:, None]).sum(0)

    def diagonal_sums(
        self, colors: np.ndarray | None, n_seed: int, batch_size: int, batched: bool
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """Masks the pushed tangent with the (indicator) tangent itself."""
        return _DiagonalSums(batch_size)

    def held_entries(self, entries: Entries, like: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Made ahead of dynamo's trace (which runs no NumPy of the plan): the index tensors,
        constants of the compiled graph. Eagerly ``None``: made once per host array
        (:func:`resident`)."""
        if not Ahead.active:
            return None
        host = (entries.which, entries.within, entries.rows, entries.cols)
        return tuple(torch.as_tensor(a, device=like.device) for a in host)

    def take_entries(
        self,
        compressed: torch.Tensor,
        entries: Entries,
        held: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        device = compressed.device
        if held is not None:
            return compressed[held[0], :, held[1]].T
        which, within = resident(entries.which, device), resident(entries.within, device)
        return compressed[which, :, within].T

    def densify(
        self,
        values: torch.Tensor,
        entries: Entries,
        shape: tuple[int, int, int],
        held: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        B, n_out, n_in = shape
        device = values.device
        if held is not None:
            flat = held[2] * n_in + held[3]
        else:
            flat = resident(entries.rows, device) * n_in + resident(entries.cols, device)
        dense = values.new_zeros(B, n_out * n_in).index_copy(1, flat, values)
        return dense.reshape(B, n_out, n_in)

    def is_randomness(self, x: Any) -> bool:
        """A ``torch.Generator``, or ``None`` for torch's global generator (of ``x``'s device)."""
        return x is None or is_generator(x)

    def draw(
        self,
        randomness: torch.Generator | None,
        shape: Sequence[int],
        distribution: str,
        like: torch.Tensor,
    ) -> torch.Tensor:
        device, dtype = like.device, like.dtype
        shape = tuple(shape)
        at = device if randomness is None else randomness.device
        if distribution == "rademacher":
            bits = torch.randint(0, 2, shape, generator=randomness, device=at)
            return (2 * bits - 1).to(device=device, dtype=dtype)
        raw = torch.randn(shape, generator=randomness, device=at, dtype=dtype)
        return raw.to(device)

    def sparse_format(self, layout: torch.layout | None) -> torch.layout:
        """``torch.sparse_coo`` (the default) or ``torch.sparse_csr``; not under
        ``torch.compile`` (dynamo traces no sparse tensor, torch 2.13)."""
        if compiling():
            raise CompileError(
                "sparse_jacobian cannot run under torch.compile (dynamo does not trace "
                "torch's sparse tensors, torch 2.13). Call it outside the compiled function, "
                "or compile jacobian(f, mode='sparse'), which computes the same nonzeros in "
                "as many passes and returns them dense."
            )
        if layout is None:
            return torch.sparse_coo
        if layout not in (torch.sparse_coo, torch.sparse_csr):
            raise OptionError(
                "sparse_jacobian: layout must be torch.sparse_coo or torch.sparse_csr; "
                f"got {layout}."
            )
        return layout

    def sparse_matrix(
        self,
        entries: Entries,
        values: torch.Tensor,
        shape: tuple[int, int, int],
        *,
        single: bool,
        sparse_format: torch.layout,
    ) -> torch.Tensor:
        with warnings.catch_warnings():  # we only build it, with our own valid indices
            for message in SPARSE_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            if sparse_format == torch.sparse_csr:
                return _csr(entries.rows, entries.cols, values, shape, single)
            return _coo(entries.rows, entries.cols, values, shape, single)


def _coo(
    rows: np.ndarray,
    cols: np.ndarray,
    values: torch.Tensor,
    shape: tuple[int, int, int],
    single: bool,
) -> torch.Tensor:
    """A batched COO tensor (every sample shares the pattern) of values ``(B, nnz)``."""
    B, n_out, n_in = shape
    device = values.device
    pair = torch.stack([resident(rows, device), resident(cols, device)])
    if single:
        return torch.sparse_coo_tensor(
            pair, values[0], (n_out, n_in), is_coalesced=True, check_invariants=False
        )
    nnz = pair.shape[1]
    batch = torch.arange(B, device=device).repeat_interleave(nnz)
    indices = torch.cat([batch[None], pair.repeat(1, B)])
    return torch.sparse_coo_tensor(
        indices, values.reshape(-1), shape, is_coalesced=True, check_invariants=False
    )


def _csr(
    rows: np.ndarray,
    cols: np.ndarray,
    values: torch.Tensor,
    shape: tuple[int, int, int],
    single: bool,
) -> torch.Tensor:
    """A batched CSR tensor (every sample shares the pattern) of values ``(B, nnz)``, its
    nonzeros in row-major order (each row's first at the count of those in earlier rows)."""
    B, n_out, n_in = shape
    device = values.device
    rows_t = resident(rows, device)
    crow_t = torch.searchsorted(rows_t, torch.arange(n_out + 1, device=device))
    col_t = resident(cols, device)
    if single:
        return torch.sparse_csr_tensor(
            crow_t, col_t, values[0], (n_out, n_in), check_invariants=False
        )
    return torch.sparse_csr_tensor(
        crow_t.expand(B, -1),
        col_t.expand(B, -1),
        values,
        (B, n_out, n_in),
        check_invariants=False,
    )


BACKEND = TorchBackend()


MEASURED_FROM = 64
"""Passes (input elements of a square Jacobian) from which ``auto`` times both directions."""

_TIMED = 4
"""Passes timed per direction (after one untimed run of them)."""

_ROUNDS = 3
"""Timed runs per direction, of which the fastest counts."""


def _measurable(point: Point[Traced]) -> bool:
    """Whether timing a few passes of each direction is possible and harmless here: eagerly
    (no compile, no functorch transform around), a square Jacobian of at least
    :data:`MEASURED_FROM` elements, no random draws to repeat (dropout: the caller's random
    stream stays as it was) and no process group whose ranks must take the same path."""
    in_n, out_n = math.prod(point.in_sample), math.prod(point.out_sample)
    return (
        in_n == out_n >= MEASURED_FROM
        and not compiling()
        and not under_transform()
        and not point.traced.draws_random
        and not (torch.distributed.is_available() and torch.distributed.is_initialized())
    )


def _measured_reverse(backend: TorchBackend, point: Point[Traced]) -> bool:
    """Whether :data:`_TIMED` pushed rows (VJPs) take less time than as many columns (JVPs):
    after one untimed run of each (kernels warm up, rows record the tape), the best of
    :data:`_ROUNDS` runs, alternating; on one sample's tangents of ones shared by the batch,
    as a plan's seeds are, in the caller's context. Their results are dropped. A direction
    whose passes fail here (``tensor_split`` at tensor indices has no batched forward
    derivative) leaves the other one, which then runs, or reports, the real passes."""
    linears, seconds = {}, {False: math.inf, True: math.inf}
    for reverse in (False, True):
        sample = point.out_sample if reverse else point.in_sample
        tangents = point.xb.new_ones((_TIMED, *sample))
        linears[reverse] = functools.partial(
            backend.linearize(point, reverse=reverse).passes,
            tangents,
            _as_is,
            _last,
            Chunks(_TIMED),
            shared=True,
        )
        try:
            linears[reverse]()
        except Exception:  # any failure of a trial: the other direction
            return not reverse
    for _ in range(_ROUNDS):
        for reverse, run in linears.items():
            start = time.perf_counter()
            run()
            seconds[reverse] = min(seconds[reverse], time.perf_counter() - start)
    return seconds[True] < seconds[False]


def _as_is(seed: torch.Tensor) -> torch.Tensor:
    return seed


def _last(c: torch.Tensor, t: torch.Tensor, pushed: torch.Tensor) -> torch.Tensor:
    return pushed.detach()
