"""``divjac demo``: the main job on built-in models, in every installed backend.

The driver here is shared by the backends: it decides what to measure, times it, computes the
errors and fills a :class:`Report` that :mod:`._demo_render` prints and :mod:`._plots` draws. The
framework-specific code (building the models, jit and timing, the brute-force references) is in
the small adapters of :mod:`._demo_backends`, which only call the framework and the divjac API.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core import estimators, plan
from ._common import FRAMEWORKS, UsageError, backend_or_none

if TYPE_CHECKING:
    import scipy.sparse as sp
    from rich.console import Console

    from .._core.pattern import SparsityPattern
    from ._demo_backends import Backend

__all__ = ["FULL", "QUICK", "Case", "Measure", "Report", "Row", "Sizes", "run_demo"]

STOCHASTIC = ("hutchinson", "hutch++", "xtrace", "probing")
DENSE_CHUNK = 256  # chunk_size of the dense method on the image models (bounds its memory)
EXACT = ("exact", "sparse", "auto")
METHODS = EXACT + STOCHASTIC


@dataclass(frozen=True)
class Sizes:
    """The sizes of one demo run (:data:`FULL` for ``divjac demo``, :data:`QUICK` for tests)."""

    mlp_batch: int
    mlp_d: int
    mlp_hidden: int
    cnn_shape: tuple[int, int, int, int]  # (B, H, W, C)
    cnn_channels: int
    blur_shape: tuple[int, int, int]  # (B, H, W)
    blur_kernel: int
    blur_sigma: float
    budgets: tuple[int, ...]  # matvec budgets of the estimator sweep (multiples of 6)
    table_budget: int  # the budget shown in the divergence tables
    repeat: int  # timed runs after warm-up (best of)
    dense_samples: int  # samples the dense method is timed on for the image models
    dense_limit_s: float  # the dense method is skipped when estimated slower than this


FULL = Sizes(
    mlp_batch=512,
    mlp_d=2,
    mlp_hidden=100,
    cnn_shape=(8, 32, 32, 3),
    cnn_channels=8,
    blur_shape=(4, 64, 64),
    blur_kernel=11,
    blur_sigma=2.0,
    budgets=(6, 12, 24, 48),
    table_budget=24,
    repeat=2,
    dense_samples=1,
    dense_limit_s=12.0,
)
QUICK = Sizes(
    mlp_batch=16,
    mlp_d=2,
    mlp_hidden=16,
    cnn_shape=(2, 8, 8, 3),
    cnn_channels=4,
    blur_shape=(2, 16, 16),
    blur_kernel=5,
    blur_sigma=1.0,
    budgets=(6, 12),
    table_budget=6,
    repeat=1,
    dense_samples=1,
    dense_limit_s=6.0,
)


@dataclass
class Case:
    """One built-in model in one backend: ``fn(*args)`` differentiated in ``args[argnum]``.

    ``convert`` turns an array shaped like ``(k, *x.shape)`` in the JAX layout (NHWC images)
    into this backend's array in its layout, so both backends get the same probes.
    """

    key: str  # "mlp", "cnn", "blur"
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    argnum: int
    batched: tuple[int, ...]  # positions of the arguments that carry the batch (axis 0)
    canonical_shape: tuple[int, ...]  # the shape of x in the JAX layout
    convert: Callable[[np.ndarray], Any]

    @property
    def x(self) -> Any:
        return self.args[self.argnum]

    @property
    def batch_size(self) -> int:
        return int(self.x.shape[0])

    @property
    def n(self) -> int:
        return math.prod(int(s) for s in self.x.shape[1:])

    def first(self, k: int) -> tuple[Any, ...]:
        """The arguments restricted to the first ``k`` samples."""
        return tuple(a[:k] if i in self.batched else a for i, a in enumerate(self.args))


TITLES = {
    "mlp": "mlp: net(x, t), tanh MLP {d}+1 > {h} > {h} > {d}, x [{b}, {d}]",
    "cnn": "cnn: 3-layer 3x3 conv stack, {c} channels, x {shape}",
    "blur": "blur: {k}x{k} Gaussian blur, x {shape}",
}


def case_title(key: str, sizes: Sizes) -> str:
    if key == "mlp":
        return TITLES[key].format(d=sizes.mlp_d, h=sizes.mlp_hidden, b=sizes.mlp_batch)
    if key == "cnn":
        return TITLES[key].format(c=sizes.cnn_channels, shape=list(sizes.cnn_shape))
    return TITLES[key].format(k=sizes.blur_kernel, shape=list(sizes.blur_shape))


@dataclass
class Measure:
    """One measurement in one backend.

    Attributes:
        seconds: best wall time after warm-up (``None``: not timed).
        error: relative error ``||value - exact|| / ||exact||`` over the batch.
        scaled: the time was measured on fewer samples and scaled to the batch.
        note: why it was skipped, or how it failed.
        failed: the computation raised.
    """

    seconds: float | None = None
    error: float | None = None
    scaled: bool = False
    note: str = ""
    failed: bool = False


@dataclass
class Row:
    """One line of a table: a method (or quantity) of a model, measured in each backend."""

    case: str
    label: str
    passes: int | None = None
    detail: str = ""
    by_backend: dict[str, Measure] = field(default_factory=dict)


@dataclass
class SparseStats:
    """Sparsity of a model's per-sample Jacobian, as detected by one backend."""

    n_in: int
    n_out: int
    nnz: int
    density: float
    n_colors: int
    n_row_colors: int
    n_diagonal_colors: int
    batch_independent: bool
    detect_seconds: float
    jacobian: Measure = field(default_factory=Measure)


@dataclass
class SweepPoint:
    """A stochastic estimate at one matvec budget."""

    backend: str
    method: str
    budget: int
    error: float
    stderr: float


@dataclass
class Report:
    """Everything the demo measured, for the terminal tables, the plots and ``results.json``."""

    sizes: Sizes
    batch: dict[str, int] = field(default_factory=dict)
    backends: list[str] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)
    titles: dict[str, str] = field(default_factory=dict)
    n: dict[str, int] = field(default_factory=dict)
    divergence: dict[tuple[str, str], Row] = field(default_factory=dict)
    derivatives: dict[tuple[str, str], Row] = field(default_factory=dict)
    sparse: dict[tuple[str, str], SparseStats] = field(default_factory=dict)
    sweep: list[SweepPoint] = field(default_factory=list)
    exact: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)  # (model, backend)
    spy: tuple[sp.csr_array, str] | None = None
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def row(self, table: str, case: str, label: str, passes: int | None = None) -> Row:
        rows = self.divergence if table == "divergence" else self.derivatives
        found = rows.setdefault((case, label), Row(case, label, passes))
        if passes is not None:
            found.passes = passes
        return found

    def agreement(self) -> dict[str, float]:
        """Per model: ``||div_jax - div_torch|| / ||div_jax||`` of the exact divergences."""
        out = {}
        for case in self.titles:
            values = [self.exact[(case, b)] for b in self.backends if (case, b) in self.exact]
            if len(values) == 2:
                out[case] = relative_error(values[1], values[0])
        return out

    def to_json(self) -> dict[str, Any]:
        def measures(rows: dict[tuple[str, str], Row]) -> list[dict[str, Any]]:
            return [
                {
                    "model": r.case,
                    "label": r.label,
                    "passes": r.passes,
                    "detail": r.detail,
                    "backends": {b: vars(m) for b, m in r.by_backend.items()},
                }
                for r in rows.values()
            ]

        return {
            "sizes": vars(self.sizes),
            "backends": self.backends,
            "unavailable": self.unavailable,
            "models": {k: {"title": t, "n": self.n.get(k)} for k, t in self.titles.items()},
            "divergence": measures(self.divergence),
            "derivatives": measures(self.derivatives),
            "sparsity": [
                {"model": c, "backend": b, **{k: v for k, v in vars(s).items() if k != "jacobian"}}
                | {"sparse_jacobian": vars(s.jacobian)}
                for (c, b), s in self.sparse.items()
            ],
            "sweep": [vars(p) for p in self.sweep],
            "backend_agreement": self.agreement(),
            "failures": self.failures,
            "seconds": self.seconds,
        }


def make_data(sizes: Sizes) -> dict[str, Any]:
    """Weights and inputs of the three models, in NumPy (float32, JAX layouts: dense weights
    ``(n_in, n_out)``, HWIO kernels, NHWC images), shared by the backends so that they compute
    the same numbers. Drawn like the models' ``init_*`` functions, without compiling anything."""
    rng = np.random.default_rng(0)

    def dense(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
        w = rng.standard_normal((n_in, n_out)) / math.sqrt(n_in)
        return w.astype(np.float32), (0.1 * rng.standard_normal(n_out)).astype(np.float32)

    d, h, b = sizes.mlp_d, sizes.mlp_hidden, sizes.mlp_batch
    mlp = [dense(d + 1, h), dense(h, h), dense(h, d)]
    c = sizes.cnn_channels
    channels = [sizes.cnn_shape[-1], c, c, sizes.cnn_shape[-1]]
    cnn = []
    for c_in, c_out in itertools.pairwise(channels):
        w = rng.standard_normal((3, 3, c_in, c_out)) / math.sqrt(9 * c_in)
        cnn.append((w.astype(np.float32), (0.1 * rng.standard_normal(c_out)).astype(np.float32)))
    return {
        "mlp": mlp,
        "x": rng.standard_normal((b, d)).astype(np.float32),
        "t": rng.uniform(size=(b, 1)).astype(np.float32),
        "cnn": cnn,
        "images": rng.standard_normal(sizes.cnn_shape).astype(np.float32),
        "blur_images": rng.uniform(size=sizes.blur_shape).astype(np.float32),
    }


def relative_error(value: Any, exact: Any) -> float:
    """``||value - exact|| / ||exact||`` (absolute error when ``exact`` is zero)."""
    value = np.asarray(value, np.float64)
    exact = np.asarray(exact, np.float64)
    scale = float(np.linalg.norm(exact))
    diff = float(np.linalg.norm(value - exact))
    return diff / scale if scale > 0 else diff


# --- the shared driver ------------------------------------------------------------------------


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
            assert pattern is not None
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
        pattern: SparsityPattern = self.api.sparsity(case.fn, *case.args, argnums=case.argnum)
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
                raise AssertionError(f"{b.nnz(matrix)} stored values, expected {expected}")
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
    from ._demo_backends import make_backend

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
    import json

    from . import _plots
    from ._demo_render import render

    sizes = QUICK if quick else FULL
    with console.status("starting") as spinner:
        report = collect(sizes, frameworks, status=lambda text: spinner.update(text))
        if not report.backends:
            reasons = "; ".join(f"{name}: {why}" for name, why in report.unavailable.items())
            hints = " or ".join(f"`pip install 'divjac[{name}]'`" for name in report.unavailable)
            raise UsageError(f"no backend is installed ({reasons}). Install one with {hints}.")
        spinner.update("plotting")
        out.mkdir(parents=True, exist_ok=True)
        paths = _plots.demo_plots(report, out)
        (out / "results.json").write_text(json.dumps(report.to_json(), indent=2, default=str))
    render(report, console)
    written = ", ".join(str(p) for p in [*paths, out / "results.json"])
    console.print(f"\nwrote {written}", highlight=False)
    return report
