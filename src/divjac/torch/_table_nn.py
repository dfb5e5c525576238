"""The table's entries for the operations of neural network layers: normalization, convolutions,
pooling, the gradients of resizes, attention (see :mod:`divjac.torch._table`)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from .._core import rules as D
from .._core.rules import Deps, Op
from ._aten import bind, expand, packet, shape
from ._graph import Graph
from ._table import Extracted, add, tensor_args

__all__ = ["is_convolution"]


# --- normalization ------------------------------------------------------------------------------


def _per_channel(op: Op, first: int, axis: int) -> list[Deps]:
    """The inputs from ``first`` on (per-channel weight, bias, ...) broadcast along ``axis``."""
    x = op.ins[0]
    return [D.broadcast_in_dim(d, x.shape, [axis]) for d in op.ins[first:] if not d.is_empty]


def _stats_outputs(op: Op, stats: Deps) -> list[Deps]:
    """The statistics outputs (mean, inverse deviation) where they fit, else nothing."""
    return [
        D.reshape(stats, s) if op.wants(k) and math.prod(s) == stats.size else op.empty(k)
        for k, s in enumerate(op.out_shapes[1:], 1)
    ]


def _layer_norm(op: Op) -> list[Deps]:
    """Inputs: input, weight, bias (over the last ``k`` axes)."""
    x = op.ins[0]
    axes = list(range(len(x.shape) - op.params["k"], len(x.shape)))
    stats = D.reduce(x, axes, keepdims=True)
    affine = [D.broadcast_to(d, x.shape) for d in op.ins[1:]]
    return [D.union(D.broadcast_to(stats, x.shape), *affine), *_stats_outputs(op, stats)]


def _layer_norm_args(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    return [b["input"], b["weight"], b["bias"]], {"k": len(b["normalized_shape"])}


add(["native_layer_norm"], _layer_norm, _layer_norm_args)


def _group_norm(op: Op) -> list[Deps]:
    """Inputs: input, weight, bias (per channel)."""
    x = op.ins[0]
    n, groups = op.params["n"], op.params["groups"]
    grouped = D.reshape(x, (n, groups, x.size // (n * groups)))
    stats = D.reduce(grouped, [2], keepdims=True)
    out = D.reshape(D.broadcast_to(stats, grouped.shape), x.shape)
    return [D.union(out, *_per_channel(op, 1, 1)), *_stats_outputs(op, stats)]


def _group_norm_args(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    return [b["input"], b["weight"], b["bias"]], {"n": int(b["N"]), "groups": int(b["group"])}


add(["native_group_norm"], _group_norm, _group_norm_args)


def _batch_norm(op: Op) -> list[Deps]:
    """Training mode couples every sample through the per-channel batch statistics.

    Inputs: input, weight, bias, running mean, running variance.
    """
    x = op.ins[0]
    channels = x.shape[1]
    if op.params["training"]:
        stats = D.reduce(x, [0, *range(2, len(x.shape))])
        spread = D.broadcast_in_dim(stats, x.shape, [1])
    else:
        stats, spread = D.empty((channels,), x.n_labels), x
    running = D.union(stats, *(d for d in op.ins[3:] if not d.is_empty))
    return [D.union(spread, *_per_channel(op, 1, 1)), *_stats_outputs(op, running)]


def _batch_norm_args(g: Graph, node: torch.fx.Node) -> Extracted:
    name = packet(node.target)
    b = bind(node)
    if name == "_native_batch_norm_legit_no_training":
        training = False
    elif name.startswith("_batch_norm_with_update"):
        training = True
    elif name == "_batch_norm_no_update":
        training = b.get("running_mean") is None
    else:
        training = bool(b.get("training", True))
    args = [b["input"], b.get("weight"), b.get("bias"), b.get("running_mean"), b.get("running_var")]
    return args, {"training": training}


add(
    ["native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
     "_native_batch_norm_legit_no_training", "_batch_norm_with_update",
     "_batch_norm_with_update_functional", "_batch_norm_no_update", "cudnn_batch_norm",
     "miopen_batch_norm", "batch_norm"],
    _batch_norm,
    _batch_norm_args,
)  # fmt: skip


# --- convolutions -------------------------------------------------------------------------------


def _conv(lhs: Deps, weight: Deps, out_shape: tuple[int, ...], p: dict[str, Any]) -> Deps:
    """``torch`` convolution (NC* layout) in terms of XLA's ``conv_general_dilated``.

    A transposed convolution is a convolution of the stride-dilated input (``lhs_dilation``)
    with padding ``dilation * (k - 1) - padding`` on the low side and whatever the output
    size needs on the high side (output padding, or the input size of a gradient).
    """
    nd = len(weight.shape) - 2
    unbatched = len(lhs.shape) == nd + 1
    if unbatched:
        lhs = D.reshape(lhs, (1, *lhs.shape))
        out_shape = (1, *out_shape)
    spec = tuple(range(nd + 2))
    kernel = weight.shape[2:]
    stride, padding = expand(p["stride"], nd), expand(p["padding"], nd)
    dilation = expand(p["dilation"], nd)
    if not p["transposed"]:
        out = D.conv(
            lhs,
            weight,
            out_shape=out_shape,
            lhs_spec=spec,
            rhs_spec=spec,
            out_spec=spec,
            window_strides=stride,
            padding=[(q, q) for q in padding],
            rhs_dilation=dilation,
            feature_group_count=p["groups"],
        )
    else:
        pads = []
        for size, out, k, s, q, d in zip(
            lhs.shape[2:], out_shape[2:], kernel, stride, padding, dilation, strict=True
        ):
            lo = d * (k - 1) - q
            span = d * (k - 1) + 1
            dilated = (size - 1) * s + 1
            pads.append((lo, out - 1 - dilated - lo + span))
        out = D.conv(
            lhs,
            D.empty(weight.shape, lhs.n_labels),
            out_shape=out_shape,
            lhs_spec=spec,
            rhs_spec=(1, 0, *range(2, nd + 2)),
            out_spec=spec,
            window_strides=[1] * nd,
            padding=pads,
            lhs_dilation=stride,
            rhs_dilation=dilation,
            feature_group_count=p["groups"],
        )
        if not weight.is_empty:
            out = D.union(out, D.dense(out_shape, weight))
    return D.reshape(out, out_shape[1:]) if unbatched else out


def _geometry(b: dict[str, Any], *, transpose: bool = False) -> dict[str, Any]:
    return {
        "stride": b["stride"],
        "padding": b["padding"],
        "dilation": b["dilation"],
        "transposed": bool(b.get("transposed", False)) != transpose,
        "groups": int(b["groups"]),
    }


def _convolution(op: Op) -> list[Deps]:
    """Inputs: input, weight, bias."""
    x, weight, bias = op.ins
    out = _conv(x, weight, op.out_shapes[0], dict(op.params))
    if not bias.is_empty:
        unbatched = len(op.out_shapes[0]) == len(weight.shape) - 1
        out = D.union(out, D.broadcast_in_dim(bias, out.shape, [0 if unbatched else 1]))
    return [out]


def _convolution_args(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    return [b["input"], b["weight"], b.get("bias")], _geometry(b)


_CONVOLUTIONS = ("convolution", "_convolution", "conv1d", "conv2d", "conv3d")
add(_CONVOLUTIONS, _convolution, _convolution_args)


def is_convolution(target: Any) -> bool:
    """Whether a graph node's target is a convolution (of any dimension, transposed or not)."""
    return packet(target) in _CONVOLUTIONS


def _convolution_backward(op: Op) -> list[Deps]:
    """Gradients of a convolution: the input's is the transposed convolution of ``grad_output``.

    Inputs: grad_output, input, weight.
    """
    grad, x, weight = op.ins
    results = [op.empty(k) for k in range(len(op.out_shapes))]
    if op.wants(0):
        results[0] = _conv(grad, weight, op.out_shapes[0], dict(op.params))
    if op.wants(1):
        results[1] = D.dense(op.out_shapes[1], grad, x)
    if op.wants(2):
        axes = [a for a in range(len(grad.shape)) if a != 1]
        results[2] = D.reshape(D.reduce(grad, axes), op.out_shapes[2])
    return results


def _convolution_backward_args(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    return [b["grad_output"], b["input"], b["weight"]], _geometry(b, transpose=True)


add(["convolution_backward"], _convolution_backward, _convolution_backward_args)


# --- pooling ------------------------------------------------------------------------------------


def _window_axis(
    in_len: int, out_len: int, k: int, s: int, p: int, d: int
) -> tuple[np.ndarray, np.ndarray]:
    """(output, input) index pairs of a sliding window along one axis (output size given)."""
    o = np.arange(out_len)[:, None]
    i = o * s - p + np.arange(k)[None, :] * d
    ok = (i >= 0) & (i < in_len)
    return np.broadcast_to(o, i.shape)[ok], i[ok]


def _adaptive_axis(in_len: int, out_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(output, input) pairs of adaptive pooling: window ``[floor(o*in/out), ceil((o+1)*in/out))``."""
    o = np.arange(out_len)
    start = (o * in_len) // out_len
    end = -((-(o + 1) * in_len) // out_len)
    width = int((end - start).max()) if out_len else 0
    i = start[:, None] + np.arange(width)[None, :]
    ok = i < end[:, None]
    return np.broadcast_to(o[:, None], i.shape)[ok], i[ok]


def _pool_pairs(
    node: torch.fx.Node, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per spatial axis: (axis, output indices, input indices) of a pooling operation."""
    name = packet(node.target)
    b = bind(node)
    found = re.search(r"(\d)d", name)
    nd = int(found.group(1)) if found else 2
    first = len(in_shape) - nd
    if "adaptive" in name:
        return [
            (a, *_adaptive_axis(in_shape[a], out_shape[a])) for a in range(first, len(in_shape))
        ]
    kernel = expand(b["kernel_size"], nd)
    stride = expand(b.get("stride") or kernel, nd)
    padding = expand(b.get("padding", 0), nd)
    dilation = expand(b.get("dilation", 1), nd)
    return [
        (a, *_window_axis(in_shape[a], out_shape[a], kernel[j], stride[j], padding[j], dilation[j]))
        for j, a in enumerate(range(first, len(in_shape)))
    ]


def _pool(g: Graph, node: torch.fx.Node) -> Extracted:
    x = node.args[0]
    val = node.meta["val"]
    in_shape, out_shape = g.deps(x).shape, shape(val[0] if isinstance(val, tuple | list) else val)
    maps = [
        (a, out_shape[a], rows, cols) for a, rows, cols in _pool_pairs(node, in_shape, out_shape)
    ]
    return [x], {"maps": maps}


add(
    ["max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
     "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d",
     "avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_avg_pool1d",
     "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
     "adaptive_max_pool3d", "mkldnn_max_pool2d", "quantized_max_pool2d"],
    D.axis_maps_rule,
    _pool,
)  # fmt: skip


def _pool_backward(g: Graph, node: torch.fx.Node) -> Extracted:
    """The gradient of a pooling spreads each output's gradient over its window."""
    grad = bind(node)["grad_output"]
    in_shape = shape(node.meta["val"])
    pairs = _pool_pairs(node, in_shape, g.deps(grad).shape)
    return [grad], {"maps": [(a, in_shape[a], cols, rows) for a, rows, cols in pairs]}


add(
    ["max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward",
     "avg_pool2d_backward", "avg_pool3d_backward", "_adaptive_avg_pool2d_backward",
     "_adaptive_avg_pool3d_backward", "adaptive_max_pool2d_backward",
     "adaptive_max_pool3d_backward"],
    D.axis_maps_rule,
    _pool_backward,
)  # fmt: skip

# Elements of a forward resize's probe (the identity along one axis times the image) beyond
# which the rule takes every plane as dense.
_PROBE_ELEMENTS = 1 << 22
_SCALES = {1: ("scales",), 2: ("scales_h", "scales_w"), 3: ("scales_d", "scales_h", "scales_w")}


def _upsample_backward(g: Graph, node: torch.fx.Node) -> Extracted:
    """Each input element collects the gradients of the outputs that read it (the pairs of
    :func:`_resize_maps`, from the gradient to the input)."""
    grad = bind(node)["grad_output"]
    return [grad], {"maps": _resize_maps(node, "grad_output", g.deps(grad).shape, backward=True)}


def _upsample(g: Graph, node: torch.fx.Node) -> Extracted:
    """The resizes without a decomposition (the anti-aliased ones): each output element reads
    the input elements of its window, every (batch, channel) plane apart. The other axes of a
    probe keep their sizes (these kernels treat an axis of length one apart); where that probe
    would be large, every plane is taken as dense (``maps`` ``None``)."""
    x = bind(node)["self"]
    in_shape = g.deps(x).shape
    probe = max(in_shape[2:], default=1) * math.prod(in_shape[2:])
    if probe > _PROBE_ELEMENTS:
        return [x], {"maps": None}
    return [x], {"maps": _resize_maps(node, "self", in_shape, backward=False)}


def _upsample_rule(op: Op) -> list[Deps]:
    if op.params["maps"] is None:
        return D.batched_rule(op.replace(params={"lead": 2}))
    return D.axis_maps_rule(op)


def _resize_maps(
    node: torch.fx.Node, source: str, source_shape: Sequence[int], *, backward: bool
) -> list[Any]:
    """Which elements of the resize's output read which of its argument ``source``, per
    spatial axis. Resizes are separable: the pairs of one axis are those of the same resize
    applied to the identity along that axis (the other axes of length one for the backward
    kernels, of their own sizes and constant for the forward ones); weights that are zero are
    true zeros (they do not depend on the input)."""
    b = bind(node)
    out_shape = shape(node.meta["val"])
    nd = len(out_shape) - 2
    dtype = node.args[0].meta["val"].dtype  # type: ignore[union-attr]
    if dtype not in (torch.float32, torch.float64):
        dtype = torch.float64
    maps = []
    for j in range(nd):
        axis = 2 + j
        n_src, n_dst = source_shape[axis], out_shape[axis]
        if backward:
            src_size, dst_size = [1] * nd, [1] * nd
        else:
            src_size, dst_size = list(source_shape[2:]), list(out_shape[2:])
        src_size[j], dst_size[j] = n_src, n_dst
        eye = torch.eye(n_src, dtype=dtype).reshape(
            n_src, 1, *[n_src if k == j else 1 for k in range(nd)]
        )
        args = dict(b)
        args[source] = eye.expand(n_src, 1, *src_size).contiguous()
        if backward:  # output_size: the forward's output (the gradient's), input_size: ours
            args["output_size"], args["input_size"] = src_size, [n_src, 1, *dst_size]
        else:
            args["output_size"] = dst_size
        for k, name in enumerate(_SCALES[nd]):
            if k != j:
                args[name] = None
        with torch.no_grad():
            pulled = node.target(**args)  # type: ignore[operator]
        read = (pulled != 0).movedim(axis, -1).flatten(1, -2).any(1)  # over the others
        reads, writes = np.nonzero(read.reshape(n_src, n_dst).numpy())
        maps.append((axis, n_dst, writes, reads))
    return maps


def _grid_sampler_rule(op: Op) -> list[Deps]:
    """``grid_sampler_3d`` (no decomposition; the 2-d one has): an output plane ``(n, c)``
    reads its input plane ``(n, c)`` and the grid of ``n``, at points the grid chooses (so
    each plane is taken as dense)."""
    (s,) = op.out_shapes
    parts = [
        D.batched_dense(d, len(d.shape) - lead, s, len(s) - lead)
        for d, lead in zip(op.ins[:2], (2, 1), strict=True)
        if not d.is_empty
    ]
    return [D.union(op.empty(0), *parts)]


def _grid_sampler(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    return [b["input"], b["grid"]], {}


add(["grid_sampler_3d"], _grid_sampler_rule, _grid_sampler)


add(
    ["_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "_upsample_lanczos2d_aa"],
    _upsample_rule,
    _upsample,
)


add(
    ["upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward",
     "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward",
     "_upsample_nearest_exact3d_backward", "upsample_linear1d_backward",
     "upsample_bilinear2d_backward", "upsample_trilinear3d_backward",
     "upsample_bicubic2d_backward", "_upsample_bilinear2d_aa_backward",
     "_upsample_bicubic2d_aa_backward", "_upsample_lanczos2d_aa_backward"],
    D.axis_maps_rule,
    _upsample_backward,
)  # fmt: skip


# --- attention ----------------------------------------------------------------------------------


def _attention(op: Op) -> list[Deps]:
    """Output row ``l`` reads row ``l`` of the queries and of the mask, and every key and value
    of its batch entry and head. Inputs: query, key, value, mask."""
    q, k, v, mask = op.ins
    nd = len(q.shape)
    per_batch = op.replace(ins=[d for d in op.ins if not d.is_empty])
    if nd < 2 or not (len(k.shape) == len(v.shape) == nd and q.shape[:-2] == k.shape[:-2]):
        return D.batched_rule(per_batch.replace(params={"lead": 1}))  # grouped-query attention
    memory = D.union(*(D.reduce(d, [nd - 2, nd - 1], keepdims=True) for d in (k, v)))
    rows = D.reduce(q, [nd - 1], keepdims=True)  # (..., L, 1)
    per_row = D.union(rows, D.broadcast_to(memory, rows.shape))
    if not mask.is_empty:
        scores = (*q.shape[:-1], k.shape[-2])
        mixed = D.reduce(D.broadcast_to(mask, scores), [nd - 1], keepdims=True)
        per_row = D.union(per_row, mixed)
    results: list[Deps] = []
    for j, s in enumerate(op.out_shapes):
        if not op.wants(j):
            results.append(op.empty(j))
        elif len(s) == nd and s[:-1] == rows.shape[:-1]:
            results.append(D.broadcast_to(per_row, s))  # the output (and debug scores)
        elif s == rows.shape[:-1]:
            results.append(D.reshape(per_row, s))  # the log-sum-exp of every row
        else:
            lead = per_batch.replace(out_shapes=[s], wanted=None, params={"lead": nd - 2})
            results.extend(D.batched_rule(lead))
    return results


def _attention_args(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    mask = b.get("attn_mask", b.get("attn_bias"))
    return [b["query"], b["key"], b["value"], mask], {}


add(
    ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
     "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
     "_scaled_dot_product_attention_math_for_mps"],
    _attention,
    _attention_args,
)  # fmt: skip


def _leading(lead: int) -> Any:
    def extract(g: Graph, node: torch.fx.Node) -> Extracted:
        return tensor_args(g, node)[0], {"lead": lead}

    return extract


# The gradients of attention mix everything within one batch entry (and head).
add(
    ["_scaled_dot_product_flash_attention_backward",
     "_scaled_dot_product_efficient_attention_backward",
     "_scaled_dot_product_cudnn_attention_backward",
     "_scaled_dot_product_fused_attention_overrideable_backward",
     "_scaled_dot_product_flash_attention_for_cpu_backward"],
    D.batched_rule,
    _leading(2),
)  # fmt: skip
add(  # attention kernels on ``(batch, length, heads, features)``
    ["_efficient_attention_forward", "_efficient_attention_backward", "_flash_attention_forward",
     "_flash_attention_backward"],
    D.batched_rule,
    _leading(1),
)  # fmt: skip
