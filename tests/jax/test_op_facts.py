"""The op-fact table of the JAX backend (:mod:`divjac.jax._ops`): an element-wise primitive is one
entry, and every transform that reads the table handles it (detection, the Taylor sweep, the
sparse sweep, the Laplacian), against brute force; the primitives whose treatment the one table
changed, each against brute force."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

import divjac
from divjac.jax import _detect, _ops, _table, laplacian, sparsity
from divjac.jax._sparse_taylor import sparse_cost, sparse_laplacian
from divjac.jax._table import register_elementwise
from divjac.jax._taylor import second_order_sweep

# ``cube(x) = x^3``, whose JVP is ``dcube(x) * t`` with a ``dcube`` JAX cannot differentiate:
# a second derivative can only come from the table's curvature ``6 x``.
dcube_p = Primitive("divjac_test_dcube")
dcube_p.def_impl(lambda x: 3 * x * x)
dcube_p.def_abstract_eval(lambda x: x)
batching.defvectorized(dcube_p)
mlir.register_lowering(dcube_p, mlir.lower_fun(lambda x: 3 * x * x, multiple_results=False))

cube_p = Primitive("divjac_test_cube")
cube_p.def_impl(lambda x: x * x * x)
cube_p.def_abstract_eval(lambda x: x)
ad.defjvp(cube_p, lambda t, x: dcube_p.bind(x) * t)
batching.defvectorized(cube_p)
mlir.register_lowering(cube_p, mlir.lower_fun(lambda x: x * x * x, multiple_results=False))


@pytest.fixture
def registered(monkeypatch):
    """``cube`` registered in the op-fact table for one test (the tables restored after it:
    other tests read the whole table)."""
    for table in (_table.TABLE, _ops.ELEMENTWISE, _table.REGISTRY._rules):
        monkeypatch.setitem(table, cube_p.name, None)
    register_elementwise(cube_p, _ops.Elementwise(curvature=lambda x, y, p: 6 * x))


N, DIM, WIDTH = 6, 2, 5  # particles of 2 coordinates: an element depends on 2 of the 12 inputs


def _weights(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (
        jax.random.normal(k1, (DIM, WIDTH), jnp.float64) * 0.5,
        jax.random.normal(k2, (WIDTH,), jnp.float64) * 0.5,
    )


def _per_particle(g):
    """``u(x) = sum_i g(tanh(x_i W1)) . w2`` over the particles ``x_i``: sparse second order."""
    w1, w2 = _weights()

    def u(x):
        h = jnp.tanh(x.reshape(x.shape[0], N, DIM) @ w1)
        return jnp.sum(g(h) @ w2, -1)

    return u


def _brute(u, x):
    """Per-sample ``tr(H)`` of the batch-first scalar ``u`` (float64)."""
    one = lambda z: jnp.trace(jax.hessian(lambda q: u(q[None])[0])(z))  # noqa: E731
    return jax.vmap(one)(x)


def _x(seed=1, batch=3):
    return jax.random.normal(jax.random.key(seed), (batch, N * DIM), jnp.float64)


def test_a_registered_elementwise_primitive_reaches_every_transform(registered):
    u = _per_particle(cube_p.bind)
    ref = _brute(_per_particle(lambda h: h**3), _x())
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error", divjac.DenseFallbackWarning)
        pattern = sparsity(cube_p.bind)(x)
    np.testing.assert_array_equal(pattern.csr.toarray(), np.eye(N * DIM, dtype=bool))
    assert not pattern.dense_fallbacks
    eye = jnp.eye(N * DIM, dtype=x.dtype)[:, None]
    _, _, dense = second_order_sweep(u, x, eye)
    np.testing.assert_allclose(dense, ref, rtol=1e-10)
    np.testing.assert_allclose(jax.jit(lambda z: sparse_laplacian(u, z))(x), ref, rtol=1e-10)
    # Kept sparse through it, as through a built-in element-wise primitive.
    as_sin = _per_particle(jnp.sin)
    assert sparse_cost(u, x, against_colors=False) == sparse_cost(as_sin, x, against_colors=False)
    np.testing.assert_allclose(laplacian(u, method="exact")(x), ref, rtol=1e-10)
    assert _detect._fused("divjac_test_cube")


# The element-wise primitives the sparse sweep took as dense before the one table (it listed them
# nowhere): each keeps its terms sparse now, and the Laplacian through it is right.
_NOW_SPARSE = {
    "bessel_i0e": lax.bessel_i0e,
    "bessel_i1e": lax.bessel_i1e,
    "digamma": lambda h: lax.digamma(h + 3),
    "lgamma": lambda h: lax.lgamma(h + 3),
    "erfc": lax.erfc,
    "igamma": lambda h: lax.igamma(jnp.full_like(h, 2.5), h + 2),
    "igammac": lambda h: lax.igammac(jnp.full_like(h, 2.5), h + 2),
    "polygamma": lambda h: lax.polygamma(jnp.ones_like(h), h + 3),
    "complex, real, imag, conj": lambda h: (
        lax.real(lax.conj(lax.complex(h, h * h))) + lax.imag(lax.complex(h, h * h)) ** 2
    ),
    "bitcast_convert_type": lambda h: lax.bitcast_convert_type(h, jnp.float64) * h,
}


@pytest.mark.parametrize("g", _NOW_SPARSE.values(), ids=_NOW_SPARSE.keys())
def test_the_sparse_sweep_keeps_every_elementwise_primitive_sparse(g):
    u, x = _per_particle(g), _x()
    np.testing.assert_allclose(
        jax.jit(lambda z: sparse_laplacian(u, z))(x), _brute(u, x), rtol=1e-9, atol=1e-12
    )
    # Expanded to the dense terms at the primitive, the cost was 0.47-0.68 of the dense sweep's.
    assert sparse_cost(u, x, against_colors=False) < 0.3


def test_the_primitives_of_the_sweeps_come_from_one_table():
    from divjac._core import rules as D

    for name, fact in _ops.ELEMENTWISE.items():
        rule = _table.TABLE[name][0]
        if name != "select_n":  # a select reads its known predicate: a finer rule
            assert rule is (D.nothing_rule if fact.constant else D.elementwise_rule), name
        assert _detect._fused(name)


def test_zero_derivative_elementwise_primitives_are_fused_in_the_memory_estimate():
    """``floor`` and its kin are element-wise work XLA fuses: not written out (they were
    counted as materialized before the one table)."""

    def f(x):
        return jnp.tanh(jnp.floor(jnp.sin(x)) + jnp.sign(x) + lax.stop_gradient(x))

    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 8))).jaxpr
    kept = _detect._materialized(jaxpr)
    assert {e.primitive.name for e in jaxpr.eqns if any(v in kept for v in e.outvars)} == {"tanh"}


def test_a_checkpointed_call_is_swept_inline_with_shared_directions():
    """``remat2`` is one of the calls (:data:`divjac.jax._ops.CALLS`) the first-order push of
    directions shared by the samples now runs inline, as the Taylor sweep does."""
    w1, w2 = _weights()
    u = lambda x: jnp.tanh(jax.checkpoint(lambda z: z @ jnp.tile(w1, (N, 1)))(x)) @ w2  # noqa: E731
    x = _x()
    shared = jnp.eye(N * DIM, dtype=x.dtype)[:, None]
    _, first, second = second_order_sweep(u, x, shared)
    np.testing.assert_allclose(second, _brute(u, x), rtol=1e-10)
    np.testing.assert_allclose(
        first[:, :],
        jax.vmap(lambda v: jax.jvp(u, (x,), (v,))[1])(
            jnp.broadcast_to(shared, (N * DIM, *x.shape))
        ),
        rtol=1e-12,
    )
