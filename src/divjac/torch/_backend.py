"""PyTorch's primitives for divjac's transforms, on ``torch.func``.

Passes run together under ``torch.func.vmap``: VJPs pull a batch of cotangents through one
``torch.func.vjp`` (``chunk_size`` at a time); JVPs are pushed by ``torch.func.jvp`` inside the
``vmap``, a chunk at a time. Module parameters are ordinary captured tensors: results stay on the
autograd graph, so a loss built on a divergence backpropagates to them (``loss.backward()``),
and everything composes with ``torch.func`` transforms. Device and dtype follow the
differentiated input. Passes read their own entries with masks.

Random operations of the function (dropout in training mode) draw once per call, whatever the
chunking: every evaluation of the function starts from the state torch's global generators had
when the passes started, so every pass differentiates the same forward pass.

Under ``torch.compile`` the setup of a call (tracing, detection, planning, seeds: what depends
on shapes and static arguments only) is evaluated once per compilation, eagerly, as a constant
(:meth:`TorchBackend.ahead`); dynamo traces only the passes, all by ``torch.func``. The constant
is sound while dynamo's own guards hold: it traces the same function in the passes, so it
guards on what the setup read of it (shapes, dtypes, modules and their modes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from .._backend import Backend, Finish, Linear, Point, Seed
from .._core.detection import LRU
from .._errors import CompileError, OptionError
from . import _ddp
from ._aten import located, packet, storage_positions
from ._detect import plain_kernels, trace
from ._running import NoFastPaths
from ._traced import LAYOUTS, TensorSpec, Traced

__all__ = ["BACKEND", "TorchBackend"]

R = TypeVar("R")

# Seed matrices (passes x elements) up to this size are built once and sliced by vmap.
_SEED_MATRIX_ELEMENTS = 1 << 22
# The seeds of recent plans (keyed by the coloring's identity, which the cached pattern keeps).
_SEEDS: LRU[tuple[Any, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = LRU(16)


class _Passes(Linear):
    """The JVP (or VJP) of the batch-first function, run as vmapped ``torch.func`` passes.

    The function is evaluated by the passes (the VJP's forward pass is shared by all of them);
    ``value`` and ``aux`` are those of the first run.
    """

    def __init__(self, point: Point[Traced], reverse: bool) -> None:
        self._point = point
        self._reverse = reverse
        self._g: Callable[[torch.Tensor], Any] = point.g
        self._aux_of: Callable[[Any], Any] | None = None
        if point.has_aux:
            self._g, self._aux_of = _split_aux(point.g)
        self._vjp: Any = None
        self._traced = point.traced
        self._rng = _Generators(point.xb.device) if self._traced.draws_random else None

    def _keep(self, y: torch.Tensor, aux: Any) -> None:
        if self.value is None:
            self.value, self.aux = y, aux

    def passes(
        self, inputs: torch.Tensor, seed: Seed, finish: Finish, chunk: int, *, shared: bool
    ) -> torch.Tensor:
        point = self._point
        xb, B = _without_overlap(point.xb), point.batch_size
        g, aux_of = self._g, self._aux_of
        n_passes = int(inputs.shape[0])

        def tangent(t: torch.Tensor) -> torch.Tensor:
            # Materialized: batched matmuls of a stride-0 (expanded) tangent fall back to bmm
            # and copies under vmap, ~7% slower on an MLP.
            return t.expand(B, *t.shape).contiguous() if shared else t

        traced = self._traced
        # Under torch.compile no batch normalization runs (_check_compilable).
        quiet = contextlib.nullcontext() if _compiling() else traced.running_stats()
        attention, fused, rnn, norms, layouts, scatters = _differentiable_kernels(
            traced, forward=not self._reverse
        )
        n_chunks = -(-n_passes // chunk)
        checkpointed = _checkpointed(
            point, n_chunks, _pass_contexts(traced, forward=not self._reverse)
        )
        with quiet, attention, fused, rnn, norms, layouts, scatters:
            if self._reverse:
                if self._vjp is None:
                    pulled: Any = torch.func.vjp(g, xb, has_aux=aux_of is not None)
                    y, vjp_fn, aux = pulled if aux_of is not None else (*pulled, None)
                    self._vjp = vjp_fn
                    self._keep(y, aux_of(aux) if aux_of is not None else None)
                vjp_fn = self._vjp

                def pull(c: torch.Tensor) -> torch.Tensor:
                    t = seed(c)
                    return finish(c, t, vjp_fn(tangent(t))[0])

                if not n_passes:
                    return _no_passes(pull, inputs)
                if traced.forward_less:  # one by one, as _Tape says why
                    return torch.stack([pull(c) for c in inputs])
                if n_chunks == 1:
                    return torch.func.vmap(pull)(inputs)
                pulls = checkpointed(torch.func.vmap(pull))
                return torch.cat(
                    [pulls(inputs[lo : lo + chunk]) for lo in range(0, n_passes, chunk)]
                )
            auxes: list[Any] = []

            def push(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                t = seed(c)
                result: Any = torch.func.jvp(g, (xb,), (tangent(t),), has_aux=aux_of is not None)
                if aux_of is not None:
                    auxes.append(result[2])
                return result[0], finish(c, t, result[1])

            # The value is the same in every pass (out_dims None); chunks are run one by one,
            # as vmap's own chunk_size cannot return an unbatched output. Random operations
            # draw once per chunk (shared by its passes), and every chunk the same numbers.
            out_dims: Any = (None, 0)  # torch's annotation says int | tuple[int, ...]
            pushes = torch.func.vmap(push, out_dims=out_dims, randomness="same")
            pushes = checkpointed(pushes)
            parts = []
            for lo in range(0, max(n_passes, 1), chunk):  # no pass: one empty chunk (the value)
                if self._rng is not None:
                    self._rng.rewind()
                if n_passes:
                    y, part = pushes(inputs[lo : lo + chunk])
                else:
                    y, one = push(inputs.new_zeros(inputs.shape[1:]))
                    part = one[None][:0]
                parts.append(part)
            self._keep(y, aux_of(auxes[0]) if aux_of is not None else None)
            return torch.cat(parts) if len(parts) > 1 else parts[0]


class _Generators:
    """The state of torch's global generators (the CPU's, and that of the input's device) when
    the passes of a call start. Every evaluation of the function is rewound to it, so it draws
    what the first one drew, and leaves them where one evaluation does."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._module: Any = None
        if device.type not in ("cpu", "meta"):
            self._module = torch.get_device_module(device.type)
        self._cpu = torch.get_rng_state()
        self._own = None if self._module is None else self._module.get_rng_state(device)

    def rewind(self) -> None:
        torch.set_rng_state(self._cpu)
        if self._own is not None:
            self._module.set_rng_state(self._own, self._device)


class _Tape(Linear):
    """The VJP of the batch-first function on torch's autograd tape, as FFJORD's code does it:
    one forward pass, then ``torch.autograd.grad`` per chunk of cotangents (batched by
    ``vmap``, or one by one for a few). Graphs with an operation that has no forward
    derivative (``cdist``, a ``torch.library`` custom operation) pull every cotangent one by
    one: the backward kernels of such operations are not composed of differentiable
    operations, and their batching rules are wrong (``cdist``'s in torch 2.13) or missing (the
    in-place arithmetic of the chunked ``linear_cross_entropy``'s backward). Outside ``torch.func`` transforms this is
    the fast way to pull rows: ``torch.func.vjp`` wraps every operation of the forward pass
    (about 2 ms per call on FFJORD's ODE function at B=256, against its 1.5 ms of compute).

    With grad mode on (as the caller has it), the passes are on the autograd graph
    (``create_graph``): a loss on the result backpropagates to the parameters and the input.
    With it off, nothing is kept on the graph. The function is evaluated once, so a random
    operation (dropout) draws once.
    """

    def __init__(self, point: Point[Traced]) -> None:
        self._point = point
        self._traced = point.traced
        self._tape: tuple[torch.Tensor, torch.Tensor, bool] | None = None

    def _record(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        point = self._point
        xb = point.xb
        # On the graph only when something the caller has requires grad (the input, an
        # argument or a captured parameter); else the results carry no graph, as torch.func's.
        create = _on_graph(point)
        with torch.enable_grad():
            x = xb if xb.requires_grad else xb.detach().requires_grad_()
            out = point.g(x)
        y, aux = out if point.has_aux else (out, None)
        if create:
            self.value, self.aux = y, aux
        else:
            self.value = y.detach()
            self.aux = (
                None
                if aux is None
                else pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, aux)
            )
        return x, y, create

    def _pull(
        self, tape: tuple[torch.Tensor, torch.Tensor, bool], cotangent: torch.Tensor
    ) -> torch.Tensor:
        x, y, create = tape
        if not y.requires_grad:  # the output depends on neither x nor parameters
            return x.new_zeros(x.shape)
        if cotangent.dtype != y.dtype:
            cotangent = cotangent.to(y.dtype)
        (pulled,) = torch.autograd.grad(
            y,
            x,
            cotangent,
            retain_graph=True,
            create_graph=create,
            allow_unused=True,
        )
        if pulled is None:  # no gradient reached x
            if self._traced.custom_ops:
                raise OptionError(
                    "divjac: the function's output depends on its input through "
                    f"{', '.join(sorted(self._traced.custom_ops))}, a torch.library custom "
                    "operation, but torch's autograd gives the input no gradient through it. "
                    "Its Python wrapper may have decided, under torch.func.vmap, that nothing "
                    "requires grad (batched tensors report requires_grad=False; torch 2.13's "
                    "chunked linear_cross_entropy computes no input gradient then): call it "
                    "outside vmap (batch_axis instead), or use its reference path "
                    "(linear_cross_entropy with options=None)."
                )
            return x.new_zeros(x.shape)
        return pulled

    def passes(
        self, inputs: torch.Tensor, seed: Seed, finish: Finish, chunk: int, *, shared: bool
    ) -> torch.Tensor:
        B = self._point.batch_size

        def one(c: torch.Tensor) -> torch.Tensor:
            t = seed(c)
            return finish(c, t, self._pull(tape, t.expand(B, *t.shape) if shared else t))

        def pulled(cs: torch.Tensor) -> torch.Tensor:
            count = int(cs.shape[0])
            if count <= _ONE_BY_ONE or traced.forward_less:
                return torch.stack([one(cs[i]) for i in range(count)])
            # batched backward passes: torch.func's vmap over autograd (is_grads_batched's own
            # vmap lacks batching rules for some backward kernels, GroupNorm's among them)
            return torch.func.vmap(one)(cs)

        traced = self._traced
        parts: list[torch.Tensor] = []
        attention, fused, rnn, norms, layouts, scatters = _differentiable_kernels(traced)
        with traced.running_stats(), attention, fused, rnn, norms, layouts, scatters:
            if self._tape is None:
                self._tape = self._record()
            tape = self._tape
            n_passes = int(inputs.shape[0])
            if not n_passes:
                return _no_passes(one, inputs)
            n_chunks = -(-n_passes // chunk)
            run = _checkpointed(self._point, n_chunks, _pass_contexts(traced))(pulled)
            for lo in range(0, n_passes, chunk):
                parts.append(run(inputs if chunk >= n_passes else inputs[lo : lo + chunk]))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def _no_passes(pull: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    """The result of no passes (``inputs`` holds none): ``pull`` of a zero pass, sliced to none.
    ``vmap`` over an empty batch fails in some kernels (``linalg.det``'s) and in reshapes the
    function makes of an empty sample (``reshape(-1)``)."""
    return pull(inputs.new_zeros(inputs.shape[1:]))[None][:0]


def _on_graph(point: Point[Traced]) -> bool:
    """Whether the results of the passes at ``point`` go on the autograd graph: grad mode is
    on and something the caller has requires grad (the input, an argument or a captured
    parameter)."""
    return torch.is_grad_enabled() and (
        point.xb.requires_grad
        or point.traced.captures_grad()
        or any(
            isinstance(a, torch.Tensor) and a.requires_grad
            for a in pytree.tree_leaves((point.args, point.kwargs))
        )
    )


def _checkpointed(
    point: Point[Traced],
    n_chunks: int,
    contexts: Callable[[], Sequence[contextlib.AbstractContextManager[Any]]] | None = None,
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """A wrapper of the work of one chunk (a function of its tensors) for results that go on
    the autograd graph in more than one chunk (the identity where they do not, and under
    ``torch.compile``, whose partitioner chooses what to recompute): ``torch.utils.checkpoint``
    keeps a chunk's result and its inputs, not its graph, and the backward recomputes the
    chunk with the random numbers it drew, within ``contexts()`` (the kernels and frozen
    running statistics that the chunk ran within). Peak memory then follows the chunk size
    (one chunk's graph at a time, and the function's own, which a tape keeps), at the cost of
    computing every chunk twice when a gradient is taken."""
    if n_chunks < 2 or _compiling() or not _on_graph(point):
        return lambda run: run

    @contextlib.contextmanager
    def recomputing() -> Any:
        with contextlib.ExitStack() as stack:
            for context in contexts() if contexts is not None else ():
                stack.enter_context(context)
            yield

    def context_fn() -> tuple[
        contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
    ]:
        return contextlib.nullcontext(), recomputing()

    def wrap(run: Callable[..., R]) -> Callable[..., R]:
        def checkpointed(*tensors: Any) -> R:
            return cast(R, checkpoint(run, *tensors, use_reentrant=False, context_fn=context_fn))

        return checkpointed

    return wrap


def _pass_contexts(
    traced: Traced, *, forward: bool = False
) -> Callable[[], tuple[contextlib.AbstractContextManager[Any], ...]]:
    """The contexts the passes run within (for their recomputation), made anew per call."""
    return lambda: (traced.running_stats(), *_differentiable_kernels(traced, forward=forward))


# Chunks of up to this many passes pull their cotangents one by one (no vmap to set up).
_ONE_BY_ONE = 4


def _differentiable_kernels(
    traced: Traced, *, forward: bool = False
) -> tuple[contextlib.AbstractContextManager[Any], ...]:
    """Kernels that forward-mode AD, ``vmap`` and double backward go through: attention in its
    math form (the fused CPU and CUDA kernels have no forward derivative, nor batching rules
    for their gradients) and without the fast paths of :class:`NoFastPaths`, recurrent layers
    without oneDNN and cuDNN (whose kernels have no forward derivative), the normalizations of
    :class:`_ComposedNorms`, the memory formats of :class:`PlainLayouts`, and the strided
    scatters of :class:`_ComposedScatters`. Only where the
    graph has them (the contexts cost ~25 us). Separate contexts, entered in one ``with``
    statement (dynamo traces those, not an ``ExitStack``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    norms = traced.norms if forward else traced.norms & {"strided_group"}
    return (
        sdpa_kernel(SDPBackend.MATH) if traced.attends else contextlib.nullcontext(),
        # (dynamo refuses to trace the switch: under torch.compile the fast paths are as the
        # compiled code has them, off with grad on)
        NoFastPaths() if traced.attends and not _compiling() else contextlib.nullcontext(),
        plain_kernels(cudnn=True) if traced.runs_rnn else contextlib.nullcontext(),
        _ComposedNorms(forward) if norms else contextlib.nullcontext(),
        PlainLayouts() if traced.lays_out else contextlib.nullcontext(),
        _ComposedScatters() if traced.scatters_strided else contextlib.nullcontext(),
    )


class _ComposedScatters(TorchFunctionMode):
    """``as_strided_scatter`` composed of a gather and a ``where`` by storage positions, with
    the same values (torch 2.13): torch's backward of it with respect to its input is wrong
    (it passes the gradient of the elements ``src`` overwrites and drops that of the others),
    and it has no batching rule, so neither rows nor columns could go through it."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _STRIDED_SCATTERS:
            return _as_strided_scatter(*args, **kwargs)
        return func(*args, **kwargs)


_STRIDED_SCATTERS = frozenset({torch.as_strided_scatter, torch.Tensor.as_strided_scatter})


def _as_strided_scatter(
    input: torch.Tensor,
    src: torch.Tensor,
    size: Sequence[int],
    stride: Sequence[int],
    storage_offset: int | None = None,
) -> torch.Tensor:
    """``torch.as_strided_scatter``: the input's values, those at the storage positions of the
    view ``(size, stride, storage_offset)`` replaced by ``src``'s, the output laid out as the
    input (contiguous where its elements share memory, as torch's ``clone_preserve_strides``)."""
    if not src.numel():
        return input.clone()
    out = _without_overlap(input)
    offset = int(input.storage_offset() if storage_offset is None else storage_offset)
    index, written = located(
        storage_positions(input, out.shape, out.stride(), int(out.storage_offset())),
        storage_positions(input, size, stride, offset),
    )
    return torch.where(written, src.reshape(-1)[index], input)


class PlainLayouts(TorchFunctionMode):
    """Memory formats of a given rank (``channels_last``) asked as the contiguous one: under
    ``vmap`` the function runs on tensors with one more axis, which the format does not fit
    (torch 2.13: ``Tensor.to``, ``contiguous``, ``clone``, ``empty_like`` fail). Values do not
    depend on the layout."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("memory_format") in LAYOUTS:
            kwargs = {**kwargs, "memory_format": torch.contiguous_format}
        return func(*args, **kwargs)


class _ComposedNorms(TorchFunctionMode):
    """Normalizations whose torch kernels fail the passes, run in other forms with the same
    values (torch 2.13):

    - a group normalization of a non-contiguous input (the transposed output of an attention
      block, in a diffusers ``UNet2DModel``) on a contiguous copy: torch's forward derivative
      of ``native_group_norm`` views its input and fails, and its backward under ``vmap`` asks
      for the input's memory format, which ``vmap`` cannot tell;
    - in ``forward`` passes, layer and instance normalizations composed of means and
      variances: the gradient of the forward derivative of their kernels is wrong (it treats
      the saved statistics as constants), so ``grad_divergence`` and a loss on a divergence
      would get wrong gradients.
    """

    def __init__(self, forward: bool) -> None:
        super().__init__()
        self._forward = forward

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _GROUP_NORMS and not args[0].is_contiguous():
            return func(args[0].contiguous(), *args[1:], **kwargs)
        if self._forward and func in _LAYER_NORMS:
            return _layer_norm(*args, **kwargs)
        if self._forward and func is torch.native_layer_norm:  # the kernel called directly
            return composed_norm(torch.ops.aten.native_layer_norm.default)(*args, **kwargs)  # type: ignore[misc]
        if self._forward and func is F.instance_norm:
            composed = _instance_norm(*args, **kwargs)
            if composed is not None:
                return composed
        return func(*args, **kwargs)


def _affine(
    y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, shape: Any
) -> torch.Tensor:
    if weight is not None:
        y = y * weight.reshape(shape)
    return y if bias is None else y + bias.reshape(shape)


def _layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *_cudnn_enable: Any,  # torch.layer_norm's last argument
) -> torch.Tensor:
    dims = tuple(range(-len(normalized_shape), 0))
    mean = input.mean(dims, keepdim=True)
    var = input.var(dims, unbiased=False, keepdim=True)
    y = (input - mean) * torch.rsqrt(var + eps)
    return _affine(y, weight, bias, tuple(normalized_shape))


def _instance_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor | None:
    """Instance normalization by its statistics; ``None`` where it uses or updates running
    statistics (torch's kernel then, whose forward derivative treats them as constants, as
    they are)."""
    if not use_input_stats or running_mean is not None or running_var is not None:
        return None
    dims = tuple(range(2, input.ndim))
    mean = input.mean(dims, keepdim=True)
    var = input.var(dims, unbiased=False, keepdim=True)
    y = (input - mean) * torch.rsqrt(var + eps)
    return _affine(y, weight, bias, (-1,) + (1,) * len(dims))


# Every layer, group, batch and RMS normalization kernel, the functional variants a trace
# records included.
_NORM_KERNEL = re.compile(
    r"_?(native_|_native_|fused_)?(layer|group|batch|rms)_norm"
    r"(_legit|_with_update|_no_update)?(_functional|_no_training)?"
)


def composed_norm(target: Any) -> Callable[..., Any] | None:
    """A normalization kernel composed of torch's own decomposition, its differentiability
    kept: for torch's autograd only the normalized value of a layer, batch or RMS
    normalization is differentiable (the saved and running statistics it also returns are
    not), while a group normalization's mean and inverse deviation are (torch 2.13's
    derivatives); ``None``: not such a kernel."""
    from torch._decomp import decomposition_table

    name = packet(target)
    decomposed = decomposition_table.get(target) if _NORM_KERNEL.fullmatch(name) else None
    if decomposed is None or name == "native_group_norm":
        return decomposed

    def composed(*args: Any, **kwargs: Any) -> Any:
        out = decomposed(*args, **kwargs)
        if not isinstance(out, tuple | list):
            return out
        return (out[0], *(o.detach() if isinstance(o, torch.Tensor) else o for o in out[1:]))

    return composed


_GROUP_NORMS = frozenset({F.group_norm, torch.group_norm})
_LAYER_NORMS = frozenset({F.layer_norm, torch.layer_norm})


def _without_overlap(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied if elements share memory (an expanded tensor): forward-mode AD writes
    tangents into a tensor of its layout."""
    if any(stride == 0 and size > 1 for stride, size in zip(x.stride(), x.shape, strict=True)):
        return x.contiguous()
    return x


def _split_aux(
    g: Callable[[torch.Tensor], Any],
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], Any]]:
    """``g`` returning ``(y, tensor leaves of aux)`` (what ``torch.func`` passes through) and
    the function that puts the aux back together with its other leaves (strings, numbers)."""
    box: list[Any] = []

    def tensors_only(xb: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        y, aux = g(xb)
        leaves, treedef = pytree.tree_flatten(aux)
        box[:] = [(leaves, treedef)]
        return y, [a for a in leaves if isinstance(a, torch.Tensor)]

    def rebuild(tensors: list[torch.Tensor]) -> Any:
        leaves, treedef = box[0]
        it = iter(tensors)
        return pytree.tree_unflatten(
            [next(it) if isinstance(a, torch.Tensor) else a for a in leaves], treedef
        )

    return tensors_only, rebuild


@dataclass(frozen=True)
class _Indicator:
    """The indicator of a pass from its input: the input itself (a row of the seed matrix),
    or where the ``labels`` of the elements are the pass's index (a value, not a closure: it
    goes through :func:`_constant`)."""

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


@functools.lru_cache(maxsize=16)
def _flat_tree(n: int) -> Any:
    """The tree of ``(args, kwargs)`` for ``n`` leaf arguments and no keywords (one object)."""
    return pytree.tree_structure((tuple(range(n)), {}))


class _Ahead:
    """Whether a setup is being evaluated ahead of a compiler's trace (then not compiling)."""

    active = False


def _compiling() -> bool:
    """Whether dynamo is tracing the call (not evaluating a setup ahead of it)."""
    return torch.compiler.is_compiling() and not _Ahead.active


def _constant(fn: Callable[..., R], *args: Any) -> R:
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


def _constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` marked as ``torch._dynamo.assume_constant_result`` marks it (dynamo evaluates its
    calls as constants), without importing dynamo (seconds) with divjac."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_constant_result
def _evaluate(fn: Callable[..., Any], positions: tuple[Any, ...], *leaves: Any) -> Any:
    parts = pytree.tree_map(lambda i: leaves[i], positions)
    args = pytree.tree_map(_dataclass, parts, is_leaf=_is_fields)
    _Ahead.active = True
    try:
        result = fn(*args)
    finally:
        _Ahead.active = False

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
    return _constant_result(take)


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


def _prepared(
    setup: Callable[..., R], spec: Any, args: tuple[Any, ...], kwargs: dict[str, Any], static: Any
) -> R:
    """``setup`` of the call of ``spec`` at ``args`` and ``kwargs``, prepared again."""
    from .._call import prepare

    return setup(prepare(spec, args, kwargs), *static)


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
    if _Ahead.active:
        _check_compilable(traced)
    return traced


def _check_compilable(traced: Traced) -> None:
    """Raise :class:`CompileError` for what the passes cannot do under ``torch.compile`` (and
    :class:`DDPError` for modules that would train unsynchronized). The facts the compiled
    passes read of the trace are computed here (dynamo reads them as constants, and calls no
    method of the trace)."""
    _ddp.check_synchronized(traced.modules())
    _differentiable_kernels(traced)
    _ = traced.forward_less  # (reverse passes read it: rows one by one)
    if traced.draws_random:
        what = "draws random numbers (dropout in training mode, randn)"
    elif traced.batch_norms:
        what = "runs batch normalization (its running statistics are kept still in the passes)"
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


class TorchBackend(Backend[Traced]):
    """The transforms on torch tensors and modules (``torch.func.jvp``, ``vjp``, ``vmap``)."""

    array_noun = "tensor"
    param_grad_hint = "call .backward() on a loss built on the result"
    input_cast_hint = "x.float()"
    output_cast_hint = "cast integer or boolean results with .float()"
    randomness_example = "torch.Generator().manual_seed(0)"

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

    def moveaxis(self, x: torch.Tensor, source: int, destination: int) -> torch.Tensor:
        return x if source == destination else torch.movedim(x, source, destination)

    def zeros_like(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def concatenate(self, arrays: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(arrays))

    def functional(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """A ``torch.compile``d module (an ``OptimizedModule``) is its original module."""
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # none before torch.compile
        if eval_frame is not None and isinstance(fun, eval_frame.OptimizedModule):
            return cast(Callable[..., Any], fun._orig_mod)
        return fun

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
        if _compiling():
            return _constant(_trace, fun, args, kwargs, argnum, batch_axis, has_aux)
        return _trace(fun, args, kwargs, argnum, batch_axis, has_aux)

    def ahead(self, setup: Callable[..., R], point: Point[Traced], *static: Any) -> R:
        """Under ``torch.compile``: evaluated once, when dynamo traces the call, on the call
        prepared again from its (example) inputs."""
        if not _compiling():
            return setup(point, *static)
        call: Any = point  # a Call: its spec prepares it again
        return _constant(_prepared, setup, call.spec, call.args, call.kwargs, static)

    def prefer_reverse(self, traced: Traced) -> bool:
        """Rows, but columns for a convolution network: PyTorch's reverse mode runs one
        forward pass then batched backward passes, faster on dense layers (MLPs: ~20%), while
        its batched convolution backward is the slower one (3-7x on a blur). Columns too when
        a linear solve broadcasts its matrix over a batch of right-hand sides: PyTorch's
        ``vmap`` of its gradient fails (torch 2.13)."""
        return not (traced.has_convolution or traced.solves_broadcast)

    def forward_less(self, point: Point[Traced]) -> frozenset[str]:
        """The operations without a forward derivative, and, where a gradient will flow
        through the passes (:func:`_on_graph`: training, ``grad_divergence``), those whose
        forward derivative PyTorch does not differentiate right (linalg solves, determinants)."""
        traced = point.traced
        if _on_graph(point):
            return traced.forward_less | traced.forward_twice_wrong
        return traced.forward_less

    def pass_elements(self, point: Point[Traced]) -> int:
        """Where the passes go on the autograd graph (:func:`_on_graph`), what a pass keeps
        for the backward, which recomputes it chunk by chunk (:func:`_checkpointed`):
        :attr:`~divjac.torch._traced.Traced.graph_elements` (under ``torch.compile``, whose
        partitioner decides, the program's own estimate)."""
        if not _compiling() and _on_graph(point):
            return point.traced.graph_elements
        return point.traced.pass_elements

    def checkpointed(
        self, point: Point[Traced], n_chunks: int
    ) -> Callable[[Callable[..., R]], Callable[..., R]]:
        return _checkpointed(point, n_chunks)

    def pull_hessian_rows(self, point: Point[Traced]) -> bool:
        """Also where the gradient runs an operation whose forward derivative PyTorch computes
        inaccurately (:func:`~divjac.torch._aten.forward_derivative_inexact`)."""
        return bool(self.forward_less(point) or point.traced.forward_inexact)

    def linearize(self, point: Point[Traced], reverse: bool) -> Linear:
        """Rows on the autograd tape outside ``torch.func`` transforms, ``torch.compile`` and
        ``torch.inference_mode`` (which no tape records, not even under ``enable_grad``: its
        rows would all be zeros), else (and columns) by ``torch.func`` passes, which
        differentiate under inference mode too, inference tensors included. Under
        ``torch.compile`` the modules were checked synchronized when the setup traced the
        function (:func:`_check_compilable`)."""
        if _compiling():
            return _Passes(point, reverse)
        _ddp.check_synchronized(point.traced.modules())
        if (
            reverse
            and torch._C._functorch.peek_interpreter_stack() is None
            and not torch.is_inference_mode_enabled()
        ):
            return _Tape(point)
        return _Passes(point, reverse)

    def second_order_sweep(
        self,
        f: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        directions: torch.Tensor,
        *,
        weights: torch.Tensor | None,
        collapse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from . import _taylor  # it runs the traced graph with this module's kernels

        return _taylor.second_order_sweep(f, x, directions, weights=weights, collapse=collapse)

    def grad_of_sum(
        self, fn: Callable[[torch.Tensor], Any], x: torch.Tensor, *, has_aux: bool
    ) -> Any:
        if has_aux:
            tensors_only, rebuild = _split_aux(fn)

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

    def take_entries(
        self, compressed: torch.Tensor, which: np.ndarray, within: np.ndarray
    ) -> torch.Tensor:
        device = compressed.device
        return compressed[
            torch.as_tensor(which, device=device), :, torch.as_tensor(within, device=device)
        ].T

    def densify(
        self,
        values: torch.Tensor,
        rows: np.ndarray,
        cols: np.ndarray,
        shape: tuple[int, int, int],
    ) -> torch.Tensor:
        B, n_out, n_in = shape
        flat = torch.as_tensor(rows * n_in + cols, device=values.device)
        dense = values.new_zeros(B, n_out * n_in).index_copy(1, flat, values)
        return dense.reshape(B, n_out, n_in)

    def is_randomness(self, x: Any) -> bool:
        """A ``torch.Generator``, or ``None`` for torch's global generator (of ``x``'s device)."""
        return x is None or isinstance(x, torch.Generator)

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
        """``torch.sparse_coo`` (the default) or ``torch.sparse_csr``."""
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
        rows: np.ndarray,
        cols: np.ndarray,
        values: torch.Tensor,
        shape: tuple[int, int, int],
        *,
        single: bool,
        sparse_format: torch.layout,
    ) -> torch.Tensor:
        B, n_out, n_in = shape
        device = values.device
        if sparse_format == torch.sparse_csr:
            with warnings.catch_warnings():  # "sparse CSR support is in beta": we only build it
                warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
                return _csr(rows, cols, values, shape, single)
        pair = torch.as_tensor(np.stack([rows, cols]), device=device)
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
    """A batched CSR tensor (every sample shares the pattern) of values ``(B, nnz)``."""
    B, n_out, n_in = shape
    device = values.device
    crow = np.zeros(n_out + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=n_out), out=crow[1:])
    crow_t = torch.as_tensor(crow, device=device)
    col_t = torch.as_tensor(cols, device=device)
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
