"""The collapsed Taylor sweep of order 3 and 4 (divjac.jax._taylor_high) against brute force:
nested ``jax.jacfwd`` of ``s -> f(x + s v)`` per sample and direction, float64; and the cost of
``differential_operator``'s fourth-order terms built on it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import divjac.jax as dj
from divjac.jax._taylor_high import taylor_sweep

B, N, K = 3, 4, 5
RNG = np.random.default_rng(0)
W1, W2, W3 = RNG.normal(size=(N, 6)) / 2, RNG.normal(size=(6, 6)) / 2, RNG.normal(size=(6, 2))


def _mlp(x):
    return jnp.tanh(jnp.tanh(x @ W1) @ W2) @ W3


def _products(x):  # products and quotients of two dependent operands, powers
    a, b = jnp.sin(x), jnp.exp(0.3 * x)
    outer = jnp.einsum("bi,bj->bij", a, b)  # dot_general of two dependent operands
    return (outer.sum((1, 2)) * x[:, 0]) / (1.0 + x[:, 1] ** 2) + jnp.log1p(x[:, 2] ** 4)


def _custom(x):  # custom_jvp functions, a max, two curved operands (the fallback's jvp)
    y = jnp.logaddexp(x, 0.5 * x[:, ::-1]) + jax.nn.softplus(x) * jnp.maximum(x, 0.1)
    return jnp.arctan2(y, 1.0 + x**2).sum(1)


FUNCTIONS = {"mlp": _mlp, "products": _products, "custom": _custom}


def _brute(f, x, v, order):
    """``(v_k . grad)^order f`` ``[K, B, *out]`` for directions ``v`` ``[K, B or 1, n]``."""

    def one(xi, vi):
        g = lambda s: f((xi + s * vi)[None])[0]  # noqa: E731
        for _ in range(order):
            g = jax.jacfwd(g)
        return g(0.0)

    v = jnp.broadcast_to(v, (v.shape[0], *x.shape))
    return jnp.stack([jax.vmap(one)(x, vk) for vk in v])


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("order", [2, 3, 4])
def test_taylor_sweep_is_nested_jacfwd(name, order):
    f = FUNCTIONS[name]
    x = jnp.asarray(RNG.normal(size=(B, N)))
    shared = jnp.asarray(RNG.normal(size=(K, 1, N)))
    own = jnp.asarray(RNG.normal(size=(K, B, N)))
    w, wb = jnp.asarray(RNG.normal(size=K)), jnp.asarray(RNG.normal(size=(K, B)))

    @jax.jit
    def runs(x, shared, own, w, wb):
        return [
            taylor_sweep(f, x, shared, order, weights=w),
            taylor_sweep(f, x, shared, order, collapse=False),
            taylor_sweep(f, x, own, order, weights=wb),
            taylor_sweep(f, x, own, order),
        ]

    ref_shared, ref_own = _brute(f, x, shared, order), _brute(f, x, own, order)

    def weighted(w, terms):
        return (w.reshape(w.shape + (1,) * (terms.ndim - w.ndim)) * terms).sum(0)

    expected = [
        weighted(w, ref_shared),
        ref_shared,
        weighted(wb, ref_own),
        ref_own.sum(0),
    ]
    for got, want in zip(runs(x, shared, own, w, wb), expected, strict=True):
        assert got.shape == want.shape
        atol = 1e-10 * (1 + float(jnp.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=atol)


@pytest.mark.parametrize("chunk_size", [2, None])
def test_operator_fourth_and_third_order_in_chunks(chunk_size):
    """Mixed terms of orders 3 and 4 with number and per-sample coefficients, the directions
    in chunks (the last one padded) and at once."""
    x = jnp.asarray(RNG.normal(size=(B, N)))
    c = jnp.asarray(RNG.normal(size=B))
    terms = [(1.5, (0, 0, 0, 0)), (-0.5, (1, 2, 2, 3)), (c, (0, 1, 1)), (2.0, (3, 3, 3))]
    got = dj.differential_operator(_mlp, terms, chunk_size=chunk_size)(x)
    single = lambda xi: _mlp(xi[None])[0]  # noqa: E731
    d3 = jax.vmap(jax.jacfwd(jax.jacfwd(jax.jacfwd(single))))(x)
    d4 = jax.vmap(jax.jacfwd(jax.jacfwd(jax.jacfwd(jax.jacfwd(single)))))(x)
    want = (
        1.5 * d4[:, :, 0, 0, 0, 0]
        - 0.5 * d4[:, :, 1, 2, 2, 3]
        + c[:, None] * d3[:, :, 0, 1, 1]
        + 2.0 * d3[:, :, 3, 3, 3]
    )
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)


def test_fourth_order_diagonal_costs_few_passes_per_direction():
    """``sum_i d^4u/dx_i^4`` of a tanh MLP: the compiled program's work is at most 3 forward
    passes of ``u`` per direction (each direction carries 3 Taylor coefficients, the fourth
    summed over the directions; two nested second-order sweeps cost over 5)."""
    d = 16
    params = [jnp.asarray(RNG.normal(size=s), jnp.float32) for s in [(d, 64), (64, 64), (64, 1)]]

    def u(x):
        return (jnp.tanh(jnp.tanh(x @ params[0]) @ params[1]) @ params[2])[:, 0]

    x = jnp.asarray(RNG.normal(size=(128, d)), jnp.float32)
    op = dj.differential_operator(u, [(1.0, (i,) * 4) for i in range(d)], method="exact")

    def flops(fn):
        cost = jax.jit(fn).lower(x).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    assert flops(op) <= 3 * d * flops(u)


def test_fourth_order_diagonal_of_a_particle_sum_follows_the_colors():
    """``sum_i d^4u/dx_i^4`` of ``u(x) = sum_p phi(x_p)`` (pairs): ``"auto"`` merges the
    inputs of a color of the Hessian's pattern (2 here) into one direction, so the work does
    not grow with ``d`` (per direction: 64 at ``d = 64``)."""
    d = 64
    w = [jnp.asarray(RNG.normal(size=s), jnp.float32) for s in [(2, 16), (16, 1)]]

    def u(x):
        pairs = x.reshape(x.shape[0], -1, 2)
        return (jnp.tanh(pairs @ w[0]) @ w[1])[..., 0].sum(1)

    x = jnp.asarray(RNG.normal(size=(32, d)), jnp.float32)
    op = dj.differential_operator(u, [(1.0, (i,) * 4) for i in range(d)])

    def flops(fn):
        cost = jax.jit(fn).lower(x).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    assert flops(op) <= 20 * flops(u)
