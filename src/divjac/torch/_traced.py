"""A traced function's ATen graph (:class:`Traced`, made by :func:`divjac.torch._detect.trace`)
and what the passes and detection read of it: the operations it runs (attention, recurrent
layers, normalizations, operations without forward derivatives), the elements its passes hold,
and the propagation of a per-sample pattern through it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from .._core import detection, rules as D
from .._core.detection import EntryLimit, Propagated
from ._aten import (
    forward_derivative_inexact,
    forward_derivative_wrong,
    lacks_forward_derivative,
)
from ._checks import any_dead
from ._compat import OpOverload, outside_transforms, pytree
from ._interpret import Interpreter, is_convolution
from ._side_effects import quiet_batch_norm
from ._trace_keys import module_signature

__all__ = ["DECOMPOSED", "LAYOUTS", "TensorSpec", "Traced"]


# The context of a function without batch normalization (a null context can be entered again
# and again, by any number of calls at once).
_STILL = contextlib.nullcontext()


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor the traced function returned."""

    shape: tuple[int, ...]
    dtype: torch.dtype


# Setups kept per trace (a few per transform and context; a CUDA device's free memory, part of
# the context, may change from call to call).
PLANS = 32


@dataclass(eq=False)
class Traced(detection.Traced):
    """The ATen graph of a batched function, batch-first in and out, with cached detections.

    ``pass_elements`` is twice the most elements the graph's intermediates hold at once
    (:func:`live_peak`; memory planning).

    Attributes:
        gm: graph whose inputs are the tensor leaves of ``(args, kwargs)``, the differentiated
            one with its batch axis moved first (or a leading batch of one added). Its
            constants are meta tensors, except the ``readable`` ones.
        x_pos: position of the differentiated leaf among the graph inputs.
        module_refs: weak references to the modules the function may run.
        readable: the graph constants detection may read: captured integer and boolean tensors
            (the caller's own objects, in ``versioned``) and the literals of the program.
        versioned: the readable constants that are the caller's tensors.
        identified: weak references to the objects the cache key identifies by ``id``.
        unreached: modules the trace ran that :func:`~divjac.torch._trace_keys.reach` did not
            find, with the signature of their state then.
        batch_norms: the batch normalization modules the trace ran that update their running
            statistics (training mode): kept still during passes.
        captured: the floating-point tensors the graph captured (parameters, buffers), weakly.
        reads: a copy of every ``versioned`` constant a detection read, as it read it
            (``None``: it read two different values, the trace never holds again).
        dropped: the graph constants replaced by meta tensors (weights), weakly, by name.
        directions: by context, whether rows were measured faster than columns
            (:meth:`~divjac.torch._backend.TorchBackend.prefer_reverse`).
        plans: the results of the setups of calls of this trace (each in a 1-tuple), by
            setup, spec and context (:meth:`~divjac.torch._backend.TorchBackend.ahead`), the
            :data:`PLANS` most recent.
    """

    gm: torch.fx.GraphModule
    x_pos: int
    module_refs: tuple[weakref.ref[nn.Module], ...]
    readable: dict[str, torch.Tensor]
    versioned: frozenset[str]
    identified: tuple[weakref.ref[Any], ...]
    unreached: tuple[tuple[weakref.ref[nn.Module], Hashable], ...]
    batch_norms: tuple[weakref.ref[nn.Module], ...]
    captured: tuple[weakref.ref[torch.Tensor], ...]
    reads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    dropped: dict[str, weakref.ref[torch.Tensor]] = field(default_factory=dict)
    directions: dict[Hashable, bool] = field(default_factory=dict)
    plans: detection.LRU[tuple[Any]] = field(default_factory=lambda: detection.LRU(PLANS))

    def modules(self) -> list[nn.Module]:
        """The modules the function may run (alive while a call runs it)."""
        return [m for m in (r() for r in self.module_refs) if m is not None]

    def captures_grad(self) -> bool:
        """Whether a captured tensor requires grad now (a parameter being trained)."""
        return any(t is not None and t.requires_grad for t in (r() for r in self.captured))

    def running_stats(self) -> contextlib.AbstractContextManager[None]:
        """The batch normalization modules of the function kept from updating their running
        statistics (a context)."""
        if not self.batch_norms:
            return _STILL
        return quiet_batch_norm([m for m in (r() for r in self.batch_norms) if m is not None])

    def current(self) -> bool:
        """Whether the trace still holds for a call whose cache key is its own: the objects the
        key identifies are alive (their ``id`` is theirs), the constants detection read hold
        the values it read, and the modules that only the trace found are as they were.

        Values, not version counters: writes through ``.data``, a new ``.data`` or a shared
        NumPy array change an index tensor without a new version."""
        if any_dead(self.identified):
            return False
        if not all(_same(self.readable[name], v) for name, v in self.reads.items()):
            return False
        return all(
            (m := ref()) is not None and module_signature(m) == signature
            for ref, signature in self.unreached
        )

    def record_reads(self, names: Iterable[str]) -> None:
        """Note that a result kept with the trace read the constants ``names``: the trace
        holds no longer once one of the caller's among them is modified in place."""
        for name in set(names) & self.versioned:
            now = self.readable[name]
            if name not in self.reads:
                self.reads[name] = now.detach().clone()
            elif not _same(now, self.reads[name]):
                self.reads[name] = None  # never current again

    @functools.cached_property
    def graph_elements(self) -> int:
        """Elements one pass keeps when a gradient will flow through it (memory planning): its
        intermediates, saved for the backward, and the gradients alive at once in the
        backward, which runs the graph in reverse (its live peak, :func:`live_peak`): 1.8x the
        measured peak per pass of a 32x32 U-Net's sparse divergence + backward
        (``bench_memory_plan``), where twice the sum of the intermediates was 2.9x."""
        return sum(map(_elements, self.gm.graph.nodes)) + live_peak(self.gm)

    @functools.cached_property
    def draws_random(self) -> bool:
        """Whether the function draws random numbers (dropout in training mode, ``randn``)."""
        return any(
            node.op == "call_function"
            and isinstance(node.target, OpOverload)
            and torch.Tag.nondeterministic_seeded in node.target.tags
            for node in self.gm.graph.nodes
        )

    @functools.cached_property
    def attends(self) -> bool:
        """Whether the graph may run attention (a softmax: the decomposition of every
        attention kernel has one)."""
        return any(
            node.op == "call_function" and node.target in _SOFTMAXES for node in self.gm.graph.nodes
        )

    @functools.cached_property
    def custom_ops(self) -> frozenset[str]:
        """The ``torch.library`` custom operations (outside ATen) on the path from the
        differentiated input."""
        return self._on_path(
            lambda target: (
                isinstance(target, OpOverload) and target.namespace not in ("aten", "prims")
            )
        )

    @functools.cached_property
    def scatters_strided(self) -> bool:
        """Whether the graph has ``as_strided_scatter`` (whose backward is wrong, torch 2.13)."""
        return any(
            node.op == "call_function" and node.target is torch.ops.aten.as_strided_scatter.default
            for node in self.gm.graph.nodes
        )

    @functools.cached_property
    def lays_out(self) -> bool:
        """Whether the graph asks for a memory format other than the contiguous one
        (``channels_last``), which ``vmap`` cannot give the tensors it batches (torch 2.13)."""
        return any(
            node.op == "call_function" and node.kwargs.get("memory_format") in LAYOUTS
            for node in self.gm.graph.nodes
        )

    @functools.cached_property
    def nests(self) -> bool:
        """Whether an ``nn.TransformerEncoder`` in eval mode may take its nested-tensor fast
        path, which PyTorch takes without gradients (``no_grad``, ``inference_mode``) and
        with a padding mask, and which returns zeros at the padded positions where the path
        with gradients (the one divjac differentiates) returns the layers' values."""
        return any(
            isinstance(m, nn.TransformerEncoder)
            and getattr(m, "use_nested_tensor", False)
            and not m.training
            for m in self.modules()
        )

    @functools.cached_property
    def runs_rnn(self) -> bool:
        """Whether the function runs a recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``)."""
        return any(isinstance(m, nn.RNNBase) for m in self.modules())

    @functools.cached_property
    def solves_broadcast(self) -> bool:
        """Whether a linear solve broadcasts its matrix over more batch axes than it has."""
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and node.target in _SOLVES_EX:
                a, b = (arg.meta["val"] for arg in node.args[:2])
                if b.ndim > a.ndim:
                    return True
        return False

    @functools.cached_property
    def norms(self) -> frozenset[str]:
        """The normalizations of the graph whose torch kernels some passes avoid (torch 2.13):
        ``"layer"`` and ``"instance"`` (the gradient of their forward derivative is wrong),
        ``"strided_group"`` (a group normalization of a non-contiguous input, as the output of
        an attention block transposed back to an image: its forward derivative views that
        input and fails, its backward under ``vmap`` asks for a memory format)."""
        found = set()
        for node in self.gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is torch.ops.aten.native_layer_norm.default:
                found.add("layer")
            elif node.target is torch.ops.aten._native_batch_norm_legit.no_stats:
                found.add("instance")
            elif (
                node.target is torch.ops.aten.native_group_norm.default
                and not node.args[0].meta["val"].is_contiguous()
            ):
                found.add("strided_group")
        return frozenset(found)

    @functools.cached_property
    def forward_less(self) -> frozenset[str]:
        """The operations of the graph that PyTorch has no forward derivative for (``cdist``,
        ``pdist``, ``cholesky``) on the path from the differentiated input: only reverse
        passes go through them."""
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        live = {placeholders[self.x_pos]}
        missing = set()
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and any(a in live for a in node.all_input_nodes):
                live.add(node)
                if lacks_forward_derivative(node, live):
                    missing.add(str(node.target))
        for call in self.gm.meta.get(DECOMPOSED, ()):  # the decomposed ones (grid_sampler_2d)
            if any(a in live for a in call.all_input_nodes) and lacks_forward_derivative(
                call, live
            ):
                missing.add(str(call.target))
        return frozenset(missing)

    @functools.cached_property
    def forward_twice_wrong(self) -> frozenset[str]:
        """The operations on the path from the differentiated input whose forward derivative
        PyTorch does not differentiate right (:func:`forward_derivative_wrong`: the linalg
        kernels): a gradient must not flow through forward passes of them."""
        return self._on_path(forward_derivative_wrong)

    @functools.cached_property
    def forward_inexact(self) -> frozenset[str]:
        """The operations on the path from the differentiated input whose forward derivative
        PyTorch computes inaccurately (:func:`forward_derivative_inexact`)."""
        return self._on_path(forward_derivative_inexact)

    def _on_path(self, which: Callable[[Any], bool]) -> frozenset[str]:
        """The operations on the path from the differentiated input that ``which`` picks."""
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        live = {placeholders[self.x_pos]}
        found = set()
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and any(a in live for a in node.all_input_nodes):
                live.add(node)
                if which(node.target):
                    found.add(str(node.target))
        return frozenset(found)

    @functools.cached_property
    def has_convolution(self) -> bool:
        """Whether the graph convolves (its reverse mode is then the slower one under vmap)."""
        return any(
            node.op == "call_function" and is_convolution(node.target)
            for node in self.gm.graph.nodes
        )

    def _propagate(self, seeded: D.Deps, limit: EntryLimit | None) -> Propagated:
        interp = Interpreter(seeded.n_labels, limit=limit, constants=self.readable)
        n_inputs = sum(1 for node in self.gm.graph.nodes if node.op == "placeholder")
        in_deps = [
            seeded if i == self.x_pos else D.empty((), seeded.n_labels) for i in range(n_inputs)
        ]
        with outside_transforms():  # the rules compute on plain tensors, under any transform
            out = interp.run(self.gm, in_deps)
        self.record_reads(interp.read)
        interp.warn_fallbacks()
        return Propagated(out, frozenset(interp.fallbacks))


def _elements(node: torch.fx.Node) -> int:
    """The elements of the tensors an operation of the graph makes (none for other nodes)."""
    if node.op != "call_function":
        return 0
    return sum(
        v.numel() for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)
    )


def live_peak(gm: torch.fx.GraphModule) -> int:
    """The most elements the intermediates of ``gm`` hold at once, run in order: what one pass
    holds of tangents (the skip connections of a U-Net stay alive across it), where the
    largest intermediate alone underestimates a U-Net's passes 3x and the sum of all of them
    overestimates it 12x."""
    nodes = list(gm.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    last = {a: order[node] for node in nodes for a in node.all_input_nodes}
    change = [0] * (len(nodes) + 1)
    for i, node in enumerate(nodes):
        if node.op == "call_function":
            size = _elements(node)
            change[i] += size
            change[max(last.get(node, i), i) + 1] -= size
    peak = alive = 0
    for step in change:
        alive += step
        peak = max(peak, alive)
    return peak


# The memory formats of a given rank (vmap's batched tensors have one more axis).
LAYOUTS = frozenset({torch.channels_last, torch.channels_last_3d})
_SOFTMAXES = (torch.ops.aten._softmax.default, torch.ops.aten._safe_softmax.default)
_SOLVES_EX = (torch.ops.aten._linalg_solve_ex.default, torch.ops.aten.linalg_solve_ex.default)


DECOMPOSED = "divjac_decomposed"
"""The key of a traced graph's ``meta`` to the :class:`Decomposed` calls of its trace."""


def _same(now: torch.Tensor, then: torch.Tensor | None) -> bool:
    """Whether a constant holds the values ``then`` read of it (a copy; ``None``: never)."""
    return (
        then is not None
        and now.shape == then.shape
        and now.dtype == then.dtype
        and bool(torch.equal(now, then))
    )
