"""Calibration of the stochastic estimators on the per-sample Jacobians of small networks.

The Jacobians of an MLP, a CNN and a transformer block (pre-LayerNorm self-attention and MLP,
with residual connections: a large diagonal) at ``B`` random inputs are built once, as dense
matrices, by central differences of NumPy forward passes; the estimators then see them through a
batched matvec, ``R`` independent repetitions of the batch at once. The standard error is meant
to be read as a confidence interval: ``estimate +- 2 * stderr`` must cover the exact trace
90-99 % of the ``R * B`` times, at small budgets (3-8 matvecs) as at moderate ones. Everything is
seeded: the tests are deterministic.

Measured coverage (8000 intervals each, Rademacher probes), over the three models:

==========  ======  ==========  ==========  ===============================================
method      budget  first       second      now
==========  ======  ==========  ==========  ===============================================
hutchinson  3-8     0.80-0.92   0.94-0.95   0.978-1.000 (the larger of two variance estimates)
hutchinson  16-32   0.94-0.95   0.94-0.95   0.957-0.974 (s^2's excess in the share (k-1)/nu)
hutch++     6-24    0.71-0.92   0.93-0.95   0.977-1.000
xtrace      4-24    0.69-0.93   0.93-0.97   0.937-0.975 (never below its naive estimate)
probing     4-24    0.69-0.90   0.92-0.96   0.962-1.000 (the images' class variances)
==========  ======  ==========  ==========  ===============================================

The calibration set of ``divjac.cli.bench.bench_calibration`` (21 matrices, the degenerate
Rademacher cases among them) is checked on its named cases here, in seconds; its full table and
the end-to-end per-framework one are docs/calibration.md's.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import scipy.sparse as sp

from divjac._core import estimators as est, stochastic
from divjac._core.pattern import SparsityPattern
from divjac._errors import NumProbesError

B = 8  # inputs (samples) per model
R = 200  # repetitions of the batch

Forward = Callable[[np.ndarray], np.ndarray]


# --------------------------------------------------------------------------------------------
# Per-sample Jacobians
# --------------------------------------------------------------------------------------------


def _jacobians(f: Forward, x: np.ndarray, h: float = 1e-5) -> np.ndarray:
    """``(B, n, n)`` Jacobians of ``f: (batch, n) -> (batch, n)`` at the rows of ``x``."""
    batch, n = x.shape
    step = h * np.eye(n)
    plus = (x[:, None, :] + step).reshape(-1, n)
    minus = (x[:, None, :] - step).reshape(-1, n)
    columns = (f(plus) - f(minus)).reshape(batch, n, n) / (2 * h)  # [b, j] = d f / d x_j
    return np.swapaxes(columns, 1, 2)


def _mlp(rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, ...]]:
    n, hidden = 48, 96
    w1 = rng.standard_normal((n, hidden)) / np.sqrt(n)
    b1 = 0.1 * rng.standard_normal(hidden)
    w2 = rng.standard_normal((hidden, n)) / np.sqrt(hidden)
    return _jacobians(lambda x: np.tanh(x @ w1 + b1) @ w2, rng.standard_normal((B, n))), (n,)


def _conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """'Same' 3x3 convolution of ``x`` (batch, H, W, C) with ``w`` (3, 3, C, C')."""
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    height, width = x.shape[1:3]
    return sum(
        padded[:, i : i + height, j : j + width] @ w[i, j] for i in range(3) for j in range(3)
    )


def _cnn(rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, ...]]:
    shape, hidden = (8, 8, 2), 4
    w1 = rng.standard_normal((3, 3, 2, hidden)) / np.sqrt(18)
    w2 = rng.standard_normal((3, 3, hidden, 2)) / np.sqrt(9 * hidden)

    def f(x: np.ndarray) -> np.ndarray:
        images = x.reshape(-1, *shape)
        return _conv(np.tanh(_conv(images, w1)), w2).reshape(len(x), -1)

    return _jacobians(f, rng.standard_normal((B, 128))), shape


def _layer_norm(x: np.ndarray) -> np.ndarray:
    centered = x - x.mean(-1, keepdims=True)
    return centered / np.sqrt((centered**2).mean(-1, keepdims=True) + 1e-5)


def _transformer(rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, ...]]:
    tokens, d, heads, hidden = 8, 8, 2, 16
    wq, wk, wv, wo = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(4))
    w1 = rng.standard_normal((d, hidden)) / np.sqrt(d)
    w2 = rng.standard_normal((hidden, d)) / np.sqrt(hidden)

    def attention(x: np.ndarray) -> np.ndarray:
        q, k, v = (
            (x @ w).reshape(*x.shape[:-1], heads, d // heads).swapaxes(-2, -3) for w in (wq, wk, wv)
        )
        scores = q @ k.swapaxes(-1, -2) / np.sqrt(d // heads)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        return (weights @ v).swapaxes(-2, -3).reshape(x.shape) @ wo

    def f(x: np.ndarray) -> np.ndarray:
        x = x.reshape(-1, tokens, d)
        y = x + attention(_layer_norm(x))
        return (y + np.tanh(_layer_norm(y) @ w1) @ w2).reshape(len(x), -1)

    return _jacobians(f, rng.standard_normal((B, tokens * d))), (tokens, d)


BUILDERS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


@functools.cache
def _model(name: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """``(J, per-sample shape)``: ``B`` Jacobians of the model, the same in every test."""
    return BUILDERS[name](np.random.default_rng(0))


# --------------------------------------------------------------------------------------------
# Repetitions
# --------------------------------------------------------------------------------------------


def _draw(rng: np.random.Generator, distribution: str, shape: tuple[int, ...]) -> np.ndarray:
    if distribution == "rademacher":
        return rng.choice(np.array([-1.0, 1.0]), size=shape)
    return est.normalize_probes(rng.standard_normal(shape), distribution)


def _repeat(
    model: str, method: str, budget: int, distribution: str = "rademacher", reps: int = R
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Estimates, stderrs (``(reps, B)``) and exact traces (``(B,)``) of seeded repetitions.

    ``method`` is a stochastic method; probing plans its coloring from
    the Jacobians' sparsity pattern as the transforms do.
    """
    j, shape = _model(model)
    n = j.shape[-1]
    rng = np.random.default_rng(zlib.crc32(f"{model}/{method}/{budget}/{distribution}".encode()))

    def matvec(v: np.ndarray) -> np.ndarray:
        """``J_b`` on the repetition-major batch ``(reps * B, n, k)``, one product per sample."""
        k = v.shape[-1]
        columns = np.moveaxis(v.reshape(reps, B, n, k), 0, 2).reshape(B, n, reps * k)
        return np.moveaxis((j @ columns).reshape(B, n, reps, k), 2, 0).reshape(v.shape)

    if method == "probing":
        pattern = SparsityPattern(sp.csr_array(np.any(j != 0, axis=0)), shape, shape, B)
        colors, exact, num = stochastic.probing_plan(
            pattern, shape, num_probes=budget, probing_distance=None
        )
        signs = _draw(rng, "rademacher", (reps * B, n, num))
        estimate, stderr = est.probing(matvec, colors, signs, exact=exact)
    else:
        k = est.num_random_vectors(method, budget, n)
        probes = _draw(rng, distribution, (reps * B, n, k))
        estimate, stderr = est.estimate_trace(method, matvec, probes)
    return estimate.reshape(reps, B), stderr.reshape(reps, B), np.trace(j, axis1=1, axis2=2)


def _coverage(estimate: np.ndarray, stderr: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean(np.abs(estimate - exact) <= 2 * stderr))


# --------------------------------------------------------------------------------------------
# Coverage of the two-standard-error interval
# --------------------------------------------------------------------------------------------

SMALL = {"hutchinson": [3, 4, 5, 6, 8], "hutch++": [6], "xtrace": [4, 6, 8], "probing": [4, 6, 8]}
MODERATE = {"hutchinson": [16, 32], "hutch++": [12, 24], "xtrace": [16, 24], "probing": [16, 24]}
CASES = [
    (model, method, budget)
    for model in BUILDERS
    for method in SMALL
    for budget in SMALL[method] + MODERATE[method]
    if not (model == "cnn" and method == "probing" and budget == 24)  # exact: 18 colors fit
]


LOWEST = {"hutchinson": 0.955, "hutch++": 0.97, "xtrace": 0.93, "probing": 0.955}
"""The least coverage each method reaches on these models (8000 intervals: +-0.005)."""


@pytest.mark.parametrize(("model", "method", "budget"), CASES)
def test_two_stderr_interval_is_a_confidence_interval(model: str, method: str, budget: int) -> None:
    estimate, stderr, exact = _repeat(model, method, budget)
    assert np.all(stderr > 0)
    coverage = _coverage(estimate, stderr, exact)
    assert coverage >= LOWEST[method]
    # Conservative at a few probes (the variance formula and its floor dominate), close to
    # the nominal level from 16 on.
    assert budget < 16 or coverage <= 0.99


def _probing_coverage(j: np.ndarray, budget: int, draws: int) -> float:
    """Coverage of probing's ``+- 2 stderr`` on the ``(B, n, n)`` matrices ``j``, ``draws``
    seeded intervals, with the plan of the transforms (``return_stderr=True``)."""
    batch, n, _ = j.shape
    reps = -(-draws // batch)
    pattern = SparsityPattern(sp.csr_array(np.any(j != 0, axis=0)), (n,), (n,), batch)
    colors, exact, num = stochastic.probing_plan(
        pattern, (n,), num_probes=budget, probing_distance=None
    )
    assert not exact
    rng = np.random.default_rng(zlib.crc32(f"probing/{n}/{budget}".encode()))
    signs = _draw(rng, "rademacher", (reps * batch, n, num))
    tiled = np.tile(j, (reps, 1, 1))
    estimate, stderr = est.probing(lambda v: tiled @ v, colors, signs)
    return _coverage(estimate, stderr, np.tile(np.trace(j, axis1=1, axis2=2), reps))


def _pinn_hessians(d: int, hidden: int = 32) -> np.ndarray:
    """Hessians of ``u(x) = w2 . tanh(W1 x + b1)`` at ``B`` points: dense, symmetric,
    indefinite, a few dominant directions."""
    rng = np.random.default_rng(d)
    w1 = rng.standard_normal((hidden, d))
    b1 = 0.5 * rng.standard_normal(hidden)
    w2 = rng.standard_normal(hidden) / np.sqrt(hidden)
    z = np.tanh(rng.uniform(-1, 1, (B, d)) @ w1.T + b1)
    return np.einsum("hi,bh,hj->bij", w1, w2 * (-2 * z * (1 - z * z)), w1)


@pytest.mark.parametrize(("d", "budget"), [(5, 4), (6, 4), (8, 6), (12, 8)])
def test_probing_covers_small_hessians(d: int, budget: int) -> None:
    """Probing's standard error on small Hessians, where two repetitions of classes of two or
    three elements take few values (a class's sample variance is 0 half the time): 2000 draws,
    >= 0.94 up to their sampling error. The classes' sample variances alone covered 0.79-0.93
    on these (0.79, 0.90, 0.90, 0.90 here; now 0.96-0.99); the images' class variances are
    kept when larger."""
    assert _probing_coverage(_pinn_hessians(d), budget, 2000) >= 0.94 - 0.011


@pytest.mark.slow
def test_probing_is_calibrated_on_the_calibration_set() -> None:
    """Every probing cell of the core calibration table (21 matrices, 4-16 passes, 2000 draws):
    >= 0.94 up to the sampling error of 2000 draws. Before: 22 of 63 cells below, 0.787 at
    worst (a PINN's Hessian at d = 5, 4 passes)."""
    pytest.importorskip("typer", reason="the calibration cells live in the CLI's bench")
    from divjac.cli.bench.bench_calibration import core_cells

    cells = list(core_cells(2000, estimators=["probing"]))
    assert len(cells) == 63
    for cell in cells:
        assert cell.draws >= 2000
        assert cell.coverage >= 0.94 - 0.011, cell


NAMED = [
    "Hessian of x0^2 + x0 x1 (d=2)",
    "PINN Hessian (d=2)",
    "rand(10, 10)",
    "rand(15, 15)",
    "tanh(x @ A) + 0.5 x (n=64)",
]
"""The cases of issue 22, in the calibration set of the benchmark."""


def test_issue_cases_are_calibrated() -> None:
    """Every budget of Hutchinson (Rademacher, Gaussian), Hutch++ and XTrace on the cases of
    issue 22, 2000 draws per cell: coverage >= 0.94 up to the sampling error of 2000 draws
    (2 standard errors: 0.011), and beyond 3 stderr no more often than the estimator's Student
    model predicts plus that error. Before: 0.49 (x0^2 + x0 x1, 2 Rademacher probes), 0.86-0.92
    (rand), Hutch++ 0.94 with 2.6 % beyond 3 stderr."""
    pytest.importorskip("typer", reason="the calibration cells live in the CLI's bench")
    from divjac.cli.bench.bench_calibration import core_cells

    methods = ["hutchinson (rademacher)", "hutchinson (gaussian)", "hutch++", "xtrace"]
    cells = list(core_cells(2000, estimators=methods, cases=NAMED))
    assert len(cells) > 80
    for cell in cells:
        assert cell.draws >= 2000
        assert cell.coverage >= 0.94 - 0.011, cell
        assert cell.beyond3 <= cell.predicted3 + 0.006, cell


@pytest.mark.slow
@pytest.mark.parametrize("distribution", ["gaussian", "sphere"])
@pytest.mark.parametrize(
    ("model", "method", "budget"),
    [case for case in CASES if case[1] != "probing"],
)
def test_two_stderr_interval_with_other_probe_distributions(
    model: str, method: str, budget: int, distribution: str
) -> None:
    estimate, stderr, exact = _repeat(model, method, budget, distribution)
    coverage = _coverage(estimate, stderr, exact)
    assert coverage >= 0.9 and (budget < 16 or coverage <= 0.99)


@pytest.mark.parametrize("model", list(BUILDERS))
@pytest.mark.parametrize(("method", "budget"), [("hutch++", 3), ("xtrace", 2)])
def test_single_term_stderr_is_finite_and_conservative(
    model: str, method: str, budget: int
) -> None:
    """One Hutchinson term has no sample variance: its documented bound covers (almost) always."""
    estimate, stderr, exact = _repeat(model, method, budget)
    assert np.all(np.isfinite(stderr)) and np.all(stderr > 0)
    assert _coverage(estimate, stderr, exact) >= 0.97


@pytest.mark.parametrize("model", list(BUILDERS))
def test_xtrace_budget_of_n_is_exact(model: str) -> None:
    """With n matvecs XTrace computes the exact trace: no error, standard error 0."""
    n = _model(model)[0].shape[-1]
    for budget in (n, n + 1, 2 * n):  # n odd or even: 2m >= n
        budget += budget % 2
        estimate, stderr, exact = _repeat(model, "xtrace", budget, reps=2)
        np.testing.assert_allclose(estimate, np.broadcast_to(exact, (2, B)), atol=1e-12)
        np.testing.assert_array_equal(stderr, 0.0)
    # Two matvecs fewer: an estimate with an error bar.
    estimate, stderr, exact = _repeat(model, "xtrace", n - 2, reps=2)
    assert np.all(np.abs(estimate - exact) > 1e-9) and np.all(stderr > 0)


# --------------------------------------------------------------------------------------------
# Unbiasedness: the mean of the repetitions converges to the trace
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(BUILDERS))
@pytest.mark.parametrize(
    ("method", "budget"),
    [("hutchinson", 4), ("hutch++", 6), ("xtrace", 8), ("probing", 8)],
)
def test_mean_of_repetitions_converges_to_the_trace(model: str, method: str, budget: int) -> None:
    estimate, _, exact = _repeat(model, method, budget)
    error = np.abs(estimate.mean(axis=0) - exact)
    spread = estimate.std(axis=0, ddof=1)
    assert np.all(error < 4 * spread / np.sqrt(R)), (error, spread)
    # The mean of the first quarter is farther off than the mean of all R: it converges.
    first = np.abs(estimate[: R // 4].mean(axis=0) - exact)
    assert np.sqrt(np.mean(error**2)) < np.sqrt(np.mean(first**2))


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_hessian_diagonal_bound_covers_every_entry(distribution: str) -> None:
    """Bekas' diagonal estimate at 3-8 probes: every entry of a tridiagonal Rosenbrock Hessian
    (rows of three values: few-valued Rademacher terms) and of a dominant-diagonal one (skewed
    Gaussian terms) is covered >= 0.94 of 4000 draws by ``+- 2 stderr``, where the terms' own
    sample variance covered 0.68."""
    rng = np.random.default_rng(zlib.crc32(distribution.encode()))
    x = np.linspace(-1.0, 1.5, 10)
    rosen = np.diag(np.r_[1200 * x[:-1] ** 2 - 400 * x[1:] + 2, 0.0] + np.r_[0.0, [200.0] * 9])
    rosen += np.diag(-400 * x[:-1], 1) + np.diag(-400 * x[:-1], -1)
    dominant = np.diag(1.0 / np.arange(1, 11) ** 2) + 0.01 * np.ones((10, 10))
    for matrix in (rosen, dominant):
        for k in (3, 8):
            shape = (4000, 10, k)
            if distribution == "gaussian":
                probes = rng.standard_normal(shape)
            else:
                probes = rng.choice([-1.0, 1.0], size=shape)
            estimate, stderr = est.diagonal_mean_and_stderr(
                probes, matrix @ probes, est.namespace(probes)
            )
            covered = np.abs(estimate - np.diagonal(matrix)) <= 2 * stderr + 1e-12
            assert covered.mean(0).min() >= 0.94 - 0.011, (k, covered.mean(0))


FIXED = [
    "divergence hutchinson (rademacher)",
    "divergence hutchinson (gaussian)",
    "divergence hutch++",
    "divergence xtrace",
    "divergence probing",
]
"""The transforms whose standard errors rest on the images (the matvec estimators, probing)."""


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_issue_cases_are_calibrated_end_to_end(framework: str) -> None:
    """The public ``divergence`` of each framework on the issue's functions (x0^2 + x0 x1's
    gradient is not square: the rand(10, 10) map and tanh(x @ A) + 0.5 x), every budget, 2000
    draws (the samples of one batch): the bench's end-to-end cells, >= 0.94 up to 2000 draws'
    sampling error."""
    pytest.importorskip(framework)
    from divjac.cli.bench.bench_calibration import framework_cells

    cells = list(framework_cells(framework, 2000, only=FIXED))
    assert len(cells) >= 20
    for cell in cells:
        assert cell.coverage >= 0.94 - 0.011, cell


SECOND = [
    "laplacian hutchinson (rademacher)",
    "laplacian hutchinson (gaussian)",
    "weighted_laplacian hutchinson",
    "hessian_diagonal hutchinson",
]
"""The second-order transforms whose standard errors rest on Hessian-vector products."""


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_second_order_hutchinson_is_calibrated_end_to_end(framework: str) -> None:
    """The public ``laplacian``, ``weighted_laplacian`` and ``hessian_diagonal`` Hutchinson of
    each framework on the bench's scalar functions (x0^2 + x0 x1, the PINNs), every budget
    they accept below n, 2000 draws: >= 0.94 up to 2000 draws' sampling error."""
    pytest.importorskip(framework)
    from divjac.cli.bench.bench_calibration import framework_cells

    cells = list(framework_cells(framework, 2000, only=SECOND))
    assert len(cells) >= 8
    for cell in cells:
        assert cell.coverage >= 0.94 - 0.011, cell


# --------------------------------------------------------------------------------------------
# SLQ: the quadrature's bias in the error bar (issue 25)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_slq_stderr_holds_the_quadrature_bias(model: str) -> None:
    """SLQ at 8 of ``n = 48 / 64`` Lanczos steps (``J^T J`` of condition up to 1.5e7): the
    Gauss rule overestimates the terms (bias 8.0 / 3.9) by more than the probes' stderr at 32
    probes (it covered 0.81 / 0.90 without the bias), and twice the gap to the rule of half the
    steps in the stderr covers it (320 intervals here; measured 1.000 over 400 of other seeds,
    the stderr 0.99 / 1.14 times the root-mean-square error; at 16 and 30 steps, 8 or 32
    probes, on these and the CNN: 0.985-1.000, 0.83-1.8 times)."""
    j, _ = _model(model)
    n, reps, k, steps = j.shape[-1], 40, 32, 8
    gram = np.swapaxes(j, 1, 2) @ j
    rng = np.random.default_rng(zlib.crc32(f"slq/{model}".encode()))
    probes = _draw(rng, "rademacher", (reps * B, n, k))

    def matvec(v: np.ndarray) -> np.ndarray:
        columns = np.moveaxis(v.reshape(reps, B, n, k), 0, 2).reshape(B, n, reps * k)
        return np.moveaxis((gram @ columns).reshape(B, n, reps, k), 2, 0).reshape(v.shape)

    estimate, stderr = est.slq_log_abs_det(matvec, probes, steps)
    estimate, stderr = estimate.reshape(reps, B), stderr.reshape(reps, B)
    exact = np.linalg.slogdet(j)[1]
    error = estimate - exact
    assert np.mean(error) > 0.5 * np.mean(stderr)  # the bias is there, and large
    assert _coverage(estimate, stderr, exact) >= 0.94
    assert np.mean(stderr) <= 1.5 * np.sqrt(np.mean(error**2))  # not absurdly wide


def test_slq_refuses_an_error_bar_it_cannot_gauge() -> None:
    """Below ``MIN_GAUGED_STEPS`` Lanczos steps (and ``n``) the bias of the quadrature has not
    started to fall steadily, and the gap to the rule of half the steps misses it: a standard
    error is refused (the estimate alone is given)."""
    j, _ = _model("mlp")
    gram = np.swapaxes(j, 1, 2) @ j
    probes = _draw(np.random.default_rng(0), "rademacher", (B, j.shape[-1], 4))
    for steps in (1, 4, est.MIN_GAUGED_STEPS - 1):
        with pytest.raises(NumProbesError, match="lanczos_steps >= 8"):
            est.slq_log_abs_det(lambda v: gram @ v, probes, steps)
        estimate, stderr = est.slq_log_abs_det(lambda v: gram @ v, probes, steps, stderr=False)
        assert stderr is None and estimate.shape == (B,)


def test_slq_gauge_covers_an_odd_number_of_steps() -> None:
    """At odd ``m`` the smaller rule has ``floor(m / 2)`` nodes, half the steps or fewer, as the
    bound assumes (``ceil``: 0.06-0.61 at 3 steps on MLP Jacobians): ``J`` with log-spaced
    singular values of condition 500, 9 steps of 32, 32 probes."""
    rng = np.random.default_rng(3)
    n = 32
    q, _ = np.linalg.qr(rng.standard_normal((B, n, n)))
    r, _ = np.linalg.qr(rng.standard_normal((B, n, n)))
    j = q @ (np.logspace(0, -np.log10(500), n)[:, None] * r)
    gram = np.swapaxes(j, 1, 2) @ j
    probes = _draw(rng, "rademacher", (60 * B, n, 32))

    def matvec(v: np.ndarray) -> np.ndarray:
        return (gram @ v.reshape(60, B, n, -1)).reshape(v.shape)

    estimate, stderr = est.slq_log_abs_det(matvec, probes, 9)
    exact = np.linalg.slogdet(j)[1]
    assert _coverage(estimate.reshape(60, B), stderr.reshape(60, B), exact) >= 0.94


@pytest.mark.slow
@pytest.mark.parametrize("budget", [2, 8, 16])
@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_slq_is_calibrated_on_the_calibration_set(distribution: str, budget: int) -> None:
    """Every SLQ cell of the core calibration table at 2, 8 and 16 probes (21 matrices, either
    distribution, the default ``min(n, 30)`` Lanczos steps, 2000 draws): >= 0.94 up to the
    sampling error of 2000 draws. Before the quadrature's bias was in the stderr: 0.535 at
    worst (CNN Jacobian, n = 128, 32 probes). The 32-probe cells (minutes each on the CNN)
    are the bench's (``divjac bench``, P15; docs/calibration.md)."""
    pytest.importorskip("typer", reason="the calibration cells live in the CLI's bench")
    from divjac.cli.bench.bench_calibration import core_cells

    estimator = f"slq ({distribution})"
    cells = list(core_cells(2000, estimators=[estimator], budgets={estimator: [budget]}))
    assert len(cells) == 21
    for cell in cells:
        assert cell.draws >= 2000
        assert cell.coverage >= 0.94 - 0.011, cell


@pytest.mark.slow
@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_slq_is_calibrated_end_to_end(framework: str, distribution: str) -> None:
    """The public ``log_abs_det(method="slq")`` of each framework on the bench's square maps
    (rand(10, 10) x: exact quadrature; tanh(x @ A) + 0.5 x at n = 64: 30 of 64 steps), 2-32
    probes of ``distribution``, 2000 draws: >= 0.94 up to 2000 draws' sampling error (one test
    per distribution: both took up to 600 s on 2 loaded cores)."""
    pytest.importorskip(framework)
    from divjac.cli.bench.bench_calibration import framework_cells

    only = [f"log_abs_det slq ({distribution})"]
    cells = list(framework_cells(framework, 2000, only=only))
    assert len(cells) == 2 * 4
    for cell in cells:
        assert cell.coverage >= 0.94 - 0.011, cell


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_differential_operator_stderr_is_calibrated_end_to_end(framework: str) -> None:
    """The public ``differential_operator(method="stde")`` of each framework on the PINN at
    d = 5: ``sum_i d^4u/dx_i^4``, Kuramoto-Sivashinsky's linear part with a mixed third-order
    term, and a sum of every order with mixed terms, at 8 and 32 directions, 2000 draws (the
    samples of one batch; the exact values in closed form): >= 0.94 up to 2000 draws'
    sampling error (the bench's cells, P15; docs/calibration.md). A budget below the
    operator's directions refuses the error bar (issue 45: the sampled orders' spread covered
    0.49-0.96): the sum of every order, 23 directions, at 8."""
    pytest.importorskip(framework)
    pytest.importorskip("typer", reason="the calibration cells live in the CLI's bench")
    from divjac.cli.bench.bench_calibration_operators import operator_cells

    cells = list(
        operator_cells(framework, 2000, dimensions=(5,), budgets=(8, 32), methods=("stde",))
    )
    assert len(cells) == 5  # every order, mixed, at 8 directions: refused
    low = [c for c in cells if c.coverage < 0.94 - 0.011]
    assert not low, "\n".join(c.row() for c in low)
