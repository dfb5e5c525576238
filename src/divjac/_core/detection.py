"""One sparsity detection: seed the batched input, propagate, read the per-sample pattern.

The backends trace a batched function (batch first in and out) and propagate dependency sets
through their own program representation; what surrounds the propagation is the same for all of
them and lives here (NumPy/SciPy only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from . import pattern as P
from .deps import Deps
from .pattern import BatchLayout, Coupling, SparsityPattern

__all__ = ["AUTO_DETECTION_ENTRIES", "LRU", "Detection", "Propagated", "TooDense", "detect"]

AUTO_DETECTION_ENTRIES = 20_000_000
"""In mode/method ``"auto"``, sparse detection is abandoned once an intermediate holds more
dependency entries (the pattern is then too dense for coloring to pay off)."""


class TooDense(Exception):
    """Raised by a propagation when an intermediate exceeds its ``max_entries``."""


@dataclass(frozen=True)
class Detection:
    """What one detection found.

    Attributes:
        pattern: the per-sample pattern (``None`` when only coupling was checked, or when the
            pattern was too dense to be worth detecting).
        coupling: ``None`` if the batch is independent, else evidence of coupling.
        has_custom_vjp: a function with a custom VJP is on the path (prefer reverse mode).
        fallbacks: operations without a sparsity rule, assumed dense.
    """

    pattern: SparsityPattern | None
    coupling: Coupling | None
    has_custom_vjp: bool
    fallbacks: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Propagated:
    """What a backend's propagation returns: output dependency sets and what it met."""

    out: Deps
    fallbacks: frozenset[str]
    has_custom_vjp: bool = False


def detect(
    x_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    propagate: Callable[[Deps, int | None], Propagated],
    *,
    per_sample: bool,
    whole_batch: bool = False,
    max_entries: int | None = None,
) -> Detection | None:
    """Seed the batch-first input, ``propagate`` it and read the pattern and coupling.

    Args:
        x_shape: batch-first shape of the differentiated input.
        out_shape: batch-first shape of the output.
        propagate: ``(seeded input deps, max_entries) -> Propagated``; may raise
            :class:`TooDense`.
        per_sample: seed positions as well as samples (the per-sample pattern); without it only
            batch coupling is decided (much cheaper).
        whole_batch: treat the whole batch as one sample: the full ``(B*n_out, B*n_in)``
            pattern (used for the exact diagonal blocks of coupled functions).
        max_entries: abandon (return ``None``) once an intermediate holds more entries.
    """
    axis = None if whole_batch else 0
    in_layout = BatchLayout(x_shape, axis)
    out_layout = BatchLayout(out_shape, axis)
    seeded = P.seed(in_layout, per_sample=per_sample)
    try:
        found = propagate(seeded, max_entries)
    except TooDense:
        return None
    csr, coupling = P.read_out(found.out, out_layout, in_layout, per_sample=per_sample)
    pattern = None
    if csr is not None:
        pattern = SparsityPattern(
            csr=csr,
            in_shape=in_layout.sample_shape,
            out_shape=out_layout.sample_shape,
            batch_size=in_layout.batch_size,
            coupling=coupling,
            dense_fallbacks=found.fallbacks,
        )
    return Detection(pattern, coupling, found.has_custom_vjp, found.fallbacks)


V = TypeVar("V")


class LRU(Generic[V]):
    """A small least-recently-used cache (of traced functions, shared by all transforms).

    Keys hold the function itself, so creating a transform per call (common in eager loops)
    still reuses the detection; at most ``size`` entries are kept alive.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, V] = OrderedDict()

    def get(self, key: Hashable) -> V | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: Hashable, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()
