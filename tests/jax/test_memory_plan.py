"""The chunk planner's estimate of one pass (JAX) against what XLA keeps: the program's live
peak (not the sum of its intermediates), and, where a gradient flows through the passes, its
kept intermediates plus that peak. XLA's memory analysis is deterministic on CPU: a pass's
bytes are the growth of the compiled call's temporaries from chunk 4 to chunk 8, over 4."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import divjac.jax as dj
from divjac._core import plan
from divjac.jax._detect import _kept_elements, _live_peak
from divjac.models import jax as models


@pytest.fixture
def planned(monkeypatch):
    """The bytes per pass the planner is given, call by call."""
    seen = []
    original = plan.choose_chunk_size

    def spy(n_passes, bytes_per_pass, chunk_size, **kwargs):
        seen.append(bytes_per_pass)
        return original(n_passes, bytes_per_pass, chunk_size, **kwargs)

    monkeypatch.setattr(plan, "choose_chunk_size", spy)
    return seen


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _mlp():
    key = jax.random.key(0)
    params = models.init_mlp(key, (16, 64, 64, 16), jnp.float64)
    return models.mlp, params, jax.random.normal(key, (16, 16), jnp.float64)


def _cnn():
    key = jax.random.key(0)
    params = models.init_cnn(key, channels=8, dtype=jnp.float64)
    return models.cnn, params, jax.random.normal(key, (4, 8, 8, 3), jnp.float64)


@pytest.mark.parametrize("model", [_mlp, _cnn])
@pytest.mark.parametrize("grad", [False, True])
def test_the_estimate_is_within_2x_of_xlas_temporaries_per_pass(model, grad, planned):
    f, params, x = model()

    def at(chunk):
        def call(p, x):
            return dj.divergence(f, 1, method="sparse", chunk_size=chunk)(p, x)

        fn = jax.grad(lambda p, x: jnp.sum(call(p, x))) if grad else call
        return _temp_bytes(fn, params, x)

    per_pass = (at(8) - at(4)) / 4
    assert per_pass > 0
    assert len(set(planned)) == 1  # the estimate does not depend on the chunk
    assert 0.5 <= planned[0] / per_pass <= 2


def test_a_differentiated_pass_is_planned_larger(planned):
    f, params, x = _mlp()
    transform = dj.divergence(f, 1, method="sparse", chunk_size=4)
    jax.jit(transform)(params, x)
    jax.jit(jax.grad(lambda p: jnp.sum(transform(p, x))))(params)
    evaluated, differentiated = planned
    assert differentiated > 2 * evaluated


def test_an_eager_grad_is_planned_as_under_jit(planned):
    """An eager ``jax.grad`` through a transform runs it as its own compiled program, whose
    trace cannot see the differentiation: it is planned for the backward all the same."""
    f, params, x = _mlp()
    transform = dj.divergence(f, 1, method="sparse", chunk_size=4)

    def loss(p):
        return jnp.sum(transform(p, x))

    jitted = jax.jit(jax.grad(loss))(params)
    under_jit = planned[-1]
    eager = jax.grad(loss)(params)
    assert planned[-1] == under_jit
    for got, expected in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-12)
    transform(params, x)  # evaluated eagerly: another program, planned without the backward
    assert planned[-1] < under_jit / 2


def _jaxpr(f, n=10):
    return jax.make_jaxpr(f)(jnp.ones(n)).jaxpr


W = jnp.eye(10) / 2
"""A matrix: its products are stored (XLA fuses no elementwise work into them)."""


def test_live_peak_of_a_chain_holds_two_values_at_once():
    chain = _jaxpr(lambda x: ((x @ W) @ W) @ W)
    assert _live_peak(chain) == 20  # an operation's input and output
    assert _kept_elements(chain) == 30


def test_live_peak_keeps_a_skip_connection_alive():
    def skip(x):
        y = x @ W
        z = (y @ W) @ W
        return z + y  # y alive across both products

    jaxpr = _jaxpr(skip)
    assert _live_peak(jaxpr) == 30  # y, z and their sum; the first product is freed by then
    assert _kept_elements(jaxpr) == 40


def test_fused_elementwise_work_is_not_stored():
    """XLA computes elementwise work that only elementwise work or a reduction reads inside its
    reader's loop: of sin -> cos -> exp only the result is stored; what a product reads is."""
    assert _live_peak(_jaxpr(lambda x: jnp.exp(jnp.cos(jnp.sin(x))))) == 10
    assert _kept_elements(_jaxpr(lambda x: jnp.exp(jnp.cos(jnp.sin(x))))) == 10
    assert _live_peak(_jaxpr(lambda x: jnp.sum(jnp.cos(x + 1.0)))) == 1
    into_product = _jaxpr(lambda x: jnp.tanh(jnp.sin(x) @ W))
    assert _live_peak(into_product) == 20  # sin's result, read by the product, and the product
    assert _kept_elements(into_product) == 30


def test_live_peak_counts_a_nested_program_at_its_call_site():
    inner = jax.jit(lambda x: ((x @ W) @ W) @ W)

    def outer(x):
        y = x @ W
        return inner(y) + y

    jaxpr = _jaxpr(outer)
    # y alive (10) while the nested program peaks at 20; then y, its result and the sum.
    assert _live_peak(jaxpr) == 30
    assert _live_peak(jaxpr) <= _kept_elements(jaxpr)


def test_a_scan_body_is_kept_once_per_iteration():
    def scanned(x):
        return jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=5)[0]

    jaxpr = _jaxpr(scanned)
    assert _kept_elements(jaxpr) == 10 + 5 * 10  # the scan's result, the body's sin 5 times
    assert _live_peak(jaxpr) == 10
