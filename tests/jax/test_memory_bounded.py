"""Training through chunked passes within a memory budget (JAX): differentiated, every chunk of
passes and of second-order directions is rematerialized (``jax.checkpoint``), so XLA's
temporaries follow the chunk size; the gradients are those of the unchunked call, to 1e-12 in
float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import divjac.jax as dj


def _cnn(params, x):
    h = x
    for i, w in enumerate(params):
        h = jax.lax.conv_general_dilated(
            h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return h


def _params(channels=(2, 4, 2), dtype=jnp.float64):
    keys = jax.random.split(jax.random.key(0), len(channels) - 1)
    return [
        0.3 * jax.random.normal(k, (3, 3, a, b), dtype)
        for k, a, b in zip(keys, channels, channels[1:], strict=False)
    ]


def _loss(transform):
    def loss(params, x):
        value = transform(lambda x: _cnn(params, x))(x)
        return jnp.sum(value**2 + value)

    return loss


@pytest.mark.slow
@pytest.mark.parametrize("method", ["exact", "sparse"])
@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_chunked_training_gradients_equal_unchunked(method, mode):
    params = _params()
    x = jax.random.normal(jax.random.key(1), (3, 5, 5, 2), jnp.float64)

    def grads_at(chunk):
        transform = lambda f: dj.divergence(f, method=method, mode=mode, chunk_size=chunk)  # noqa: E731
        return jax.grad(_loss(transform), (0, 1))(params, x)

    grads = [grads_at(None), grads_at(4)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_second_order_sweep_chunked_training():
    w = jax.random.normal(jax.random.key(2), (6, 8), jnp.float64)

    def loss(v, x, chunk):
        lap = dj.laplacian(lambda x: jnp.tanh(x @ w) ** 2 @ v, chunk_size=chunk)(x)
        return jnp.sum(lap**2)

    v = jax.random.normal(jax.random.key(3), (8,), jnp.float64)
    x = jax.random.normal(jax.random.key(4), (3, 6), jnp.float64)
    whole = jax.grad(loss, (0, 1))(v, x, None)
    chunked = jax.grad(loss, (0, 1))(v, x, 2)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_temporaries_follow_the_chunk_size():
    """XLA's temporaries of the differentiated sparse divergence of a CNN fall with the chunk
    (without rematerialization they stayed within 30 % of the unchunked program's)."""
    params = _params((3, 16, 16, 3), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (4, 16, 16, 3), jnp.float32)

    def temporaries(chunk):
        loss = _loss(lambda f: dj.divergence(f, method="sparse", chunk_size=chunk))
        compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole, small = temporaries(10**6), temporaries(4)
    assert small < 0.4 * whole, (small, whole)
