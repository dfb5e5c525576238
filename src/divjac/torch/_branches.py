"""Traces on values, one per branch taken: what a trace on the actual inputs depended on.

A function whose control flow depends on values is traced on the actual values; the trace holds
for the inputs that take the same branches. :class:`Branch` keeps the part of the graph that
computes the values the control flow read, to recompute and compare them at every call.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from .._errors import InternalError, RetraceWarning, warn_at_caller
from ._compat import OpOverload, op_schema
from ._trace_keys import Reached

__all__ = ["MAX_BRANCHES", "Branch", "Branches", "branch"]

MAX_BRANCHES = 8
"""Traces on values kept per function and shapes (one per branch taken)."""


@dataclass(eq=False)
class Branch:
    """What a trace on values depended on: the graph (pruned) that computes the scalars the
    function took from tensors and the shapes of data-dependent results, with their values.

    Its constants are the tensors the cache key found (held weakly: their values are read
    here, so every found tensor must be the same object, at the same place) or literals.
    """

    graph: torch.fx.GraphModule
    constants: dict[str, Callable[[], torch.Tensor | None]]
    ids: tuple[int, ...]
    expected: tuple[Any, ...]

    def holds(self, inputs: Sequence[torch.Tensor], reached: Reached) -> bool:
        if reached.ids != self.ids:
            return False
        constants = {}
        for name, get in self.constants.items():
            const = get()
            if const is None:  # freed: not the tensor the function reaches
                return False
            constants[name] = const
        try:
            return _decisions(self.graph, constants, inputs) == self.expected
        except Exception:  # another branch's values (a slice too long, ...)
            return False


class Branches:
    """The traces on values of one function and shapes, most recent first."""

    def __init__(self, fun: Callable[..., Any]) -> None:
        self.entries: list[tuple[Branch, Any]] = []
        self.traces = 0
        self.name = getattr(fun, "__qualname__", type(fun).__qualname__)

    def select(self, inputs: list[torch.Tensor], reached: Reached) -> Any:
        for i, (branch, traced) in enumerate(self.entries):
            if traced.current() and branch.holds(inputs, reached):
                self.entries.insert(0, self.entries.pop(i))
                return traced
        return None

    def add(self, branch: Branch | None, traced: Any) -> None:
        self.traces += 1
        if branch is not None:
            self.entries.insert(0, (branch, traced))
            del self.entries[MAX_BRANCHES:]
        if self.traces == 2 * MAX_BRANCHES:
            warn_at_caller(
                f"divjac traced {self.name} {self.traces} times: its control flow depends on "
                "values of its inputs (Python `if` on a tensor, `.item()`, data-dependent "
                "shapes) that differ from call to call, so every call traces it again and "
                "detects its sparsity again (slow). Write value-dependent choices with "
                "torch.where, or keep the values the function takes from tensors fixed.",
                RetraceWarning,
            )


def _decides(node: torch.fx.Node) -> bool:
    """Whether a node takes a value out of the tensors (``.item()``, ``bool``, ``equal``) or
    has a data-dependent shape (``nonzero``, boolean masks)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return False
    if target is torch.ops.aten.index.Tensor:  # data-dependent with a boolean index only
        indices = node.args[1]
        if not isinstance(indices, list | tuple):
            raise InternalError(f"aten.index with indices {indices!r} (a list was expected)")
        masks = (i.meta["val"].dtype for i in indices if isinstance(i, torch.fx.Node))
        return any(dtype in (torch.bool, torch.uint8) for dtype in masks)
    if torch.Tag.dynamic_output_shape in target.tags:
        return True
    returns = op_schema(target).returns
    return bool(returns) and not any("Tensor" in str(r.type) for r in returns)


def branch(gm: torch.fx.GraphModule, reached: Reached, inputs: list[torch.Tensor]) -> Branch | None:
    """The branch a trace on values took (``None`` if it cannot be recomputed safely: random
    or in-place operations, constants the cache key does not identify)."""
    nodes = list(gm.graph.nodes)
    decisions = [n for n in nodes if _decides(n)]
    needed: set[torch.fx.Node] = set()
    stack = list(decisions)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    constants: dict[str, Callable[[], torch.Tensor | None]] = {}
    for node in nodes:
        if node.op == "placeholder" or node in needed:
            target = node.target
            if (
                node.op == "call_function"
                and isinstance(target, OpOverload)
                and (
                    torch.Tag.nondeterministic_seeded in target.tags or op_schema(target).is_mutable
                )
            ):
                return None
            if node.op == "get_attr":
                const = getattr(gm, str(target))
                if reached.tensors.get(id(const)) is const:
                    constants[str(target)] = weakref.ref(const)
                elif all(u.target is torch.ops.aten.lift_fresh_copy.default for u in node.users):
                    constants[str(target)] = functools.partial(_same, const)
                else:
                    return None
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in decisions))
    pruned = torch.fx.GraphModule(
        {name: torch.empty(0, device="meta") for name in constants}, graph
    )
    values = {name: get() for name, get in constants.items()}
    expected = _decisions(pruned, values, inputs)  # type: ignore[arg-type]
    return Branch(pruned, constants, reached.ids, expected)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _Values(torch.fx.Interpreter):
    """Runs a pruned graph with its constants given."""

    def __init__(self, gm: torch.fx.GraphModule, constants: dict[str, torch.Tensor]) -> None:
        super().__init__(gm)
        self._constants = constants

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._constants[str(target)]


def _decisions(
    graph: torch.fx.GraphModule, constants: dict[str, torch.Tensor], inputs: Sequence[torch.Tensor]
) -> tuple[Any, ...]:
    with torch.no_grad():
        out = _Values(graph, constants).run(*inputs)
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in out)
