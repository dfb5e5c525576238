"""What ``divjac demo`` measures: its sizes, the models' data and the report it fills.

Plain data, shared by the driver (:mod:`._demo`), the framework adapters
(:mod:`._demo_backends`), the tables (:mod:`._demo_render`) and the plots (:mod:`._plots`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import scipy.sparse as sp

__all__ = [
    "EXACT",
    "FULL",
    "METHODS",
    "QUICK",
    "STOCHASTIC",
    "Case",
    "Measure",
    "Report",
    "Row",
    "Sizes",
    "SparseStats",
    "SweepPoint",
    "case_title",
    "make_data",
    "method_rank",
    "relative_error",
]

EXACT = ("exact", "sparse", "auto")
STOCHASTIC = ("hutchinson", "hutch++", "xtrace", "probing")
METHODS = EXACT + STOCHASTIC  # the order of the tables and plots


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


def method_rank(row: Row) -> int:
    """Where a row of the divergence table goes: in the order of :data:`METHODS`."""
    return METHODS.index(row.label) if row.label in METHODS else len(METHODS)
