"""Empty samples ``(B, 0)``: a ``(B, 0, 0)`` Jacobian and zero divergences and Laplacians, in
both backends, whatever the mode or method (no pass to run)."""

from __future__ import annotations

import numpy as np
import pytest

B = 3
MODES = ["auto", "fwd", "rev", "sparse"]
METHODS = ["auto", "exact", "sparse"]


def _jax():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import divjac.jax as dj

    key = jax.random.key(0)
    return dj, jnp.ones((B, 0)), jnp.sin, lambda x: jnp.sin(x).sum(-1), key


def _torch():
    torch = pytest.importorskip("torch")

    import divjac.torch as dt

    x = torch.ones((B, 0), dtype=torch.float64)
    return dt, x, torch.sin, lambda x: torch.sin(x).sum(-1), None


BACKENDS = {"jax": _jax, "torch": _torch}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_jacobian_of_empty_samples(backend, mode):
    lib, x, f, _, _ = BACKENDS[backend]()
    assert tuple(lib.jacobian(f, mode=mode)(x).shape) == (B, 0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", [*METHODS, "hutchinson"])
def test_divergence_of_empty_samples_is_zero(backend, method):
    lib, x, f, _, key = BACKENDS[backend]()
    args = (key, x) if method == "hutchinson" else (x,)
    div = lib.divergence(f, method=method)(*args)
    np.testing.assert_array_equal(np.asarray(div), np.zeros(B))
    value, div = lib.value_and_divergence(f)(x)
    assert tuple(value.shape) == (B, 0)
    np.testing.assert_array_equal(np.asarray(div), np.zeros(B))
    assert tuple(lib.grad_divergence(f)(x).shape) == (B, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_laplacian_of_empty_samples_is_zero(backend, method):
    lib, x, _, u, _ = BACKENDS[backend]()
    np.testing.assert_array_equal(np.asarray(lib.laplacian(u, method=method)(x)), np.zeros(B))
    assert tuple(lib.hessian_diagonal(u)(x).shape) == (B, 0)
    assert tuple(lib.hessian(u)(x).shape) == (B, 0, 0)


def test_divergence_of_empty_samples_under_jit():
    jax = pytest.importorskip("jax")
    dj, x, f, _, _ = _jax()
    np.testing.assert_array_equal(np.asarray(jax.jit(dj.divergence(f))(x)), np.zeros(B))
