"""Eager calls run as one cached compiled program (divjac.jax._eager), never a stale one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from divjac._core import plan
from divjac.jax import _eager, clear_caches, divergence, sparse_jacobian
from divjac.models import jax as models
from tests.reference import jax_diagonal_blocks, traces


def _expected(params, x):
    return traces(jax_diagonal_blocks(models.mlp, (params, x), 1), (3,))


def test_eager_calls_reuse_one_program_and_read_the_current_weights(monkeypatch):
    compiled = []
    program = _eager._program

    def counting(*args, **kwargs):
        compiled.append(1)
        return program(*args, **kwargs)

    monkeypatch.setattr(_eager, "_program", counting)
    clear_caches()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)))
    params = models.init_mlp(jax.random.key(0), (3, 8, 3), dtype=jnp.float64)
    div = divergence(lambda x: models.mlp(params, x), method="sparse")
    for step in range(3):  # the closure reads `params`, rebound at every step
        params = jax.tree_util.tree_map(lambda a, s=step: a * (1.0 + 0.5 * s), params)
        np.testing.assert_allclose(div(x), _expected(params, x), rtol=1e-10)
        fresh = divergence(lambda x, p=params: models.mlp(p, x), method="sparse")
        np.testing.assert_allclose(fresh(x), _expected(params, x), rtol=1e-10)
    assert len(compiled) == 1  # one program: new closures and new weights are its arguments
    key = jax.random.key(1)
    hutch = divergence(lambda x: models.mlp(params, x), method="hutchinson", num_probes=2)
    np.testing.assert_allclose(hutch(key, x), jax.jit(hutch)(key, x), rtol=1e-12)
    np.testing.assert_allclose(
        sparse_jacobian(lambda x: models.mlp(params, x))(x).todense(),
        jax_diagonal_blocks(models.mlp, (params, x), 1).reshape(4, 3, 3),
        rtol=1e-10,
    )
    assert len(compiled) == 3
    clear_caches()
    assert not _eager.CACHE._items


def test_a_changed_index_array_is_a_new_program():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4)))
    order = np.array([1, 0, 3, 2])
    div = divergence(lambda x: jnp.sin(x[:, order]), method="sparse")
    first = div(x)
    order[:] = [0, 1, 2, 3]  # changed in place: the traced constant differs
    np.testing.assert_allclose(div(x), jnp.sum(jnp.cos(x), axis=1), rtol=1e-12)
    assert not np.allclose(first, div(x))


@pytest.mark.parametrize(("available", "budget"), [(None, 1024 << 20), (8 << 30, 4 << 30)])
def test_the_budget_is_half_the_free_device_memory(monkeypatch, available, budget):
    monkeypatch.delenv("DIVJAC_MEMORY_BUDGET_MB", raising=False)
    assert plan.memory_budget(available) == budget
    assert plan.choose_chunk_size(10**6, 1 << 20, None, available=available) == budget >> 20
    monkeypatch.setenv("DIVJAC_MEMORY_BUDGET_MB", "16")
    assert plan.memory_budget(available) == 16 << 20  # the setting wins
