"""A detected pattern saved and loaded (pickle) computes what the detected one computes, with
its colors (no detection, no coloring after loading)."""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.signal import convolve2d

from divjac.jax import divergence_from_pattern, jacobian_from_pattern, sparsity


def _blur(x: jax.Array) -> jax.Array:
    return jax.vmap(lambda image: convolve2d(image, jnp.ones((3, 3)), mode="same"))(x)


def test_a_pickled_pattern_gives_the_same_results(tmp_path) -> None:
    x = jax.random.normal(jax.random.key(0), (3, 12, 10))
    pattern = sparsity(_blur)(x)
    colors = pattern.colors, pattern.diagonal_colors
    path = tmp_path / "blur.pattern"
    path.write_bytes(pickle.dumps(pattern))
    loaded = pickle.loads(path.read_bytes())
    assert loaded.in_shape == (12, 10) and loaded.n_colors == 9
    assert "colors" in vars(loaded)  # the colors travel with it: none is computed again
    np.testing.assert_array_equal(loaded.colors, colors[0])
    np.testing.assert_array_equal(loaded.diagonal_colors, colors[1])
    np.testing.assert_allclose(
        jacobian_from_pattern(_blur, loaded)(x),
        jax.vmap(jax.jacfwd(lambda v: _blur(v[None])[0]))(x),
    )
    np.testing.assert_allclose(divergence_from_pattern(_blur, loaded)(x), np.full(3, 120.0))
