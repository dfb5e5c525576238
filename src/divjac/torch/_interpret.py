"""Sparsity detection for PyTorch: abstract interpretation of an ATen graph over dependency sets.

The graph comes from ``make_fx`` (functionalized, so there is no aliasing or mutation to track).
The walker of this module follows it node by node; each ATen operation is one lookup in the
rules users registered, then in the table of :mod:`divjac.torch._table` (a rule of
:mod:`divjac._core.rules` and its argument extractor); every operation tagged
``torch.Tag.pointwise`` is element-wise. Operations that have a PyTorch decomposition and no
rule (upsampling, recurrent layers, many ``*_backward`` operations) are decomposed while tracing
(:func:`decompositions`) and never reach the interpreter; higher-order operations (``cond``,
...) are not followed: assumed dense.

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
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from .._core import rules as D
from .._core.rules import Deps, Op, Rule
from .._errors import InternalError
from ._aten import bind, host, inexact, is_tensor, outputs, packet, shape
from ._compat import HigherOrderOperator, OpOverload, decomposition_table, op_schema, pytree
from ._graph import Graph
from ._ops import is_elementwise
from ._table import TABLE, tensor_args
from ._table_nn import is_convolution

__all__ = ["REGISTRY", "Interpreter", "decompositions", "is_convolution", "last_uses"]

REGISTRY = D.Registry("ATen operation")


@functools.cache
def decompositions() -> dict[Any, Callable[..., Any]]:
    """PyTorch decompositions of every operation the interpreter has no rule for.

    Tracing with them turns upsampling, most ``*_backward`` operations and other composite
    kernels into operations with rules (index operations with constant indices, arithmetic).
    Cleared when a rule is registered (an operation with a rule is kept whole).
    """
    return {
        op: fn
        for op, fn in decomposition_table().items()
        if isinstance(op, OpOverload)
        and not (op.namespace == "aten" and packet(op) in TABLE)
        and REGISTRY.get(op_schema(op).name) is None
        and torch.Tag.pointwise not in op.tags
    }


def last_uses(nodes: Sequence[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Per node (of a graph, in order), the nodes no later one reads: its inputs read for the
    last time, itself if nothing reads it. Their dependency sets are released once it ran, so
    that a detection holds only what is still to be read."""
    order = {node: i for i, node in enumerate(nodes)}
    done: list[list[torch.fx.Node]] = [[] for _ in nodes]
    for node in nodes:
        done[max((order[user] for user in node.users), default=order[node])].append(node)
    return done


# Operations that read only the shape of their first argument (the gradient of a sum starts
# from ``ones_like`` of its value).
_SHAPE_ONLY = frozenset(
    {"ones_like", "zeros_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
     "new_full", "sym_size", "sym_numel", "sym_stride"}
)  # fmt: skip


def live_nodes(nodes: Sequence[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes whose values the output reads. The others (the value of a loss whose
    gradient is the function) are not propagated: their dependency sets would be paid for,
    and a dense one would end a screening that the output never sees."""
    live: set[torch.fx.Node] = set()
    for node in reversed(nodes):
        if node.op != "output" and node not in live:
            continue
        live.add(node)
        inputs = node.all_input_nodes
        if node.op == "call_function" and packet(node.target) in _SHAPE_ONLY and node.args:
            inputs = [a for a in inputs if a is not node.args[0]]
        live.update(inputs)
    return live


def _user_args(g: Graph, node: torch.fx.Node) -> tuple[list[Any], dict[str, Any]]:
    """A registered rule's inputs (the tensor arguments, in schema order) and parameters."""
    schema = op_schema(node.target)  # type: ignore[arg-type]
    b = bind(node)
    tensors = [a.name for a in schema.arguments if "Tensor" in str(a.type)]
    args = [x for name in tensors for x in pytree.tree_leaves(b[name])]
    return args, {k: v for k, v in b.items() if k not in tensors}


class Interpreter(Graph):
    """Propagates dependency sets through an ATen graph (see :class:`~divjac.torch._graph.Graph`
    for the arguments and attributes)."""

    def run(self, gm: torch.fx.GraphModule, in_deps: Sequence[Deps]) -> Deps:
        """Dependency sets of the graph's (single tensor) output, given those of its inputs."""
        placeholders = iter(in_deps)
        result: Deps | None = None
        nodes = list(gm.graph.nodes)
        live = live_nodes(nodes)
        for node, done in zip(nodes, last_uses(nodes), strict=True):
            if node.op == "placeholder":
                given = next(placeholders)
                if not given.is_empty:
                    self._deps[node] = given
            elif node.op == "call_function" and node in live:
                self._call(node)
            elif node.op == "output":
                out = next(a for a in pytree.tree_leaves(node.args) if isinstance(a, torch.fx.Node))
                result = self.deps(out)
            for dead in done:
                self.release(dead)
        if result is None:
            raise InternalError("an ATen graph without output")
        return result

    def warn_fallbacks(self) -> None:
        """Emit one :class:`DenseFallbackWarning` naming every operation without a rule."""
        D.warn_fallbacks(self.fallbacks, kind="ATen operation")

    def _call(self, node: torch.fx.Node) -> None:
        target = node.target
        if target is operator.getitem:
            parent = self._deps.get(node.args[0])  # type: ignore[arg-type]
            if isinstance(parent, list):
                found = parent[node.args[1]]  # type: ignore[index]
                if found is not None and inexact(node.meta.get("val")):
                    self._deps[node] = found
            return
        if not isinstance(target, HigherOrderOperator | OpOverload):
            return  # arithmetic on sizes and other Python values
        vals = outputs(node)
        if not any(inexact(v) for v in vals):
            return  # integer and boolean results: no derivative
        if not any(self.has_deps(a) for a in pytree.tree_leaves((node.args, node.kwargs))):
            return  # constants and parameters: nothing depends on the labels
        results = self._apply(node, vals)
        stored: list[Deps | None] = []
        for val, dep in zip(vals, results, strict=True):
            if not inexact(val) or dep.is_empty:
                stored.append(None)
                continue
            if dep.shape != shape(val):
                dep = D.reshape(dep, shape(val))
            if self.limit is not None:
                self.limit.check(dep, str(target))
            stored.append(dep)
        if isinstance(node.meta.get("val"), tuple | list):
            self._deps[node] = stored
        elif stored[0] is not None:
            self._deps[node] = stored[0]

    def _apply(self, node: torch.fx.Node, vals: list[Any]) -> list[Deps]:
        """The dependency sets of every output: a registered rule, the table's, element-wise
        (pointwise operations), else the dense fallback over every argument."""
        target = node.target
        overload = isinstance(target, OpOverload)
        user = REGISTRY.get(op_schema(target).name) if overload else None  # type: ignore[arg-type]
        # The table holds ATen operations (a custom operator may have an ATen one's name).
        aten = overload and target.namespace == "aten"  # type: ignore[union-attr]
        entry = TABLE.get(packet(target)) if aten else None
        found: tuple[Rule, tuple[list[Any], Mapping[str, Any]]] | None = None
        if user is not None:
            found = (user, _user_args(self, node))
        elif entry is not None:
            extracted = entry[1](self, node)
            found = None if extracted is None else (entry[0], extracted)
        elif overload and is_elementwise(target):
            found = (D.elementwise_rule, tensor_args(self, node))
        if found is None:  # no rule (or a subgraph: cond, ...; not followed)
            args = pytree.tree_leaves((node.args, node.kwargs))
            found = (D.dense_rule, (args, {}))
        rule, (args, params) = found
        op = Op(
            str(target),
            [a if isinstance(a, Deps) else self.deps(a) for a in args],
            [shape(v) if is_tensor(v) else () for v in vals],
            self.n_labels,
            params=params,
            values=lambda i: host(self.value(args[i])),
            fallbacks=self.fallbacks,
            wanted=[inexact(v) for v in vals],
        )
        return list(rule(op))
