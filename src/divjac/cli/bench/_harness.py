"""Shared helpers of the side-by-side benchmarks: timing and result records.

Absolute times depend on the machine; the targets are on ratios.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Result:
    """One measured comparison.

    Attributes:
        id: the target's id in DESIGN.md (``"P1"`` ...), or ``"-"`` for context rows.
        case: what was measured (model, sizes).
        ours: label of the divjac computation.
        baseline: label of the alternative.
        ours_value: divjac's measurement (seconds, error, ...).
        baseline_value: the alternative's measurement, same unit.
        unit: ``"s"`` for times, or the name of the metric.
        kind: ``"ratio"`` (ours / baseline, lower is better, e.g. time ratio <= 1.10) or
            ``"gain"`` (baseline / ours, higher is better, e.g. speedup >= 20).
        target: the bound on ``value`` (``None``: reported only).
        extra: anything else worth keeping (pass counts, max error, ...).
    """

    id: str
    case: str
    ours: str
    baseline: str
    ours_value: float
    baseline_value: float
    unit: str = "s"
    kind: str = "ratio"
    target: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def value(self) -> float:
        """ours / baseline for ``"ratio"``, baseline / ours for ``"gain"``."""
        if self.kind == "ratio":
            return self.ours_value / self.baseline_value if self.baseline_value else float("inf")
        return self.baseline_value / self.ours_value if self.ours_value else float("inf")

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        return self.value <= self.target if self.kind == "ratio" else self.value >= self.target

    @property
    def target_text(self) -> str:
        if self.target is None:
            return "-"
        return f"<= {self.target:g}x" if self.kind == "ratio" else f">= {self.target:g}x"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(value=self.value, passed=self.passed, target_text=self.target_text)
        return out


def block(value: Any) -> Any:
    """Wait for asynchronous computations (JAX dispatch, CUDA kernels) to finish.

    Only a framework the benchmark already imported is asked.
    """
    jax = sys.modules.get("jax")
    if jax is not None:
        value = jax.block_until_ready(value)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
    return value


def best_time(
    fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1, min_time: float = 0.0
) -> float:
    """Best wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs.

    A run shorter than ``min_time`` is repeated inside the timing loop and averaged, so short
    kernels are not dominated by timer resolution.
    """
    for _ in range(warmup):
        block(fn())
    gc.collect()
    best = float("inf")
    for _ in range(repeat):
        inner = 1
        while True:
            start = time.perf_counter()
            for _ in range(inner):
                block(fn())
            elapsed = (time.perf_counter() - start) / inner
            if elapsed * inner >= min_time or inner >= 1024:
                break
            inner *= 2
        best = min(best, elapsed)
    return best


def interleaved_best_times(
    fns: Mapping[str, Callable[[], Any]],
    *,
    repeat: int = 7,
    warmup: int = 1,
    min_time: float = 0.05,
    settle: int = 0,
) -> dict[str, float]:
    """Best times of several functions measured in alternation (fair under machine noise)."""
    times = interleaved_times(fns, repeat=repeat, warmup=warmup, min_time=min_time, settle=settle)
    return {name: min(ts) for name, ts in times.items()}


def interleaved_times(
    fns: Mapping[str, Callable[[], Any]],
    *,
    repeat: int = 7,
    warmup: int = 1,
    min_time: float = 0.05,
    settle: int = 0,
) -> dict[str, list[float]]:
    """All ``repeat`` times of several functions measured in alternation (for a median on a
    machine that others load). ``settle``: untimed calls before each timing, for functions of
    very different memory (one timed right after another that freed gigabytes pays the page
    faults of the memory it takes back: 2x on a 0.2 s call after a 4 s one)."""
    for fn in fns.values():
        for _ in range(warmup):
            block(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            times[name].append(best_time(fn, repeat=1, warmup=settle, min_time=min_time))
    return times


ESTIMATOR_BUDGET = 24


def cost_rows(framework: str, times: dict[str, dict[str, float]]) -> list[Result]:
    """Hutch++ and XTrace against Hutchinson at the same number of matvecs (their linear
    algebra per sample should cost a small fraction of the passes)."""
    return [
        Result(
            "E1",
            f"{case}, {ESTIMATOR_BUDGET} matvecs per sample ({framework})",
            method,
            "hutchinson (same matvecs)",
            t[method],
            t["hutchinson"],
            target=1.5,
        )
        for case, t in times.items()
        for method in ("hutch++", "xtrace")
    ]


BILAPLACIAN_TARGET = 3.0


def bilaplacian_row(
    framework: str,
    case: str,
    ours: Callable[[], Any],
    nested: Callable[[], Any],
    *,
    rel_err: float,
    repeat: int,
    min_time: float,
) -> Result:
    """The exact bi-Laplacian against nested Hessians (:func:`gain_row`)."""
    return gain_row(
        "P9-bilap",
        f"{case} ({framework})",
        ("bilaplacian (exact)", ours),
        ("nested hessian (trace of the Hessian of the Hessian's trace)", nested),
        target=BILAPLACIAN_TARGET,
        extra={"max_rel_err_vs_nested_hessian": rel_err},
        repeat=repeat,
        min_time=min_time,
    )


def gain_row(
    id: str,
    case: str,
    ours: tuple[str, Callable[[], Any]],
    baseline: tuple[str, Callable[[], Any]],
    *,
    target: float | None,
    extra: dict[str, Any],
    repeat: int,
    min_time: float,
) -> Result:
    """``ours`` and ``baseline`` (label, computation) timed in alternation: the gain of the
    best times, with the gain of the medians and the machine's load beside it (others may
    load it)."""
    times = interleaved_times(
        {"ours": ours[1], "baseline": baseline[1]}, repeat=repeat, min_time=min_time
    )
    median = {name: statistics.median(ts) for name, ts in times.items()}
    return Result(
        id,
        case,
        ours[0],
        baseline[0],
        min(times["ours"]),
        min(times["baseline"]),
        kind="gain",
        target=target,
        extra={
            **extra,
            "median_gain": median["baseline"] / median["ours"],
            "median_seconds": median,
            "repeats": repeat,
            "load_average_1min": os.getloadavg()[0],
        },
    )


OPERATOR_TARGET = 5.0
"""P21 and P23: the exact ``differential_operator``'s speedup over nested ``jacfwd``."""
PARTICLE_TARGET = 2.0
"""P24: the operator's cost in evaluations of ``u`` at the largest ``d`` over the smallest."""


def rel_err(got: Any, want: Any) -> float:
    """The largest difference of two arrays (JAX, torch on the CPU) over ``want``'s largest."""
    import numpy as np

    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def operator_row(
    id: str,
    case: str,
    ours: Callable[[], Any],
    nested: tuple[str, Callable[[], Any]],
    *,
    repeat: int,
    min_time: float,
) -> Result:
    """P21 and P23: the exact ``differential_operator`` (``ours``) against a nested ``jacfwd``
    (label, computation), with the largest difference relative to the largest value."""
    return gain_row(
        id,
        case,
        ("differential_operator (exact)", ours),
        nested,
        target=OPERATOR_TARGET,
        extra={"max_rel_err_vs_nested_jacfwd": rel_err(ours(), nested[1]())},
        repeat=repeat,
        min_time=min_time,
    )


def particles_row(
    framework: str,
    case: str,
    cases: dict[int, tuple[Callable[[], Any], Callable[[], Any]]],
    *,
    repeat: int,
    extra: dict[str, Any],
) -> Result:
    """P24: per ``d``, ``cases[d] = (operator, u)``: the time of the operator over the time of
    ``u`` itself, the largest ``d`` against the smallest."""
    per_u: dict[int, float] = {}
    for d, (operator, forward) in cases.items():
        t_ours = best_time(operator, repeat=repeat, min_time=0.05)
        t_u = best_time(forward, repeat=repeat, min_time=0.05)
        per_u[d] = t_ours / t_u
        extra[f"seconds_d{d}"] = {"operator": t_ours, "u": t_u}
    first, last = min(cases), max(cases)
    return Result(
        "P24",
        f"{case}, d={last} vs d={first} ({framework})",
        f"differential_operator, cost in evaluations of u at d={last}",
        f"the same at d={first}",
        per_u[last],
        per_u[first],
        unit="x u",
        target=PARTICLE_TARGET,
        extra=extra,
    )
