"""Stochastic divergence in JAX: unbiased, calibrated, reproducible, differentiable, exact probing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import divjac
from divjac.jax import divergence, value_and_divergence
from divjac.models import jax as models
from tests.reference import jax_diagonal_blocks, traces

METHODS = [
    ("hutchinson", "rademacher", 4),
    ("hutchinson", "gaussian", 4),
    ("hutchinson", "sphere", 4),
    ("hutch++", "rademacher", 3),
    ("xtrace", "rademacher", 4),
    ("xtrace", "sphere", 4),
    ("probing", "rademacher", 4),
]


def _mlp():
    params = models.init_mlp(jax.random.key(0), (6, 12, 6), jnp.float64)
    x = jax.random.normal(jax.random.key(1), (3, 6))
    exact = traces(jax_diagonal_blocks(models.mlp, (params, x), 1), (6,))
    return params, x, exact


def _single_term(method, num_probes):
    """Hutch++ at 3 matvecs (its only estimate at n = 6) rests on one term, XTrace at 4 on two
    (its only estimate at n = 6; a stderr needs 6 matvecs): no stderr."""
    return (method, num_probes) in (("hutch++", 3), ("xtrace", 4))


def _estimates(method, distribution, num_probes, params, x, n_keys, seed=0):
    with_stderr = not _single_term(method, num_probes)
    div = divergence(
        models.mlp,
        1,
        method=method,
        distribution=distribution,
        num_probes=num_probes,
        return_stderr=with_stderr,
    )
    keys = jax.random.split(jax.random.key(seed), n_keys)
    out = jax.jit(jax.vmap(lambda k: div(k, params, x)))(keys)
    return out if with_stderr else (out, None)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "distribution", "num_probes"), METHODS)
def test_estimators_are_unbiased(method, distribution, num_probes):
    params, x, exact = _mlp()
    estimates, _ = _estimates(method, distribution, num_probes, params, x, 2000)
    mean = estimates.mean(axis=0)
    sem = estimates.std(axis=0, ddof=1) / np.sqrt(len(estimates))
    assert np.all(sem > 0)
    np.testing.assert_array_less(np.abs(mean - exact), 4 * sem + 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "num_probes", "terms"),
    [("hutchinson", 16, 16), ("hutch++", 24, 8), ("xtrace", 16, 8)],
)
def test_stderr_is_calibrated(method, num_probes, terms):
    params = models.init_mlp(jax.random.key(2), (30, 40, 30), jnp.float64)
    x = jax.random.normal(jax.random.key(3), (2, 30))
    exact = traces(jax_diagonal_blocks(models.mlp, (params, x), 1), (30,))
    estimates, stderr = _estimates(method, "rademacher", num_probes, params, x, 1500)
    z = (estimates - exact) / stderr
    # z is at most as spread as a Student-t with terms - 1 degrees of freedom (variance
    # (m - 1) / (m - 3)): Hutchinson's and Hutch++'s variance is the larger of two unbiased
    # estimates, XTrace's never below its naive one, so z is somewhat lighter (conservative).
    expected = (terms - 1) / (terms - 3)
    assert 0.4 * expected < float(np.var(z)) < 1.3 * expected
    ratio = np.sqrt(np.mean((estimates - exact) ** 2)) / np.sqrt(np.mean(stderr**2))
    assert 0.65 < ratio < 1.25


@pytest.mark.slow
def test_hutchpp_and_xtrace_are_exact_on_low_rank_jacobians():
    U = jax.random.normal(jax.random.key(4), (20, 3))
    V = jax.random.normal(jax.random.key(5), (20, 3))
    f = lambda x: x @ V @ U.T  # noqa: E731  rank-3 per-sample Jacobian U V^T
    x = jax.random.normal(jax.random.key(6), (4, 20))
    exact = jnp.trace(U @ V.T) * jnp.ones(4)
    key = jax.random.key(7)
    for method, budget in [("hutch++", 12), ("xtrace", 10)]:
        got = divergence(f, method=method, num_probes=budget)(key, x)
        np.testing.assert_allclose(got, exact, rtol=1e-8)
    rough = divergence(f, method="hutchinson", num_probes=12)(key, x)
    assert np.max(np.abs(rough - exact)) > 1e-3


@pytest.mark.slow
def test_probing_with_a_valid_diagonal_coloring_is_exact():
    params = models.init_cnn(
        jax.random.key(8), channels=2, layers=1, in_channels=2, out_channels=2, dtype=jnp.float64
    )
    x = jax.random.normal(jax.random.key(9), (3, 8, 8, 2))
    exact = traces(jax_diagonal_blocks(models.cnn, (params, x), 1), (8, 8, 2))
    div, err = divergence(models.cnn, 1, method="probing", num_probes=8, return_stderr=True)(
        jax.random.key(10), params, x
    )  # 4C = 8 diagonal colors fit the budget: exact, zero variance
    np.testing.assert_allclose(div, exact, rtol=1e-10)
    np.testing.assert_array_equal(err, 0.0)


@pytest.mark.slow
def test_probing_beats_hutchinson_when_the_jacobian_is_concentrated_near_the_diagonal():
    """A U-Net's Jacobian is structurally dense but numerically local: probing with far-apart
    colors (channels never split) has far lower variance than Hutchinson at equal passes."""
    params = models.init_unet(jax.random.key(11), channels=4, dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(12), (2, 16, 16, 3))
    exact = np.asarray(divergence(models.unet, 1, method="exact")(params, x))
    keys = jax.random.split(jax.random.key(13), 100)

    def mse(method):
        div = divergence(models.unet, 1, method=method, num_probes=27)
        est = jax.jit(jax.vmap(lambda k: div(k, params, x)))(keys)
        return np.mean((np.asarray(est) - exact) ** 2)

    assert mse("probing") < mse("hutchinson") / 5


@pytest.mark.slow
def test_probing_distance_option():
    params = models.init_cnn(jax.random.key(14), channels=2, layers=2, dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(15), (2, 8, 8, 3))
    exact = np.asarray(divergence(models.cnn, 1, method="exact")(params, x))
    # Radius-2 receptive field: distance 2 on the image axes, channels whole, is exact.
    div, err = divergence(
        models.cnn, 1, method="probing", num_probes=27, probing_distance=(2, 2, None),
        return_stderr=True,
    )(jax.random.key(16), params, x)  # fmt: skip
    np.testing.assert_allclose(div, exact, rtol=1e-10)
    np.testing.assert_array_equal(err, 0.0)  # recognized as a valid diagonal coloring


def test_probing_refuses_an_error_bar_from_one_repetition():
    """A budget that pays for one repetition of the colors gives one term per color: no error
    bar (as Hutchinson at one probe); the error names the least budget that gives one."""
    params = models.init_cnn(jax.random.key(14), channels=2, layers=2, dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(15), (2, 8, 8, 3))
    options = dict(method="probing", num_probes=12, probing_distance=(1, 1, None))
    with pytest.raises(divjac.NumProbesError, match="num_probes >= 24"):
        divergence(models.cnn, 1, return_stderr=True, **options)(jax.random.key(16), params, x)
    assert np.all(np.isfinite(divergence(models.cnn, 1, **options)(jax.random.key(16), params, x)))
    div, err = divergence(models.cnn, 1, return_stderr=True, **{**options, "num_probes": 24})(
        jax.random.key(16), params, x
    )
    assert np.all(np.isfinite(div)) and np.all(err > 0)


@pytest.mark.slow
def test_same_key_or_same_probes_give_the_same_estimate():
    params, x, _ = _mlp()
    div = divergence(models.mlp, 1, method="hutch++", num_probes=3)  # 3 < n=6: an estimate
    key = jax.random.key(14)
    np.testing.assert_array_equal(div(key, params, x), div(key, params, x))
    assert not np.allclose(div(key, params, x), div(jax.random.key(15), params, x))
    probes = jax.random.normal(key, (2, *x.shape))  # hutch++ with 3 matvecs: 2 random vectors
    np.testing.assert_array_equal(div(probes, params, x), div(probes, params, x))
    one = jax.random.rademacher(key, x.shape, jnp.float64)
    hutch = divergence(models.mlp, 1, method="hutchinson", num_probes=1)
    J = jax_diagonal_blocks(models.mlp, (params, x), 1)
    np.testing.assert_allclose(
        hutch(one, params, x), np.einsum("bi,bij,bj->b", one, J, one), rtol=1e-12
    )


@pytest.mark.parametrize(("method", "num_probes"), [(m, n) for m, _, n in METHODS])
def test_value_and_divergence_with_every_method(method, num_probes):
    params, x, _ = _mlp()
    fn = value_and_divergence(
        models.mlp, 1, method=method, num_probes=num_probes, return_stderr=True
    )
    if _single_term(method, num_probes):
        with pytest.raises(divjac.NumProbesError, match="num_probes >= 6"):
            fn(jax.random.key(16), params, x)
        return
    value, (div, err) = fn(jax.random.key(16), params, x)
    np.testing.assert_allclose(value, models.mlp(params, x), rtol=1e-12)
    assert div.shape == err.shape == (3,)


@pytest.mark.slow
def test_gradients_wrt_params_match_brute_force_for_fixed_probes():
    params, x, _ = _mlp()
    probes = jax.random.rademacher(jax.random.key(17), (5, *x.shape), jnp.float64)

    def estimate(p):
        return jnp.sum(divergence(models.mlp, 1, method="hutchinson", num_probes=5)(probes, p, x))

    def brute(p):
        J = jax.vmap(jax.jacfwd(lambda xi: models.mlp(p, xi)))(x)
        return jnp.sum(jnp.einsum("kbi,bij,kbj->b", probes, J, probes) / 5)

    for g, e in zip(
        jax.tree.leaves(jax.grad(estimate)(params)),
        jax.tree.leaves(jax.grad(brute)(params)),
        strict=True,
    ):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_gradients_are_unbiased_in_expectation():
    params, x, _ = _mlp()

    def exact_loss(p):
        return jnp.sum(divergence(models.mlp, 1, method="exact")(p, x))

    def stochastic_loss(p, key):
        return jnp.sum(divergence(models.mlp, 1, method="hutchinson", num_probes=2)(key, p, x))

    keys = jax.random.split(jax.random.key(18), 3000)
    grads = jax.jit(jax.vmap(jax.grad(stochastic_loss), in_axes=(None, 0)))(params, keys)
    expected = jax.grad(exact_loss)(params)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        mean, sem = g.mean(0), g.std(0) / np.sqrt(g.shape[0])
        np.testing.assert_array_less(np.abs(mean - e), 5 * sem + 1e-9)


@pytest.mark.slow
def test_coupled_functions_with_stochastic_methods():
    x = jax.random.normal(jax.random.key(19), (4, 3))
    center = lambda x: jnp.tanh(x - x.mean(0))  # noqa: E731
    with pytest.raises(divjac.BatchCouplingError):
        divergence(center, method="hutchinson")(jax.random.key(0), x)
    with pytest.raises(divjac.BatchCouplingError):
        divergence(center, method="xtrace", num_probes=2, coupling="exact")(jax.random.key(0), x)
    # Independent probes per sample keep Hutchinson unbiased for the diagonal blocks.
    exact = traces(jax_diagonal_blocks(center, (x,)), (3,))
    div = divergence(center, method="hutchinson", num_probes=2, coupling="exact")
    keys = jax.random.split(jax.random.key(20), 4000)
    est = jax.jit(jax.vmap(lambda k: div(k, x)))(keys)
    sem = est.std(0) / np.sqrt(len(est))
    np.testing.assert_array_less(np.abs(est.mean(0) - exact), 4 * sem)


def test_xtrace_with_a_budget_of_n_matvecs_is_exact():
    """num_probes >= n pays for the n identity columns: the exact trace, standard error 0."""
    params, x, exact = _mlp()  # n = 6
    for num_probes in (6, 8, 12):
        div, err = divergence(
            models.mlp, 1, method="xtrace", num_probes=num_probes, return_stderr=True
        )(jax.random.key(21), params, x)
        np.testing.assert_allclose(div, exact, rtol=1e-12)
        np.testing.assert_array_equal(err, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "count", "budget"), [("hutchinson", 3, 3), ("hutch++", 4, 6), ("xtrace", 3, 6)]
)
def test_caller_probes_set_the_budget(method, count, budget):
    """``num_probes=None`` with the caller's probes: the budget they pay for (as the
    functionals do), the same estimate as the explicit ``num_probes``; odd Hutch++ refused."""
    params = models.init_mlp(jax.random.key(0), (12, 9, 12), jnp.float64)
    x = jax.random.normal(jax.random.key(1), (2, 12), jnp.float64)
    probes = jax.random.rademacher(jax.random.key(2), (count, *x.shape), jnp.float64)
    inferred = divergence(models.mlp, 1, method=method)(probes, params, x)
    given = divergence(models.mlp, 1, method=method, num_probes=budget)(probes, params, x)
    np.testing.assert_allclose(inferred, given, rtol=1e-12)
    if method == "hutch++":
        with pytest.raises(divjac.NumProbesError, match="even number"):
            divergence(models.mlp, 1, method=method)(probes[:3], params, x)


def _shapes(jaxpr) -> set[tuple[int, ...]]:
    found = {tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars}
    for eqn in jaxpr.eqns:
        for sub in jcore.jaxprs_in_params(eqn.params):
            found |= _shapes(sub)
    return found


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_one_probe_is_one_plain_pass(mode):
    """A single probe runs the program hand-written code runs (one JVP or VJP, no pass axis of
    one; with it a jitted diffrax CNF training step took 1.11-1.24x that code's time), with
    its value and gradients."""
    params, x, _ = _mlp()
    probe = jax.random.rademacher(jax.random.key(18), (1, *x.shape), jnp.float64)
    fn = value_and_divergence(models.mlp, 1, method="hutchinson", num_probes=1, mode=mode)

    def loss(p, z):
        y, div = fn(probe, p, z)
        return jnp.sum(y**2) + jnp.sum(jnp.sin(div))

    def hand(p, z):
        y, pushed = jax.jvp(lambda u: models.mlp(p, u), (z,), (probe[0],))
        return jnp.sum(y**2) + jnp.sum(jnp.sin(jnp.sum(pushed * probe[0], axis=1)))

    width = params[0][0].shape[1]
    shapes = _shapes(jax.make_jaxpr(jax.grad(loss, (0, 1)))(params, x).jaxpr)
    assert (x.shape[0], width) in shapes
    assert (1, x.shape[0], width) not in shapes
    for ours, theirs in zip(
        jax.tree.leaves(jax.grad(loss, (0, 1))(params, x)),
        jax.tree.leaves(jax.grad(hand, (0, 1))(params, x)),
        strict=True,
    ):
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-13)


def _equations(jaxpr) -> int:
    """Equations of ``jaxpr`` and of every program inside it."""
    return sum(
        1 + sum(_equations(sub) for sub in jcore.jaxprs_in_params(eqn.params)) for eqn in jaxpr.eqns
    )


@pytest.mark.parametrize(
    ("transform", "sizes"),
    [
        ("bilaplacian", (8, 64)),  # num_probes
        ("log_abs_det", (4, 12)),  # lanczos_steps
    ],
)
def test_probes_and_lanczos_steps_do_not_grow_the_program(transform, sizes):
    """Probes are a batch axis and Lanczos steps one loop: the traced program is the same
    size at 8 probes as at 64, at 4 Lanczos steps as at 12 (unrolled, the bi-Laplacian's first
    call took 4.2 s at 8 probes and 24 s at 128, SLQ's 18 s at 100 steps)."""
    from divjac.jax import bilaplacian, log_abs_det

    params = models.init_mlp(jax.random.key(0), (12, 9, 12), jnp.float64)
    x = jax.random.normal(jax.random.key(1), (2, 12), jnp.float64)

    def made(size):
        if transform == "bilaplacian":
            u = lambda z: models.mlp(params, z).sum(1)  # noqa: E731
            fn = bilaplacian(u, method="hutchinson", num_probes=size)
        else:
            f = lambda z: z + models.mlp(params, z)  # noqa: E731
            fn = log_abs_det(f, method="slq", num_probes=3, lanczos_steps=size)
        return _equations(jax.make_jaxpr(fn)(jax.random.key(2), x).jaxpr)

    small, large = (made(size) for size in sizes)
    assert small == large, (small, large)
