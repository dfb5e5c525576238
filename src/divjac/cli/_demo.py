"""``divjac demo``: the main job on built-in models, in every installed backend.

The driver here is shared by the backends: it decides what to measure, times it, computes the
errors and fills a :class:`~._demo_report.Report` that :mod:`._demo_render` prints and
:mod:`._plots` draws. The framework-specific code (building the models, jit and timing, the
brute-force references) is in the small adapters of :mod:`._demo_backends`, which only call the
framework and the divjac API.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core import estimators, plan
from .._errors import InternalError
from . import _plots
from ._common import FRAMEWORKS, UsageError, backend_or_none, writing
from ._demo_backends import Backend, make_backend
from ._demo_render import render
from ._demo_report import (
    FULL,
    QUICK,
    STOCHASTIC,
    Case,
    Measure,
    Report,
    Sizes,
    SparseStats,
    SweepPoint,
    case_title,
    relative_error,
)

if TYPE_CHECKING:
    from rich.console import Console

    from .._core.pattern import SparsityPattern

__all__ = ["collect", "run_backend", "run_demo"]

DENSE_CHUNK = 256  # chunk_size of the dense method on the image models (bounds its memory)


class _Run:
    """One backend's part of the demo; fills the shared report."""

    def __init__(
        self, backend: Backend, sizes: Sizes, report: Report, status: Callable[[str], Any]
    ):
        self.backend = backend
        self.api = backend.api
        self.sizes = sizes
        self.report = report
        self.status = status

    @contextmanager
    def attempt(self, what: str, measure: Measure) -> Iterator[None]:
        """Record a failure in ``measure`` and the report instead of stopping the demo."""
        try:
            yield
        except Exception as err:
            measure.failed = True
            measure.note = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            self.report.failures.append(f"{self.backend.name}: {what}: {measure.note}")

    def measure(self, table: str, case: Case, label: str, passes: int | None = None) -> Measure:
        m = Measure()
        self.report.row(table, case.key, label, passes).by_backend[self.backend.name] = m
        return m

    # --- divergence by every applicable method ---

    def divergences(self, case: Case, pattern: SparsityPattern | None) -> None:
        api, b, name = self.api, self.backend, self.backend.name
        self.status(f"{name}: divergence of {case.key} (exact methods)")
        auto_plan = plan.divergence_plan("auto", case.n, pattern)
        auto = self.measure("divergence", case, "auto", auto_plan.n_passes)
        self.report.row("divergence", case.key, "auto").detail = (
            "(= sparse)" if auto_plan.is_sparse else "(= exact)"
        )
        exact_values: Any = None
        with self.attempt(f"{case.key} divergence auto", auto):
            fn = api.divergence(case.fn, case.argnum, method="auto")
            values, auto.seconds = b.timed(fn, case.args, repeat=self.sizes.repeat)
            exact_values = b.numpy(values)
            auto.error = 0.0
            self.report.exact[(case.key, name)] = exact_values
        if auto_plan.is_sparse:  # the same computation as method="sparse": not run twice
            if pattern is None:
                raise InternalError("the auto plan of the divergence is sparse without a pattern")
            sparse = self.measure("divergence", case, "sparse", pattern.n_diagonal_colors)
            sparse.seconds, sparse.error, sparse.failed = auto.seconds, auto.error, auto.failed
        self.dense(case, auto, exact_values)
        if case.key == "cnn":  # n = 2 for the MLP; the blur is linear: its divergence is constant
            self.stochastic(case, exact_values, pattern)

    def dense(self, case: Case, auto: Measure, exact_values: Any) -> None:
        """The dense exact method, timed on a few samples of the image models when it is slow."""
        b, sizes = self.backend, self.sizes
        dense = self.measure("divergence", case, "exact", case.n)
        k = case.batch_size if case.key == "mlp" else min(sizes.dense_samples, case.batch_size)
        row = self.report.divergence[(case.key, "exact")]
        first = next((name for name, m in row.by_backend.items() if m.seconds is not None), None)
        if k < case.batch_size and first is not None:
            # The slow reference runs once per image model: the backends agree on its values.
            dense.note = f"timed in {first} only (the backends agree, see below)"
            return
        if auto.seconds is not None and not auto.failed and k < case.batch_size:
            passes = self.report.divergence[(case.key, "auto")].passes or case.n
            estimate = auto.seconds / case.batch_size * k * case.n / passes
            if estimate > sizes.dense_limit_s:
                dense.note = (
                    f"skipped in {b.name}: about {estimate:.0f} s for {case.n:,} passes "
                    f"(estimated from the {passes} passes of method='auto')"
                )
                return
        with self.attempt(f"{case.key} divergence exact", dense):
            chunk = None if case.key == "mlp" else DENSE_CHUNK
            fn = self.api.divergence(case.fn, case.argnum, method="exact", chunk_size=chunk)
            repeat = sizes.repeat if k == case.batch_size else 1
            values, seconds = b.timed(fn, case.first(k), repeat=repeat)
            dense.seconds = seconds * case.batch_size / k
            dense.scaled = k < case.batch_size
            if exact_values is not None:
                dense.error = relative_error(b.numpy(values), exact_values[:k])

    def stochastic(self, case: Case, exact_values: Any, pattern: SparsityPattern | None) -> None:
        """The estimators at ``table_budget`` (and at every budget of the sweep for the CNN)."""
        b, sizes = self.backend, self.sizes
        # The backends get the same weights, inputs and probes: one sweep (the first backend's)
        # draws the curves; the others compute the table's budget.
        sweep = not any(p.backend != b.name for p in self.report.sweep)
        budgets = (
            sorted(set(sizes.budgets) | {sizes.table_budget}) if sweep else [sizes.table_budget]
        )
        for method in STOCHASTIC:
            self.status(f"{b.name}: divergence of {case.key} ({method})")
            passes = sizes.table_budget
            colors = pattern.n_diagonal_colors if pattern is not None else case.n
            if method == "probing" and colors <= sizes.table_budget:
                passes = colors
                self.report.row(
                    "divergence", case.key, method
                ).detail = f"exact: the {passes} diagonal colors fit the budget"
            shown = self.measure("divergence", case, method, passes)
            for budget in budgets:
                in_table = budget == sizes.table_budget
                sink = shown if in_table else Measure()
                with self.attempt(f"{case.key} divergence {method} ({budget} probes)", sink):
                    fn = self.api.divergence(
                        case.fn, case.argnum, method=method, num_probes=budget, return_stderr=True
                    )
                    if method == "probing":  # its number of draws depends on its coloring
                        randomness = b.randomness(0)
                    else:
                        k = estimators.num_random_vectors(method, budget, case.n)
                        signs = np.random.default_rng(budget).choice(
                            np.array([-1.0, 1.0], np.float32), size=(k, *case.canonical_shape)
                        )
                        randomness = case.convert(signs)  # the same probes in every backend
                    repeat = sizes.repeat if in_table else 0
                    (values, stderr), seconds = b.timed(
                        fn, (randomness, *case.args), {}, repeat=repeat
                    )
                    if in_table:
                        shown.seconds = seconds
                    error = _error(values, exact_values, b)
                    sink.error = error
                    if error is not None and sweep:
                        mean_stderr = float(np.mean(b.numpy(stderr)))
                        self.report.sweep.append(
                            SweepPoint(b.name, method, budget, error, mean_stderr)
                        )

    # --- sparsity ---

    def sparsity(self, case: Case) -> SparsityPattern | None:
        """Detect the pattern (timed, colorings included); the sparse Jacobian of image models."""
        b = self.backend
        self.status(f"{b.name}: sparsity of {case.key}")
        start = time.perf_counter()
        pattern: SparsityPattern = self.api.sparsity(case.fn, case.argnum)(*case.args)
        colors = (pattern.n_colors, pattern.n_row_colors, pattern.n_diagonal_colors)
        seconds = time.perf_counter() - start
        if case.key == "mlp":
            return pattern
        stats = SparseStats(
            n_in=pattern.shape[1],
            n_out=pattern.shape[0],
            nnz=pattern.nnz,
            density=pattern.density,
            n_colors=colors[0],
            n_row_colors=colors[1],
            n_diagonal_colors=colors[2],
            batch_independent=pattern.is_batch_independent,
            detect_seconds=seconds,
        )
        self.report.sparse[(case.key, b.name)] = stats
        if case.key == "cnn" and self.report.spy is None:
            self.report.spy = (pattern.csr, f"{b.name}, {b.layout(case.key)} layout")
        self.status(f"{b.name}: sparse Jacobian of {case.key}")
        with self.attempt(f"{case.key} sparse_jacobian", stats.jacobian):
            fn = self.api.sparse_jacobian(case.fn, case.argnum)
            matrix, stats.jacobian.seconds = b.timed(fn, case.args, repeat=1)
            expected = pattern.nnz * case.batch_size
            if b.nnz(matrix) != expected:
                raise InternalError(
                    f"sparse_jacobian stored {b.nnz(matrix)} values; its pattern has {expected}"
                )
        return pattern

    # --- d/dt, d/dx, grad div, Laplacian, gradient w.r.t. parameters ---

    def derivatives(self, case: Case) -> None:
        b, api, repeat = self.backend, self.api, self.sizes.repeat
        self.status(f"{b.name}: derivatives of {case.key}")
        if case.key == "mlp":
            f = case.fn

            def d_dt(*args: Any) -> Any:
                return api.jacobian(f, 2)(*args)[..., 0]

            def u(p: Any, x: Any, t: Any) -> Any:
                y = f(p, x, t)
                return 0.5 * (y * y).sum(-1)

            def loss(p: Any, x: Any, t: Any) -> Any:
                div = api.divergence(f, 1)(p, x, t)
                return (div * div).mean()

            quantities: list[tuple[str, Callable[..., Any], Callable[[], Any]]] = [
                ("d/dt  jacobian(f, 2)", d_dt, lambda: b.ref_jacobian(case, 2)[..., 0]),
                ("d/dx  jacobian(f, 1)", api.jacobian(f, 1), lambda: b.ref_jacobian(case, 1)),
                ("grad div  grad_divergence", api.grad_divergence(f, 1), lambda: b.ref_grad_div(case)),
                ("Laplacian  laplacian(u)", api.laplacian(u, 1), lambda: b.ref_laplacian(case, u)),
            ]  # fmt: skip
            for label, fn, reference in quantities:
                m = self.measure("derivatives", case, label)
                with self.attempt(f"{case.key} {label}", m):
                    values, m.seconds = b.timed(fn, case.args, repeat=repeat)
                    m.error = relative_error(b.numpy(values), reference())
            label = "d mean(div^2)/d params"
            m = self.measure("derivatives", case, label)
            with self.attempt(f"{case.key} {label}", m):
                _, m.seconds = b.timed_param_grad(loss, case.args, repeat=repeat)
        elif case.key == "cnn":
            label = "CNN grad div (sparse)"
            m = self.measure("derivatives", case, label)
            with self.attempt(f"{case.key} {label}", m):
                fn = api.grad_divergence(case.fn, case.argnum)
                _, m.seconds = b.timed(fn, case.args, repeat=repeat)


def _error(values: Any, exact_values: Any, backend: Backend) -> float | None:
    if exact_values is None:
        return None
    return relative_error(backend.numpy(values), exact_values)


def run_backend(
    backend: Backend, sizes: Sizes, report: Report, status: Callable[[str], Any]
) -> None:
    """Measure everything in one backend."""
    run = _Run(backend, sizes, report, status)
    for case in backend.cases(sizes):
        report.titles.setdefault(case.key, case_title(case.key, sizes))
        report.n.setdefault(case.key, case.n)
        report.batch.setdefault(case.key, case.batch_size)
        pattern: SparsityPattern | None = None
        measure = Measure()
        with run.attempt(f"{case.key} sparsity", measure):
            pattern = run.sparsity(case)
        run.divergences(case, pattern)
        run.derivatives(case)


def collect(
    sizes: Sizes, frameworks: tuple[str, ...], status: Callable[[str], Any] = lambda _: None
) -> Report:
    """Run the demo in each framework that is installed; no output, no files."""
    report = Report(sizes)
    start = time.perf_counter()
    for framework in frameworks:
        api, why = backend_or_none(framework)
        if api is None:
            report.unavailable[framework] = why
            continue
        report.backends.append(framework)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            run_backend(make_backend(framework, api), sizes, report, status)
    report.seconds = time.perf_counter() - start
    return report


def run_demo(
    out: Path, *, quick: bool = False, frameworks: tuple[str, ...] = FRAMEWORKS, console: Console
) -> Report:
    """Run, print the tables and write the plots and ``results.json`` to ``out``."""
    sizes = QUICK if quick else FULL
    with console.status("starting") as spinner:
        report = collect(sizes, frameworks, status=lambda text: spinner.update(text))
        if not report.backends:
            reasons = "; ".join(f"{name}: {why}" for name, why in report.unavailable.items())
            hints = " or ".join(f"`pip install 'divjac[{name}]'`" for name in report.unavailable)
            raise UsageError(f"no backend is installed ({reasons}). Install one with {hints}.")
        spinner.update("plotting")
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
            paths = _plots.demo_plots(report, out)
            (out / "results.json").write_text(json.dumps(report.to_json(), indent=2, default=str))
    render(report, console)
    written = ", ".join(str(p) for p in [*paths, out / "results.json"])
    console.print(f"\nwrote {written}", highlight=False)
    return report
