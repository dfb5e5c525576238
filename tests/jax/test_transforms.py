"""divjac.jax transforms against brute-force float64 references (loops over samples)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import divjac
from divjac.jax import (
    divergence,
    divergence_from_pattern,
    grad_divergence,
    jacobian,
    jacobian_from_pattern,
    laplacian,
    sparse_jacobian,
    sparsity,
    value_and_divergence,
)
from divjac.models import jax as models
from tests.reference import jax_diagonal_blocks, traces

KEY = jax.random.key(0)


class Net(nn.Module):
    """The Flax ``net(x, t)`` of the user story: hstack(x, t) -> 100 tanh -> 100 tanh -> d."""

    d: int

    @nn.compact
    def __call__(self, x, t):
        h = jnp.hstack([x, t])
        h = nn.tanh(nn.Dense(100)(h))
        h = nn.tanh(nn.Dense(100)(h))
        return nn.Dense(self.d)(h)


def _mlp_case(dtype=jnp.float64):
    params = models.init_mlp(KEY, (5, 16, 16, 5), dtype)
    x = jax.random.normal(jax.random.key(1), (4, 5), dtype)
    return models.mlp, (params, x), 1


def _cnn_case(dtype=jnp.float64):
    params = models.init_cnn(KEY, channels=4, layers=2, dtype=dtype)
    x = jax.random.normal(jax.random.key(2), (3, 5, 4, 3), dtype)
    return models.cnn, (params, x), 1


def _elementwise_case(dtype=jnp.float64):
    x = jax.random.normal(jax.random.key(3), (6, 2, 3), dtype)
    return (lambda x: jnp.sin(x) * x**2), (x,), 0


def _flax_case(dtype=jnp.float64):
    net = Net(d=3)
    x = jax.random.normal(jax.random.key(4), (5, 3), dtype)
    t = jax.random.uniform(jax.random.key(5), (5, 1), dtype)
    params = net.init(KEY, x, t)
    return net.apply, (params, x, t), 1


def _nonsquare_case(dtype=jnp.float64):
    params = models.init_mlp(KEY, (4, 8, 7), dtype)
    x = jax.random.normal(jax.random.key(6), (5, 4), dtype)
    return models.mlp, (params, x), 1


CASES = {
    "mlp": _mlp_case,
    "cnn": _cnn_case,
    "elementwise": _elementwise_case,
    "flax_xt": _flax_case,
    "nonsquare": _nonsquare_case,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["auto", "fwd", "rev", "sparse"])
def test_jacobian_matches_loop_over_samples(case, mode):
    f, args, argnum = CASES[case]()
    expected = jax_diagonal_blocks(f, args, argnum)
    got = jacobian(f, argnum, mode=mode)(*args)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["mlp", "cnn", "elementwise", "flax_xt"])
@pytest.mark.parametrize("method", ["auto", "exact", "sparse"])
@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_divergence_matches_trace(case, method, chunk_size):
    f, args, argnum = CASES[case]()
    blocks = jax_diagonal_blocks(f, args, argnum)
    expected = traces(blocks, args[argnum].shape[1:])
    got = divergence(f, argnum, method=method, chunk_size=chunk_size)(*args)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_dtypes_follow_the_input(dtype):
    f, args, argnum = _mlp_case(dtype)
    jac = jacobian(f, argnum)(*args)
    div = divergence(f, argnum)(*args)
    assert jac.dtype == dtype and div.dtype == dtype
    expected = jax_diagonal_blocks(f, args, argnum)
    tol = 1e-5 if dtype == jnp.float32 else 1e-12
    np.testing.assert_allclose(jac, expected, rtol=tol, atol=tol)


def test_value_and_divergence_shares_the_forward_value():
    f, args, argnum = _cnn_case()
    value, div = value_and_divergence(f, argnum)(*args)
    np.testing.assert_allclose(value, f(*args), rtol=1e-12)
    np.testing.assert_allclose(div, divergence(f, argnum)(*args), rtol=1e-12)


def test_flax_time_derivative_and_space_jacobian():
    f, (params, x, t), _ = _flax_case()
    d_dt = jacobian(f, 2)(params, x, t)
    assert d_dt.shape == (5, 3, 1)
    expected_dt = jax_diagonal_blocks(f, (params, x, t), 2)
    np.testing.assert_allclose(d_dt, expected_dt, rtol=1e-10, atol=1e-12)
    # d out / dt as (b, d): drop the trailing singleton input axis.
    np.testing.assert_allclose(
        d_dt[..., 0], jax.vmap(jax.jacfwd(lambda xi, ti: f(params, xi, ti), 1))(x, t)[..., 0]
    )
    d_dx = jacobian(f, 1)(params, x, t)
    assert d_dx.shape == (5, 3, 3)


def test_batch_axis_not_zero():
    W = jax.random.normal(KEY, (3, 3))

    def f(x):  # batch on axis 1: x (d, B)
        return jnp.tanh(W @ x) * x

    x = jax.random.normal(jax.random.key(7), (3, 6))
    got = jacobian(f, batch_axis=1)(x)
    expected = jax_diagonal_blocks(f, (x,), 0, batch_axis=1)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    np.testing.assert_allclose(
        divergence(f, batch_axis=1)(x), np.trace(expected, axis1=1, axis2=2), rtol=1e-12
    )
    assert divergence(f, batch_axis=-1)(x).shape == (6,)


def test_single_sample_function():
    W = jax.random.normal(KEY, (4, 4))
    f = lambda x: jnp.tanh(W @ x)  # noqa: E731
    x = jax.random.normal(jax.random.key(8), (4,))
    np.testing.assert_allclose(jacobian(f, batch_axis=None)(x), jax.jacfwd(f)(x), rtol=1e-12)
    np.testing.assert_allclose(
        divergence(f, batch_axis=None)(x), jnp.trace(jax.jacfwd(f)(x)), rtol=1e-12
    )


def test_tuple_argnums_and_has_aux():
    f, (params, x, t), _ = _flax_case()

    def with_aux(params, x, t):
        out = f(params, x, t)
        return out, {"norm": jnp.sum(out**2)}

    (d_dx, d_dt), aux = jacobian(with_aux, (1, 2), has_aux=True)(params, x, t)
    assert d_dx.shape == (5, 3, 3) and d_dt.shape == (5, 3, 1)
    np.testing.assert_allclose(aux["norm"], jnp.sum(f(params, x, t) ** 2))
    div, aux2 = divergence(with_aux, 1, has_aux=True)(params, x, t)
    np.testing.assert_allclose(div, np.trace(d_dx, axis1=1, axis2=2), rtol=1e-12)
    assert set(aux2) == {"norm"}
    (value, _), div2 = value_and_divergence(with_aux, 1, has_aux=True)(params, x, t)
    np.testing.assert_allclose(value, f(params, x, t))
    np.testing.assert_allclose(div2, div)


@pytest.mark.slow
def test_composes_with_jit_and_grad_wrt_params():
    f, (params, x), _argnum = _mlp_case()

    def loss(params):
        return jnp.sum(divergence(f, 1)(params, x) ** 2)

    def brute(params):
        blocks = jax.vmap(jax.jacfwd(lambda xi: f(params, xi)))(x)
        return jnp.sum(jnp.trace(blocks, axis1=1, axis2=2) ** 2)

    np.testing.assert_allclose(jax.jit(loss)(params), brute(params), rtol=1e-12)
    got = jax.grad(loss)(params)
    expected = jax.grad(brute)(params)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-12)
    jitted = jax.jit(jacobian(f, 1))(params, x)
    np.testing.assert_allclose(jitted, jacobian(f, 1)(params, x), rtol=1e-12)


def test_composes_with_vmap_over_an_extra_axis():
    f, (params, x), _ = _mlp_case()
    xs = jnp.stack([x, 2 * x])
    got = jax.vmap(lambda xx: divergence(f, 1)(params, xx))(xs)
    np.testing.assert_allclose(got[1], divergence(f, 1)(params, 2 * x), rtol=1e-12)


def test_grad_divergence_matches_finite_differences():
    f, (params, x), _ = _mlp_case()
    div = divergence(f, 1)
    got = grad_divergence(f, 1)(params, x)
    assert got.shape == x.shape
    eps = 1e-6
    fd = np.zeros(x.shape)
    for i in range(x.shape[1]):
        e = jnp.zeros(x.shape).at[:, i].set(eps)
        fd[:, i] = (div(params, x + e) - div(params, x - e)) / (2 * eps)
    np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-8)
    # Not scaled by 1/B: the same as each sample's gradient computed alone.
    alone = grad_divergence(f, 1)(params, x[:1])
    np.testing.assert_allclose(got[:1], alone, rtol=1e-10)


def test_laplacian_matches_hessian_trace():
    W = jax.random.normal(KEY, (4, 4))

    def u(x):
        return jnp.sum(jnp.tanh(x @ W) ** 2, axis=1)

    x = jax.random.normal(jax.random.key(9), (6, 4))
    hess = jax.vmap(jax.hessian(lambda xi: jnp.sum(jnp.tanh(xi @ W) ** 2)))(x)
    expected = np.trace(hess, axis1=1, axis2=2)
    for method in ["exact", "sparse", "auto"]:
        np.testing.assert_allclose(laplacian(u, method=method)(x), expected, rtol=1e-10)
    # The Laplacian of each output component has the output's shape: (B, 1) for (B, 1).
    np.testing.assert_allclose(laplacian(lambda x: u(x)[:, None])(x), expected[:, None], rtol=1e-10)


def test_sum_of_gradient_of_sum_is_not_the_divergence():
    """A popular wrong answer: summing the gradient of sum(f) adds the off-diagonal terms."""
    W = jnp.array([[1.0, 2.0], [0.5, -1.0]])
    f = lambda x: jnp.tanh(x @ W)  # noqa: E731  (not elementwise)
    x = jax.random.normal(KEY, (3, 2))
    wrong = jnp.sum(jax.grad(lambda x: jnp.sum(f(x)))(x), axis=1)
    right = divergence(f)(x)
    assert np.all(np.abs(wrong - right) > 1e-3)
    # For an elementwise function the two coincide (the Jacobian is diagonal).
    g = jnp.sin
    np.testing.assert_allclose(
        jnp.sum(jax.grad(lambda x: jnp.sum(g(x)))(x), axis=1), divergence(g)(x)
    )


@pytest.mark.slow
@given(
    batch=st.integers(1, 4),
    sample=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    axis=st.integers(0, 3),
    mode=st.sampled_from(["fwd", "rev", "auto"]),
)
def test_random_shapes_and_batch_axes(batch, sample, axis, mode):
    axis = axis % (len(sample) + 1)
    shape = list(sample)
    shape.insert(axis, batch)
    x = jax.random.normal(KEY, tuple(shape))
    n = int(np.prod(sample))
    W = jax.random.normal(jax.random.key(1), (n, n))

    def f(x):
        xs = jnp.moveaxis(x, axis, 0).reshape(batch, n)
        ys = jnp.tanh(xs @ W) + xs**2
        return jnp.moveaxis(ys.reshape(batch, *sample), 0, axis)

    expected = jax_diagonal_blocks(f, (x,), 0, batch_axis=axis)
    got = jacobian(f, batch_axis=axis, mode=mode)(x)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        divergence(f, batch_axis=axis)(x), traces(expected, tuple(sample)), rtol=1e-9, atol=1e-12
    )


# --- the same options on every transform, and the staged API ------------------------------------

_W = np.random.default_rng(0).normal(size=(3, 3))
_XV = (np.random.default_rng(1).normal(size=(4, 3)), np.random.default_rng(2).normal(size=(4, 3)))


def _two_args(x, v):
    """Square in each argument: ``tanh(x W) * v``."""
    return jnp.tanh(x @ _W) * v


def _one_sample_divergence(x, v, argnum):
    """``tr d f / d arg`` of one sample, by dense ``jax.jacfwd``."""
    return jnp.trace(jax.jacfwd(lambda *a: _two_args(*a), argnums=argnum)(x, v))


@pytest.mark.slow
def test_every_transform_takes_tuple_argnums():
    x, v = (jnp.asarray(a) for a in _XV)
    blocks = [jax_diagonal_blocks(_two_args, (x, v), argnum=a) for a in (0, 1)]
    divs = [traces(b, (3,)) for b in blocks]
    got = divergence(_two_args, (0, 1))(x, v)
    for g, d in zip(got, divs, strict=True):
        np.testing.assert_allclose(g, d, rtol=1e-12)
    value, got = value_and_divergence(_two_args, (0, 1))(x, v)
    np.testing.assert_allclose(value, _two_args(x, v))
    np.testing.assert_allclose(got[1], divs[1], rtol=1e-12)
    grads = grad_divergence(_two_args, (0, 1))(x, v)
    for a, g in enumerate(grads):
        per_sample = jax.vmap(jax.grad(_one_sample_divergence, argnums=a), (0, 0, None))
        np.testing.assert_allclose(g, per_sample(x, v, a), rtol=1e-10)
    u = lambda x, v: jnp.sum(_two_args(x, v) * x, axis=1)  # noqa: E731
    laps = laplacian(u, (0, 1))(x, v)
    for a, lap in enumerate(laps):
        hess = jax.vmap(jax.hessian(lambda x, v: jnp.sum(_two_args(x, v) * x), argnums=a))(x, v)
        np.testing.assert_allclose(lap, jnp.trace(hess, axis1=1, axis2=2), rtol=1e-10)
    sparse = sparse_jacobian(_two_args, (0, 1))(x, v)
    patterns = sparsity(_two_args, (0, 1))(x, v)
    for block, matrix, pattern in zip(blocks, sparse, patterns, strict=True):
        np.testing.assert_allclose(matrix.todense(), block, rtol=1e-12)
        assert pattern.shape == (3, 3)
    with pytest.raises(divjac.ArgnumsError, match=r"argnums=\(\)"):
        divergence(_two_args, ())


def test_grad_divergence_and_laplacian_take_has_aux():
    x, v = (jnp.asarray(a) for a in _XV)

    def with_aux(x, v):
        out = _two_args(x, v)
        return out, {"mean": jnp.mean(out)}

    grad, aux = grad_divergence(with_aux, has_aux=True)(x, v)
    np.testing.assert_allclose(grad, grad_divergence(_two_args)(x, v), rtol=1e-12)
    np.testing.assert_allclose(aux["mean"], jnp.mean(_two_args(x, v)))
    u = lambda x, v: jnp.sum(_two_args(x, v), axis=1)  # noqa: E731
    lap, aux = laplacian(lambda x, v: (u(x, v), {"u": u(x, v)}), has_aux=True)(x, v)
    np.testing.assert_allclose(lap, laplacian(u)(x, v), rtol=1e-12)
    np.testing.assert_allclose(aux["u"], u(x, v))
    with pytest.raises(divjac.OutputError, match="pair"):
        laplacian(u, has_aux=True)(x, v)


def test_sparse_jacobian_of_a_coupled_function_with_coupling_exact():
    x = jnp.asarray(_XV[0])
    f = lambda x: jnp.tanh(x) * jnp.mean(x, axis=0)  # noqa: E731 - mixes samples
    with pytest.raises(divjac.BatchCouplingError):
        sparse_jacobian(f)(x)
    got = sparse_jacobian(f, coupling="exact")(x)
    np.testing.assert_allclose(got.todense(), jax_diagonal_blocks(f, (x,)), rtol=1e-12)


def test_sparsity_is_a_transform_whose_calls_take_the_functions_own_keywords():
    x = jnp.asarray(_XV[0])

    def f(x, *, batch_axis, argnums):  # f's own keywords, named like divjac's options
        return jnp.cumsum(x, axis=1) * batch_axis * argnums

    pattern = sparsity(f)(x, batch_axis=2.0, argnums=3.0)
    assert pattern.nnz == 6 and pattern.is_batch_independent
    with pytest.raises(divjac.ArgnumsError, match=r"sparsity\(f\)\(x\)"):
        sparsity(f, x)  # the eager form of earlier versions
    with pytest.raises(divjac.ArgnumsError, match="got float"):
        jacobian(f, 1.0)
    single = sparsity(lambda s: jnp.cumsum(s), batch_axis=None)(x[0])
    np.testing.assert_array_equal(single.todense(), pattern.todense())


def test_jacobian_and_divergence_from_a_pattern():
    f = lambda x: jnp.cumsum(jnp.sin(x), axis=1) ** 2  # noqa: E731
    x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 4)))
    pattern = sparsity(f)(x[:2])  # detected once, on another batch size
    blocks = jax_diagonal_blocks(f, (x,))
    np.testing.assert_allclose(jacobian_from_pattern(f, pattern)(x), blocks, rtol=1e-12)
    np.testing.assert_allclose(
        divergence_from_pattern(f, pattern)(x), traces(blocks, (4,)), rtol=1e-12
    )
    with_aux = lambda x: (f(x), x.sum())  # noqa: E731
    jac, aux = jacobian_from_pattern(with_aux, pattern, has_aux=True, chunk_size=1)(x)
    np.testing.assert_allclose(jac, blocks, rtol=1e-12)
    div, aux = divergence_from_pattern(with_aux, pattern, has_aux=True)(x)
    np.testing.assert_allclose(div, traces(blocks, (4,)), rtol=1e-12)
    np.testing.assert_allclose(aux, x.sum())
    g = lambda p, x: f(x.T).T * p  # noqa: E731 - the input in argument 1, batch on axis 1
    got = jacobian_from_pattern(g, pattern, 1, batch_axis=1)(2.0, x.T)
    np.testing.assert_allclose(got, 2.0 * blocks, rtol=1e-12)


def test_a_stale_pattern_is_refused():
    f = lambda x: jnp.cumsum(x, axis=1)  # noqa: E731
    x = jnp.asarray(_XV[0])
    stale = sparsity(f)(jnp.ones((2, 5)))  # another sample shape
    for transform in (jacobian_from_pattern, divergence_from_pattern):
        with pytest.raises(divjac.PatternError, match=r"\(5,\).*\(3,\).*again"):
            transform(f, stale)(x)
    coupled = sparsity(lambda x: x - jnp.mean(x, axis=0))(x)
    with pytest.raises(divjac.PatternError, match="mixes samples"):
        jacobian_from_pattern(f, coupled)(x)
    with pytest.raises(divjac.PatternTypeError, match="SparsityPattern"):
        divergence_from_pattern(f, coupled.csr)(x)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "f",
    [
        lambda m: m + 4 * jnp.eye(3),
        lambda m: jnp.linalg.solve(m + 4 * jnp.eye(3), jnp.ones(3)),
        lambda m: jnp.linalg.inv(m + 4 * jnp.eye(3)),
    ],
    ids=["plus_eye", "solve", "inv"],
)
def test_rev_mode_with_a_float32_input_and_a_float64_output(f, jit):
    """Seeds are built like the input; reverse passes cast them to the output's dtype."""
    m = jnp.arange(9, dtype=jnp.float32).reshape(3, 3) / 9
    wrap = jax.jit if jit else (lambda g: g)
    J = wrap(jacobian(f, batch_axis=None, mode="rev"))(m)
    np.testing.assert_allclose(J, jax.jacrev(f)(m), rtol=1e-6)
    g = lambda x: x * jnp.arange(1.0, 4.0)  # noqa: E731  (float64 weights)
    div = wrap(divergence(g, mode="rev"))(jnp.ones((2, 3), jnp.float32))
    np.testing.assert_allclose(div, [6.0, 6.0])
