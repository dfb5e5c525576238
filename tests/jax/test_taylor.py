"""The collapsed second-order Taylor sweep (divjac.jax._taylor) against brute force: the dense
Hessian and Jacobian of the whole batched function (``jacfwd`` of ``jacfwd``, float64)
contracted with the directions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

from divjac.jax._taylor import second_order_sweep


def _brute(f, x, v):
    """``J v_k`` ``[K, B, *out]`` and ``v_k^T H v_k`` ``[K, B, *out]`` from the dense batch Hessian."""
    y = f(x)
    n, m = x.size, y.size
    vk = jnp.broadcast_to(v, (v.shape[0], *x.shape)).reshape(v.shape[0], n)
    J = jax.jacfwd(f)(x).reshape(m, n)
    H = jax.jacfwd(jax.jacfwd(f))(x).reshape(m, n, n)  # forward-over-forward: loops too
    first = jnp.einsum("oi,ki->ko", J, vk).reshape(-1, *y.shape)
    second = jnp.einsum("oij,ki,kj->ko", H, vk, vk).reshape(-1, *y.shape)
    return y, first, second


def _weighted(terms, w):
    if w is None:
        return terms.sum(0)
    w = w.reshape(w.shape + (1,) * (terms.ndim - w.ndim))
    return (w * terms).sum(0)


def _check(f, x, v, weights=(None,), apart=False, rtol=1e-9, reference=None):
    """The sweep with each of ``weights`` (collapsed) and, if ``apart``, uncollapsed, against
    one brute-force reference."""
    y_ref, first_ref, second_ref = jax.jit(lambda x, v: _brute(reference or f, x, v))(x, v)
    atol = rtol * (1 + float(jnp.abs(second_ref).max()))
    runs = [(w, True) for w in weights] + ([(None, False)] if apart else [])

    @jax.jit
    def sweeps(x, v, ws):  # one compiled program for every run
        return [
            second_order_sweep(f, x, v, weights=w, collapse=c)
            for w, (_, c) in zip(ws, runs, strict=True)
        ]

    for (w, collapse), (y, first, second) in zip(
        runs, sweeps(x, v, [w for w, _ in runs]), strict=True
    ):
        expected = _weighted(second_ref, w) if collapse else second_ref
        assert second.shape == expected.shape and first.shape == first_ref.shape
        np.testing.assert_allclose(y, y_ref, rtol=rtol, atol=atol)
        np.testing.assert_allclose(first, first_ref, rtol=rtol, atol=atol)
        np.testing.assert_allclose(second, expected, rtol=rtol, atol=atol)


def _arr(rng, *shape, scale=1.0):
    return jnp.asarray(scale * rng.normal(size=shape))


def _mlp(rng, d, h, o):
    W1, b1, W2, W3 = _arr(rng, d, h), _arr(rng, h), _arr(rng, h, h, scale=0.5), _arr(rng, h, o)

    def f(x):
        z = x @ W1 + b1
        a = jnp.tanh(z) + jax.nn.softplus(z) + jnp.sin(z) * jnp.exp(-0.5 * z)
        a = jnp.log(1 + a**2) + jax.nn.sigmoid(a) + jax.nn.relu(z)
        return a @ W2 @ W3

    return f


def _products(rng, d):
    W = _arr(rng, d, 6)

    def f(x):
        z = x @ W
        m = z.mean(-1, keepdims=True)
        var = ((z - m) ** 2).mean(-1, keepdims=True)
        ln = (z - m) * lax.rsqrt(var + 0.1)
        ratio = z[:, :3] / (2.0 + jnp.cos(z[:, 3:]))
        rest = jnp.sqrt(1 + z**2)[:, :3] * ratio + jnp.arctan(z[:, :3]) * z[:, 3:] ** 3
        rest = (
            rest
            + jnp.power(1.5 + jnp.tanh(z[:, :3]), 2.5)
            + jnp.arctan2(z[:, :3], 2.0 + z[:, 3:] ** 2)
        )
        return jnp.concatenate([ln, rest, jnp.linalg.norm(z, axis=-1, keepdims=True)], -1)

    return f


def _net_xt(rng, d):
    t = _arr(rng, 3, 1)  # closed over, one per sample: the batch of net(x, t)
    W1, W2 = _arr(rng, d + 1, 8), _arr(rng, 8, 1)

    def f(x):
        return (jnp.tanh(jnp.concatenate([x, t], -1) @ W1) @ W2)[:, 0] * jnp.exp(-t[:, 0])

    return f


def _cnn(rng):
    k1, k2 = _arr(rng, 3, 3, 2, 4, scale=0.5), _arr(rng, 3, 3, 4, 1, scale=0.5)
    dn = ("NHWC", "HWIO", "NHWC")

    def f(x):
        h = jnp.tanh(lax.conv_general_dilated(x, k1, (1, 1), "SAME", dimension_numbers=dn))
        return jax.nn.softplus(
            lax.conv_general_dilated(h, k2, (1, 1), "SAME", dimension_numbers=dn)
        )

    return f


def _attention(rng):
    Wq, Wk, Wv = _arr(rng, 3, 3), _arr(rng, 3, 3), _arr(rng, 3, 3)

    def f(x):  # [B, tokens, 3]: two dependent operands in each dot_general
        s = jnp.einsum("bte,bse->bts", x @ Wq, x @ Wk)
        return jnp.einsum("bts,bse->bte", jax.nn.softmax(s, -1), x @ Wv)

    return f


def _control(rng, d, sin=jnp.sin):
    W = _arr(rng, d, d, scale=0.5)

    def f(x):
        h, _ = lax.scan(lambda c, _: (jnp.tanh(c @ W), None), x, None, length=2)
        h = lax.while_loop(
            lambda ic: ic[0] < 2, lambda ic: (ic[0] + 1, ic[1] * jnp.cos(ic[1])), (0, h)
        )[1]
        h = lax.cond(h.sum() > 0, lambda c: c**2, lambda c: c, h)
        return jax.checkpoint(lambda c: sin(c) * c)(h) + jax.jit(jnp.exp)(x)

    return f


def test_custom_vjp_by_its_primal(rng):
    """jvp cannot enter a custom_vjp function: the sweep differentiates its primal."""

    @jax.custom_vjp
    def sin(z):
        return jnp.sin(z)

    sin.defvjp(lambda z: (jnp.sin(z), z), lambda z, c: (c * jnp.cos(z),))
    f = _control(np.random.default_rng(1), 3, sin)
    x, v = _arr(rng, 2, 3), _arr(rng, 3, 1, 3)
    _check(f, x, v, reference=_control(np.random.default_rng(1), 3))


CASES = {
    "mlp": (lambda rng: _mlp(rng, 4, 7, 3), (3, 4)),
    "products": (lambda rng: _products(rng, 4), (3, 4)),
    "net_xt": (lambda rng: _net_xt(rng, 3), (3, 3)),
    "cnn": (_cnn, (2, 4, 4, 2)),
    "attention": (_attention, (2, 3, 3)),
    "control": (lambda rng: _control(rng, 3), (2, 3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shared", [pytest.param(True, marks=pytest.mark.slow), False])
def test_against_dense_hessian(case, shared, rng):
    """All ones, weights ``[K]`` and ``[K, B]`` (collapsed), and the terms kept apart."""
    make, shape = CASES[case]
    f, x = make(rng), _arr(rng, *shape)
    v = _arr(rng, 4, 1 if shared else shape[0], *shape[1:])
    _check(f, x, v, weights=(None, _arr(rng, 4), _arr(rng, 4, shape[0])), apart=True)


def test_unit_basis_is_the_laplacian(rng):
    f = _mlp(rng, 5, 6, 1)
    x = _arr(rng, 4, 5)
    lap = jax.jit(lambda x: second_order_sweep(f, x, jnp.eye(5)[:, None, :])[2])(x)
    per_sample = lambda z: f(z[None])[0]  # noqa: E731
    trace = lambda z: jnp.trace(jax.hessian(per_sample)(z), axis1=-2, axis2=-1)  # noqa: E731
    np.testing.assert_allclose(lap, jax.jit(jax.vmap(trace))(x), rtol=1e-10)


def test_constant_and_linear_outputs(rng):
    x = _arr(rng, 3, 4)
    v = _arr(rng, 2, 1, 4)
    _, first, second = second_order_sweep(lambda z: jnp.ones((3, 2)), x, v)
    assert (
        first.shape == (2, 3, 2) and not first.any() and second.shape == (3, 2) and not second.any()
    )
    A = _arr(rng, 4, 2)
    _check(lambda z: z @ A, x, v)
    _check(lambda z: jnp.sin(lax.stop_gradient(z[:, :2])) * z[:, 2:], x, v)


@pytest.mark.slow
def test_jit_and_grad_wrt_params(rng):
    d = 4
    params = (_arr(rng, d, 6), _arr(rng, 6), _arr(rng, 6, 1))
    x = _arr(rng, 5, d)

    def u(p, z):
        W1, b1, W2 = p
        return (jnp.tanh(z @ W1 + b1) ** 2 @ W2)[:, 0]

    basis = jnp.eye(d)[:, None, :]

    def loss(p):
        _, _, lap = second_order_sweep(lambda z: u(p, z), x, basis)
        return jnp.sum((lap - 1.0) ** 2)

    def brute(p):
        per_sample = lambda z: u(p, z[None])[0]  # noqa: E731
        lap = jax.vmap(lambda z: jnp.trace(jax.hessian(per_sample)(z)))(x)
        return jnp.sum((lap - 1.0) ** 2)

    np.testing.assert_allclose(jax.jit(loss)(params), brute(params), rtol=1e-10)
    for g, g_ref in zip(jax.jit(jax.grad(loss))(params), jax.grad(brute)(params), strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_float32(rng):
    W1, W2 = _arr(rng, 4, 7), _arr(rng, 7, 2)
    f64 = lambda z: jnp.tanh(z @ W1) ** 2 @ W2  # noqa: E731
    f32 = lambda z: jnp.tanh(z @ W1.astype(jnp.float32)) ** 2 @ W2.astype(jnp.float32)  # noqa: E731
    x64, v64 = _arr(rng, 3, 4), _arr(rng, 4, 1, 4)
    y, first, second = jax.jit(lambda x, v: second_order_sweep(f32, x, v))(
        x64.astype(jnp.float32), v64.astype(jnp.float32)
    )
    assert y.dtype == first.dtype == second.dtype == jnp.float32
    _, _, ref = second_order_sweep(f64, x64, v64)
    np.testing.assert_allclose(second, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@settings(max_examples=6)
@given(
    batch=st.integers(1, 4),
    d=st.integers(1, 5),
    hidden=st.integers(1, 6),
    out=st.integers(1, 3),
    k=st.integers(1, 4),
    shared=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_mlp_shapes(batch, d, hidden, out, k, shared, seed):
    rng = np.random.default_rng(seed)
    f = _mlp(rng, d, hidden, out)
    _check(f, _arr(rng, batch, d), _arr(rng, k, 1 if shared else batch, d), weights=(_arr(rng, k),))


@pytest.mark.parametrize("case", ["modulus", "complex_weights"])
def test_laplacian_through_abs_of_a_complex_intermediate(case):
    """``|z|`` is piecewise linear on the reals only: of ``x0 + i x1`` its Laplacian is ``1/r``."""
    from divjac.jax import laplacian

    key = jax.random.key(3)
    if case == "modulus":
        u = lambda x: jnp.abs(x[..., 0] + 1j * x[..., 1])  # noqa: E731
        x = jax.random.normal(key, (4, 2))
    else:
        kr, ki = jax.random.split(key)
        W = jax.random.normal(kr, (3, 5)) + 1j * jax.random.normal(ki, (3, 5))
        u = lambda x: jnp.abs(x @ W).sum(-1)  # noqa: E731
        x = jax.random.normal(key, (4, 3))
    truth = jax.vmap(lambda s: jnp.trace(jax.hessian(lambda s: u(s[None])[0])(s)))(x)
    if case == "modulus":
        np.testing.assert_allclose(truth, 1 / jnp.linalg.norm(x, axis=1), rtol=1e-12)
    for method in ("exact", "sparse", "auto"):
        np.testing.assert_allclose(laplacian(u, method=method)(x), truth, rtol=1e-10)


def test_a_while_loop_has_no_hessian_pattern():
    """A ``lax.while_loop`` has no reverse derivative, so no per-sample gradient gives the
    Hessian's pattern: ``"auto"`` sweeps the unit basis (it raised JAX's reverse-mode error),
    ``"sparse"`` names the loop and the fix; against ``jacfwd`` of ``jacfwd``."""
    import divjac
    from divjac.jax import hessian_diagonal, laplacian

    W = jnp.array([[0.5, -0.2, 0.1], [0.3, 0.4, -0.6], [0.2, 0.1, 0.7]])

    def u(x):
        body = lambda c: (c[0] + 1, jnp.sin(c[1] @ W) * c[1])  # noqa: E731
        return jnp.sum(lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1], -1)

    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    hess = jax.vmap(jax.jacfwd(jax.jacfwd(lambda s: u(s[None])[0])))(x)
    diag = jnp.diagonal(hess, axis1=1, axis2=2)
    for fn in (laplacian(u), jax.jit(laplacian(u, method="auto"))):
        np.testing.assert_allclose(fn(x), diag.sum(1), rtol=1e-12)
    np.testing.assert_allclose(hessian_diagonal(u)(x), diag, rtol=1e-12)
    with pytest.raises(divjac.OptionError, match=r"lax\.while_loop, which has no reverse"):
        laplacian(u, method="sparse")(x)


@jax.custom_jvp
def _looped_cube(x):
    """``x ** 3`` by a ``lax.while_loop``; reverse mode differentiates the rule, not the loop."""
    return lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * x), (0, jnp.ones_like(x))
    )[1]


@_looped_cube.defjvp
def _looped_cube_rule(primals, tangents):
    ((x,), (t,)) = primals, tangents
    return _looped_cube(x), 3 * x**2 * t


def test_a_while_loop_inside_a_custom_jvp_keeps_the_sparse_path():
    """A loop in a ``custom_jvp`` function's body does not block reverse mode (as in
    ``jax.scipy.special.exp1``): ``"sparse"`` colors the Hessian's pattern (one color for a
    diagonal Hessian) and matches ``jacfwd`` of ``jacfwd``."""
    from divjac.jax import laplacian

    def u(x):
        return jnp.sum(_looped_cube(x), -1)

    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    hess = jax.vmap(jax.jacfwd(jax.jacfwd(lambda s: u(s[None])[0])))(x)
    want = jnp.trace(hess, axis1=1, axis2=2)
    for method in ("sparse", "auto"):
        np.testing.assert_allclose(laplacian(u, method=method)(x), want, rtol=1e-12)
