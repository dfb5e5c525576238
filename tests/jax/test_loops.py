"""Sparsity of loops (``lax.scan``, ``lax.while_loop``, ``lax.fori_loop``) against brute force.

The truth is the union of the nonzeros of the dense batched Jacobian (``jacfwd``, float64) at a
few random points. A detected pattern must contain it in every sample's block, report coupling
whenever an off-diagonal block has a nonzero, and (where the loop's structure is what its
values give: no structural zero) equal it. Loops of unknown trip count are compared with the
union over trip counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

import divjac
from divjac._core.rules import control
from divjac.jax import jacobian, sparsity

SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)


def _points(shape, n=2, seed=0):
    rng = np.random.default_rng(seed)
    return [
        jnp.asarray(rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)) for _ in range(n)
    ]


def truth(f, shape, points=2):
    """``(nonzeros of one sample's block, union over samples (n_out, n_in); coupled?)``."""
    block, coupled = None, False
    jacobian_of = jax.jit(jax.jacfwd(f))
    for x in _points(shape, points):
        B, n_in = shape[0], int(np.prod(shape[1:]))
        J = np.abs(np.asarray(jacobian_of(x)).reshape(B, -1, B, n_in)) > 0
        diag = J[np.arange(B), :, np.arange(B), :].any(0)
        block = diag if block is None else block | diag
        J[np.arange(B), :, np.arange(B), :] = False
        coupled |= bool(J.any())
    return block, coupled


def detected(f, shape):
    pattern = sparsity(f)(_points(shape, 1, seed=7)[0])
    return pattern.csr.toarray().astype(bool), pattern


def check(f, shape, *, exact=True, points=2):
    """The pattern covers the truth (equals it when ``exact``); returns both."""
    want, coupled = truth(f, shape, points)
    got, pattern = detected(f, shape)
    want = want.reshape(got.shape)
    missed = want & ~got
    assert not missed.any(), f"misses {missed.sum()} nonzeros"
    assert pattern.is_batch_independent == (not coupled)
    if exact:
        assert (got == want).all(), f"{(got & ~want).sum()} spurious entries of {got.size}"
    return want, got


def shift(h, k):
    """``h`` moved by ``k`` along its last axis, zero filled (a local coupling)."""
    pad = [(0, 0)] * (h.ndim - 1)
    if abs(k) >= h.shape[-1]:
        return jnp.zeros_like(h)
    if k > 0:
        return jnp.pad(h[..., :-k], [*pad, (k, 0)])
    return jnp.pad(h[..., -k:], [*pad, (0, -k)])


def time_major(f):
    """``f`` over ``xs (T, B, ...)`` as a function of ``x (B, T, ...)``, outputs back to batch-first."""
    return lambda x: jax.tree.map(lambda y: jnp.swapaxes(y, 0, 1), f(jnp.swapaxes(x, 0, 1)))


def unrolled_scan(f, init, xs, length=None, reverse=False):
    """``lax.scan`` as a Python loop: what the traced program would be with every step written."""
    length = length if xs is None else jax.tree.leaves(xs)[0].shape[0]
    carry, ys = init, []
    for t in range(length - 1, -1, -1) if reverse else range(length):
        carry, y = f(carry, None if xs is None else jax.tree.map(lambda x, t=t: x[t], xs))
        ys.append(y)
    ys = ys[::-1] if reverse else ys
    return carry, None if ys[0] is None else jax.tree.map(lambda *y: jnp.stack(y), *ys)


def local_rnn(x, steps_back=False, scan=lax.scan):
    """A tridiagonal recurrence: ``h_t = tanh(0.5 h + 0.3 h[i-1] + 0.2 h[i+1] + x_t)``."""

    def step(h, xt):
        h = jnp.tanh(0.5 * h + 0.3 * shift(h, 1) + 0.2 * shift(h, -1) + xt)
        return h, h

    return scan(step, jnp.ones(x.shape[1:]), x, reverse=steps_back)[1]


def rolled(x, scan=lax.scan):
    def step(h, xt):
        h = jnp.sin(jnp.roll(h, 1, -1) + xt)
        return h, 2 * h

    return scan(step, jnp.ones(x.shape[1:]), x)[1]


def cumulative(x, scan=lax.scan):
    c, ys = scan(lambda c, xt: (c + xt, c * xt), x[0], x)
    return ys * c


def dense_carry(x, scan=lax.scan):
    def step(h, xt):
        h = jnp.tanh(h + 0.1 * jnp.sum(h, -1, keepdims=True) + xt)
        return h, h

    return scan(step, jnp.ones(x.shape[1:]), x)[1]


def two_carries(x, scan=lax.scan):
    """Two carries, two xs (one reversed), two ys and the carries out."""

    def step(c, xt):
        (a, b), (u, v) = c, xt
        a2 = jnp.tanh(a + shift(b, 1) * u)
        b2 = 0.9 * b + v
        return (a2, b2), (a2 * v, b2 + u)

    (a, b), (y1, y2) = scan(step, (x[0], x[1]), (x, 2 * x[::-1]))
    return jnp.concatenate([y1, y2, a[None], b[None]], 0)


def nested(x, scan=lax.scan):
    def outer(h, xt):
        g = scan(lambda g, _: (jnp.tanh(g + 0.5 * shift(g, 1)), None), h + xt, None, length=3)[0]
        return g, g

    return scan(outer, jnp.ones(x.shape[1:]), x)[1]


def consts_and_carry(x, scan=lax.scan):
    """The body reads the whole (time-major) input as a constant, and a slice of it as ``x``."""
    first = x[0]

    def step(h, xt):
        h = jnp.tanh(shift(h, 1) + xt * first)
        return h, h + first

    return scan(step, jnp.zeros(x.shape[1:]), x)[1]


SCANS = {  # (time-major function, (B, T, n), exact)
    "local_rnn_40": (local_rnn, (2, 40, 12), True),
    "local_rnn_reverse": (lambda x, scan=lax.scan: local_rnn(x, True, scan), (2, 24, 10), True),
    "roll": (rolled, (2, 30, 8), True),
    "cumulative": (cumulative, (2, 20, 5), True),
    "dense_carry": (dense_carry, (2, 24, 6), True),
    "two_carries": (two_carries, (2, 20, 6), False),  # the rules' own structural zeros
    "nested": (nested, (2, 20, 10), True),
    "consts_and_carry": (consts_and_carry, (2, 20, 6), True),
}


@pytest.mark.parametrize("name", sorted(SCANS))
def test_scans_are_exact(name):
    """Sound, equal to the truth where the rules have no structural zero, and equal to the
    pattern of the same program with its steps written out."""
    f, shape, exact = SCANS[name]
    _, got = check(time_major(f), shape, exact=exact)
    written, _ = detected(time_major(lambda x: f(x, scan=unrolled_scan)), shape)
    assert (got == written).all()


def test_a_40_step_local_rnn_stays_sparse():
    want, got = check(time_major(local_rnn), (2, 40, 16))
    assert got.mean() == want.mean() < 0.5


def _fori(steps):
    return lambda x: lax.fori_loop(0, steps, lambda i, c: jnp.tanh(0.5 * shift(c, 1) + c), x)


def test_fori_loop_of_static_length_is_exact():
    check(_fori(40), (2, 60))


def test_dynamic_trip_count_covers_every_trip_count():
    """A trip count that depends on the values: the pattern is the union over trip counts (the
    least fixpoint), no more."""

    def f(x):
        steps = 2 + (jnp.sum(x) > 0).astype(jnp.int32)
        return lax.fori_loop(0, steps, lambda i, c: jnp.tanh(0.5 * shift(c, 1) + c), x)

    got, _ = detected(f, (2, 6))
    union = np.zeros_like(got)
    for steps in range(7):  # 5 steps reach every element a shift can reach
        union |= truth(_fori(steps), (2, 6), points=1)[0].reshape(got.shape)
    assert (got == union).all()


def test_while_loop_of_a_rotation_is_dense_and_of_a_shift_lower_triangular():
    def loop(move):
        return lambda x: lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(move(c[1]) + c[1])), (0, x)
        )[1]

    got, _ = detected(loop(lambda h: jnp.roll(h, 1, -1)), (2, 7))
    assert got.all()
    got, _ = detected(loop(lambda h: shift(h, 1)), (2, 7))
    assert (got == np.tril(np.ones((7, 7), bool))).all()


@pytest.mark.parametrize("rounds", [1, 2, 64])
def test_widening_past_the_round_limit_stays_sound(monkeypatch, rounds):
    """A one-directional chain needs as many rounds as elements: past the limit, the groups that
    still grow are widened (to their connected part), the settled ones kept."""
    monkeypatch.setattr(control, "MAX_FIXPOINT_ROUNDS", rounds)
    divjac.jax.clear_caches()

    def f(x):
        def body(c):
            h, g = c[1], c[2]
            return c[0] + 1, jnp.sin(shift(h, 1) + h), g * 2  # g never grows

        return lax.while_loop(lambda c: c[0] < 3, body, (0, x[:, :8], x[:, 8:]))

    got, _ = detected(lambda x: jnp.concatenate(f(x)[1:], 1), (2, 12))
    chain = np.tril(np.ones((8, 8), bool))
    assert (got[:8, :8] >= chain).all() and not got[:8, 8:].any() and not got[8:, :8].any()
    assert (got[8:, 8:] == np.eye(4, dtype=bool)).all()
    assert (got[:8, :8] == chain).all() == (rounds >= 8)


def test_scans_past_the_entry_budget_are_merged_soundly(monkeypatch):
    monkeypatch.setattr(control, "SCAN_ENTRY_BUDGET", 1000)
    divjac.jax.clear_caches()
    f = time_major(local_rnn)
    want, got = check(f, (2, 30, 8), exact=False)
    assert (got[:8] == want[:8]).all()  # the first steps stay exact
    assert got.mean() < 1.0


@pytest.mark.slow
@SETTINGS
@given(
    st.integers(1, 20),
    st.integers(1, 6),
    st.lists(st.integers(-2, 2), min_size=1, max_size=3, unique=True),
    st.booleans(),
    st.booleans(),
)
def test_random_local_recurrences_are_exact(length, n, offsets, reverse, roll):
    move = (lambda h, k: jnp.roll(h, k, -1)) if roll else (lambda h, k: shift(h, k) if k else h)

    def f(x):
        def step(h, xt):
            h = jnp.tanh(sum((0.3 + 0.1 * k) * move(h, k) for k in offsets) + xt)
            return h, h * xt

        return lax.scan(step, jnp.ones(x.shape[1:]), x, reverse=reverse)[1]

    check(time_major(f), (2, length, n))


def test_a_scan_that_mixes_samples_raises():
    def f(x):
        step = lambda h, xt: (jnp.tanh(h + xt + jnp.mean(h, 0)), h)  # noqa: E731
        return lax.scan(step, jnp.ones(x.shape[1:]), x)[1]

    _, pattern = detected(time_major(f), (3, 20, 4))
    assert not pattern.is_batch_independent
    check(time_major(f), (3, 20, 4), exact=False)
    with pytest.raises(divjac.BatchCouplingError):
        jacobian(time_major(f))(_points((3, 20, 4), 1)[0])
