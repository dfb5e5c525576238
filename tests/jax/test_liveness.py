"""The jaxpr interpreter releases dependency sets after their last use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from divjac._core import rules as D
from divjac._errors import InternalError
from divjac.jax import _interpret, sparsity
from divjac.jax._jaxpr import Scope
from tests.jax.test_sparsity import assert_sound


def _chain(x):
    for _ in range(40):
        x = jnp.sin(x) * 1.1
    return x


def _skips(x):
    """Skip connections: early values read again at the end (a U-Net's)."""
    a = jnp.tanh(x)
    b = jnp.roll(a, 1, axis=-1) * a
    c = jnp.cumsum(jnp.sin(b), axis=-1)
    return c + jnp.flip(a, -1) + x


def _scanned(x):
    def step(carry, _):
        return jnp.tanh(carry) + jnp.roll(carry, 1, axis=-1), None

    out, _ = jax.lax.scan(step, x, None, length=3)
    return out * x


@pytest.fixture
def live_counts(monkeypatch):
    """The number of variables holding dependency sets before each equation (top level)."""
    counts: list[int] = []
    original = _interpret.Interpreter._eqn

    def counting(self, scope, eqn, ins):
        counts.append(len(scope.deps))
        return original(self, scope, eqn, ins)

    monkeypatch.setattr(_interpret.Interpreter, "_eqn", counting)
    return counts


def _x(shape):
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape))


def test_a_chain_holds_a_bounded_number_of_dependency_sets(live_counts):
    pattern = sparsity(_chain)(_x((2, 5)))
    assert pattern.nnz == 5  # element-wise
    assert len(live_counts) >= 80
    assert max(live_counts) <= 3  # without release: one per equation


@pytest.mark.parametrize("f", [_skips, _scanned])
def test_values_read_later_are_kept(f):
    pattern = assert_sound(f, _x((2, 3, 6)))
    assert pattern.is_batch_independent


def test_every_variable_is_released_once_after_its_last_reader():
    jaxpr = jax.make_jaxpr(_skips)(_x((2, 6))).jaxpr
    done = _interpret.last_uses(jaxpr)
    at = {v: i for i, group in enumerate(done) for v in group}
    assert sum(len(group) for group in done) == len(at)  # once each
    assert not set(jaxpr.outvars) & set(at)  # the outputs are kept
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if v in at:
                assert at[v] >= i
        for v in eqn.outvars:
            if v not in jaxpr.outvars:
                assert at[v] >= i


def test_reading_released_dependency_sets_raises():
    jaxpr = jax.make_jaxpr(_skips)(_x((2, 6))).jaxpr
    scope = Scope(_interpret.Interpreter(3), jaxpr)
    var = jaxpr.eqns[0].outvars[0]
    scope.deps[var] = D.from_labels((2, 6), np.zeros(12, np.int64), 3)
    scope.release(var)
    assert scope.value(var) is None  # a released variable depended on the labels
    with pytest.raises(InternalError, match="after their last use"):
        scope.read(var)
