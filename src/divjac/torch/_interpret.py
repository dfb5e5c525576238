"""Sparsity detection for PyTorch: abstract interpretation of an ATen graph over dependency sets.

The graph comes from ``make_fx`` (functionalized, so there is no aliasing or mutation to track).
Every ATen operation is mapped onto a backend-neutral rule of :mod:`divjac._core.rules`:

* element-wise operations (every op tagged ``torch.Tag.pointwise``) and the activations;
* data movement (views, reshapes, permutes, ``cat``, slicing, indexing with known indices,
  padding, ``where`` with a known mask, ...) by one generic trick: the operation itself is run on
  an ``arange`` of its inputs' positions, which gives the source element of every output element;
* contractions (``mm``, ``addmm``, ``bmm``, ...), convolutions (all variants, transposed ones and
  their input gradient), reductions, cumulative operations, sorting, softmax, layer / group /
  batch normalization, pooling (max, average, adaptive) and their gradients, the gradients of
  resizes, fused attention kernels and their gradients, batched linear algebra and solves;
* operations that have a PyTorch decomposition (upsampling, recurrent layers, many
  ``*_backward`` operations) are decomposed while tracing and never reach the interpreter;
* higher-order operations (``cond``, ...) are not followed: assumed dense.

Integer and boolean results have no derivative (empty dependency sets); values that do not
depend on the input are folded when a rule needs them (gather indices, masks): what the program
computes from constants it builds itself (``arange``, ``full``, ``torch.tensor([...])``
literals) and from the graph constants the tracer lets it read (captured integer and boolean
tensors, whose versions it guards). Captured floating-point tensors (parameters, buffers,
weights closed over) are never read: they change between calls. An operation without a rule
never raises and never under-approximates: its outputs depend on everything its inputs depend
on, with one :class:`~divjac.DenseFallbackWarning` per detection naming every such operation.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch.fx
from torch.utils import _pytree as pytree

import torch

from .._core import detection, rules as D
from .._core.detection import EntryLimit
from .._core.rules import Deps

__all__ = ["Interpreter", "decompositions", "is_convolution"]

# Constant folding (for indices, masks, ...) is limited to results of this many elements.
_FOLD_LIMIT = 1 << 22

# Float results whose derivative is zero wherever it exists.
_ZERO_DERIVATIVE = {
    "floor", "ceil", "round", "trunc", "sign", "sgn", "heaviside", "detach", "zeros_like",
    "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "bernoulli", "new_zeros", "new_ones", "new_empty", "new_full", "zero", "empty_strided",
    "scalar_tensor", "lift_fresh_copy", "lift_fresh", "rand", "randn", "randint", "normal",
    "uniform", "exponential", "geometric", "cauchy", "log_normal", "randperm",
}  # fmt: skip
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                  "empty_permuted"}  # fmt: skip
# Same shape in and out, each output element a function of its input element.
_IDENTITY = {
    "_to_copy", "clone", "alias", "contiguous", "_conj", "resolve_conj", "resolve_neg",
    "positive", "_conj_physical", "conj_physical", "to", "dropout", "feature_dropout",
    "alpha_dropout",
}  # fmt: skip
# Pure data movement: every output element is one input element (or a constant).
_MOVEMENT = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "transpose", "t",
    "expand", "unsqueeze", "squeeze", "cat", "concat", "stack", "slice", "select", "narrow",
    "index_select", "flip", "roll", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d",
    "reflection_pad3d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "_unsafe_index", "index", "gather", "take", "split", "split_with_sizes", "unbind",
    "chunk", "tensor_split", "diagonal", "diag_embed", "diag", "repeat", "repeat_interleave",
    "unfold", "im2col", "movedim", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
    "native_channel_shuffle", "rot90", "tril", "triu", "slice_scatter", "select_scatter",
    "diagonal_scatter", "copy", "copy_", "embedding", "masked_select", "_unsafe_masked_index",
    "where", "masked_fill", "index_fill", "view_copy", "_unsafe_view_copy", "reshape_copy",
    "permute_copy", "transpose_copy", "t_copy", "expand_copy", "unsqueeze_copy",
    "squeeze_copy", "slice_copy", "select_copy", "split_copy", "split_with_sizes_copy",
    "unbind_copy", "diagonal_copy", "unfold_copy", "alias_copy", "as_strided", "as_strided_copy",
    "as_strided_scatter", "expand_as", "view_as", "swapaxes", "swapdims",
}  # fmt: skip


def _packet(target: Any) -> str:
    """The operation's name without namespace and overload (``"add"`` for ``aten.add.Tensor``)."""
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return str(packet.__name__)
    return str(getattr(target, "__name__", target))


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _inexact(value: Any) -> bool:
    return _is_tensor(value) and (value.dtype.is_floating_point or value.dtype.is_complex)


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in value.shape)


def _outputs(node: torch.fx.Node) -> list[Any]:
    """The fake values of a node's outputs (one list entry per output)."""
    val = node.meta.get("val")
    return list(val) if isinstance(val, tuple | list) else [val]


def bind(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def _expand(value: Any, n: int) -> list[int]:
    """An int or int list broadcast to ``n`` entries (PyTorch accepts a single value)."""
    if value is None:
        return [0] * n
    values = [int(value)] if isinstance(value, int) else [int(v) for v in value]
    if not values:
        return []
    return values * n if len(values) == 1 else values


def _dims(value: Any, ndim: int) -> list[int]:
    """Reduction axes: ``None`` or an empty list mean all axes."""
    if value is None:
        return list(range(ndim))
    if isinstance(value, int):
        return [value % max(ndim, 1)]
    axes = [int(v) % max(ndim, 1) for v in value]
    return axes if axes else list(range(ndim))


class _UnknownValue(Exception):
    """An index or mask a rule needs is not known at detection time."""


@functools.cache
def decompositions() -> dict[Any, Callable[..., Any]]:
    """PyTorch decompositions of every operation the interpreter has no rule for.

    Tracing with them turns upsampling, most ``*_backward`` operations and other composite
    kernels into operations with rules (index operations with constant indices, arithmetic).
    """
    from torch._decomp import decomposition_table

    handled = set(_RULES) | _ZERO_DERIVATIVE | _IDENTITY | _MOVEMENT
    return {
        op: fn
        for op, fn in decomposition_table.items()
        if isinstance(op, torch._ops.OpOverload)
        and _packet(op) not in handled
        and torch.Tag.pointwise not in op.tags
    }


class Interpreter:
    """Propagates dependency sets through an ATen graph.

    Args:
        n_labels: number of labels (columns of every dependency matrix).
        limit: abort with :class:`~divjac._core.detection.TooDense` once an intermediate is
            past it.
        constants: the graph constants (``get_attr`` targets) whose values may be read; any
            other constant is unknown.

    Attributes:
        fallbacks: names of operations that had no rule (handled as dense).
        read: the names of the ``constants`` whose values were read.
    """

    def __init__(
        self,
        n_labels: int,
        *,
        limit: EntryLimit | None = None,
        constants: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.n_labels = n_labels
        self.limit = limit
        self.constants: Mapping[str, torch.Tensor] = constants or {}
        self.fallbacks: set[str] = set()
        self.read: set[str] = set()
        self._deps: dict[torch.fx.Node, Any] = {}
        self._values: dict[torch.fx.Node, Any] = {}

    def run(self, gm: torch.fx.GraphModule, in_deps: Sequence[Deps]) -> Deps:
        """Dependency sets of the graph's (single tensor) output, given those of its inputs."""
        placeholders = iter(in_deps)
        result: Deps | None = None
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                given = next(placeholders)
                if not given.is_empty:
                    self._deps[node] = given
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                out = next(a for a in pytree.tree_leaves(node.args) if isinstance(a, torch.fx.Node))
                result = self.deps(out)
        assert result is not None
        return result

    def warn_fallbacks(self) -> None:
        """Emit one :class:`DenseFallbackWarning` naming every operation without a rule."""
        detection.warn_fallbacks(self.fallbacks, kind="ATen operation", stacklevel=2)

    # --- dependency sets and constant values of graph values ---------------------------------

    def deps(self, arg: Any) -> Deps:
        """Dependency sets of a tensor argument (empty for constants and parameters)."""
        if isinstance(arg, torch.fx.Node):
            found = self._deps.get(arg)
            if isinstance(found, Deps):
                return found
            val = arg.meta.get("val")
            if _is_tensor(val):
                return D.empty(_shape(val), self.n_labels)
        if _is_tensor(arg):
            return D.empty(_shape(arg), self.n_labels)
        return D.empty((), self.n_labels)

    def has_deps(self, arg: Any) -> bool:
        return isinstance(arg, torch.fx.Node) and not self.deps(arg).is_empty

    def value(self, arg: Any) -> Any:
        """The concrete value of a graph value that does not depend on the input, else ``None``.

        Only the readable ``constants`` are graph constants with a value (their reads are
        recorded in :attr:`read`); weights are never read, so a pattern cannot go stale when
        they are trained.
        """
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg in self._values:
            return self._values[arg]
        self._values[arg] = None  # guards against cycles while folding
        result: Any = None
        if arg.op == "get_attr":
            const = self.constants.get(str(arg.target))
            if const is not None:
                self.read.add(str(arg.target))
                result = const.detach()
        elif arg.op == "call_function" and not self.has_deps(arg):
            result = self._fold(arg)
        self._values[arg] = result
        return result

    def _fold(self, node: torch.fx.Node) -> Any:
        target = node.target
        if target is operator.getitem:
            parent = self.value(node.args[0])
            return None if parent is None else parent[node.args[1]]
        if not isinstance(target, torch._ops.OpOverload):
            return None
        if torch.Tag.nondeterministic_seeded in target.tags:
            return None
        vals = _outputs(node)
        if any(_is_tensor(v) and v.numel() > _FOLD_LIMIT for v in vals):
            return None
        if _packet(target) in _UNINITIALIZED:
            # Uninitialized memory, about to be overwritten (``ones`` decomposes into
            # ``empty`` + ``fill``); a program that reads it has no defined result anyway.
            val = vals[0]
            return torch.zeros(_shape(val), dtype=val.dtype, device=val.device)
        missing = False

        def concrete(a: Any) -> Any:
            nonlocal missing
            if isinstance(a, torch.fx.Node):
                v = self.value(a)
                missing = missing or v is None
                return v
            return a

        args = pytree.tree_map(concrete, node.args)
        kwargs = pytree.tree_map(concrete, node.kwargs)
        if missing:
            return None
        try:
            with torch.no_grad():
                return target(*args, **kwargs)
        except Exception:
            return None

    # --- dispatch ----------------------------------------------------------------------------

    def _call(self, node: torch.fx.Node) -> None:
        target = node.target
        if target is operator.getitem:
            parent = self._deps.get(node.args[0])  # type: ignore[arg-type]
            if isinstance(parent, list):
                found = parent[node.args[1]]  # type: ignore[index]
                if found is not None and _inexact(node.meta.get("val")):
                    self._deps[node] = found
            return
        higher_order = isinstance(target, torch._ops.HigherOrderOperator)
        if not (higher_order or isinstance(target, torch._ops.OpOverload)):
            return  # arithmetic on sizes and other Python values
        vals = _outputs(node)
        if not any(_inexact(v) for v in vals):
            return  # integer and boolean results: no derivative
        inputs = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if self.has_deps(a)]
        if not inputs:
            return  # constants and parameters: nothing depends on the labels
        outs = [_shape(v) if _inexact(v) else None for v in vals]  # None: no derivative
        if higher_order:  # a subgraph (cond, ...): not followed
            results = self.dense(node, outs, str(target))
        else:
            results = self._apply(node, outs)
        stored: list[Deps | None] = []
        for val, dep in zip(vals, results, strict=True):
            if dep is None or not _inexact(val) or dep.is_empty:
                stored.append(None)
                continue
            if dep.shape != _shape(val):
                dep = D.reshape(dep, _shape(val))
            if self.limit is not None:
                self.limit.check(dep, str(target))
            stored.append(dep)
        if isinstance(node.meta.get("val"), tuple | list):
            self._deps[node] = stored
        elif stored[0] is not None:
            self._deps[node] = stored[0]

    def _apply(self, node: torch.fx.Node, outs: list[tuple[int, ...] | None]) -> list[Deps | None]:
        target = node.target
        assert isinstance(target, torch._ops.OpOverload)
        name = _packet(target)
        if name in _ZERO_DERIVATIVE:
            return [None] * len(outs)
        if name in _IDENTITY:
            first = self.deps(node.args[0])
            return [D.elementwise(outs[0], first)] + [None] * (len(outs) - 1)  # type: ignore[arg-type]
        rule = _RULES.get(name)
        if rule is not None:
            return rule(self, node, outs)
        if name in _MOVEMENT:
            moved = self.movement(node)
            if moved is not None:
                return moved
        elif torch.Tag.pointwise in target.tags:
            return [self.elementwise(node, s) if s is not None else None for s in outs]
        return self.dense(node, outs, str(target))

    def elementwise(self, node: torch.fx.Node, shape: tuple[int, ...]) -> Deps:
        """Union of the broadcast dependency sets of every tensor argument."""
        tensors = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if self.has_deps(a)]
        return D.elementwise(shape, *(self.deps(a) for a in tensors))

    def dense(
        self, node: torch.fx.Node, outs: list[tuple[int, ...] | None], name: str
    ) -> list[Deps | None]:
        """The conservative rule: every output depends on everything any input depends on."""
        self.fallbacks.add(name)
        tensors = [self.deps(a) for a in pytree.tree_leaves((node.args, node.kwargs))]
        return [D.dense(s, *tensors) if s is not None else None for s in outs]

    # --- data movement by running the operation on positions --------------------------------

    def movement(
        self,
        node: torch.fx.Node,
        *,
        smear: dict[torch.fx.Node, list[int]] | None = None,
        zero_unknown: bool = False,
    ) -> list[Deps | None] | None:
        """Dependency sets of a data-movement operation (``None`` if an index is unknown).

        Every floating tensor argument is replaced by its 1-based positions (offset so that the
        arguments do not overlap), as float64 (exact below 2**53); float scalars (fill values)
        become 0; integer and boolean arguments (indices, masks) keep their constant values.
        Running the operation then gives, for every output element, the position it copies
        (0: a constant). ``smear`` replaces an argument's dependency sets by their union along
        the given axes, and ``zero_unknown`` replaces unknown indices by zeros, which together
        bound every possible index.
        """
        sources: list[Deps] = []
        offset = 0

        def encode(a: Any) -> Any:
            nonlocal offset
            if isinstance(a, torch.fx.Node):
                val: Any = a.meta.get("val")
                if not _is_tensor(val):
                    return self.value(a)
                if _inexact(val):
                    n = val.numel()
                    ids = torch.arange(offset + 1, offset + n + 1, dtype=torch.float64)
                    deps = self.deps(a)
                    if smear and a in smear:
                        axes = smear[a]
                        deps = D.broadcast_to(D.reduce(deps, axes, keepdims=True), deps.shape)
                    sources.append(deps)
                    offset += n
                    return ids.reshape(_shape(val))
                value = self.value(a)
                if value is None:
                    if not zero_unknown:
                        raise _UnknownValue
                    # Any index bounds the reads once the data is smeared; a mask reads everything.
                    fill = torch.ones if val.dtype == torch.bool else torch.zeros
                    return fill(_shape(val), dtype=val.dtype)
                return value.cpu() if _is_tensor(value) else value
            if isinstance(a, float):
                return 0.0
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        target = node.target
        assert isinstance(target, torch._ops.OpOverload)
        try:
            args = pytree.tree_map(encode, node.args)
            kwargs = pytree.tree_map(encode, node.kwargs)
        except _UnknownValue:
            return None
        strided = _packet(target) in ("as_strided", "as_strided_copy", "as_strided_scatter")
        if strided and not _strides_are_safe(node):
            return None
        try:
            with torch.no_grad():
                out = target(*args, **kwargs)
        except Exception:
            return None
        results = list(out) if isinstance(out, tuple | list) else [out]
        deps: list[Deps | None] = []
        for o, val in zip(results, _outputs(node), strict=False):
            if not _inexact(o) or not _inexact(val):
                deps.append(None)
                continue
            if tuple(o.shape) != _shape(val):
                return None  # a data-dependent shape: the replaced indices do not tell
            src = o.detach().real.to(torch.float64).round().to(torch.int64).cpu().numpy() - 1
            deps.append(D.index_map(tuple(o.shape), sources, src))
        return deps


def _strides_are_safe(node: torch.fx.Node) -> bool:
    """``as_strided`` reads only its (contiguous) input's own elements."""
    val: Any = node.args[0].meta.get("val")  # type: ignore[union-attr]
    if not _is_tensor(val) or not val.is_contiguous() or val.storage_offset() != 0:
        return False
    b = bind(node)
    size, stride = b.get("size") or [], b.get("stride") or []
    last = int(b.get("storage_offset") or 0) + sum(
        (int(n) - 1) * int(s) for n, s in zip(size, stride, strict=False)
    )
    return all(int(n) > 0 for n in size) and 0 <= last < max(val.numel(), 1)


# --- rules: (interpreter, node, output shapes) -> output dependency sets ------------------------

Rule = Callable[[Interpreter, torch.fx.Node, list[Any]], list[Any]]
_RULES: dict[str, Rule] = {}


_rule = detection.rule_registry(_RULES)


def _index_smear(it: Interpreter, node: torch.fx.Node) -> dict[torch.fx.Node, list[int]]:
    """Axes along which an indexing operation may read anywhere when its indices are unknown."""
    name = _packet(node.target)
    b = bind(node)
    data = b.get("self", b.get("weight"))
    if not isinstance(data, torch.fx.Node):
        return {}
    ndim = len(_shape(data.meta["val"]))
    if name in ("index_select", "gather"):
        return {data: [int(b["dim"]) % ndim]}
    if name == "embedding":
        return {data: [0]}
    if name in ("index", "_unsafe_index", "_unsafe_masked_index"):
        axes, pos = [], 0
        for ix in b["indices"]:
            span = 1
            if isinstance(ix, torch.fx.Node) and ix.meta["val"].dtype in (torch.bool, torch.uint8):
                span = ix.meta["val"].ndim
            if ix is not None:
                axes += list(range(pos, pos + span))
            pos += span
        return {data: axes}
    return {data: list(range(ndim))}  # take, masked_select, ...


@_rule(
    "index_select", "gather", "take", "index", "_unsafe_index", "embedding", "_unsafe_masked_index",
)  # fmt: skip
def _indexing(it, node, outs):
    moved = it.movement(node)
    if moved is None:
        moved = it.movement(node, smear=_index_smear(it, node), zero_unknown=True)
    if moved is None:
        return it.dense(node, outs, str(node.target))
    return moved


@_rule("where", "masked_fill", "index_fill")
def _select(it, node, outs):
    moved = it.movement(node)
    if moved is None:  # unknown mask: either side may be chosen
        return [it.elementwise(node, outs[0])]
    return moved


@_rule("fill")
def _fill(it, node, outs):
    value = bind(node).get("value")
    return [D.broadcast_to(it.deps(value), outs[0]) if it.has_deps(value) else None]


@_rule("native_dropout")
def _native_dropout(it, node, outs):
    return [D.elementwise(outs[0], it.deps(node.args[0])), None]


# --- reductions, scans, sorting ---------------------------------------------------------------

_REDUCTIONS = (
    "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "aminmax",
    "logsumexp", "var", "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "median",
    "nanmedian", "mode", "kthvalue",
)  # fmt: skip


@_rule(*_REDUCTIONS)
def _reduce(it, node, outs):
    b = bind(node)
    x = it.deps(b["self"])
    if "other" in b:  # max.other, min.other: element-wise
        return [it.elementwise(node, outs[0])]
    axes = _dims(b.get("dim"), len(x.shape))
    reduced = D.reduce(x, axes, keepdims=True)
    return [D.reshape(reduced, s) if s is not None else None for s in outs]


@_rule("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin")
def _cumulative(it, node, outs):
    b = bind(node)
    x = it.deps(b["self"])
    return [D.cumulative(x, int(b["dim"]))] + [None] * (len(outs) - 1)


@_rule("sort", "msort", "topk", "argsort")
def _sort(it, node, outs):
    b = bind(node)
    x = it.deps(b["self"])
    axis = 0 if _packet(node.target) == "msort" else int(b.get("dim", -1))
    line = D.reduce(x, [axis], keepdims=True)
    return [D.broadcast_to(line, outs[0])] + [None] * (len(outs) - 1)


@_rule("_softmax", "_log_softmax", "_safe_softmax", "softmax", "log_softmax")
def _softmax(it, node, outs):
    b = bind(node)
    return [D.sort_along(it.deps(b["self"]), int(b["dim"]))]


@_rule("_softmax_backward_data", "_log_softmax_backward_data")
def _softmax_backward(it, node, outs):
    b = bind(node)
    dim = int(b["dim"])
    return [D.union(*(D.sort_along(it.deps(b[k]), dim) for k in ("grad_output", "output")))]


# --- normalization ------------------------------------------------------------------------------


def _per_channel(it: Interpreter, args: Sequence[Any], shape: tuple[int, ...], axis: int) -> list:
    """Dependency sets of per-channel parameters (weight, bias, ...) broadcast along ``axis``."""
    return [D.broadcast_in_dim(it.deps(a), shape, [axis]) for a in args if it.has_deps(a)]


@_rule("native_layer_norm")
def _layer_norm(it, node, outs):
    b = bind(node)
    x = it.deps(b["input"])
    k = len(b["normalized_shape"])
    axes = list(range(len(x.shape) - k, len(x.shape)))
    stats = D.reduce(x, axes, keepdims=True)
    params = [D.broadcast_to(it.deps(b[p]), x.shape) for p in ("weight", "bias")]
    out = D.union(D.broadcast_to(stats, x.shape), *params)
    return [out] + [D.reshape(stats, s) if s is not None else None for s in outs[1:]]


@_rule("native_group_norm")
def _group_norm(it, node, outs):
    b = bind(node)
    x = it.deps(b["input"])
    n, c, groups = int(b["N"]), int(b["C"]), int(b["group"])
    grouped = D.reshape(x, (n, groups, x.size // (n * groups)))
    stats = D.reduce(grouped, [2], keepdims=True)
    out = D.reshape(D.broadcast_to(stats, grouped.shape), x.shape)
    out = D.union(out, *_per_channel(it, [b["weight"], b["bias"]], x.shape, 1))
    assert c == x.shape[1]
    return [out] + [D.reshape(stats, s) if s is not None else None for s in outs[1:]]


_BATCH_NORM = (
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "_batch_norm_with_update",
    "_batch_norm_with_update_functional", "_batch_norm_no_update", "cudnn_batch_norm",
    "miopen_batch_norm", "batch_norm",
)  # fmt: skip


@_rule(*_BATCH_NORM)
def _batch_norm(it, node, outs):
    """Training mode couples every sample through the per-channel batch statistics."""
    name = _packet(node.target)
    b = bind(node)
    x = it.deps(b["input"])
    if name == "_native_batch_norm_legit_no_training":
        training = False
    elif name.startswith("_batch_norm_with_update"):
        training = True
    elif name == "_batch_norm_no_update":
        training = b.get("running_mean") is None
    else:
        training = bool(b.get("training", True))
    running = [b.get("running_mean"), b.get("running_var")]
    params = _per_channel(it, [b.get("weight"), b.get("bias"), *running], x.shape, 1)
    channels = x.shape[1]
    if training:
        stats = D.reduce(x, [0, *range(2, len(x.shape))])
        spread = D.broadcast_in_dim(stats, x.shape, [1])
    else:
        stats, spread = D.empty((channels,), x.n_labels), x
    results: list[Deps | None] = [D.union(spread, *params)]
    running_deps = [it.deps(r) for r in running if it.has_deps(r)]
    for s in outs[1:]:
        if s is None or math.prod(s) != channels:
            results.append(None)
        else:
            results.append(D.reshape(D.union(stats, *running_deps), s))
    return results


# --- contractions -------------------------------------------------------------------------------


def _host(value: Any) -> np.ndarray | None:
    if not _is_tensor(value):
        return None
    return value.detach().cpu().resolve_conj().resolve_neg().numpy()


def _dot(
    it: Interpreter,
    lhs: Any,
    rhs: Any,
    contracting: tuple[Sequence[int], Sequence[int]],
    batch: tuple[Sequence[int], Sequence[int]],
) -> Deps:
    """``dot_general`` of two graph values; a constant operand's zeros are used."""
    lhs_deps, rhs_deps = it.deps(lhs), it.deps(rhs)
    return D.dot_general(
        lhs_deps,
        rhs_deps,
        contracting=contracting,
        batch=batch,
        lhs_value=_host(it.value(lhs)) if lhs_deps.is_empty else None,
        rhs_value=_host(it.value(rhs)) if rhs_deps.is_empty else None,
    )


def _with_bias(it: Interpreter, bias: Any, product: Deps) -> Deps:
    return (
        D.union(product, D.broadcast_to(it.deps(bias), product.shape))
        if bias is not None
        else product
    )


@_rule("mm", "addmm", "_addmm_activation")
def _mm(it, node, outs):
    b = bind(node)
    product = _dot(it, b.get("mat1", b["self"]), b.get("mat2"), ([1], [0]), ([], []))
    if "mat1" not in b:
        return [product]
    out = _with_bias(it, b["self"], product)
    return [D.elementwise(outs[0], out)]


@_rule("bmm", "baddbmm")
def _bmm(it, node, outs):
    b = bind(node)
    first = b.get("batch1", b["self"])
    second = b.get("batch2", b.get("mat2"))
    product = _dot(it, first, second, ([2], [1]), ([0], [0]))
    return [_with_bias(it, b["self"], product) if "batch1" in b else product]


@_rule("addbmm")
def _addbmm(it, node, outs):
    b = bind(node)
    product = _dot(it, b["batch1"], b["batch2"], ([0, 2], [0, 1]), ([], []))
    return [_with_bias(it, b["self"], product)]


@_rule("mv", "addmv")
def _mv(it, node, outs):
    b = bind(node)
    if "mat" in b:
        return [_with_bias(it, b["self"], _dot(it, b["mat"], b["vec"], ([1], [0]), ([], [])))]
    return [_dot(it, b["self"], b["vec"], ([1], [0]), ([], []))]


@_rule("dot", "vdot")
def _dot_rule(it, node, outs):
    b = bind(node)
    other = b.get("tensor", b.get("other"))
    return [D.reshape(_dot(it, b["self"], other, ([0], [0]), ([], [])), outs[0])]


@_rule("addr", "outer", "ger")
def _outer(it, node, outs):
    b = bind(node)
    first, second = b.get("vec1", b["self"]), b.get("vec2", b.get("vec2"))
    product = _dot(it, first, second, ([], []), ([], []))
    return [_with_bias(it, b["self"], product) if "vec1" in b else product]


@_rule("matmul")
def _matmul(it, node, outs):
    # Normally decomposed by PyTorch; kept for graphs recorded without decomposition.
    b = bind(node)
    lhs, rhs = it.deps(b["self"]), it.deps(b["other"])
    if len(lhs.shape) >= 2 and len(rhs.shape) >= 2 and lhs.shape[:-2] == rhs.shape[:-2]:
        nb = len(lhs.shape) - 2
        batch = list(range(nb))
        return [_dot(it, b["self"], b["other"], ([nb + 1], [nb]), (batch, batch))]
    return it.dense(node, outs, str(node.target))


@_rule("_cdist_forward", "_euclidean_dist")
def _cdist(it, node, outs):
    """Pairwise distances: ``out[..., i, j]`` reads row ``i`` of ``x1`` and row ``j`` of ``x2``."""
    x1, x2 = node.args[0], node.args[1]
    s1, s2 = it.deps(x1).shape, it.deps(x2).shape
    if len(s1) != len(s2) or s1[:-2] != s2[:-2]:
        return it.dense(node, outs, str(node.target))
    lead = list(range(len(s1) - 2))
    last = len(s1) - 1
    return [_dot(it, x1, x2, ([last], [last]), (lead, lead))]


@_rule("_trilinear")
def _trilinear(it, node, outs):
    """``sum over sumdim of i1 * i2 * i3``, each unsqueezed at its ``expand`` axes."""
    b = bind(node)
    parts = []
    for name, expand in (("i1", "expand1"), ("i2", "expand2"), ("i3", "expand3")):
        d = it.deps(b[name])
        shape = list(d.shape)
        for axis in sorted(int(a) for a in b[expand]):
            shape.insert(axis, 1)
        parts.append(D.reshape(d, shape))
    full = np.broadcast_shapes(*(p.shape for p in parts))
    product = D.elementwise(full, *parts)
    summed = D.reduce(product, [int(a) for a in b["sumdim"]], keepdims=True)
    return [D.reshape(summed, outs[0])]


# --- convolutions -------------------------------------------------------------------------------


def _conv(
    lhs: Deps,
    weight: Deps,
    out_shape: tuple[int, ...],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    groups: int,
) -> Deps:
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
    stride, padding, dilation = _expand(stride, nd), _expand(padding, nd), _expand(dilation, nd)
    if not transposed:
        out = D.conv(
            lhs,
            weight,
            out_shape=out_shape,
            lhs_spec=spec,
            rhs_spec=spec,
            out_spec=spec,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            feature_group_count=groups,
        )
    else:
        pads = []
        for size, out, k, s, p, d in zip(
            lhs.shape[2:], out_shape[2:], kernel, stride, padding, dilation, strict=True
        ):
            lo = d * (k - 1) - p
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
            feature_group_count=groups,
        )
        if not weight.is_empty:
            out = D.union(out, D.dense(out_shape, weight))
    return D.reshape(out, out_shape[1:]) if unbatched else out


_CONVOLUTIONS = ("convolution", "_convolution", "conv1d", "conv2d", "conv3d")


def is_convolution(target: Any) -> bool:
    """Whether a graph node's target is a convolution (of any dimension, transposed or not)."""
    return _packet(target) in _CONVOLUTIONS


@_rule(*_CONVOLUTIONS)
def _convolution(it, node, outs):
    b = bind(node)
    out = _conv(
        it.deps(b["input"]),
        it.deps(b["weight"]),
        outs[0],
        b["stride"],
        b["padding"],
        b["dilation"],
        bool(b.get("transposed", False)),
        int(b["groups"]),
    )
    if it.has_deps(b.get("bias")):
        unbatched = len(outs[0]) == len(it.deps(b["weight"]).shape) - 1
        out = D.union(out, *_per_channel(it, [b["bias"]], out.shape, 0 if unbatched else 1))
    return [out]


@_rule("convolution_backward")
def _convolution_backward(it, node, outs):
    """Gradients of a convolution: the input's is the transposed convolution of ``grad_output``."""
    b = bind(node)
    grad, weight = it.deps(b["grad_output"]), it.deps(b["weight"])
    results: list[Deps | None] = [None, None, None]
    if outs[0] is not None:
        grad_input = _conv(
            grad,
            weight,
            outs[0],
            b["stride"],
            b["padding"],
            b["dilation"],
            not b["transposed"],
            int(b["groups"]),
        )
        results[0] = grad_input
    if outs[1] is not None:
        results[1] = D.dense(outs[1], grad, it.deps(b["input"]))
    if outs[2] is not None:
        axes = [a for a in range(len(grad.shape)) if a != 1]
        results[2] = D.reshape(D.reduce(grad, axes), outs[2])
    return results


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


def _n_spatial(name: str) -> int:
    found = re.search(r"(\d)d", name)
    return int(found.group(1)) if found else 2


def _pool_pairs(
    node: torch.fx.Node, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per spatial axis: (axis, output indices, input indices) of a pooling operation."""
    name = _packet(node.target)
    b = bind(node)
    nd = _n_spatial(name)
    first = len(in_shape) - nd
    pairs = []
    if "adaptive" in name:
        for a in range(first, len(in_shape)):
            pairs.append((a, *_adaptive_axis(in_shape[a], out_shape[a])))
        return pairs
    kernel = _expand(b["kernel_size"], nd)
    stride = _expand(b.get("stride") or kernel, nd)
    padding = _expand(b.get("padding", 0), nd)
    dilation = _expand(b.get("dilation", 1), nd)
    for j, a in enumerate(range(first, len(in_shape))):
        rows, cols = _window_axis(
            in_shape[a], out_shape[a], kernel[j], stride[j], padding[j], dilation[j]
        )
        pairs.append((a, rows, cols))
    return pairs


_POOLS = (
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d",
    "avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_avg_pool1d",
    "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "adaptive_max_pool3d", "mkldnn_max_pool2d", "quantized_max_pool2d",
)  # fmt: skip


@_rule(*_POOLS)
def _pool(it, node, outs):
    x = it.deps(node.args[0])
    for axis, rows, cols in _pool_pairs(node, x.shape, outs[0]):
        x = D.axis_map(x, axis, outs[0][axis], rows, cols)
    return [x] + [None] * (len(outs) - 1)


_POOL_BACKWARDS = (
    "max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward",
    "avg_pool2d_backward", "avg_pool3d_backward", "_adaptive_avg_pool2d_backward",
    "_adaptive_avg_pool3d_backward", "adaptive_max_pool2d_backward",
    "adaptive_max_pool3d_backward",
)  # fmt: skip


@_rule(*_POOL_BACKWARDS)
def _pool_backward(it, node, outs):
    """The gradient of a pooling spreads each output's gradient over its window."""
    b = bind(node)
    grad = it.deps(b["grad_output"])
    for axis, rows, cols in _pool_pairs(node, outs[0], grad.shape):
        grad = D.axis_map(grad, axis, outs[0][axis], cols, rows)
    return [grad]


# Gradients of resizes: (grad_output, output_size, input_size, ..., scales of each axis).
_UPSAMPLE_BACKWARDS = (
    "upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward",
    "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward",
    "_upsample_nearest_exact3d_backward", "upsample_linear1d_backward",
    "upsample_bilinear2d_backward", "upsample_trilinear3d_backward",
    "upsample_bicubic2d_backward", "_upsample_bilinear2d_aa_backward",
    "_upsample_bicubic2d_aa_backward", "_upsample_lanczos2d_aa_backward",
)  # fmt: skip
_SCALES = {1: ("scales",), 2: ("scales_h", "scales_w"), 3: ("scales_d", "scales_h", "scales_w")}


@_rule(*_UPSAMPLE_BACKWARDS)
def _upsample_backward(it, node, outs):
    """Each input element collects the gradients of the outputs that read it. Resizes are
    separable: the pairs of one axis are those of the same gradient along that axis alone (the
    other axes of length one), applied to the identity; weights that are zero are true zeros
    (they do not depend on the input)."""
    b = bind(node)
    grad = it.deps(b["grad_output"])
    in_shape = outs[0]
    nd = len(in_shape) - 2
    dtype = node.args[0].meta["val"].dtype
    if dtype not in (torch.float32, torch.float64):
        dtype = torch.float64
    for j in range(nd):
        axis = 2 + j
        n_out, n_in = grad.shape[axis], in_shape[axis]
        out_size, in_size = [1] * nd, [1] * nd
        out_size[j], in_size[j] = n_out, n_in
        args = dict(b)
        args["grad_output"] = torch.eye(n_out, dtype=dtype).reshape(n_out, 1, *out_size)
        args["output_size"], args["input_size"] = out_size, [n_out, 1, *in_size]
        for k, name in enumerate(_SCALES[nd]):
            if k != j:
                args[name] = None
        with torch.no_grad():
            pulled = node.target(**args)
        reads, inputs = np.nonzero(pulled.reshape(n_out, n_in).numpy())
        grad = D.axis_map(grad, axis, n_in, inputs, reads)
    return [grad]


# --- scatter-like operations --------------------------------------------------------------------


def _positions(shape: Sequence[int], offset: int = 1) -> torch.Tensor:
    n = math.prod(shape)
    return torch.arange(offset, offset + n, dtype=torch.float64).reshape(tuple(shape))


def _route(
    it: Interpreter,
    node: torch.fx.Node,
    outs: list[Any],
    dest: torch.Tensor,
    source: Deps,
    *,
    overwrite: bool,
    smear_axes: Sequence[int] | None,
    base: Deps | None = None,
) -> list[Deps | None]:
    """``self`` (or ``base``) with ``source`` element ``k`` added (or written) at flat position
    ``dest[k] - 1`` (0: nowhere); ``smear_axes``: the positions along them are unknown."""
    shape = outs[0]
    base = it.deps(node.args[0]) if base is None else base
    target = dest.round().to(torch.int64).cpu().numpy().ravel() - 1
    landed = target >= 0
    routed = D.compose(shape, target[landed], np.flatnonzero(landed), source)
    if smear_axes is not None:
        routed = D.broadcast_to(D.reduce(routed, list(smear_axes), keepdims=True), shape)
    elif overwrite:
        keep = np.arange(math.prod(shape))
        keep[target[landed]] = -1
        base = D.gather(base, keep.reshape(shape))
    return [D.union(base, routed)]


def _index_or_zeros(it: Interpreter, arg: Any) -> tuple[Any, bool]:
    """The value of an index tensor (zeros if unknown) and whether it was known."""
    if not isinstance(arg, torch.fx.Node):
        return arg, True
    value = it.value(arg)
    if value is None:
        val = arg.meta["val"]
        return torch.zeros(_shape(val), dtype=val.dtype), False
    return value.cpu(), True


@_rule("scatter", "scatter_add", "scatter_reduce")
def _scatter(it, node, outs):
    b = bind(node)
    shape = outs[0]
    dim = int(b["dim"]) % len(shape)
    index, known = _index_or_zeros(it, b["index"])
    dest = torch.gather(_positions(shape), dim, index)
    src = b.get("src")
    if isinstance(src, torch.fx.Node):  # only src[:index.shape] is scattered
        src_deps = it.deps(src)
        window = tuple(slice(0, s) for s in index.shape)
        source = D.gather(src_deps, np.arange(src_deps.size).reshape(src_deps.shape)[window])
    else:  # a scalar value: the written elements depend on nothing
        source = D.empty(tuple(index.shape), it.n_labels)
    overwrite = _packet(node.target) == "scatter" and b.get("reduce") is None
    smear = None if known else [dim]
    return _route(it, node, outs, dest, source, overwrite=overwrite, smear_axes=smear)


@_rule("index_add", "index_copy")
def _index_add(it, node, outs):
    b = bind(node)
    shape = outs[0]
    dim = int(b["dim"]) % len(shape)
    index, known = _index_or_zeros(it, b["index"])
    dest = torch.index_select(_positions(shape), dim, index)
    return _route(
        it,
        node,
        outs,
        dest,
        it.deps(b["source"]),
        overwrite=_packet(node.target) == "index_copy",
        smear_axes=None if known else [dim],
    )


@_rule("index_put", "_index_put_impl", "_unsafe_index_put")
def _index_put(it, node, outs):
    b = bind(node)
    shape = outs[0]
    indices, known, axes, pos = [], True, [], 0
    for ix in b["indices"]:
        value, ok = _index_or_zeros(it, ix)
        known = known and ok
        span = value.ndim if _is_tensor(value) and value.dtype == torch.bool else 1
        if ix is not None:
            axes += list(range(pos, pos + span))
        pos += span
        indices.append(value)
    if not known and any(_is_tensor(v) and v.dtype == torch.bool for v in indices):
        return it.dense(node, outs, str(node.target))
    dest = _positions(shape)[tuple(slice(None) if v is None else v for v in indices)]
    values = D.broadcast_to(it.deps(b["values"]), tuple(dest.shape))
    return _route(
        it,
        node,
        outs,
        dest,
        values,
        overwrite=not b.get("accumulate", False),
        smear_axes=None if known else axes,
    )


@_rule("masked_scatter")
def _masked_scatter(it, node, outs):
    b = bind(node)
    mask = it.value(b["mask"])
    if mask is None:
        return it.dense(node, outs, str(node.target))
    shape = outs[0]
    full = torch.broadcast_to(mask.cpu(), shape).reshape(-1)
    dest = torch.flatten(_positions(shape))[full]
    source = D.reshape(it.deps(b["source"]), (it.deps(b["source"]).size,))
    source = D.slice_(source, [0], [int(full.sum())])
    return _route(it, node, outs, dest, source, overwrite=True, smear_axes=None)


@_rule("col2im")
def _col2im(it, node, outs):
    """``fold`` sums overlapping patches: each output reads the columns ``im2col`` puts it in."""
    b = bind(node)
    shape = outs[0]
    dest = torch.ops.aten.im2col(
        _positions(shape), b["kernel_size"], b["dilation"], b["padding"], b["stride"]
    )
    columns = it.deps(b["self"])
    return _route(
        it,
        node,
        outs,
        dest.reshape(columns.shape),
        columns,
        overwrite=False,
        smear_axes=None,
        base=D.empty(shape, it.n_labels),
    )


# --- linear algebra, FFT, complex views ---------------------------------------------------------

_LINALG = (
    "_linalg_svd", "linalg_svd", "_linalg_eigh", "linalg_eigh", "linalg_eig", "_linalg_eigvals",
    "linalg_inv_ex", "linalg_inv", "_linalg_det", "linalg_det", "_linalg_slogdet",
    "linalg_cholesky_ex", "cholesky", "linalg_lu_factor_ex", "linalg_lu", "linalg_qr",
    "cholesky_inverse", "linalg_householder_product", "linalg_pinv", "linalg_matrix_exp",
    "_linalg_check_errors", "linalg_ldl_factor_ex", "geqrf", "ormqr",
)  # fmt: skip


def _per_batch(
    it: Interpreter,
    node: torch.fx.Node,
    outs: list[tuple[int, ...] | None],
    inputs: Sequence[Deps],
    lead: int,
) -> list[Deps | None]:
    """Operations independent along their ``lead`` leading axes (a batch, heads): within one
    entry of those, every output element depends on every input element. An output whose
    leading axes are not the inputs' is dense (and reported)."""
    results: list[Deps | None] = []
    for s in outs:
        if s is None or not inputs:
            results.append(None)
            continue
        batch = s[:lead]
        if len(s) < lead or any(len(d.shape) < lead or d.shape[:lead] != batch for d in inputs):
            if math.prod(s):
                it.fallbacks.add(str(node.target))
            results.append(D.dense(s, *inputs))
            continue
        parts = [D.batched_dense(d, len(d.shape) - lead, s, len(s) - lead) for d in inputs]
        results.append(D.union(*parts))
    return results


def _inputs_with_deps(it: Interpreter, node: torch.fx.Node) -> list[Deps]:
    return [it.deps(a) for a in pytree.tree_leaves((node.args, node.kwargs)) if it.has_deps(a)]


@_rule(*_LINALG)
def _linalg(it, node, outs):
    """Batched matrix functions: leading axes are a batch, the trailing matrix axes are dense."""
    inputs = _inputs_with_deps(it, node)
    lead = len(inputs[0].shape) - 2
    if lead < 0:
        return it.dense(node, outs, str(node.target))
    return _per_batch(it, node, outs, inputs, lead)


# Solvers of ``A X = B``: the names of ``A`` and ``B`` in their schemas.
_SOLVES = {
    "_linalg_solve_ex": ("A", "B"), "linalg_solve": ("A", "B"), "linalg_solve_ex": ("A", "B"),
    "cholesky_solve": ("input2", "self"), "triangular_solve": ("A", "self"),
    "linalg_solve_triangular": ("self", "B"), "linalg_lu_solve": ("LU", "B"),
    "lu_solve": ("LU_data", "self"),
}  # fmt: skip


@_rule(*_SOLVES)
def _solve(it, node, outs):
    """``A X = B`` (``X A = B`` with ``left=False``): a column (row) of ``X`` reads the same
    column (row) of ``B`` and all of ``A`` (of its batch entry); the other outputs
    (factorizations, a copy of ``A``) read ``A`` alone."""
    b = bind(node)
    a_name, b_name = _SOLVES[_packet(node.target)]
    a, rhs = it.deps(b[a_name]), it.deps(b[b_name])
    n_a = len(a.shape)
    vector = _packet(node.target) in ("_linalg_solve_ex", "linalg_solve", "linalg_solve_ex") and (
        len(rhs.shape) == 1 or (len(rhs.shape) == n_a - 1 and rhs.shape == a.shape[:-1])
    )  # linalg.solve takes (batches of) vectors
    if vector:
        axis = len(rhs.shape) - 1
    else:
        axis = len(rhs.shape) - (2 if b.get("left", True) else 1)
    whole_a = D.reduce(a, [n_a - 2, n_a - 1], keepdims=True)
    solution = [D.broadcast_to(D.reduce(rhs, [axis], keepdims=True), outs[0])]
    if not a.is_empty:
        reduced = D.reshape(whole_a, whole_a.shape[:-1]) if vector else whole_a
        solution.append(D.broadcast_to(reduced, outs[0]))
    results: list[Deps | None] = [D.union(*solution)]
    for s in outs[1:]:
        results.append(None if s is None or a.is_empty else D.broadcast_to(whole_a, s))
    return results


# Attention on ``(batch, heads, length, features)``. (PyTorch decomposes the CPU kernel
# ``_scaled_dot_product_flash_attention_for_cpu`` into operations with exact rules.)
_ATTENTION = (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_attention_math_for_mps",
)  # fmt: skip


@_rule(*_ATTENTION)
def _attention(it, node, outs):
    """Output row ``l`` reads row ``l`` of the queries and of the mask, and every key and value
    of its batch entry and head."""
    b = bind(node)
    q, k, v = (it.deps(b[name]) for name in ("query", "key", "value"))
    mask = b.get("attn_mask", b.get("attn_bias"))
    inputs = _inputs_with_deps(it, node)
    nd = len(q.shape)
    if nd < 2 or not (len(k.shape) == len(v.shape) == nd and q.shape[:-2] == k.shape[:-2]):
        return _per_batch(it, node, outs, inputs, 1)  # grouped-query attention: per batch
    memory = D.union(*(D.reduce(d, [nd - 2, nd - 1], keepdims=True) for d in (k, v)))
    rows = D.reduce(q, [nd - 1], keepdims=True)  # (..., L, 1)
    per_row = D.union(rows, D.broadcast_to(memory, rows.shape))
    if it.has_deps(mask):
        scores = (*q.shape[:-1], k.shape[-2])
        mixed = D.reduce(D.broadcast_to(it.deps(mask), scores), [nd - 1], keepdims=True)
        per_row = D.union(per_row, mixed)
    results: list[Deps | None] = []
    for s in outs:
        if s is not None and len(s) == nd and s[:-1] == rows.shape[:-1]:
            results.append(D.broadcast_to(per_row, s))  # the output (and debug scores)
        elif s is not None and s == rows.shape[:-1]:
            results.append(D.reshape(per_row, s))  # the log-sum-exp of every row
        else:
            results.extend(_per_batch(it, node, [s], inputs, nd - 2))
    return results


_ATTENTION_BACKWARD = (
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)
# Attention kernels on ``(batch, length, heads, features)``.
_ATTENTION_PER_BATCH = (
    "_efficient_attention_forward", "_efficient_attention_backward", "_flash_attention_forward",
    "_flash_attention_backward",
)  # fmt: skip


@_rule(*_ATTENTION_BACKWARD, *_ATTENTION_PER_BATCH)
def _attention_gradients(it, node, outs):
    """The gradients of attention mix everything within one batch entry (and head)."""
    lead = 2 if _packet(node.target) in _ATTENTION_BACKWARD else 1
    return _per_batch(it, node, outs, _inputs_with_deps(it, node), lead)


@_rule("_fft_r2c", "_fft_c2r", "_fft_c2c")
def _fft(it, node, outs):
    b = bind(node)
    x = it.deps(b["self"])
    axes = _dims(b["dim"], len(x.shape))
    return [D.broadcast_to(D.reduce(x, axes, keepdims=True), outs[0])]


@_rule("view_as_real")
def _view_as_real(it, node, outs):
    x = it.deps(node.args[0])
    return [D.broadcast_to(D.reshape(x, (*x.shape, 1)), outs[0])]


@_rule("view_as_complex")
def _view_as_complex(it, node, outs):
    return [D.reduce(it.deps(node.args[0]), [-1])]
