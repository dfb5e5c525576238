"""One sparsity detection: seed the batched input, propagate, read the per-sample pattern.

The backends trace a batched function (batch first in and out) and propagate dependency sets
through their own program representation; what surrounds the propagation is the same for all of
them and lives here (NumPy/SciPy only).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from .._errors import DetectionMemoryError
from . import pattern as P, rules, settings
from .pattern import BatchLayout, Coupling, SparsityPattern
from .rules import Deps

__all__ = [
    "AUTO_DETECTION_ENTRIES",
    "LRU",
    "Detection",
    "EntryLimit",
    "MemoryStop",
    "Propagated",
    "TooDense",
    "Traced",
    "batch_first_shape",
    "detect",
    "detection_memory_budget",
    "physical_memory",
]

AUTO_DETECTION_ENTRIES = 20_000_000
"""In mode/method ``"auto"``, sparse detection is abandoned once an intermediate holds more
dependency entries than this and is too dense (see :class:`EntryLimit`)."""


# The peak of a detection over the most bytes of dependency sets alive at once: the rules'
# temporaries while they build an operation's output (index arrays, sorts, CSR assembly) on top
# of the sets still held. Measured with tracemalloc (JAX, the CNNs of divjac.models with 3 and
# 4 conv layers of 16 channels, B = 8, 32x32 to 128x128 images): 1.2x-2.0x of the live peak,
# so the estimate is within 0.8x-1.4x of the measured peak.
_WORKSPACE = 2.5


def detection_memory_budget() -> int:
    """Bytes the dependency sets of one detection may hold (``DIVJAC_DETECTION_MEMORY_MB``;
    default: a quarter of the machine's memory, at most 4096 MB)."""
    configured = settings.read().detection_memory
    if configured is not None:
        return configured
    return min(4096 << 20, physical_memory() // 4)


@functools.cache
def physical_memory() -> int:
    """Bytes of memory of this machine (16 GiB if the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return 16 << 30


class TooDense(Exception):
    """Raised by a propagation when an intermediate exceeds its :class:`EntryLimit`.

    Attributes:
        where: the operation whose output was past the limit.
        memory: the limit was the memory budget (not the density of ``"auto"``).
    """

    def __init__(self, where: str, *, memory: bool = False) -> None:
        super().__init__(where)
        self.where = where
        self.memory = memory


@dataclass
class EntryLimit:
    """When a propagation gives up: too dense to pay off (``"auto"``), or too large to hold.

    With a ``floor``, an intermediate with more than ``floor`` entries is too dense when its
    elements depend, on average, on more than ``density`` of one sample's inputs (coloring
    cannot pay off: the passes would be nearly as many as the dense ones). The entry count of a
    sparse pattern grows with the batch (every sample is seeded), its density does not: a large
    batch of a CNN stays sparse. Whatever the floor, the detection stops once its
    :attr:`estimate` is past ``budget`` bytes (memory): the arrays holding the dependency sets
    are followed until freed (each counted once, however many sets share it), and the most
    alive at once, times the rules' workspace, is the estimate.

    Attributes:
        floor: entries below which an intermediate is never too dense; ``None``: never give
            up for density (an explicit sparse detection).
        labels_per_sample: the inputs one element can depend on (its sample's); ``None`` when
            the seeds are not per input (coupling only: never too dense, only too large).
        density: mean fraction of ``labels_per_sample`` beyond which to give up.
        budget: bytes the detection may take.
        live: bytes of the dependency sets alive now.
        peak: the most bytes of dependency sets alive at once so far.
    """

    floor: int | None
    labels_per_sample: int | None
    density: float = 0.5
    budget: int = field(default_factory=detection_memory_budget)
    live: int = 0
    peak: int = 0
    _alive: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def estimate(self) -> int:
        """Bytes the detection needs at most, so far: the peak of the dependency sets alive at
        once, times the rules' workspace."""
        return int(self.peak * _WORKSPACE)

    def check(self, dep: Deps, where: str) -> None:
        """Raise :class:`TooDense` (naming ``where``) if ``dep`` is past the limit."""
        nnz = dep.nnz
        for buffer in _buffers(dep):
            key = id(buffer)
            if key not in self._alive:  # a buffer shared by several sets counts once
                self._alive[key] = buffer.nbytes
                self.live += buffer.nbytes
                weakref.finalize(buffer, self._free, key)
        self.peak = max(self.peak, self.live)
        if self.estimate > self.budget:
            raise TooDense(where, memory=True)
        per, floor = self.labels_per_sample, self.floor
        if (
            floor is not None
            and per is not None
            and nnz > max(floor, self.density * dep.size * per)
        ):
            raise TooDense(where)

    def _free(self, key: int) -> None:
        self.live -= self._alive.pop(key, 0)


def _buffers(dep: Deps) -> list[Any]:
    """The arrays that hold ``dep``'s entries (the bases of views)."""
    matrix = dep.full if dep.shared is None else dep.shared.rows
    if matrix is None:
        return []
    found = []
    for array in (matrix.indices, matrix.data, matrix.indptr):
        while isinstance(array.base, np.ndarray):
            array = array.base
        found.append(array)
    return found


def batch_first_shape(shape: Sequence[int], axis: int | None) -> tuple[int, ...]:
    """``shape`` with its batch axis ``axis`` moved first (``None``: a batch of one added)."""
    if axis is None:
        return (1, *shape)
    return (shape[axis], *shape[:axis], *shape[axis + 1 :])


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
class MemoryStop:
    """A detection abandoned past its memory budget (in ``"auto"``, with ``max_entries``).

    Attributes:
        where: the operation at which it stopped.
        estimate: bytes it needed when it stopped (a lower bound of what it needs in all).
        budget: its budget in bytes (``DIVJAC_DETECTION_MEMORY_MB``).
    """

    where: str
    estimate: int
    budget: int

    def message(self) -> str:
        """What happened, with the numbers, and how to let the detection finish."""
        return (
            f"sparsity detection stopped at the operation {self.where}: it needed about "
            f"{self.estimate / (1 << 20):.0f} MB when it stopped (more in all), past its budget "
            f"of {self.budget / (1 << 20):.0f} MB. Raise DIVJAC_DETECTION_MEMORY_MB (in MB) "
            f"above that if the machine has the memory (it has {physical_memory() >> 20} MB)"
        )


@dataclass(frozen=True)
class Propagated:
    """What a backend's propagation returns: output dependency sets and what it met."""

    out: Deps
    fallbacks: frozenset[str]
    has_custom_vjp: bool = False


def detect(
    x_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    propagate: Callable[[Deps, EntryLimit], Propagated],
    *,
    per_sample: bool,
    whole_batch: bool = False,
    max_entries: int | None = None,
) -> Detection | MemoryStop | None:
    """Seed the batch-first input, ``propagate`` it and read the pattern and coupling.

    Args:
        x_shape: batch-first shape of the differentiated input.
        out_shape: batch-first shape of the output.
        propagate: ``(seeded input deps, limit) -> Propagated``; may raise :class:`TooDense`.
        per_sample: seed positions as well as samples (the per-sample pattern); without it only
            batch coupling is decided (much cheaper).
        whole_batch: treat the whole batch as one sample: the full ``(B*n_out, B*n_in)``
            pattern (used for the exact diagonal blocks of coupled functions).
        max_entries: abandon (return ``None``) once an intermediate holds more entries and is
            too dense for coloring to pay off, or past the memory budget (see
            :class:`EntryLimit`). Without it, a detection past the memory budget raises.

    Raises:
        DetectionMemoryError: past the memory budget, without ``max_entries``.

    Returns:
        The detection; with ``max_entries``, ``None`` when abandoned as too dense, or a
        :class:`MemoryStop` when abandoned past the memory budget.
    """
    axis = None if whole_batch else 0
    in_layout = BatchLayout(x_shape, axis)
    out_layout = BatchLayout(out_shape, axis)
    seeded = P.seed(in_layout, per_sample=per_sample)
    # Per sample, an element may depend on its sample's inputs and its sample's label.
    limit = EntryLimit(max_entries, in_layout.sample_size + 1 if per_sample else None)
    try:
        found = propagate(seeded, limit)
    except TooDense as stop:
        if max_entries is not None:
            return MemoryStop(stop.where, limit.estimate, limit.budget) if stop.memory else None
        ways = (
            "; or compute without a pattern: a stochastic method (method='hutchinson'), or "
            "the dense passes (method='exact' / mode='fwd' or 'rev'), one per element of a "
            f"sample: {in_layout.sample_size}"
            if per_sample
            else "; or use a smaller batch (the batch-coupling check, one label per sample, "
            "does not fit)"
        )
        raise DetectionMemoryError(
            MemoryStop(stop.where, limit.estimate, limit.budget).message() + ways + "."
        ) from None
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


@dataclass(eq=False)
class Traced:
    """A batched function traced batch-first by a backend, with its detections cached.

    A backend subclasses it with its program (a jaxpr, an ATen graph) and :meth:`_propagate`.

    Attributes:
        x_shape: batch-first shape of the differentiated input.
        out_shape: batch-first shape of the output.
        out_tree: shapes/dtypes of what the function returns, in its own layout (for checks).
        pass_elements: elements one pass may hold at once (memory planning; an upper bound).
    """

    x_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    out_tree: Any
    pass_elements: int
    detections: dict[tuple[int, bool, bool, int | None], Detection | MemoryStop | None] = field(
        default_factory=dict, repr=False, kw_only=True
    )
    """What was detected, by ``(rules, per_sample, whole_batch, max_entries)`` where ``rules``
    is the :func:`~divjac._core.rules.generation` of the registered rules; a backend whose
    traces are made anew at every call shares one dict between the traces of the same
    program (see :mod:`divjac.jax._detect`)."""

    def detect(
        self, *, per_sample: bool, whole_batch: bool = False, max_entries: int | None = None
    ) -> Detection | None:
        """Detect the pattern and coupling; ``None`` if ``max_entries`` was exceeded.

        With ``whole_batch=True`` the whole batch is one sample: the pattern is the full
        ``(B*n_out, B*n_in)`` one (used to compute exact diagonal blocks of coupled functions).
        """
        generation = rules.generation()
        key = (generation, per_sample, whole_batch, max_entries)
        # A completed detection holds whatever its limit was; a per-sample one also decided
        # coupling. Reuse it rather than detecting again.
        for (gen, ps, wb, _), found in self.detections.items():
            if (
                isinstance(found, Detection)
                and gen == generation
                and wb == whole_batch
                and (ps or not per_sample)
            ):
                return found
        if key not in self.detections:
            self.detections[key] = detect(
                self.x_shape,
                self.out_shape,
                self._propagate,
                per_sample=per_sample,
                whole_batch=whole_batch,
                max_entries=max_entries,
            )
        found = self.detections[key]
        return found if isinstance(found, Detection) else None

    def memory_stop(self) -> MemoryStop | None:
        """Why a per-sample detection in ``"auto"`` was abandoned, if past its memory budget."""
        generation = rules.generation()
        for (gen, per_sample, _, _), found in self.detections.items():
            if gen == generation and per_sample and isinstance(found, MemoryStop):
                return found
        return None

    def _propagate(self, seeded: Deps, limit: EntryLimit) -> Propagated:
        """The dependency sets of the output given the seeded input (the backend's program)."""
        raise NotImplementedError


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
