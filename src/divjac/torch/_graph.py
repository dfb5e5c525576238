"""The values of an ATen graph during sparsity detection: dependency sets, folded constants.

:class:`Graph` holds what the interpreter knows of every graph value, and runs data movement
on positions: every floating tensor argument is replaced by its positions, so that running the
operation itself gives the source element of every output element (an index map, for
:func:`divjac._core.rules.gather_rule`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.fx

from .._core import rules as D
from .._core.detection import EntryLimit
from .._core.rules import Deps
from .._errors import InternalError
from ._aten import bind, inexact, is_tensor, outputs, packet, shape
from ._compat import OpOverload, pytree

__all__ = ["Graph", "Moved"]

# Results of these operations are uninitialized memory (folded as zeros).
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                  "empty_permuted"}  # fmt: skip


class _UnknownValue(Exception):
    """An index or mask a rule needs is not known at detection time."""


Moved = tuple[list[Any], list[np.ndarray | None]]
"""What :meth:`Graph.movement` finds: the source arguments in order, and per output the flat
index (into the sources stacked in order; ``-1``: a constant) each element copies."""


class Graph:
    """Dependency sets and known constant values of the values of one ATen graph.

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
        # Nodes that depended on the labels and whose dependency sets were released after
        # their last use (:meth:`release`): they never fold, and cannot be read.
        self._released: set[torch.fx.Node] = set()
        self._values: D.Folded[torch.fx.Node] = D.Folded(self._fold)

    def deps(self, arg: Any) -> Deps:
        """Dependency sets of a tensor argument (empty for constants and parameters)."""
        if isinstance(arg, torch.fx.Node):
            found = self._deps.get(arg)
            if isinstance(found, Deps):
                return found
            if arg in self._released:
                raise InternalError(f"the dependency sets of {arg} were read after their last use")
            val = arg.meta.get("val")
            if is_tensor(val):
                return D.empty(shape(val), self.n_labels)
        if is_tensor(arg):
            return D.empty(shape(arg), self.n_labels)
        return D.empty((), self.n_labels)

    def has_deps(self, arg: Any) -> bool:
        return isinstance(arg, torch.fx.Node) and (
            arg in self._released or not self.deps(arg).is_empty
        )

    def release(self, node: torch.fx.Node) -> None:
        """Drop the dependency sets of ``node`` (no node left reads them)."""
        if self._deps.pop(node, None) is not None:
            self._released.add(node)

    def value(self, arg: Any) -> Any:
        """The concrete value of a graph value that does not depend on the input, else ``None``.

        Only the readable ``constants`` are graph constants with a value (their reads are
        recorded in :attr:`read`); weights are never read, so a pattern cannot go stale when
        they are trained.
        """
        if not isinstance(arg, torch.fx.Node):
            return arg
        return self._values.get(arg)

    def _fold(self, node: torch.fx.Node) -> Any:
        if node.op == "get_attr":
            const = self.constants.get(str(node.target))
            if const is None:
                return None
            self.read.add(str(node.target))
            return const.detach()
        if node.op != "call_function" or self.has_deps(node):
            return None
        target = node.target
        if target is operator.getitem:
            parent = self.value(node.args[0])
            return None if parent is None else parent[node.args[1]]
        if not isinstance(target, OpOverload):
            return None
        if torch.Tag.nondeterministic_seeded in target.tags:
            return None
        vals = outputs(node)
        if not D.foldable(v.numel() for v in vals if is_tensor(v)):
            return None
        if packet(target) in _UNINITIALIZED:
            # Uninitialized memory, about to be overwritten (``ones`` decomposes into
            # ``empty`` + ``fill``); a program that reads it has no defined result anyway.
            val = vals[0]
            return torch.zeros(shape(val), dtype=val.dtype, device=val.device)
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

    def movement(
        self,
        node: torch.fx.Node,
        *,
        zero_unknown: bool = False,
    ) -> Moved | None:
        """The index map of a data-movement operation (``None`` if an index is unknown).

        Every floating tensor argument is replaced by its 1-based positions (offset so that the
        arguments do not overlap), as float64 (exact below 2**53); float scalars (fill values)
        become 0; integer and boolean arguments (indices, masks) keep their constant values.
        Running the operation then gives, for every output element, the position it copies
        (0: a constant). An integer fill value (``masked_fill(x, mask, 10)``, a ``where`` with
        an integer tensor) would read as a position: the operation runs a second time with every
        position shifted by their count, and the elements that did not move are constants
        (they copied no argument). ``zero_unknown`` replaces unknown indices by zeros (a mask by ones):
        with the data smeared along the axes they index (the unknown-index smear of
        :func:`divjac._core.rules.gather_rule`), that bounds every possible index.
        """
        sources: list[Any] = []
        encoded: list[torch.Tensor] = []
        offset = 0

        def encode(a: Any) -> Any:
            nonlocal offset
            if isinstance(a, torch.fx.Node):
                val: Any = a.meta.get("val")
                if not is_tensor(val):
                    return self.value(a)
                if inexact(val):
                    n = val.numel()
                    ids = torch.arange(offset + 1, offset + n + 1, dtype=torch.float64)
                    sources.append(a)
                    offset += n
                    ids = ids.reshape(shape(val))
                    encoded.append(ids)
                    return ids
                value = self.value(a)
                if value is None:
                    if not zero_unknown:
                        raise _UnknownValue
                    fill = torch.ones if val.dtype == torch.bool else torch.zeros
                    return fill(shape(val), dtype=val.dtype)
                return value.cpu() if is_tensor(value) else value
            if isinstance(a, float):
                return 0.0
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        target = node.target
        if not isinstance(target, OpOverload):
            return None
        try:
            args = pytree.tree_map(encode, node.args)
            kwargs = pytree.tree_map(encode, node.kwargs)
        except _UnknownValue:
            return None
        strided = packet(target) in ("as_strided", "as_strided_copy", "as_strided_scatter")
        if strided and not _strides_are_safe(node):
            return None
        vals = outputs(node)

        def run() -> list[Any] | None:
            try:
                with torch.no_grad():
                    out = target(*args, **kwargs)
            except Exception:
                return None
            results = list(out) if isinstance(out, tuple | list) else [out]
            return [
                o.detach().real.to(torch.float64).round().to(torch.int64)  # a copy
                if inexact(o) and inexact(val)
                else None
                for o, val in zip(results, vals, strict=False)
            ]

        first = run()
        if first is None:
            return None
        for ids in encoded:  # in place: the second run sees them through the same arguments
            ids += offset
        second = run()
        if second is None:
            return None
        src: list[np.ndarray | None] = [None] * len(vals)
        for k, (positions, moved, val) in enumerate(zip(first, second, vals, strict=False)):
            if positions is None or moved is None:
                continue
            if tuple(positions.shape) != shape(val):
                return None  # a data-dependent shape: the replaced indices do not tell
            step = moved - positions
            if not bool(((step == 0) | (step == offset)).all()):
                return None  # not a copy of one element (cannot be read as positions)
            positions = torch.where(step == 0, 0, positions)  # constants copy no argument
            src[k] = positions.cpu().numpy() - 1
        return sources, src


def _strides_are_safe(node: torch.fx.Node) -> bool:
    """``as_strided`` reads only its (contiguous) input's own elements."""
    val: Any = node.args[0].meta.get("val")  # type: ignore[union-attr]
    if not is_tensor(val) or not val.is_contiguous() or val.storage_offset() != 0:
        return False
    b = bind(node)
    size, stride = b.get("size") or [], b.get("stride") or []
    last = int(b.get("storage_offset") or 0) + sum(
        (int(n) - 1) * int(s) for n, s in zip(size, stride, strict=False)
    )
    return all(int(n) > 0 for n in size) and 0 <= last < max(val.numel(), 1)
