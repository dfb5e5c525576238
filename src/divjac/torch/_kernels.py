"""The kernels the passes run in: contexts and function modes that put in place of torch's
kernels that forward-mode AD, ``vmap`` or double backward cannot go through (torch 2.13) other
forms with the same values (:func:`differentiable_kernels`), and the normalization kernels
composed of torch's own decompositions (:func:`composed_norm`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ._aten import located, packet, storage_positions
from ._compat import decomposition_table
from ._compile_setup import compiling
from ._detect import plain_kernels
from ._side_effects import NoFastPaths
from ._traced import LAYOUTS, Traced

__all__ = ["PlainLayouts", "composed_norm"]


def differentiable_kernels(
    traced: Traced, *, forward: bool = False
) -> tuple[contextlib.AbstractContextManager[Any], ...]:
    """Kernels that forward-mode AD, ``vmap`` and double backward go through: attention in its
    math form (the fused CPU and CUDA kernels have no forward derivative, nor batching rules
    for their gradients) and without the fast paths of :class:`NoFastPaths`, recurrent layers
    without oneDNN and cuDNN (whose kernels have no forward derivative), the normalizations of
    :class:`ComposedNorms` (layer and instance normalizations in forward passes, and in
    reverse passes under grad mode, whose results may be differentiated twice more), the
    memory formats of :class:`PlainLayouts`, and the strided scatters of
    :class:`_ComposedScatters`. Only where the
    graph has them (entering the contexts is not free). Separate contexts, entered in one ``with``
    statement (dynamo traces those, not an ``ExitStack``)."""
    composed = forward or torch.is_grad_enabled()
    norms = traced.norms if composed else traced.norms & {"strided_group"}
    special = traced.attends or traced.runs_rnn or norms or traced.lays_out
    if not (special or traced.scatters_strided or compiling()):
        return _PLAIN  # (most graphs: no context to make per call)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return (
        sdpa_kernel(SDPBackend.MATH) if traced.attends else contextlib.nullcontext(),
        NoFastPaths() if traced.attends else contextlib.nullcontext(),
        plain_kernels(cudnn=True) if traced.runs_rnn else contextlib.nullcontext(),
        ComposedNorms(layer_and_instance=composed) if norms else contextlib.nullcontext(),
        PlainLayouts() if traced.lays_out else contextlib.nullcontext(),
        _ComposedScatters() if traced.scatters_strided else contextlib.nullcontext(),
    )


# The kernels of a graph that needs none of them, outside ``torch.compile`` (a null context
# can be entered again and again, by any number of calls at once).
_PLAIN: tuple[contextlib.AbstractContextManager[Any], ...] = (contextlib.nullcontext(),) * 6


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
    out = without_overlap(input)
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


class ComposedNorms(TorchFunctionMode):
    """Normalizations whose torch kernels fail the passes, run in other forms with the same
    values (torch 2.13):

    - a group normalization of a non-contiguous input (the transposed output of an attention
      block, in a diffusers ``UNet2DModel``) on a contiguous copy: torch's forward derivative
      of ``native_group_norm`` views its input and fails, and its backward under ``vmap`` asks
      for the input's memory format, which ``vmap`` cannot tell;
    - with ``layer_and_instance``, layer and instance normalizations composed of means and
      variances: the gradient of the forward derivative of their kernels is wrong, and so is
      the derivative of their double backward, a third derivative (the kernels treat the
      saved statistics as constants, pytorch/pytorch#175754, #186256), so ``grad_divergence``
      and a loss on a divergence or a Hessian would get wrong gradients.
    """

    def __init__(self, layer_and_instance: bool) -> None:
        super().__init__()
        self._layer_and_instance = layer_and_instance

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
        if self._layer_and_instance and func in _LAYER_NORMS:
            return _layer_norm(*args, **kwargs)
        if (
            self._layer_and_instance and func is torch.native_layer_norm
        ):  # the kernel called directly
            return composed_norm(torch.ops.aten.native_layer_norm.default)(*args, **kwargs)  # type: ignore[misc]
        if self._layer_and_instance and func is F.instance_norm:
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
    name = packet(target)
    decomposed = decomposition_table().get(target) if _NORM_KERNEL.fullmatch(name) else None
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


def without_overlap(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied if elements share memory (an expanded tensor): forward-mode AD writes
    tangents into a tensor of its layout."""
    if any(stride == 0 and size > 1 for stride, size in zip(x.stride(), x.shape, strict=True)):
        return x.contiguous()
    return x
