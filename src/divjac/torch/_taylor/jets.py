"""The jets of the second-order sweep of :mod:`divjac.torch._taylor.sweep`: the Taylor terms one
value carries (:class:`Jet`), the state of one run (:class:`Sweep`), and the algebra of terms
the rules share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload

import torch
import torch.fx

from ..._errors import InternalError

__all__: list[str] = []

Tensor = torch.Tensor


@dataclass
class Jet:
    """The Taylor terms of one value of shape ``s``: ``first`` ``[K, *s]`` and ``second``
    ``[M, *s]`` (``M = 1``: the weighted sum; ``M = K``: per direction; ``None``: zero), each
    possibly of size one on axes it is constant along (broadcastable to its full shape)."""

    first: Tensor
    second: Tensor | None


Rule = Callable[["Sweep", torch.fx.Node, Sequence[Any], dict[str, Any]], tuple[Any, Any]]


def registrar(table: dict[Any, Rule]) -> Callable[..., Callable[[Rule], Rule]]:
    """A decorator that registers a rule in ``table`` for each of its ATen targets."""

    def targets(*ops: Any) -> Callable[[Rule], Rule]:
        def register(fn: Rule) -> Rule:
            for op in ops:
                table[op] = fn
            return fn

        return register

    return targets


class Propagation(Protocol):
    """What runs a program (:meth:`divjac.torch._taylor.sweep.Program.evaluate`): the terms
    of the values by node, and how a node's value and terms are computed."""

    jets: dict[torch.fx.Node, Any]

    def apply(
        self, rule: Rule, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]: ...


class Sweep:
    """The jets of one run, and the weighted sums over the directions."""

    def __init__(self, k: int, w: Tensor | None, per_direction: bool) -> None:
        self.k = k
        self.m = k if per_direction else 1
        self.w = w
        self.per_direction = per_direction
        self.jets: dict[torch.fx.Node, Any] = {}

    def jet(self, arg: Any) -> Jet | None:
        found = self.jets.get(arg) if isinstance(arg, torch.fx.Node) else None
        return found if isinstance(found, Jet) else None

    def apply(
        self, rule: Rule, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        """The value of ``node`` and its jet, by ``rule``."""
        return rule(self, node, args, kwargs)

    def needed(self, arg: Any) -> Jet:
        """The jet of an argument a rule was given as dependent."""
        found = self.jet(arg)
        if found is None:
            raise InternalError(f"second_order_sweep: no jet for the argument {arg}")
        return found

    def weighted(self, terms: Tensor) -> Tensor:
        """``sum_k w_k terms[k]`` (kept as an axis of one), or the terms per direction."""
        if self.per_direction:
            return terms
        if self.w is not None:
            terms = terms * self.w.reshape(self.k, *([1] * (terms.ndim - 1)))
        return terms.sum(0, keepdim=True)

    def quad(self, a: Tensor, b: Tensor) -> Tensor:
        """``sum_k w_k a_k b_k`` (element-wise)."""
        return self.weighted(a * b)


def add(*terms: Tensor | None) -> Tensor | None:
    found = [t for t in terms if t is not None]
    if not found:
        return None
    total = found[0]
    for t in found[1:]:
        total = total + t
    return total


def _scale(t: Tensor | None, c: Any) -> Tensor | None:
    return None if t is None else t * c


@overload
def lift(t: Tensor, ndim: int) -> Tensor: ...
@overload
def lift(t: None, ndim: int) -> None: ...
@overload
def lift(t: Tensor | None, ndim: int) -> Tensor | None: ...


def lift(t: Tensor | None, ndim: int) -> Tensor | None:
    """Terms ``[K, *s]`` with axes of one inserted after ``K`` up to ``ndim`` value axes (as
    broadcasting aligns the value with a larger one)."""
    if t is None or t.ndim - 1 >= ndim:
        return t
    return t.reshape(t.shape[0], *([1] * (ndim + 1 - t.ndim)), *t.shape[1:])


def _full(t: Tensor, shape: Sequence[int]) -> Tensor:
    """Terms broadcast to their full shape ``[*, *shape]`` (materialized)."""
    target = (t.shape[0], *shape)
    return t if tuple(t.shape) == target else lift(t, len(shape)).expand(target).contiguous()


def folded(t: Tensor, shape: Sequence[int], fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn`` of each sample's value applied to the terms ``[K, *shape]`` with the directions
    folded into the batch axis (an operation on a batch, such as a convolution or a pooling;
    terms shared by the samples stay so)."""
    if tuple(t.shape[2:]) != tuple(shape[1:]):
        t = _full(t, shape)
    out = fn(t.reshape(-1, *t.shape[2:]))
    return out.reshape(*t.shape[:2], *out.shape[1:])


def _map(jet: Jet, fn: Callable[[Tensor], Tensor]) -> Jet:
    """The jet of a linear map of the value (``fn`` maps terms with the leading axis)."""
    return Jet(fn(jet.first), None if jet.second is None else fn(jet.second))
