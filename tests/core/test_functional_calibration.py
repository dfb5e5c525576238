"""Coverage of the functionals' error bars on a calibration set of Jacobians (near-identity,
rank one plus identity, random dense, ill-conditioned; Rademacher and Gaussian probes), 2000
draws per cell, vectorized over the draws: the estimators of ``squared_frobenius_norm``,
``value_divergence_and_frobenius`` and ``log_abs_det(method="slq")`` (docs/calibration.md)."""

from __future__ import annotations

import numpy as np
import pytest

from divjac._core import estimators as est

DRAWS = 2000


def _jacobians(n):
    rng = np.random.default_rng(n)
    E = rng.standard_normal((n, n)) / np.sqrt(n)
    u = rng.standard_normal(n)
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    R, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return {
        "near-identity": np.eye(n) + 0.1 * E,
        "rank-1 + I": np.eye(n) + 2 * np.outer(u, u) / n,
        "dense": E,
        "ill-conditioned": Q @ np.diag(np.logspace(-2, 0, n)) @ R.T,
    }


def _probes(distribution, n, k, seed):
    rng = np.random.default_rng(seed)
    if distribution == "rademacher":
        return rng.choice([-1.0, 1.0], size=(DRAWS, n, k))
    return rng.standard_normal((DRAWS, n, k))


def _coverage(estimate, stderr, exact):
    assert np.all(np.isfinite(stderr)) and np.all(stderr > 0)
    return float(np.mean(np.abs(estimate - exact) <= 2 * stderr))


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
@pytest.mark.parametrize("k", [2, 3, 4, 8, 16])
def test_squared_frobenius_norm_and_divergence_cover(distribution, k):
    """``||J||_F^2`` and the divergence of the same passes >= 0.94 in every cell (measured
    0.966-1.000 and 0.963-1.000; the divergence 0.954 at worst over 24000 draws per cell at
    2-23 probes, rank one plus identity at 23 Rademacher probes)."""
    n = 24
    for i, (name, J) in enumerate(_jacobians(n).items()):
        V = _probes(distribution, n, k, seed=100 * k + i)
        images = J @ V
        norm, norm_se = est.squared_norm_mean_and_stderr(images, est.namespace(images))
        div, div_se = est.mean_and_stderr(est.column_dots(V, images), est.namespace(V), images, V)
        assert _coverage(norm, norm_se, (J**2).sum()) >= 0.94, name
        assert _coverage(div, div_se, np.trace(J)) >= 0.94, name


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_slq_covers(distribution):
    """SLQ (exact quadrature: ``n`` steps) at 2, 4 and 8 probes: >= 0.94 (measured 0.954-1.000;
    the least on rank one plus identity, where ``log(J^T J)`` is rank one: the skew widening of
    one-signed terms holds there; it covered 0.917-0.933 before)."""
    n = 8
    for i, (name, J) in enumerate(_jacobians(n).items()):
        A = J.T @ J
        exact = np.linalg.slogdet(J)[1]
        for k in (2, 4, 8):
            V = _probes(distribution, n, k, seed=10 * k + i)
            estimate, stderr = est.slq_log_abs_det(lambda W, A=A: A @ W, V, n)
            assert _coverage(estimate, stderr, exact) >= 0.94, (name, k)
