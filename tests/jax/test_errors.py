"""The errors of divjac.jax that only JAX has (the rest: tests/test_errors.py, on both backends)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import divjac
from divjac.jax import divergence
from tests.reference import jax_diagonal_blocks, traces


def test_an_integer_array_is_no_key():
    x = jnp.ones((4, 3))
    with pytest.raises(divjac.MissingKeyError, match="got ArrayImpl of dtype int32"):
        divergence(lambda x: x, method="hutchinson")(jnp.arange(3, dtype=jnp.int32), x)
    # uint32 pairs (a legacy PRNGKey's layout) differentiated: an integer input, not a key
    with pytest.raises(divjac.InputDtypeError, match="dtype uint32"):
        divergence(lambda x: x)(jnp.ones((4, 2), jnp.uint32))


def center(x):
    return x - jnp.mean(x, axis=0)


def test_coupling_is_decided_under_jit_too():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)))
    with pytest.raises(divjac.BatchCouplingError, match="coupling='exact'"):
        jax.jit(divergence(center))(x)  # decided from the traced program


class TrainBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.BatchNorm(use_running_average=False)(nn.Dense(3)(x)))


class EvalBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.BatchNorm(use_running_average=True)(nn.Dense(3)(x)))


def test_batchnorm_train_mode_is_detected_and_eval_mode_is_fine():
    x = jax.random.normal(jax.random.key(1), (6, 3))
    train = TrainBN()
    variables = train.init(jax.random.key(2), x)

    def apply_train(x):
        return train.apply(variables, x, mutable=["batch_stats"])

    with pytest.raises(divjac.BatchCouplingError):
        divergence(apply_train, has_aux=True)(x)
    evaluation = EvalBN()
    ev = evaluation.init(jax.random.key(2), x)
    div = divergence(lambda x: evaluation.apply(ev, x))(x)
    expected = traces(jax_diagonal_blocks(lambda x: evaluation.apply(ev, x), (x,)), (3,))
    np.testing.assert_allclose(div, expected, rtol=1e-10)


@pytest.mark.parametrize("method", ["exact", "sparse", "auto"])
def test_coupling_exact_gives_true_diagonal_blocks_of_batchnorm_in_training(method):
    x = jax.random.normal(jax.random.key(3), (5, 3))
    train = TrainBN()
    variables = train.init(jax.random.key(2), x)
    f = lambda x: train.apply(variables, x, mutable=["batch_stats"])[0]  # noqa: E731
    expected = traces(jax_diagonal_blocks(f, (x,)), (3,))
    np.testing.assert_allclose(
        divergence(f, coupling="exact", method=method)(x), expected, rtol=1e-10
    )
