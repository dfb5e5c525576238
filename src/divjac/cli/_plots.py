"""PNG plots of the commands (matplotlib's Agg canvas; no pyplot, no global state)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._demo_report import method_rank

if TYPE_CHECKING:
    import scipy.sparse as sp

    from ._demo_report import Report
    from .bench import Result

__all__ = ["bench_chart", "demo_plots", "spy"]

_BACKEND_COLORS = {"jax": "tab:blue", "torch": "tab:orange"}
_METHOD_COLORS = {
    "hutchinson": "tab:red",
    "hutch++": "tab:purple",
    "xtrace": "tab:green",
    "probing": "tab:brown",
}
_LINESTYLES = {"jax": "-", "torch": "--"}


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path


# --- time per method --------------------------------------------------------------------------


def draw_times(ax: Any, report: Report) -> bool:
    """Horizontal bars: time of each divergence method of each model, one bar per backend."""
    labels: list[str] = []
    bars: list[tuple[int, str, float]] = []
    for case in report.titles:
        rows = [r for (c, _), r in report.divergence.items() if c == case]
        rows.sort(key=method_rank)
        for row in rows:
            timed = {
                b: m.seconds
                for b, m in row.by_backend.items()
                if m.seconds is not None and np.isfinite(m.seconds)
            }
            if not timed:
                continue
            passes = f" ({row.passes:,})" if row.passes is not None else ""
            scaled = "≈ " if any(m.scaled for m in row.by_backend.values()) else ""
            labels.append(f"{scaled}{case}: {row.label}{passes}")
            bars += [(len(labels) - 1, b, s) for b, s in timed.items()]
    if not bars:
        return False
    height = 0.8 / max(len(report.backends), 1)
    for i, b in enumerate(report.backends):
        mine = [(y, s) for y, name, s in bars if name == b]
        if mine:
            ys, secs = zip(*mine, strict=True)
            offsets = np.asarray(ys) + (i - (len(report.backends) - 1) / 2) * height
            ax.barh(offsets, np.asarray(secs) * 1e3, height, label=b,
                    color=_BACKEND_COLORS.get(b))  # fmt: skip
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("time per batch (ms, log scale)")
    ax.set_title("divergence: time per method (passes per sample)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return True


# --- estimator error vs number of probes ------------------------------------------------------


def draw_sweep(ax: Any, report: Report) -> bool:
    """Relative error of each estimator against the matvec budget, per backend (CNN)."""
    points = report.sweep
    if not points:
        return False
    colors = next((s.n_diagonal_colors for (c, _), s in report.sparse.items() if c == "cnn"), 0)
    colors = colors or 1 << 30
    positive = [p.error for p in points if p.error > 0]
    floor = min(positive) / 10 if positive else 1e-8
    lines = sorted({(p.backend, p.method) for p in points})
    for backend, method in lines:
        mine = sorted((p for p in points if (p.backend, p.method) == (backend, method)),
                      key=lambda p: p.budget)  # fmt: skip
        x = np.asarray([p.budget for p in mine], float)
        y = np.asarray([max(p.error, floor) for p in mine])
        ax.plot(x, y, _LINESTYLES.get(backend, "-"), marker="o", ms=4,
                color=_METHOD_COLORS.get(method), label=method)  # fmt: skip
        exact = [p for p in mine if p.error == 0 or (method == "probing" and p.budget >= colors)]
        if exact:
            p = exact[0]
            ax.annotate(f"exact: {colors} diagonal colors fit" if p.error else "exact",
                        (p.budget, max(p.error, floor)), textcoords="offset points",
                        xytext=(-8, 6), ha="right", fontsize=8,
                        color=_METHOD_COLORS.get(method))  # fmt: skip
    hutch = sorted((p for p in points if p.method == "hutchinson"), key=lambda p: p.budget)
    if hutch:
        x0, y0 = hutch[0].budget, hutch[0].error
        xs = np.asarray(sorted({p.budget for p in points}), float)
        ax.plot(xs, y0 * np.sqrt(x0 / xs), ":", color="gray", label="1/sqrt(probes)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    budgets = sorted({p.budget for p in points})
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("matvecs per sample (num_probes)")
    ax.set_ylabel("||estimate - exact|| / ||exact||")
    backends = sorted({p.backend for p in points})
    ax.set_title(f"estimator error vs probes (CNN, {', '.join(backends)})")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    return True


# --- sparsity -------------------------------------------------------------------------------


def draw_pattern(ax: Any, csr: sp.csr_array, title: str, *, bins: int = 384) -> None:
    """The pattern as an image: each pixel is a block of the matrix, dark where it has nonzeros."""
    n_out, n_in = csr.shape
    coo = csr.tocoo()
    if max(n_out, n_in) <= bins:
        ax.spy(csr, markersize=max(0.5, 200 / max(n_out, n_in)), color="black")
    else:
        rows = np.asarray(coo.row) * bins // n_out
        cols = np.asarray(coo.col) * bins // n_in
        image = np.zeros((bins, bins))
        np.add.at(image, (rows, cols), 1.0)
        ax.imshow(image > 0, cmap="Greys", interpolation="nearest",
                  extent=(0, n_in, n_out, 0))  # fmt: skip
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("input element j")
    ax.set_ylabel("output element i")


def draw_zoom(ax: Any, csr: sp.csr_array, size: int, title: str) -> None:
    block = csr[:size, :size]
    ax.spy(block, markersize=max(0.3, 120 / size), color="black")
    ax.set_title(title, fontsize=9)


def spy(csr: sp.csr_array, path: Path, title: str) -> Path:
    """A spy plot of a per-sample pattern (``divjac inspect --spy``)."""
    fig = _figure(5.5, 5.5)
    draw_pattern(fig.add_subplot(), csr, title)
    return _save(fig, path)


def demo_plots(report: Report, out: Path) -> list[Path]:
    """``time_per_method.png``, ``estimator_error.png``, ``cnn_sparsity.png``, ``summary.png``."""
    written = []
    n_rows = sum(1 for r in report.divergence.values() if r.by_backend)
    fig = _figure(8, 1.5 + 0.28 * n_rows * max(1, len(report.backends)) ** 0.5)
    if draw_times(fig.add_subplot(), report):
        written.append(_save(fig, out / "time_per_method.png"))
    fig = _figure(6.5, 4.5)
    if draw_sweep(fig.add_subplot(), report):
        written.append(_save(fig, out / "estimator_error.png"))
    if report.spy is not None:
        csr, where = report.spy
        fig = _figure(11, 5.2)
        left, right = fig.subplots(1, 2)
        n = csr.shape[0]
        draw_pattern(left, csr, f"CNN per-sample Jacobian, {n:,} x {n:,} ({where})")
        zoom = min(n, 384)
        draw_zoom(right, csr, zoom, f"top-left {zoom} x {zoom} block")
        written.append(_save(fig, out / "cnn_sparsity.png"))
    fig = _figure(17, 6)
    axes = fig.subplots(1, 3, width_ratios=[1.3, 1, 0.9])
    drew = draw_times(axes[0], report)
    drew = draw_sweep(axes[1], report) or drew
    if report.spy is not None:
        csr, where = report.spy
        draw_pattern(axes[2], csr, f"CNN Jacobian sparsity ({where})")
    else:
        axes[2].set_axis_off()
    if drew:
        written.append(_save(fig, out / "summary.png"))
    return written


def bench_chart(results: Sequence[Result], path: Path) -> bool:
    """``divjac bench``'s chart: each result with a target, as its margin over the target."""
    rows = [r for r in results if r.target is not None]
    if not rows:
        return False
    fig = _figure(9, 0.45 * len(rows) + 1.5)
    ax = fig.add_subplot()
    # Normalized so that 1 is the target and larger is better, whatever the kind.
    score = [
        (r.target / r.value if r.kind == "ratio" else r.value / r.target) if r.value else 0.0
        for r in rows
        if r.target is not None
    ]
    ax.barh([f"{r.id} {r.case}" for r in rows], score,
            color=["tab:green" if r.passed else "tab:red" for r in rows])  # fmt: skip
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("margin over target (>1 meets the target)")
    ax.invert_yaxis()
    _save(fig, path)
    return True
