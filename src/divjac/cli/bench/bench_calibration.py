"""P15: do the error bars hold? Coverage of ``estimate +- 2 * stderr`` for every estimator.

For each stochastic estimator, each budget and each function of a calibration set (21
per-sample Jacobians and Hessians, among them the degenerate Rademacher cases: the Hessian
of ``x0^2 + x0 x1`` at ``d = 2``, PINN Hessians at small ``d``, curvlinops-like
``rand(10, 10)`` / ``rand(15, 15)``, ``tanh(x @ A) + 0.5 x`` at ``n = 64``), the fraction of
draws whose interval ``estimate +- 2 * stderr`` covers the exact value (target >= 0.94) and the
fraction beyond ``3 * stderr``, beside the fraction the estimator's own model predicts
(Student's t with the degrees of freedom of its standard error, scaled by ``kappa``; 0 where the
result is exact).

Two tables. The *core* one runs the backend-neutral estimators of ``divjac._core.estimators``
in NumPy on the dense matrices, thousands of draws at once (seconds). The *framework* ones call
the public transforms of ``divjac.jax`` and ``divjac.torch`` end to end on a few functions, the
draws being the samples of one batch (every sample draws its own probes): ``x`` repeated ``R``
times gives ``R`` independent estimates in one call.

Run ``python -m divjac.cli.bench.bench_calibration [--quick]`` for the full table (markdown).
"""

from __future__ import annotations

import functools
import math
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp

from ..._core import estimators as est, stochastic
from ..._core.estimators._common import t_factor
from ..._core.pattern import SparsityPattern
from ..._errors import InternalError, NumProbesError
from ._harness import Result

__all__ = ["CASES", "Cell", "core_cells", "framework_cells", "markdown", "run"]

TARGET = 0.94
"""The promise: ``estimate +- 2 * stderr`` covers the truth at least this often."""


# --------------------------------------------------------------------------------------------
# The calibration set: per-sample matrices (B, n, n), built in NumPy
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """``matrices`` ``(B, n, n)``; ``shape`` the per-sample input shape (probing's lattice);
    ``hessian``: symmetric second derivatives (also the Laplacian estimators apply)."""

    matrices: np.ndarray
    shape: tuple[int, ...]
    hessian: bool


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _fd_jacobians(f: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """``(B, n, n)`` Jacobians of ``f: (batch, n) -> (batch, n)`` by central differences."""
    batch, n = x.shape
    step = 1e-5 * np.eye(n)
    plus = (x[:, None, :] + step).reshape(-1, n)
    minus = (x[:, None, :] - step).reshape(-1, n)
    columns = (f(plus) - f(minus)).reshape(batch, n, n) / 2e-5
    return np.swapaxes(columns, 1, 2)


def _mlp_jacobian() -> Case:
    rng = _rng("mlp")
    n, hidden = 48, 96
    w1 = rng.standard_normal((n, hidden)) / np.sqrt(n)
    w2 = rng.standard_normal((hidden, n)) / np.sqrt(hidden)
    x = rng.standard_normal((4, n))
    return Case(_fd_jacobians(lambda x: np.tanh(x @ w1) @ w2, x), (n,), hessian=False)


def _conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    h, wd = x.shape[1:3]
    return sum(padded[:, i : i + h, j : j + wd] @ w[i, j] for i in range(3) for j in range(3))


def _cnn_jacobian() -> Case:
    rng = _rng("cnn")
    shape = (8, 8, 2)
    w1 = rng.standard_normal((3, 3, 2, 4)) / np.sqrt(18)
    w2 = rng.standard_normal((3, 3, 4, 2)) / np.sqrt(36)

    def f(x: np.ndarray) -> np.ndarray:
        return _conv(np.tanh(_conv(x.reshape(-1, *shape), w1)), w2).reshape(len(x), -1)

    return Case(_fd_jacobians(f, rng.standard_normal((4, 128))), shape, hessian=False)


def _tanh_jacobian(n: int = 64) -> Case:
    """``f(x) = tanh(x @ A) + 0.5 x``: ``J = diag(1 - tanh^2(x A)) A^T + 0.5 I``."""
    rng = _rng("tanh")
    a = rng.standard_normal((n, n)) / np.sqrt(n) * 2
    x = rng.standard_normal((4, n))
    slope = 1 - np.tanh(x @ a) ** 2
    return Case(slope[:, :, None] * a.T[None] + 0.5 * np.eye(n), (n,), hessian=False)


def _single(matrix: np.ndarray, *, hessian: bool = False) -> Case:
    return Case(matrix[None], (matrix.shape[-1],), hessian)


def _pinn_hessians(d: int, hidden: int = 32) -> Case:
    """Hessians of a tanh MLP ``u(x) = w2 . tanh(W1 x + b1)`` (a PINN) at 4 points."""
    rng = _rng(f"pinn{d}")
    w1 = rng.standard_normal((hidden, d))
    b1 = 0.5 * rng.standard_normal(hidden)
    w2 = rng.standard_normal(hidden) / np.sqrt(hidden)
    x = rng.uniform(-1, 1, (4, d))
    z = np.tanh(x @ w1.T + b1)
    curvature = w2 * (-2 * z * (1 - z * z))
    return Case(np.einsum("hi,bh,hj->bij", w1, curvature, w1), (d,), hessian=True)


def _gaussian_bump_hessians(d: int = 8) -> Case:
    """Hessians of ``exp(-|x|^2 / 2)``: ``e (x x^T - I)``."""
    x = _rng("bump").standard_normal((4, d)) * 0.7
    e = np.exp(-0.5 * np.sum(x * x, axis=1))
    return Case(e[:, None, None] * (x[:, :, None] * x[:, None, :] - np.eye(d)), (d,), hessian=True)


def _rosenbrock_hessians(d: int = 10) -> Case:
    """Hessians of ``sum 100 (x_{i+1} - x_i^2)^2 + (1 - x_i)^2``: tridiagonal."""
    x = _rng("rosenbrock").uniform(-1, 1, (4, d))
    h = np.zeros((4, d, d))
    i = np.arange(d - 1)
    h[:, i, i] += 1200 * x[:, :-1] ** 2 - 400 * x[:, 1:] + 2
    h[:, i + 1, i + 1] += 200
    h[:, i, i + 1] = h[:, i + 1, i] = -400 * x[:, :-1]
    return Case(h, (d,), hessian=True)


def _low_rank_noise(n: int = 40, rank: int = 3) -> np.ndarray:
    rng = _rng("lowrank")
    low = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, n)) / 6.0
    return low + 0.05 * rng.standard_normal((n, n))


def _spectrum(n: int, eigenvalues: np.ndarray, name: str) -> np.ndarray:
    q, _ = np.linalg.qr(_rng(name).standard_normal((n, n)))
    return (q * eigenvalues) @ q.T


CASES: dict[str, Callable[[], Case]] = {
    "Hessian of x0^2 + x0 x1 (d=2)": lambda: _single(
        np.array([[2.0, 1.0], [1.0, 0.0]]), hessian=True
    ),
    "PINN Hessian (d=2)": lambda: _pinn_hessians(2),
    "PINN Hessian (d=3)": lambda: _pinn_hessians(3),
    "PINN Hessian (d=5)": lambda: _pinn_hessians(5),
    "PINN Hessian (d=10)": lambda: _pinn_hessians(10),
    "Gaussian bump Hessian (d=8)": _gaussian_bump_hessians,
    "Rosenbrock Hessian (d=10)": _rosenbrock_hessians,
    "Wishart G G^T / n (n=12)": lambda: _single(
        (lambda g: g @ g.T / 12)(_rng("wishart").standard_normal((12, 12))), hessian=True
    ),
    "indefinite spectrum +-1/i (n=16)": lambda: _single(
        _spectrum(16, (-1.0) ** np.arange(16) / np.arange(1, 17), "indefinite"), hessian=True
    ),
    "decaying spectrum 1/i^2 (n=32)": lambda: _single(
        _spectrum(32, 1 / np.arange(1, 33) ** 2, "decay"), hessian=True
    ),
    "rand(10, 10)": lambda: _single(_rng("rand10").random((10, 10))),
    "rand(15, 15)": lambda: _single(_rng("rand15").random((15, 15))),
    "tanh(x @ A) + 0.5 x (n=64)": _tanh_jacobian,
    "MLP Jacobian (n=48)": _mlp_jacobian,
    "CNN Jacobian (8x8x2)": _cnn_jacobian,
    "I + 0.1 E (n=30)": lambda: _single(
        np.eye(30) + 0.1 * _rng("residual").standard_normal((30, 30))
    ),
    "N(0, 1) entries (n=20)": lambda: _single(_rng("gauss").standard_normal((20, 20))),
    "rank 3 + 0.05 noise (n=40)": lambda: _single(_low_rank_noise()),
    "skew-symmetric + diagonal (n=16)": lambda: _single(
        (lambda e: e - e.T + np.diag(np.arange(16.0)))(_rng("skew").standard_normal((16, 16)))
    ),
    "tridiagonal (n=24)": lambda: _single(
        np.diag(_rng("tri").standard_normal(24))
        + np.diag(np.ones(23), 1)
        - 0.5 * np.diag(np.ones(23), -1)
    ),
    "diagonal (n=12)": lambda: _single(np.diag(np.arange(1.0, 13.0)), hessian=True),
}
"""The calibration set: name -> builder of its per-sample matrices."""


@functools.cache
def _case(name: str) -> Case:
    return CASES[name]()


# --------------------------------------------------------------------------------------------
# Cells
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One measured cell of the table."""

    estimator: str
    framework: str
    function: str
    budget: int
    draws: int
    coverage: float
    beyond3: float
    predicted3: float

    def row(self) -> str:
        flag = "" if self.coverage >= TARGET else " **below**"
        return (
            f"| {self.estimator} | {self.framework} | {self.function} | {self.budget} | "
            f"{self.draws} | {self.coverage:.3f}{flag} | {self.beyond3:.4f} | "
            f"{self.predicted3:.4f} |"
        )


def _beyond_three(dof: float | None) -> float:
    """``P(|T| > 3 kappa(dof))`` for Student's ``T`` with ``dof`` degrees of freedom (``None``:
    an exact result, 0), by the regularized incomplete beta function (``scipy.special``, which
    imports no array framework)."""
    if dof is None:
        return 0.0
    from scipy import special

    return float(2 * special.stdtr(dof, -3 * t_factor(float(dof))))


def score(estimates: np.ndarray, stderr: np.ndarray, exact: np.ndarray) -> tuple[float, float, int]:
    """Coverage within 2 stderr, fraction beyond 3 stderr, number of draws. Results within
    rounding of the truth (exact answers, stderr 0) count as covered."""
    tol = 1e-9 * (1.0 + np.abs(exact))
    err = np.abs(estimates - exact)
    return (
        float(np.mean(err <= 2 * stderr + tol)),
        float(np.mean(err > 3 * stderr + tol)),
        int(err.size),
    )


def _draw(rng: np.random.Generator, distribution: str, shape: tuple[int, ...]) -> np.ndarray:
    if distribution == "rademacher":
        return rng.choice(np.array([-1.0, 1.0]), size=shape)
    return rng.standard_normal(shape)


def _tiled(j: np.ndarray, reps: int) -> Callable[[np.ndarray], np.ndarray]:
    """The batched matvec of ``reps`` repetitions of the batch ``j`` ``(B, n, n)``."""
    batch, n, _ = j.shape

    def matvec(v: np.ndarray) -> np.ndarray:
        k = v.shape[-1]
        columns = np.moveaxis(v.reshape(reps, batch, n, k), 0, 2).reshape(batch, n, reps * k)
        return np.moveaxis((j @ columns).reshape(batch, n, reps, k), 2, 0).reshape(v.shape)

    return matvec


# Core estimators: name -> (budgets, degrees of freedom of the stderr at a budget and n).
CORE_BUDGETS: dict[str, list[int]] = {
    "hutchinson (rademacher)": [2, 3, 4, 6, 8, 16, 32],
    "hutchinson (gaussian)": [2, 3, 4, 6, 8, 16, 32],
    "hutch++": [6, 9, 12, 24],
    "xtrace": [6, 8, 16, 24],
    "probing": [4, 8, 16],
    "stde": [2, 3, 4, 8, 16],
    "hessian_diagonal (rademacher)": [3, 4, 8, 16],
    "hessian_diagonal (gaussian)": [3, 4, 8, 16],
    "squared_frobenius_norm (rademacher)": [2, 3, 4, 8, 16, 32],
    "squared_frobenius_norm (gaussian)": [2, 3, 4, 8, 16, 32],
    "divergence, same passes (rademacher)": [2, 3, 4, 8, 16, 32],
    "divergence, same passes (gaussian)": [2, 3, 4, 8, 16, 32],
    "slq (rademacher)": [2, 4, 8, 16, 32],
    "slq (gaussian)": [2, 4, 8, 16, 32],
}
"""Budgets per sample (matvecs, sweep directions or probes) of each core estimator, from the
least that gives a standard error (:func:`~divjac._core.estimators.check_stderr_budget`).
The Laplacian's and the weighted Laplacian's ``"hutchinson"`` with a standard error are
Hutchinson on Hessian-vector products (the ``hutchinson`` rows, on the Hessians of the set);
``stde``: random coordinates, from its terms alone (why ``laplacian(method="stde")`` refuses
``return_stderr`` below ``n``); ``hessian_diagonal``: Bekas' estimate per
coordinate, with the bound of :func:`~divjac._core.estimators.diagonal_mean_and_stderr`;
``squared_frobenius_norm`` and ``divergence, same passes``: the two estimates of
``value_divergence_and_frobenius(method="hutchinson")`` from the images of the same probes
(below ``n``: from ``n`` probes on, both are exact); ``slq``: ``log|det J|`` of
``log_abs_det(method="slq")`` at its default ``min(n, 30)`` Lanczos steps (probes at every
budget: it keeps random probes from ``n`` on)."""


def _from_terms(terms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hutchinson from its terms ``(k, draws)`` alone, as the Taylor-sweep methods compute it."""
    estimate, stderr = est.hutchinson_from_terms(terms)
    if stderr is None:
        raise InternalError("hutchinson_from_terms gave no standard error")
    return estimate, stderr


def _core_estimate(
    estimator: str, case: Case, budget: int, reps: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float | None] | None:
    """``(estimates, stderr, exact, dof)`` of ``reps`` repetitions of the batch, or ``None``
    when the estimator does not apply (the budget is refused, or the matrix is no Hessian)."""
    j = case.matrices
    batch, n, _ = j.shape
    trace = np.trace(j, axis1=1, axis2=2)
    exact = np.broadcast_to(trace, (reps, batch)).reshape(-1)
    matvec = _tiled(j, reps)
    if estimator.startswith("slq"):
        return _slq_estimate(estimator, case, budget, reps, rng)
    if estimator.startswith(("squared_frobenius_norm", "divergence, same passes")):
        if budget >= n:  # the n coordinate directions: exact
            return None
        distribution = "gaussian" if "gaussian" in estimator else "rademacher"
        probes = _draw(rng, distribution, (reps * batch, n, budget))
        images = matvec(probes)
        if estimator.startswith("squared"):
            estimate, stderr = est.squared_norm_mean_and_stderr(images, np)
            norms = np.sum(j * j, axis=(1, 2))
            return estimate, stderr, np.tile(norms, reps), float(budget - 1)
        terms = est.column_dots(probes, images)
        estimate, stderr = est.mean_and_stderr(terms, np, images, probes)
        return estimate, stderr, exact, float(budget - 1)
    if estimator.startswith("hutchinson") or estimator in ("hutch++", "xtrace"):
        method = estimator.split(" ")[0]
        distribution = "gaussian" if "gaussian" in estimator else "rademacher"
        try:
            k = est.num_random_vectors(method, budget, n)
            est.check_stderr_budget(method, budget, n, fname="calibration")
        except NumProbesError:
            return None
        probes = _draw(rng, distribution, (reps * batch, n, k))
        estimate, stderr = est.estimate_trace(method, matvec, probes)
        low_rank = {"hutchinson": k, "hutch++": 3 * (k // 2), "xtrace": 2 * k}[method]
        terms = {"hutchinson": k, "hutch++": k // 2, "xtrace": k}[method]
        dof = None if low_rank >= n else float(max(terms - 1, 1))
        return estimate, stderr, exact, dof
    if estimator == "probing":
        pattern = SparsityPattern(
            sp.csr_array(np.any(j != 0, axis=0)), case.shape, case.shape, batch
        )
        colors, is_exact, num = stochastic.probing_plan(
            pattern, case.shape, num_probes=budget, probing_distance=None
        )
        signs = _draw(rng, "rademacher", (reps * batch, n, num))
        estimate, stderr = est.probing(matvec, colors, signs, exact=is_exact)
        return estimate, stderr, exact, None if is_exact else float(max(num - 1, 1))
    if not case.hessian or (budget >= n and not estimator.startswith("stde")):
        return None
    if estimator == "stde":
        if budget >= n:
            return None
        order = np.argsort(rng.random((reps * batch, n)), axis=-1)[:, :budget]
        diagonal = np.tile(np.diagonal(j, axis1=1, axis2=2), (reps, 1))
        terms = n * np.take_along_axis(diagonal, order, axis=-1)
        estimate, stderr = _from_terms(terms.T)
        return estimate, stderr * math.sqrt(1 - budget / n), exact, float(budget - 1)
    distribution = "gaussian" if "gaussian" in estimator else "rademacher"
    probes = _draw(rng, distribution, (reps * batch, n, budget))
    estimate, stderr = est.diagonal_mean_and_stderr(probes, matvec(probes), est.namespace(probes))
    estimate, stderr = estimate.reshape(-1), stderr.reshape(-1)
    diagonal = np.broadcast_to(np.diagonal(j, axis1=1, axis2=2), (reps, batch, n)).reshape(-1)
    return estimate, stderr, diagonal, float(budget - 1)


def _slq_estimate(
    estimator: str, case: Case, budget: int, reps: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float | None]:
    """SLQ's ``log|det J|`` on ``J^T J`` at the default number of Lanczos steps, in chunks of
    the repetitions (the Lanczos basis holds ``steps`` copies of the probes: ~128 MB a chunk)."""
    j = case.matrices
    batch, n, _ = j.shape
    gram = np.swapaxes(j, 1, 2) @ j
    steps = est.default_lanczos_steps(n)
    distribution = "gaussian" if "gaussian" in estimator else "rademacher"
    per = max(1, 2**24 // (batch * n * budget * steps))
    estimates, errors = [], []
    for start in range(0, reps, per):
        count = min(per, reps - start)
        probes = _draw(rng, distribution, (count * batch, n, budget))
        estimate, stderr = est.slq_log_abs_det(_tiled(gram, count), probes, steps)
        if stderr is None:
            raise InternalError("slq_log_abs_det gave no standard error")
        estimates.append(estimate)
        errors.append(stderr)
    exact = np.tile(np.linalg.slogdet(j)[1], reps)
    return np.concatenate(estimates), np.concatenate(errors), exact, float(budget - 1)


def core_cells(
    draws: int = 2000,
    estimators: list[str] | None = None,
    cases: list[str] | None = None,
    budgets: dict[str, list[int]] | None = None,
) -> Iterator[Cell]:
    """The cells of the core table: every estimator x budget x case, ``>= draws`` each
    (``budgets``: other budgets for some estimators than :data:`CORE_BUDGETS`')."""
    chosen = {**CORE_BUDGETS, **(budgets or {})}
    for estimator in estimators or list(CORE_BUDGETS):
        for name in cases or list(CASES):
            case = _case(name)
            batch = case.matrices.shape[0]
            reps = -(-draws // batch)
            for budget in chosen[estimator]:
                rng = _rng(f"{estimator}/{name}/{budget}")
                got = _core_estimate(estimator, case, budget, reps, rng)
                if got is None:
                    continue
                estimate, stderr, exact, dof = got
                coverage, beyond, count = score(estimate, stderr, exact)
                yield Cell(
                    estimator, "core (NumPy)", name, budget, count, coverage, beyond,
                    _beyond_three(dof),
                )  # fmt: skip


# --------------------------------------------------------------------------------------------
# End to end, per framework
# --------------------------------------------------------------------------------------------


def pinn_weights(d: int, hidden: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = _rng(f"pinn{d}")
    return (
        rng.standard_normal((hidden, d)),
        0.5 * rng.standard_normal(hidden),
        rng.standard_normal(hidden) / np.sqrt(hidden),
    )


def _fields() -> dict[str, tuple[str, Any, np.ndarray]]:
    """Framework-neutral descriptions of the end-to-end functions: ``(kind, weights, x)``."""
    rng = _rng("fields")
    return {
        "x0^2 + x0 x1 (d=2)": ("quadratic", None, np.array([0.3, -0.7])),
        "PINN (d=2)": ("pinn", pinn_weights(2), rng.uniform(-1, 1, 2)),
        "PINN (d=5)": ("pinn", pinn_weights(5), rng.uniform(-1, 1, 5)),
        "rand(10, 10) x": ("linear", _rng("rand10").random((10, 10)), rng.standard_normal(10)),
        "tanh(x @ A) + 0.5 x (n=64)": (
            "tanh",
            _rng("tanh").standard_normal((64, 64)) / 4,
            rng.standard_normal(64),
        ),
    }


FRAMEWORK_CELLS: list[tuple[str, str, list[int]]] = [
    ("divergence hutchinson (rademacher)", "field", [1, 2, 4, 8, 16]),
    ("divergence hutchinson (gaussian)", "field", [1, 2, 4, 8, 16]),
    ("divergence hutch++", "field", [3, 6, 12]),
    ("divergence xtrace", "field", [4, 6, 8, 16]),
    ("divergence probing", "field", [4, 8]),
    ("laplacian hutchinson (rademacher)", "scalar", [2, 4, 16]),
    ("laplacian hutchinson (gaussian)", "scalar", [2, 4, 16]),
    ("laplacian stde", "scalar", [2, 4]),
    ("laplacian hutch++", "scalar", [3, 6]),
    ("laplacian xtrace", "scalar", [2, 4]),
    ("weighted_laplacian hutchinson", "scalar", [2, 4, 16]),
    ("hessian_diagonal hutchinson", "scalar", [3, 4, 16]),
    ("log_abs_det slq (rademacher)", "field", [2, 8, 16, 32]),
    ("log_abs_det slq (gaussian)", "field", [2, 8, 16, 32]),
]
"""End-to-end cells: (transform and method, which functions, budgets)."""


def _jax_functions() -> tuple[Any, dict[str, tuple[Callable[..., Any], np.ndarray, bool]]]:
    import jax
    import jax.numpy as jnp

    from ... import jax as dj

    out: dict[str, tuple[Callable[..., Any], np.ndarray, bool]] = {}
    for name, (kind, w, x) in _fields().items():
        if kind == "quadratic":
            out[name] = (lambda x: x[:, 0] ** 2 + x[:, 0] * x[:, 1], x, True)
        elif kind == "pinn":
            w1, b1, w2 = (jnp.asarray(a) for a in w)
            out[name] = (lambda x, w1=w1, b1=b1, w2=w2: jnp.tanh(x @ w1.T + b1) @ w2, x, True)
        elif kind == "linear":
            m = jnp.asarray(w)
            out[name] = (lambda x, m=m: x @ m.T, x, False)
        else:
            a = jnp.asarray(w)
            out[name] = (lambda x, a=a: jnp.tanh(x @ a) + 0.5 * x, x, False)
    return (dj, jax, jnp), out


def _torch_functions() -> tuple[Any, dict[str, tuple[Callable[..., Any], np.ndarray, bool]]]:
    import torch

    from ... import torch as dt

    out: dict[str, tuple[Callable[..., Any], np.ndarray, bool]] = {}
    for name, (kind, w, x) in _fields().items():
        if kind == "quadratic":
            out[name] = (lambda x: x[:, 0] ** 2 + x[:, 0] * x[:, 1], x, True)
        elif kind == "pinn":
            w1, b1, w2 = (torch.as_tensor(a) for a in w)
            out[name] = (lambda x, w1=w1, b1=b1, w2=w2: torch.tanh(x @ w1.T + b1) @ w2, x, True)
        elif kind == "linear":
            m = torch.as_tensor(w)
            out[name] = (lambda x, m=m: x @ m.T, x, False)
        else:
            a = torch.as_tensor(w)
            out[name] = (lambda x, a=a: torch.tanh(x @ a) + 0.5 * x, x, False)
    return (dt, torch), out


def _transform(
    lib: Any, what: str, fn: Callable[..., Any], budget: int, n: int
) -> Callable[..., Any]:
    transform, method = what.split(" ")[:2]
    distribution = "gaussian" if "gaussian" in what else "rademacher"
    options = dict(method=method, num_probes=budget, distribution=distribution, return_stderr=True)
    if transform == "weighted_laplacian":
        a = _rng("weight").standard_normal((n, n))
        return getattr(lib, transform)(fn, lib_array(lib, a @ a.T / n), **options)
    return getattr(lib, transform)(fn, **options)


def lib_array(lib: Any, a: np.ndarray) -> Any:
    """``a`` as an array of the framework of the divjac module ``lib``."""
    if lib.__name__.endswith("jax"):
        import jax.numpy as jnp

        return jnp.asarray(a)
    import torch

    return torch.as_tensor(a)


def _truth(what: str, case: Case, n: int) -> np.ndarray:
    h = case.matrices[0]
    if what.startswith("weighted_laplacian"):
        a = _rng("weight").standard_normal((n, n))
        return np.array(np.trace(a @ a.T / n @ h))
    if what.startswith("hessian_diagonal"):
        return np.diagonal(h)
    if what.startswith("log_abs_det"):
        return np.array(np.linalg.slogdet(h)[1])
    return np.array(np.trace(h))


def framework_cells(
    framework: str, draws: int = 2000, only: list[str] | None = None
) -> Iterator[Cell]:
    """End-to-end cells of ``"jax"`` or ``"torch"``: ``draws`` samples of one batch, each with
    its own probes, every transform x method x budget x function (``only``: these transforms
    and methods, as named in :data:`FRAMEWORK_CELLS`)."""
    if framework == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)  # before the weights become arrays
        (lib, _, _), functions = _jax_functions()
        randomness: Any = jax.random.key(0)
    else:
        (lib, torch), functions = _torch_functions()
        randomness = torch.Generator().manual_seed(0)
    for what, kind, budgets in FRAMEWORK_CELLS:
        if only is not None and what not in only:
            continue
        for name, (fn, x, scalar) in functions.items():
            if scalar != (kind == "scalar"):
                continue
            n = x.size
            case = _field_case(name, x)
            truth = _truth(what, case, n)
            xb = lib_array(lib, np.tile(x, (draws, 1)))
            for budget in budgets:
                try:
                    estimate, stderr = _transform(lib, what, fn, budget, n)(randomness, xb)
                except NumProbesError:  # a budget the method refuses at this n
                    continue
                estimate, stderr = np.asarray(estimate), np.asarray(stderr)
                coverage, beyond, count = score(
                    estimate, stderr, np.broadcast_to(truth, estimate.shape)
                )
                yield Cell(what, framework, name, budget, count, coverage, beyond, float("nan"))


def _field_case(name: str, x: np.ndarray) -> Case:
    """The exact Jacobian / Hessian of the end-to-end function ``name`` at ``x``."""
    kind, w, _ = _fields()[name]
    n = x.size
    if kind == "quadratic":
        return _single(np.array([[2.0, 1.0], [1.0, 0.0]]), hessian=True)
    if kind == "pinn":
        w1, b1, w2 = w
        z = np.tanh(w1 @ x + b1)
        return _single((w1.T * (w2 * (-2 * z * (1 - z * z)))) @ w1, hessian=True)
    if kind == "linear":
        return _single(w)
    slope = 1 - np.tanh(x @ w) ** 2
    return _single(slope[:, None] * w.T + 0.5 * np.eye(n))


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def markdown(cells: list[Cell]) -> str:
    """The table, one row per cell, then the minimum coverage per estimator and framework."""
    head = (
        "| estimator | framework | function | budget | draws | within 2 stderr | beyond 3 | "
        "predicted beyond 3 |\n|---|---|---|---|---|---|---|---|"
    )
    lowest: dict[tuple[str, str], Cell] = {}
    for cell in cells:
        key = (cell.estimator, cell.framework)
        if key not in lowest or cell.coverage < lowest[key].coverage:
            lowest[key] = cell
    summary = ["| estimator | framework | min coverage | at |", "|---|---|---|---|"]
    summary += [
        f"| {e} | {f} | {c.coverage:.3f} | {c.function}, budget {c.budget} |"
        for (e, f), c in lowest.items()
    ]
    return "\n".join([head, *(c.row() for c in cells), "", *summary])


def summary_rows(cells: list[Cell]) -> list[Result]:
    lowest: dict[tuple[str, str], Cell] = {}
    for cell in cells:
        key = (cell.estimator, cell.framework)
        if key not in lowest or cell.coverage < lowest[key].coverage:
            lowest[key] = cell
    return [
        Result(
            "P15", f"{e} ({f}), worst of {sum(1 for c in cells if (c.estimator, c.framework) == (e, f))} cells: "
            f"{c.function}, budget {c.budget}", e, "truth within 2 stderr (fraction)",
            1.0, c.coverage, unit="coverage", kind="gain", target=TARGET,
            extra={"beyond3": c.beyond3, "predicted_beyond3": c.predicted3, "draws": c.draws},
        )
        for (e, f), c in lowest.items()
    ]  # fmt: skip


QUICK_BUDGETS = {"slq (rademacher)": [2], "slq (gaussian)": [2]}
"""``--quick``: SLQ's cells at 2 probes only (the 2000 draws of 8 probes take 70-80 s per
distribution on 2 loaded cores, most of it in the batched ``eigh`` of 30 Lanczos steps; the
slow tests cover 2, 8 and 16 probes, the full bench 32)."""


def run(quick: bool) -> list[Result]:
    draws = 2000
    cells = list(core_cells(draws, budgets=QUICK_BUDGETS if quick else None))
    for framework in ("jax", "torch"):
        try:
            cells += list(framework_cells(framework, draws))
        except ImportError:
            continue
    return summary_rows(cells)


if __name__ == "__main__":  # pragma: no cover
    frameworks = [a for a in sys.argv[1:] if a in ("jax", "torch")]
    found = list(core_cells()) if "--no-core" not in sys.argv else []
    for fw in frameworks:
        found += list(framework_cells(fw))
    print(markdown(found))
