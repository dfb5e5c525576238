"""Every divjac.jax error is raised with a message that names the problem and the fix."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import divjac
from divjac.jax import divergence, jacobian, laplacian, sparse_jacobian, value_and_divergence
from tests.reference import jax_diagonal_blocks, traces

X = jnp.ones((4, 3))


def test_divergence_of_nonsquare_jacobian_names_both_shapes():
    f = lambda x: jnp.concatenate([x, x], axis=1)  # noqa: E731
    with pytest.raises(divjac.NonSquareJacobianError, match=r"\(6,\).*\(3,\)"):
        divergence(f)(X)
    same_size = lambda x: x.reshape(4, 3, 1) * 2.0  # noqa: E731
    with pytest.raises(divjac.NonSquareJacobianError, match="reshape the output"):
        divergence(same_size)(X)
    assert issubclass(divjac.NonSquareJacobianError, ValueError)


def test_output_batch_size_must_match():
    with pytest.raises(divjac.BatchSizeMismatchError, match=r"batch size 2 .* batch size 4"):
        jacobian(lambda x: x[:2])(X)


def test_integer_input_is_refused_with_a_cast_hint():
    with pytest.raises(divjac.InputDtypeError, match=r"int32.*astype\(jnp.float32\)"):
        divergence(lambda x: x * 2)(jnp.ones((4, 3), jnp.int32))
    assert issubclass(divjac.InputDtypeError, TypeError)


def test_integer_output_is_refused():
    with pytest.raises(divjac.OutputError, match="floating output"):
        jacobian(lambda x: (x > 0).astype(jnp.int32))(X)


def test_argnums_out_of_range():
    with pytest.raises(divjac.ArgnumsError, match=r"argnums=2 is out of range .* 2 positional"):
        jacobian(lambda x, y: x * y, 2)(X, X)
    with pytest.raises(divjac.ArgnumsError, match="must be an int"):
        divergence(lambda x: x, argnums="x")(X)


def test_argnums_must_select_an_array():
    with pytest.raises(divjac.ArgnumsError, match="selects an argument of type dict"):
        jacobian(lambda p, x: p["w"] * x, 0)({"w": 1.0}, X)


def test_batch_axis_out_of_range():
    with pytest.raises(divjac.BatchAxisError, match=r"batch_axis=2 .* shape \(4, 3\)"):
        jacobian(lambda x: x, batch_axis=2)(X)
    with pytest.raises(divjac.BatchAxisError, match="batch_axis=None for a single-sample"):
        divergence(lambda x: x)(jnp.ones(()))
    with pytest.raises(divjac.BatchAxisError, match="function's output"):
        jacobian(lambda x: x.sum(), batch_axis=0)(X)


def test_output_must_be_one_array():
    with pytest.raises(divjac.OutputError, match="single array; got tuple"):
        jacobian(lambda x: (x, x))(X)
    with pytest.raises(divjac.OutputError, match="has_aux=True needs"):
        jacobian(lambda x: x, has_aux=True)(X)


def test_laplacian_needs_a_scalar_per_sample():
    with pytest.raises(divjac.OutputError, match="one scalar per sample"):
        laplacian(lambda x: x**2)(X)


def test_bad_options():
    with pytest.raises(ValueError, match="mode must be one of"):
        jacobian(lambda x: x, mode="forward")
    with pytest.raises(ValueError, match="method must be one of"):
        divergence(lambda x: x, method="hutch")
    with pytest.raises(ValueError, match="coupling must be one of"):
        divergence(lambda x: x, coupling="ignore")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        divergence(lambda x: x, chunk_size=0)(X)


def test_stochastic_method_without_key():
    with pytest.raises(divjac.MissingKeyError, match=r"fn\(jax.random.key\(0\), \*args"):
        divergence(lambda x: x, method="hutchinson")(X)
    with pytest.raises(divjac.MissingKeyError, match="got int"):
        divergence(lambda x: x, method="hutchinson")(0, X)
    with pytest.raises(divjac.MissingKeyError, match="got ArrayImpl of dtype int32"):
        divergence(lambda x: x, method="hutchinson")(jnp.arange(3, dtype=jnp.int32), X)


def test_num_probes_errors():
    with pytest.raises(divjac.NumProbesError, match="multiple of 3"):
        divergence(lambda x: x, method="hutch++", num_probes=4)(jax.random.key(0), X)
    with pytest.raises(divjac.NumProbesError, match="even"):
        divergence(lambda x: x, method="xtrace", num_probes=3)(jax.random.key(0), X)
    with pytest.raises(divjac.NumProbesError, match="method='exact' costs n=3"):
        divergence(lambda x: x, method="xtrace", num_probes=8)(jax.random.key(0), X)
    with pytest.raises(divjac.NumProbesError, match="needs 4 random vectors"):
        divergence(lambda x: x, method="hutchinson", num_probes=4)(jnp.ones((2, 4, 3)), X)


# --- batch coupling -------------------------------------------------------------------------


def center(x):
    return x - jnp.mean(x, axis=0)


class TrainBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.BatchNorm(use_running_average=False)(nn.Dense(3)(x)))


class EvalBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.BatchNorm(use_running_average=True)(nn.Dense(3)(x)))


def test_coupled_functions_raise_everywhere():
    x = jax.random.normal(jax.random.key(0), (5, 3))
    transforms = [
        jacobian(center),
        divergence(center),
        value_and_divergence(center),
        sparse_jacobian(center),
        divergence(center, method="hutchinson"),
    ]
    for fn in transforms:
        with pytest.raises(divjac.BatchCouplingError, match="output sample 0 depends on input"):
            fn(jax.random.key(0), x) if fn is transforms[-1] else fn(x)
    with pytest.raises(divjac.BatchCouplingError, match="coupling='exact'"):
        jax.jit(divergence(center))(x)  # decided from the traced program, under jit too


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
def test_coupling_exact_gives_true_diagonal_blocks(method):
    x = jax.random.normal(jax.random.key(3), (5, 3))
    blocks = jax_diagonal_blocks(center, (x,))
    np.testing.assert_allclose(jacobian(center, coupling="exact")(x), blocks, rtol=1e-12)
    np.testing.assert_allclose(
        jacobian(center, coupling="exact", mode="rev")(x), blocks, rtol=1e-12
    )
    got = divergence(center, coupling="exact", method=method)(x)
    np.testing.assert_allclose(got, traces(blocks, (3,)), rtol=1e-12)

    train = TrainBN()
    variables = train.init(jax.random.key(2), x)
    f = lambda x: train.apply(variables, x, mutable=["batch_stats"])[0]  # noqa: E731
    expected = traces(jax_diagonal_blocks(f, (x,)), (3,))
    np.testing.assert_allclose(
        divergence(f, coupling="exact", method=method)(x), expected, rtol=1e-10
    )
