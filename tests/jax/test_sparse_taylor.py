"""The exact Laplacian's sweep that stores first-order terms sparse (divjac.jax._sparse_taylor)
against brute force: the trace of each sample's Hessian (``jax.hessian``, float64); and its
choice by ``laplacian(method="exact" / "auto")`` where it pays, and not where it does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax

from divjac.jax import _sparse_taylor, laplacian, sparsity
from divjac.jax._sparse_taylor import sparse_cost, sparse_laplacian
from tests.reference import block_architectures


def _brute(u, x):
    """Per-sample ``tr(H)`` ``[B, *out]`` of the batch-first ``u``."""

    def one(z):
        h = jax.hessian(lambda q: u(q[None])[0])(z)
        out_shape = h.shape[: h.ndim - 2 * z.ndim]
        n = z.size
        return jnp.trace(h.reshape(*out_shape, n, n), axis1=-2, axis2=-1)

    return jax.jit(jax.vmap(one))(x)


def _check(u, x, rtol=1e-10):
    ref = _brute(u, x)
    got = jax.jit(lambda z: sparse_laplacian(u, z))(x)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * (1 + float(jnp.abs(ref).max())))
    return ref


def _params(seed, *shapes, scale=0.5):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float64) * scale for k, s in zip(keys, shapes, strict=True)]


def _particles(n, dim, width, seed=0):
    w1, b1, w2 = _params(seed, (dim, width), (width,), (width,))

    def u(x):
        h = jnp.tanh(x.reshape(x.shape[0], n, dim) @ w1 + b1)
        return jnp.sum(jnp.sin(h @ w2) ** 2, -1)

    return u


def _ferminet(n, dim, width, seed=1):
    v1, v2, v3 = _params(seed, (dim, width), (2 * width, width), (width,))

    def u(x):
        h = jnp.tanh(x.reshape(x.shape[0], n, dim) @ v1)
        g = jnp.broadcast_to(jnp.mean(h, axis=1, keepdims=True), h.shape)
        h = jax.nn.softplus(jnp.concatenate([h, g], -1) @ v2) + h
        return jnp.sum(h @ v3, -1) + jnp.sum(x**2, -1)

    return u


def _banded(x):
    """Neighbour products and a padded, reversed, transposed stencil: unions of few inputs."""
    a = jnp.sin(x[:, 1:] * x[:, :-1])
    b = jnp.pad(jnp.exp(-x[:, 2:] * x[:, :-2]), ((0, 0), (1, 1)))
    c = jnp.flip(b, 1)[:, 1:] + a
    grid = c.reshape(x.shape[0], -1, 3).transpose(0, 2, 1)
    return jnp.sum(jnp.max(grid, axis=1) ** 2, -1) + jnp.sum(x / (2 + x**2), -1)


def _mlp(x):
    w1, w2 = _params(3, (x.shape[1], 16), (16,))
    return jnp.tanh(x @ w1) @ w2


def _cnn(x):
    (k1,) = _params(4, (3, 3, 2, 4))
    img = x.reshape(x.shape[0], 5, 5, 2)
    out = lax.conv_general_dilated(
        img, k1, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.sum(jnp.tanh(out), (1, 2, 3))


def _mixed_ops(x):
    """relu (custom_jvp), integer_pow, a quotient of two dependent operands, max-reduction,
    a nested jit, a product with the dependent operand on the right, select_n, slices."""
    w = _params(5, (4, 4))[0]
    p = x.reshape(x.shape[0], 3, 4)
    h = jax.jit(lambda q: jax.nn.relu(q @ w) + jnp.tanh(q) ** 3)(p)
    r = jnp.einsum("ij,bkj->bki", w, h)  # W @ h: the dependent operand on the right
    q = jnp.where(p > 0, r, jnp.cos(r)) / (1.5 + jnp.sin(p))
    return jnp.sum(jnp.max(q, axis=-1) * q[..., 0], -1) + jnp.sum(
        jnp.log1p(p[..., 1:] ** 2), (1, 2)
    )


@pytest.mark.parametrize(
    "name, u, d",
    [
        ("particles", _particles(6, 3, 8), 18),
        ("ferminet", _ferminet(5, 3, 8), 15),
        ("banded", _banded, 13),
        ("mlp", _mlp, 10),
        ("cnn", _cnn, 50),
        ("mixed", _mixed_ops, 12),
    ],
)
def test_sparse_sweep_against_hessian_trace(name, u, d):
    x = jax.random.normal(jax.random.key(7), (3, d), jnp.float64)
    _check(u, x)


def test_vector_output_and_linear_function():
    x = jax.random.normal(jax.random.key(8), (2, 8), jnp.float64)
    pairs = lambda x: x.reshape(x.shape[0], 4, 2)  # noqa: E731
    _check(lambda x: jnp.tanh(pairs(x)).sum(-1) * pairs(x)[..., 0], x)
    _check(lambda x: 3 * pairs(x)[..., 1], x)  # linear: no second-order term
    _check(lambda x: jnp.sin(pairs(x)[..., :0]).sum(-1) + jnp.sin(pairs(x)).sum(-1), x)  # empty


def test_cost_follows_the_sparsity():
    x = jnp.ones((2, 40), jnp.float64)
    assert (
        sparse_cost(_particles(10, 4, 8), x, against_colors=False) < 0.2
    )  # 4 of 40 inputs per intermediate
    assert (
        sparse_cost(_mlp, jnp.ones((2, 10), jnp.float64), against_colors=False) == 1.0
    )  # dense at the first product
    assert (
        sparse_cost(_ferminet(8, 3, 16), jnp.ones((2, 24), jnp.float64), against_colors=False) < 0.5
    )


@pytest.mark.parametrize("method", ["exact", "auto"])
def test_laplacian_takes_the_sparse_sweep_where_it_pays(monkeypatch, method):
    calls = []
    inner = _sparse_taylor.sparse_laplacian

    def spy(f, x):
        calls.append(x.shape)
        return inner(f, x)

    monkeypatch.setattr(_sparse_taylor, "sparse_laplacian", spy)
    ferminet, x = _ferminet(8, 3, 16), jax.random.normal(jax.random.key(9), (3, 24), jnp.float64)
    got = laplacian(ferminet, method=method)(x)
    np.testing.assert_allclose(got, _brute(ferminet, x), rtol=1e-10, atol=1e-9)
    assert calls == [(3, 24)]
    x = jax.random.normal(jax.random.key(10), (3, 10), jnp.float64)
    np.testing.assert_allclose(laplacian(_mlp, method=method)(x), _brute(_mlp, x), rtol=1e-10)
    assert calls == [(3, 24)]  # a dense MLP stays on the dense sweep


@settings(max_examples=3, deadline=None, derandomize=True)
@given(**block_architectures())
def test_random_block_architectures(n, dim, width, act, pool, seed):
    """Per-block layers, then a pooling or a FermiNet-like mixing, then a dense head."""
    w1, b1, w2, w3 = _params(seed, (dim, width), (width,), (2 * width, width), (width,))
    fn = {"tanh": jnp.tanh, "softplus": jax.nn.softplus, "sin": jnp.sin}[act]

    def u(x):
        h = fn(x.reshape(x.shape[0], n, dim) @ w1 + b1)
        if pool == "mix":
            g = jnp.broadcast_to(jnp.mean(h, axis=1, keepdims=True), h.shape)
            return jnp.sum(fn(jnp.concatenate([g, h], -1) @ w2) @ w3, -1)
        pooled = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max}[pool](h, axis=1)
        return fn(pooled @ w2[:width]) @ w3

    x = jax.random.normal(jax.random.key(seed), (2, n * dim), jnp.float64)
    _check(u, x)


def test_through_the_api_with_other_arguments_and_aux(monkeypatch):
    """Particles as ``(B, P, D)``, the Laplacian in the second argument, another per-sample
    argument and an aux output: the sparse sweep sees the batch-first function of ``x`` alone."""
    calls = []
    inner = _sparse_taylor.sparse_laplacian
    monkeypatch.setattr(
        _sparse_taylor, "sparse_laplacian", lambda f, x: calls.append(1) or inner(f, x)
    )
    w1, w2 = _params(11, (3, 16), (16,))

    def u(scale, x):
        h = jnp.tanh(x @ w1) * scale[:, None, None]
        return jnp.sum(h @ w2, -1), jnp.sum(x, (1, 2))

    scale = jnp.arange(1.0, 4.0, dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(12), (3, 10, 3), jnp.float64)
    lap, aux = jax.jit(laplacian(u, argnums=1, method="exact", has_aux=True))(scale, x)
    one = lambda s, z: u(s[None], z.reshape(1, 10, 3))[0][0]  # noqa: E731
    ref = jax.vmap(lambda s, z: jnp.trace(jax.hessian(one, 1)(s, z)))(scale, x.reshape(3, 30))
    np.testing.assert_allclose(lap, ref, rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(aux, x.sum((1, 2)))
    assert calls == [1]


def test_a_loop_goes_dense_and_the_gradient_in_the_parameters_is_right():
    """A ``scan`` over the particles takes the dense terms; ``jax.grad`` of a PINN-like loss
    w.r.t. the weights goes through the sparse sweep (the Hessian trace's gradient agrees)."""

    def looped(x):
        p = x.reshape(x.shape[0], 4, 2)
        carry, _ = lax.scan(
            lambda c, q: (c + jnp.sin(q).sum(-1) * c, None),
            jnp.ones(x.shape[0]),
            p.transpose(1, 0, 2),
        )
        return carry

    x = jax.random.normal(jax.random.key(13), (2, 8), jnp.float64)
    _check(looped, x)

    def net(w, x):
        h = jnp.tanh(x.reshape(x.shape[0], 6, 3) @ w)
        return jnp.sum(jnp.sin(h.sum(-1)) ** 2, -1)

    (w,) = _params(14, (3, 8))
    x = jax.random.normal(jax.random.key(15), (3, 18), jnp.float64)
    assert (
        sparse_cost(lambda z: net(w, z), x, against_colors=False) < 0.5
    )  # the sparse sweep is taken
    loss = lambda w: jnp.sum(laplacian(lambda z: net(w, z), method="exact")(x) ** 2)  # noqa: E731
    ref = lambda w: jnp.sum(_brute(lambda z: net(w, z), x) ** 2)  # noqa: E731
    np.testing.assert_allclose(jax.grad(loss)(w), jax.grad(ref)(w), rtol=1e-9, atol=1e-9)


def _pairs(n, reach=3):
    """A pair potential over a chain's neighbours within ``reach``: its terms read two
    particles each by a gather of constant indices."""
    i, j = np.array([(a, a + s) for a in range(n) for s in range(1, reach + 1) if a + s < n]).T
    w1, b1, w2 = _params(17, (8,), (8,), (8,))

    def u(x):
        p = x.reshape(x.shape[0], n, 3)
        diff = p[:, i, :] - p[:, j, :]
        r = jnp.sqrt(jnp.sum(diff * diff, -1) + 0.1)
        return jnp.sum((jnp.tanh(r[..., None] * w1 + b1) @ w2) * jnp.exp(-r), -1)

    return u


def test_a_gather_by_constant_indices_keeps_the_terms_sparse():
    """The indices of ``p[:, i]`` (computed from constants, inside ``jit``) are known at trace
    time: the index follows the gather; an element-wise product broadcasting one operand
    (``r[..., None] * w``) keeps it too."""
    u = _pairs(12)
    x = jax.random.normal(jax.random.key(18), (3, 36), jnp.float64)
    _check(u, x)
    assert sparse_cost(u, x, against_colors=False) * 36 < 9  # 6 inputs a pair term, not 36
    np.testing.assert_allclose(
        jax.jit(laplacian(u, method="exact"))(x), _brute(u, x), rtol=1e-10, atol=1e-9
    )


def test_auto_weighs_the_sparse_sweep_against_the_hessian_colors(monkeypatch):
    """``auto`` takes the sparse sweep where its work is at most 1.1x that of the colors'
    passes (pair terms of 6 inputs, 12 colors; 20 particles of 4 coordinates through a width
    of 64, 4 colors: work 4.1, where the bench's 50 such particles swept 1.4x faster than the
    colors' passes), the colors' passes otherwise (6 particles of 3 coordinates through a
    width of 8: work 3.6 against 3 colors; Rosenbrock, whose terms are laid out anew by
    gathers that count 4x: 3.9 against 2 colors; a CNN, whose offset products count 16x)."""
    rosenbrock = lambda x: jnp.sum(100 * (x[:, 1:] - x[:, :-1] ** 2) ** 2 + (1 - x[:, :-1]) ** 2, 1)  # noqa: E731
    taken = []
    inner = _sparse_taylor.sparse_laplacian
    monkeypatch.setattr(
        _sparse_taylor, "sparse_laplacian", lambda f, x: taken.append(x.shape) or inner(f, x)
    )
    for u, d, sparse in (
        (_pairs(12), 36, True),
        (_particles(6, 3, 8), 18, False),
        (_particles(20, 4, 64), 80, True),
        (rosenbrock, 64, False),
        (_cnn, 50, False),
    ):
        x = jax.random.normal(jax.random.key(19), (2, d), jnp.float64)
        colors = sparsity(jax.grad(lambda z, u=u: u(z).sum()))(x).n_diagonal_colors
        assert (sparse_cost(u, x, against_colors=True) * d <= 1.1 * colors) == sparse
        taken.clear()
        np.testing.assert_allclose(
            laplacian(u, method="auto")(x), _brute(u, x), rtol=1e-10, atol=1e-9
        )
        assert taken == ([(2, d)] if sparse else [])
