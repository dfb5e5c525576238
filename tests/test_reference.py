"""The brute-force references of mixed partials agree with derivatives worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from .reference import jax_operator, jax_partials, torch_operator, torch_partials

X = np.array([[0.3, -0.7, 1.1], [1.2, 0.4, -0.5]])
ALPHAS = [(0,), (0, 1), (0, 0, 1), (0, 0, 1, 2), (2, 2, 2, 2)]


def _by_hand(x: np.ndarray) -> list[np.ndarray]:
    """``u = x0^3 x1 x2 + x2^4``: its partials ``ALPHAS``."""
    x0, x1, x2 = x.T
    return [3 * x0**2 * x1 * x2, 3 * x0**2 * x2, 6 * x0 * x2, 6 * x0, np.full_like(x0, 24.0)]


def _terms(coefficient_of: object) -> list[tuple[object, tuple[int, ...]]]:
    # a number, a per-sample array, a function of the per-sample input
    return [(2.0, (0, 0, 1)), (np.array([1.0, -3.0]), (2, 2, 2, 2)), (coefficient_of, (0,))]


def _want_operator(x: np.ndarray) -> np.ndarray:
    hand = _by_hand(x)
    return 2.0 * hand[2] + np.array([1.0, -3.0]) * hand[4] + x[:, 1] * hand[0]


def test_jax_partials_and_operator_are_the_hand_derived_ones() -> None:
    pytest.importorskip("jax")
    import jax.numpy as jnp

    def u(x):
        return x[:, 0] ** 3 * x[:, 1] * x[:, 2] + x[:, 2] ** 4

    x = jnp.asarray(X)
    for got, want in zip(jax_partials(u, (x,), ALPHAS), _by_hand(X), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    got = jax_operator(u, (x,), _terms(lambda xb: xb[1]))
    np.testing.assert_allclose(got, _want_operator(X), rtol=1e-12)
    # the batch on axis 1, a vector output per sample
    two = jax_partials(lambda z: jnp.stack([u(z.T), 2 * u(z.T)], 1).T, (x.T,), [(0, 1)], 0, 1)
    np.testing.assert_allclose(two[0], np.stack([_by_hand(X)[1], 2 * _by_hand(X)[1]], 1))


def test_torch_partials_and_operator_are_the_hand_derived_ones() -> None:
    torch = pytest.importorskip("torch")

    def u(x):
        return x[:, 0] ** 3 * x[:, 1] * x[:, 2] + x[:, 2] ** 4

    x = torch.as_tensor(X)
    for got, want in zip(torch_partials(u, (x,), ALPHAS), _by_hand(X), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    got = torch_operator(u, (x,), _terms(lambda xb: xb[1]))
    np.testing.assert_allclose(got, _want_operator(X), rtol=1e-12)


@pytest.mark.parametrize("norm", ["layer", "instance"])
def test_torch_partials_of_normalizations_are_jax_ones(norm: str) -> None:
    """Orders 2-4 through ``F.layer_norm`` and ``F.instance_norm``, whose torch kernels have
    wrong higher derivatives (the reference composes them): equal to JAX's, where a
    normalization is written out as means and variances."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax")
    import jax.numpy as jnp
    import torch.nn.functional as F

    x = np.random.default_rng(0).normal(size=(2, 2, 3))
    w, b = np.array([0.7, -1.3, 0.4]), np.array([0.2, 0.1, -0.5])
    alphas = [(0, 4), (0, 1, 4), (0, 0, 3, 5), (2, 2, 2, 2)]

    def jax_u(z):
        dims = (2,) if norm == "layer" else (1,)  # instance: over positions, per channel
        y = (z - z.mean(dims, keepdims=True)) / jnp.sqrt(z.var(dims, keepdims=True) + 1e-5)
        return jnp.sin(y * w + b).sum((1, 2))

    def torch_u(z):
        tw, tb = torch.as_tensor(w), torch.as_tensor(b)
        if norm == "layer":
            y = F.layer_norm(z, (3,), tw, tb)
        else:
            y = F.instance_norm(z.transpose(1, 2), weight=tw, bias=tb).transpose(1, 2)
        return torch.sin(y).sum((1, 2))

    want = jax_partials(jax_u, (jnp.asarray(x),), alphas)
    got = torch_partials(torch_u, (torch.as_tensor(x),), alphas)
    for g, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w_, rtol=1e-9, atol=1e-9)
