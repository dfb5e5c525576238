"""The terminal tables of ``divjac demo`` (rich; readable in 80 columns)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from ._common import format_count, format_error, format_seconds
from ._demo_report import METHODS, Measure, Report, Row, method_rank

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["render"]

DESCRIPTIONS = {
    "exact": ("dense: one batched JVP per input element", "n is small (the MLP: n = 2)"),
    "sparse": (
        "exact: one batched JVP per diagonal color of the detected pattern",
        "the Jacobian is sparse (convolutions, local operators)",
    ),
    "auto": ("exact: sparse when it saves passes, else dense; never stochastic", "by default"),
    "hutchinson": (
        "unbiased estimate, error ~ 1/sqrt(probes)",
        "n is large and a few % error is fine (CNF training)",
    ),
    "hutch++": ("low-rank sketch, Hutchinson on the rest", "the spectrum decays fast"),
    "xtrace": ("exchangeable low-rank + Hutchinson", "as hutch++, most accurate per matvec"),
    "probing": (
        "random signs on color classes; exact if the colors fit",
        "a sparse Jacobian, budget below its colors",
    ),
}


def _time_cell(m: Measure | None) -> str:
    if m is None:
        return ""
    if m.failed:
        return "[red]failed"
    if m.note and m.seconds is None:
        return "[dim]skipped"
    text = format_seconds(m.seconds)
    return f"≈ {text}" if m.scaled else text


def _error_cell(m: Measure | None) -> str:
    if m is None or m.failed or m.error is None:
        return ""
    return format_error(m.error)


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", caption_justify="left")


def _add_backend_columns(table: Table, backends: list[str]) -> None:
    for b in backends:
        table.add_column(f"{b} time", justify="right")
        table.add_column(f"{b} error", justify="right")


def _cells(row: Row, backends: list[str]) -> list[str]:
    cells = []
    for b in backends:
        m = row.by_backend.get(b)
        cells += [_time_cell(m), _error_cell(m)]
    return cells


def methods_table() -> Table:
    table = _table("divergence methods (divergence(f, method=...))")
    table.add_column("method")
    table.add_column("computes")
    table.add_column("use it when")
    for name in METHODS:
        what, when = DESCRIPTIONS[name]
        table.add_row(name, what, when)
    return table


def divergence_table(report: Report, case: str) -> Table:
    rows = sorted((r for (c, _), r in report.divergence.items() if c == case), key=method_rank)
    table = _table(f"divergence of {report.titles[case]}, n = {format_count(report.n[case])}")
    table.add_column("method", no_wrap=True)
    table.add_column("passes", justify="right")
    _add_backend_columns(table, report.backends)
    for row in rows:
        label = f"{row.label} {row.detail}" if row.detail else row.label
        passes = format_count(row.passes) if row.passes is not None else ""
        table.add_row(label, passes, *_cells(row, report.backends))
    notes = [
        "passes: batched JVPs or VJPs per sample. error: ||div - exact|| / ||exact|| over the batch, "
        "exact = method 'auto'."
    ]
    for row in rows:
        for m in row.by_backend.values():
            if m.note and not m.failed:
                notes.append(f"{row.label}: {m.note}.")
    if any(m.scaled for r in rows for m in r.by_backend.values()):
        k, b = report.sizes.dense_samples, report.batch.get(case, 0)
        notes.append(f"≈: dense method timed on {k} of the {b} samples (chunk_size=256), scaled.")
    if any(r.label == "hutchinson" for r in rows):
        notes.append(
            "Stochastic methods get the same Rademacher probes in every backend (passed "
            "first); probing draws from a key / generator."
        )
    agreement = report.agreement()
    if case in agreement:
        notes.append(
            f"jax and torch agree to {format_error(agreement[case])} (same weights and inputs)."
        )
    if case == "blur":
        notes.append("No estimators: the blur is linear, its divergence is a constant.")
    elif case == "mlp":
        notes.append("No sparse or stochastic rows: n = 2 dense passes are the cheapest.")
    table.caption = "\n".join(notes)
    return table


def derivatives_table(report: Report) -> Table:
    table = _table("derivatives (f = net(x, t), u = |f|^2 / 2)")
    table.add_column("quantity", no_wrap=True)
    _add_backend_columns(table, report.backends)
    for row in report.derivatives.values():
        table.add_row(row.label, *_cells(row, report.backends))
    table.caption = (
        "error: relative to the framework's own per-sample vmap(jacfwd) / hessian.\n"
        "Every per-sample derivative comes from batched passes: no (B, ..., B, ...) array."
    )
    return table


def _shape(n_out: int, n_in: int) -> str:
    return f"{n_out:,}²" if n_out == n_in else f"{n_out:,} x {n_in:,}"


def sparsity_table(report: Report) -> Table:
    table = _table("per-sample Jacobian sparsity (detected on the traced program)")
    table.add_column("", no_wrap=True)
    keys = sorted(report.sparse, key=lambda k: (list(report.titles).index(k[0]), k[1]))
    for case, backend in keys:
        table.add_column(f"{case} ({backend})", justify="right")
    stats = [report.sparse[k] for k in keys]

    def gain(s_dense: int, colors: int) -> str:
        return f"{colors} ({s_dense / max(colors, 1):.0f}x)"

    table.add_row("Jacobian", *(_shape(s.n_out, s.n_in) for s in stats))
    table.add_row("nonzeros", *(f"{s.nnz:,}" for s in stats))
    table.add_row("density", *(f"{s.density:.2%}" for s in stats))
    table.add_row("samples independent", *("yes" if s.batch_independent else "no" for s in stats))
    table.add_row("dense passes", *(f"{min(s.n_in, s.n_out):,}" for s in stats))
    table.add_row("column colors", *(gain(min(s.n_in, s.n_out), s.n_colors) for s in stats))
    table.add_row("row colors", *(str(s.n_row_colors) for s in stats))
    table.add_row("diagonal colors", *(gain(s.n_in, s.n_diagonal_colors) for s in stats))
    table.add_row("detect + color", *(format_seconds(s.detect_seconds) for s in stats))
    table.add_row("sparse_jacobian", *(_time_cell(s.jacobian) for s in stats))
    table.caption = (
        "column colors: passes of sparse_jacobian; diagonal colors: passes of "
        "divergence(method='sparse'); (Nx): N times fewer than the dense passes.\n"
        "sparse_jacobian: one run after warm-up, all the samples' nonzeros (JAX BCOO, torch "
        "sparse COO)."
    )
    return table


def render(report: Report, console: Console) -> None:
    console.rule("[bold]divjac demo")
    ran = ", ".join(report.backends) or "none"
    console.print(f"backends: {ran} ({report.seconds:.1f} s of measurements)")
    for framework, why in report.unavailable.items():
        hint = escape(f"install it with `pip install 'divjac[{framework}]'`")
        console.print(f"[yellow]{framework}: skipped[/] ({escape(why)}); {hint}", highlight=False)
    if not report.backends:
        return
    console.print()
    console.print(methods_table())
    for case in report.titles:
        console.print()
        console.print(divergence_table(report, case))
    console.print()
    console.print(derivatives_table(report))
    if report.sparse:
        console.print()
        console.print(sparsity_table(report))
    if report.failures:
        console.print()
        console.print("[red bold]failures:")
        for failure in report.failures:
            console.print(f"  {failure}", style="red", markup=False, soft_wrap=True)
