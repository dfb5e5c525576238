"""Choosing how to compute: direction, colors, number of passes and chunk size.

A *pass* is one batched JVP (forward) or VJP (reverse) of the whole batch. Passes are described
by a coloring: pass ``c`` pushes the indicator of the elements of color ``c`` through the
linearized function, in every sample at once (the batch is a free coloring). The dense method is
the trivial coloring ``colors = arange(n)``.
"""

from __future__ import annotations

import functools
import glob
from dataclasses import dataclass

import numpy as np

from .._errors import (
    DenseFallbackWarning,
    DetectionMemoryError,
    InternalError,
    OptionError,
    warn_at_caller,
)
from .detection import MemoryStop, physical_memory
from .pattern import SparsityPattern
from .settings import Settings, read as read_settings

__all__ = [
    "AUTO_DENSE_MAX_PASSES",
    "DIVERGENCE_METHODS",
    "JACOBIAN_MODES",
    "SPARSE_GAIN",
    "SPARSE_SWEEP_CONV_COST",
    "SPARSE_SWEEP_MOVE_COST",
    "STOCHASTIC_METHODS",
    "Chunks",
    "Plan",
    "choose_chunk_size",
    "color_classes",
    "dense_fallback",
    "divergence_plan",
    "frobenius_plan",
    "host_cache_bytes",
    "jacobian_plan",
    "memory_budget",
    "sparse_sweep_share",
]

JACOBIAN_MODES = ("auto", "fwd", "rev", "sparse")
EXACT_METHODS = ("auto", "exact", "sparse")
STOCHASTIC_METHODS = ("hutchinson", "hutch++", "xtrace", "probing")
DIVERGENCE_METHODS = EXACT_METHODS + STOCHASTIC_METHODS

SPARSE_GAIN = 0.8
"""``"auto"`` takes a sparse plan when it needs at most this fraction of the dense passes."""

AUTO_DENSE_MAX_PASSES = 4096
"""The most passes per sample of the dense plan that ``"auto"`` falls back to, with a
:class:`DenseFallbackWarning`, when sparsity detection is past its memory budget; past it
``"auto"`` raises :class:`DetectionMemoryError` instead (a pattern that large is rarely dense:
the dense plan would take orders of magnitude more passes than its colors)."""


# The cost model of the sparse Taylor sweep (``divjac.jax._sparse_taylor``,
# ``divjac.torch.taylor.sparse``): its work on first-order terms against the dense sweep's.
# An element gathered or scattered to lay an operand's terms on a new index moves memory
# where the other work multiplies and adds: it counts 4x (JAX: Rosenbrock, d = 256, B = 256,
# 1 thread, the sparse sweep at 2.1 times 2 colors' count with moves counted 1x ran 2.6x their
# time, 0.6 of the 2.1 were moves; torch 2.13, 2 CPU cores: fitted to FermiNet-like nets of
# 8-32 electrons and stencils of d = 64-256, 3-11, its low end). A convolution swept as its
# kernel's offsets (JAX) runs slower than its count says against the colored passes, which run
# the convolution itself (a 2-layer CNN on 16x16x3: 1.7-1.8x the time of its 75 colors' passes
# at 0.27x their count; particles and pair potentials held within 1.3x): its products count
# 16x against the colored passes, 8x against the unit basis, whose convolutions run on every
# pass (8x8x3: the sparse sweep 1.43x faster than the unit basis, which 16x would have chosen).
SPARSE_SWEEP_MOVE_COST = 4
"""Work units of one element a sparse sweep gathers or scatters."""
SPARSE_SWEEP_CONV_COST = {True: 16, False: 8}
"""Work units of a product of a convolution's offsets, against the colored passes (``True``)
or the unit basis (``False``)."""


def sparse_sweep_share(
    stored: int, dense: int, *, moved: int = 0, convolved: int = 0, against_colors: bool = False
) -> float:
    """The sparse Taylor sweep's work as a fraction of the dense sweep's: ``stored`` units of
    work on first-order terms (of which ``convolved`` in the products of a convolution's
    offsets, weighted by :data:`SPARSE_SWEEP_CONV_COST`) and ``moved`` elements gathered or
    scattered (:data:`SPARSE_SWEEP_MOVE_COST` each), against ``dense`` units."""
    conv = SPARSE_SWEEP_CONV_COST[against_colors] - 1
    return (stored + SPARSE_SWEEP_MOVE_COST * moved + conv * convolved) / max(dense, 1)


def dense_fallback(stop: MemoryStop, dense_passes: int, *, fname: str) -> None:
    """Say that ``"auto"`` computes with the dense plan of ``dense_passes`` passes per sample
    because detection stopped past its memory budget (``stop``): a warning with the numbers, or
    :class:`DetectionMemoryError` past :data:`AUTO_DENSE_MAX_PASSES` passes."""
    if dense_passes > AUTO_DENSE_MAX_PASSES:
        raise DetectionMemoryError(
            f"{fname}: {stop.message()}. Without the pattern, 'auto' would fall back to the "
            f"dense method, {dense_passes} passes per sample (more than "
            f"{AUTO_DENSE_MAX_PASSES}), so it stops here. Other ways: a stochastic method "
            "(method='hutchinson'), or the dense passes chosen explicitly (method='exact' / "
            "mode='fwd' or 'rev')."
        )
    warn_at_caller(
        f"{fname}: {stop.message()}. 'auto' computes with the dense method instead: "
        f"{dense_passes} passes per sample.",
        DenseFallbackWarning,
    )


# Share of a device's free memory that the passes of one call may use at once: the estimate of
# a pass is an upper bound, and the framework needs room for its own buffers.
_DEVICE_SHARE = 0.5

# On the host (no device reports its free memory), the passes of a chunk run faster while their
# working set stays in the CPU's last-level cache: on 2 EPYC cores (32 MiB L3), the sparse
# Frobenius norm of a 3-layer CNN [8, 32, 32, 3] (147 passes) took 1.4x (JAX) to 2.4x (torch)
# longer in one chunk than in chunks of 8-16, a dense MLP Jacobian (64 passes) 1.8x. Chunks
# keep at least this many passes (fewer lose the batching of a pass's small kernels).
_HOST_MIN_CHUNK = 8
# Passes whose batching saves only the overhead of their kernels (``overhead_only``) run one at
# a time where a chunk of _HOST_MIN_CHUNK of them would fill more than this share of the cache
# (the rest holds what every pass reads: the function's saved forward). On 2 EPYC cores (32 MiB
# of L3), the 10 rows of a ResNet on [B, 3, 32, 32] (BatchNorm in eval mode) pulled one at a
# time on PyTorch's tape took 0.4-0.8x the time of the chunks of 5-10 that vmap batched
# (B = 8-128: 3-49 MB a pass), a 3-layer CNN's 48 sparse divergence rows at [8, 3, 32, 32]
# 0.6x; at 0.4-1.5 MB a pass (B = 1-4) the two were within noise, or batching won.
_HOST_BATCHED_SHARE = 0.5
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # of sysfs cache sizes


def memory_budget(available: int | None = None, settings: Settings | None = None) -> int:
    """Bytes the passes of one call may use at once: ``DIVJAC_MEMORY_BUDGET_MB`` if set (in
    ``settings``, else read now), else half of the device's free memory ``available`` where the
    framework reports it, else 1024 MB.
    """
    configured = (settings or read_settings()).memory_budget
    if configured is not None:
        return configured
    if available is not None:
        return int(_DEVICE_SHARE * available)
    return 1024 << 20


@dataclass(frozen=True)
class Plan:
    """How a Jacobian or divergence is computed.

    Attributes:
        reverse: VJPs (rows) instead of JVPs (columns).
        colors: color of each input element (forward) or output element (reverse);
            ``None`` for the dense method (one pass per element).
        n_passes: number of batched passes.
    """

    reverse: bool
    colors: np.ndarray | None
    n_passes: int

    @property
    def is_sparse(self) -> bool:
        return self.colors is not None


@dataclass(frozen=True)
class Chunks:
    """How the passes (or directions) of a call run.

    Attributes:
        size: passes run at once.
        count: the number of chunks.
        checkpointed: each chunk is checkpointed: a gradient flows through the passes, and the
            backward recomputes each chunk from its inputs (memory follows the chunk size).
    """

    size: int
    count: int = 1
    checkpointed: bool = False


def jacobian_plan(
    mode: str,
    n_in: int,
    n_out: int,
    pattern: SparsityPattern | None,
    *,
    prefer_reverse: bool = False,
    rows_only: bool = False,
) -> Plan:
    """Plan a per-sample Jacobian (``mode`` in :data:`JACOBIAN_MODES`); ``rows_only``: forward
    passes cannot run (an operation without a forward derivative)."""
    if mode == "fwd":
        return Plan(reverse=False, colors=None, n_passes=n_in)
    if mode == "rev":
        return Plan(reverse=True, colors=None, n_passes=n_out)
    dense_reverse = rows_only or n_out < n_in or (n_out == n_in and prefer_reverse)
    dense = Plan(dense_reverse, None, n_out if dense_reverse else n_in)
    if pattern is None:
        if mode == "sparse":
            raise InternalError(
                "jacobian_plan: mode='sparse' was planned without a detected pattern"
            )
        return dense
    by_columns = Plan(reverse=False, colors=pattern.colors, n_passes=pattern.n_colors)
    by_rows = Plan(reverse=True, colors=pattern.row_colors, n_passes=pattern.n_row_colors)
    if (
        rows_only
        or by_rows.n_passes < by_columns.n_passes
        or (by_rows.n_passes == by_columns.n_passes and prefer_reverse)
    ):
        sparse = by_rows
    else:
        sparse = by_columns
    if mode == "sparse" or sparse.n_passes <= SPARSE_GAIN * dense.n_passes:
        return sparse
    return dense


def divergence_plan(
    method: str, n: int, pattern: SparsityPattern | None, *, prefer_reverse: bool = False
) -> Plan:
    """Plan an exact divergence (``method`` in ``("auto", "exact", "sparse")``)."""
    if method == "exact" or pattern is None:
        if method == "sparse":
            raise InternalError(
                "divergence_plan: method='sparse' was planned without a detected pattern"
            )
        return Plan(prefer_reverse, None, n)
    n_colors = pattern.n_diagonal_colors
    if method == "sparse" or n_colors <= SPARSE_GAIN * n:
        return Plan(prefer_reverse, pattern.diagonal_colors, n_colors)
    return Plan(prefer_reverse, None, n)


def frobenius_plan(
    method: str,
    direction: str,
    n_in: int,
    n_out: int,
    pattern: SparsityPattern | None,
    *,
    prefer_reverse: bool = False,
    with_diagonal: bool = False,
) -> Plan:
    """Plan an exact squared Frobenius norm (``method`` in :data:`EXACT_METHODS`).

    Columns of one color of a column coloring share no nonzero row, so the norms of the
    compressed columns add up: ``sum_c ||J s_c||^2 = ||J||_F^2`` (rows likewise). ``direction``
    (``"auto"``, ``"fwd"``, ``"rev"``) restricts the passes to columns or rows.
    ``with_diagonal`` colors ``P + I`` instead of ``P``: then each pass also reads the diagonal
    entries of its own elements (``(J s_c)_i = J_ii`` for ``i`` of color ``c``), so the same
    passes give the trace.
    """
    if direction == "auto":
        dense_reverse = n_out < n_in or (n_out == n_in and prefer_reverse)
    else:
        dense_reverse = direction == "rev"
    dense = Plan(dense_reverse, None, n_out if dense_reverse else n_in)
    if method == "exact" or pattern is None:
        if method == "sparse":
            raise InternalError(
                "frobenius_plan: method='sparse' was planned without a detected pattern"
            )
        return dense
    if with_diagonal:
        pattern = pattern.with_diagonal
    candidates = []
    if direction in ("auto", "fwd"):
        candidates.append(Plan(reverse=False, colors=pattern.colors, n_passes=pattern.n_colors))
    if direction in ("auto", "rev"):
        candidates.append(
            Plan(reverse=True, colors=pattern.row_colors, n_passes=pattern.n_row_colors)
        )
    sparse = min(candidates, key=lambda p: (p.n_passes, p.reverse != prefer_reverse))
    if method == "sparse" or sparse.n_passes <= SPARSE_GAIN * dense.n_passes:
        return sparse
    return dense


def color_classes(colors: np.ndarray | None, n: int) -> np.ndarray:
    """Members of each color, ``(n_colors, max_class_size)``, padded with ``-1``.

    ``None`` (the dense method) gives ``arange(n)[:, None]``. A pass then reads only its own
    elements of the pushed tangent (a gather) instead of masking all ``n`` of them.
    """
    if colors is None:
        return np.arange(n, dtype=np.int64)[:, None]
    order = np.argsort(colors, kind="stable")
    counts = np.bincount(colors, minlength=int(colors.max()) + 1 if len(colors) else 0)
    classes = np.full((len(counts), int(counts.max()) if len(counts) else 0), -1, np.int64)
    starts = np.cumsum(counts) - counts
    slot = np.arange(len(colors)) - np.repeat(starts, counts)
    classes[np.sort(colors), slot] = order
    return classes


def memory_limit(available: int | None = None, settings: Settings | None = None) -> int:
    """Bytes beyond which passes are refused (``DIVJAC_MEMORY_LIMIT_MB``, in ``settings``, else
    read now; default: the device's free memory ``available`` where the framework reports it,
    else 80 % of the machine's memory): an estimate past it would exhaust the device, whatever
    the chunk."""
    configured = (settings or read_settings()).memory_limit
    if configured is not None:
        return configured
    if available is not None:
        return available
    return int(0.8 * physical_memory())


@functools.cache
def host_cache_bytes() -> int:
    """Bytes of the host CPU's largest cache (Linux's ``sysfs``; 32 MiB where it does not say)."""
    sizes = []
    for name in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(name) as file:
                text = file.read().strip()
        except OSError:
            continue
        if text[-1:] in _UNITS and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * _UNITS[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=32 << 20)


def choose_chunk_size(
    n_passes: int,
    bytes_per_pass: int,
    chunk_size: int | None,
    *,
    available: int | None = None,
    in_cache: bool = False,
    cache_share: int = 1,
    settings: Settings | None = None,
    overhead_only: bool = False,
) -> int:
    """Passes computed at once: ``chunk_size`` if given, else as many as fit the budget, the
    chunks that takes made even (64 passes of which 56 fit: two chunks of 32, not 56 and 8).

    ``bytes_per_pass`` is what one pass holds on one device (its share of a sharded batch);
    ``available``: the free bytes of that device, where the framework reports them
    (:func:`memory_budget`, :func:`memory_limit`). ``in_cache``: on the host (``available``
    unknown) and without ``DIVJAC_MEMORY_BUDGET_MB``, a chunk also holds no more than the CPU's
    last-level cache (:func:`host_cache_bytes`), in no more chunks than of ``8`` passes each: for
    speed, where more chunks cost nothing else (not where each chunk is recomputed for a
    gradient). ``cache_share``: a pass holds ``1 / cache_share`` of its bytes in the cache at
    once (a fused sweep). ``settings``: the environment's, as read at the call's start
    (:func:`divjac._core.settings.read`; read now when ``None``). ``overhead_only``: the passes
    share one evaluation of the function and batching them saves only the overhead of their own
    kernels (the rows of a convolution network on an eager framework's tape); with ``in_cache``,
    where ``8`` of them would fill more than half the cache, they run one at a time: their
    kernels are then large enough that the overhead is small, while a batch of them costs the
    batching rules of their kernels and a working set past the cache.

    Raises:
        OptionError: ``chunk_size`` is not a positive int or ``None``.
        DetectionMemoryError: the passes at once would need more than :func:`memory_limit`
            (their estimated size is an upper bound of what one pass holds).
    """
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise OptionError(
                f"chunk_size must be a positive int or None; got {chunk_size!r}. Pass e.g. "
                "chunk_size=8 to compute 8 passes at once, or None to fit the memory budget."
            )
        chunk = min(chunk_size, max(n_passes, 1))
    elif n_passes <= 1:  # one chunk whatever the budget
        chunk = 1
    else:
        settings = settings or read_settings()
        fit = memory_budget(available, settings) // max(bytes_per_pass, 1)
        if in_cache and available is None and settings.memory_budget is None:
            held = max(bytes_per_pass // cache_share, 1)  # of a pass, in the cache at once
            cache = host_cache_bytes()
            if overhead_only and _HOST_MIN_CHUNK * held > _HOST_BATCHED_SHARE * cache:
                fit = 1
            else:
                fit = min(fit, max(_HOST_MIN_CHUNK, cache // held))
        chunk = int(min(max(fit, 1), n_passes))
        chunk = -(-n_passes // -(-n_passes // chunk))  # as many chunks, of even sizes
    limit = memory_limit(available, settings)
    if chunk * bytes_per_pass > limit:
        fits = limit // max(bytes_per_pass, 1)
        fix = (
            f"pass chunk_size={fits} or less"
            if fits >= 1
            else "one pass alone is too large: use a smaller batch, or a stochastic method"
        )
        raise DetectionMemoryError(
            f"{chunk} passes at once would need about {chunk * bytes_per_pass >> 20} MB, more "
            f"than the limit of {limit >> 20} MB (DIVJAC_MEMORY_LIMIT_MB, or the device's free "
            f"memory): {fix}."
        )
    return chunk
