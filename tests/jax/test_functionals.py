"""Squared Frobenius norms, divergence + Frobenius from one set of passes, and log|det J| in JAX,
against float64 brute force (values and gradients), with calibrated error bars."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from divjac._core import plan
from divjac._core.estimators._common import t_factor
from divjac.jax import (
    divergence,
    log_abs_det,
    sparsity,
    squared_frobenius_norm,
    value_divergence_and_frobenius,
)
from divjac.models import jax as models
from tests.reference import jax_diagonal_blocks

EXACT = [("exact", "fwd"), ("exact", "rev"), ("sparse", "fwd"), ("sparse", "rev"), ("auto", "auto")]


def _stencil(params, x):
    """A banded map whose pattern has a structurally zero diagonal: ``y_i = w x_{i+1}^2 +
    tanh(x_{i-1})`` (the diagonal coloring and the column coloring of ``P`` differ from that of
    ``P + I``)."""
    nxt = jnp.pad(x[:, 1:], ((0, 0), (0, 1)))
    prv = jnp.pad(x[:, :-1], ((0, 0), (1, 0)))
    return params * nxt**2 + jnp.tanh(prv)


def _mlp_case(d_in=5, d_out=5):
    params = models.init_mlp(jax.random.key(0), (d_in, 9, d_out), jnp.float64)
    x = jax.random.normal(jax.random.key(1), (3, d_in), jnp.float64)
    return models.mlp, params, x


def _blocks(f, params, x):
    return jax_diagonal_blocks(f, (params, x), 1).reshape(x.shape[0], -1, x[0].size)


def _reference(f):
    """Differentiable brute force: the per-sample Jacobians by a vmapped dense jacfwd."""
    return jax.vmap(jax.jacfwd(lambda p, xb: f(p, xb[None])[0], 1), (None, 0))


@pytest.mark.parametrize(("method", "mode"), EXACT)
@pytest.mark.parametrize("case", ["mlp", "wide", "stencil"])
def test_squared_frobenius_norm_exact(case, method, mode):
    if case == "stencil":
        f, params, x = _stencil, jnp.float64(1.5), jax.random.normal(jax.random.key(2), (4, 11))
    else:
        f, params, x = _mlp_case(*((4, 7) if case == "wide" else (5, 5)))
    expected = (_blocks(f, params, x) ** 2).sum((1, 2))
    got = squared_frobenius_norm(f, 1, method=method, mode=mode)(params, x)
    np.testing.assert_allclose(got, expected, rtol=1e-12)


@pytest.mark.parametrize(("method", "mode"), EXACT)
@pytest.mark.parametrize("case", ["mlp", "stencil"])
def test_value_divergence_and_frobenius_exact(case, method, mode):
    if case == "stencil":
        f, params, x = _stencil, jnp.float64(1.5), jax.random.normal(jax.random.key(2), (4, 11))
    else:
        f, params, x = _mlp_case()
    blocks = _blocks(f, params, x)
    y, div, sq = value_divergence_and_frobenius(f, 1, method=method, mode=mode)(params, x)
    np.testing.assert_allclose(y, f(params, x), rtol=1e-14)
    np.testing.assert_allclose(div, np.trace(blocks, axis1=1, axis2=2), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sq, (blocks**2).sum((1, 2)), rtol=1e-12)


def test_sparse_plan_takes_one_pass_per_color():
    """The stencil's 11 columns take 2 colors (column j meets j +- 2), 3 with the diagonal
    added for the trace (j then meets j +- 1 too)."""
    x = jax.random.normal(jax.random.key(2), (4, 11))
    pattern = sparsity(_stencil, 1)(1.5, x)
    for with_diagonal in (False, True):
        for direction, reverse in (("fwd", False), ("rev", True)):
            planned = plan.frobenius_plan(
                "auto", direction, 11, 11, pattern, with_diagonal=with_diagonal
            )
            assert (planned.reverse, planned.n_passes) == (reverse, 2 + with_diagonal)
    assert plan.frobenius_plan("exact", "auto", 11, 4, pattern).n_passes == 4  # rows: fewer


@pytest.mark.slow
def test_gradients_to_inputs_and_params():
    f, params, x = _mlp_case()
    ref = _reference(f)

    def brute(p, xx):
        J = ref(p, xx)
        return jnp.sum(J**2), jnp.sum(jnp.trace(J, axis1=1, axis2=2) * jnp.sum(J**2, (1, 2)))

    for method in ("exact", "sparse"):
        norm = squared_frobenius_norm(f, 1, method=method)
        both = value_divergence_and_frobenius(f, 1, method=method, mode="rev")
        g_p, g_x = jax.jit(jax.grad(lambda p, xx, n=norm: n(p, xx).sum(), (0, 1)))(params, x)
        e_p, e_x = jax.grad(lambda p, xx: brute(p, xx)[0], (0, 1))(params, x)
        for a, b in zip(jax.tree.leaves((g_p, g_x)), jax.tree.leaves((e_p, e_x)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)

        def product(p, xx, both=both):
            _, div, sq = both(p, xx)
            return jnp.sum(div * sq)

        g = jax.jit(jax.grad(product, (0, 1)))(params, x)
        e = jax.grad(lambda p, xx: brute(p, xx)[1], (0, 1))(params, x)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(e), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "distribution", "num_probes"), [("fwd", "rademacher", 4), ("rev", "gaussian", 2)]
)
def test_hutchinson_unbiased_and_calibrated(mode, distribution, num_probes):
    """2000 draws: mean within 4 standard errors of the truth; the error bars cover the
    divergence and the squared norm >= 94 % of the time within 2 stderr (the recipes
    of ``mean_and_stderr`` and ``squared_norm_mean_and_stderr`` on the images of all probes;
    docs/calibration.md). One probe's standard error is refused (``test_errors``)."""
    f, params, x = _mlp_case()
    blocks = _blocks(f, params, x)
    exact_sq, exact_div = (blocks**2).sum((1, 2)), np.trace(blocks, axis1=1, axis2=2)
    both = value_divergence_and_frobenius(
        f,
        1,
        method="hutchinson",
        mode=mode,
        distribution=distribution,
        num_probes=num_probes,
        return_stderr=True,
    )
    norm = squared_frobenius_norm(
        f, 1, method="hutchinson", mode=mode, distribution=distribution, num_probes=num_probes
    )
    keys = jax.random.split(jax.random.key(3), 2000)
    _, (div, div_se), (sq, sq_se) = jax.jit(jax.vmap(lambda k: both(k, params, x)))(keys)
    alone = jax.jit(jax.vmap(lambda k: norm(k, params, x)))(keys)
    np.testing.assert_allclose(alone, sq, rtol=1e-12)  # the same probes, the same terms
    for est, se, exact, level in ((div, div_se, exact_div, 0.94), (sq, sq_se, exact_sq, 0.94)):
        est, se = np.asarray(est), np.asarray(se)
        spread = est.std(0) / np.sqrt(len(est))
        assert np.all(np.abs(est.mean(0) - exact) < 4 * spread)
        assert np.all(np.mean(np.abs(est - exact) <= 2 * se, axis=0) >= level)
        assert np.all(np.isfinite(se)) and np.all(se > 0)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_hutchinson_budget_of_n_is_exact(mode):
    """``num_probes >= n`` pays for the exact answer, as in ``divergence``: the ``n``
    coordinate directions give the divergence and the squared norm exactly, stderr 0."""
    f, params, x = _mlp_case()
    blocks = _blocks(f, params, x)
    both = value_divergence_and_frobenius(
        f, 1, method="hutchinson", mode=mode, num_probes=7, return_stderr=True
    )
    _, (div, div_se), (sq, sq_se) = both(jax.random.key(0), params, x)
    np.testing.assert_allclose(div, np.trace(blocks, axis1=1, axis2=2), rtol=1e-12)
    np.testing.assert_allclose(sq, (blocks**2).sum((1, 2)), rtol=1e-12)
    assert np.all(np.asarray(div_se) == 0) and np.all(np.asarray(sq_se) == 0)


def test_frobenius_hutchinson_matches_divergence_probes():
    """The divergence of the combined call is the divergence transform's, from the same probes."""
    f, params, x = _mlp_case()
    probes = jax.random.rademacher(jax.random.key(4), (3, *x.shape), jnp.float64)
    _, div, _ = value_divergence_and_frobenius(f, 1, method="hutchinson", mode="fwd")(
        probes, params, x
    )
    alone = divergence(f, 1, method="hutchinson", mode="fwd", num_probes=3)(probes, params, x)
    np.testing.assert_allclose(div, alone, rtol=1e-12)


def test_an_unbatched_sample_is_the_batched_call_of_one():
    """``batch_axis=None``: scalars (and scalar error bars) equal to the batch of that sample."""
    f, params, x = _mlp_case()
    one = lambda p, xb: f(p, xb[None])[0]  # noqa: E731
    y, div, sq = value_divergence_and_frobenius(one, 1, batch_axis=None)(params, x[0])
    y_b, div_b, sq_b = value_divergence_and_frobenius(f, 1)(params, x[:1])
    assert div.shape == sq.shape == ()
    np.testing.assert_allclose(y, y_b[0], rtol=1e-14)
    np.testing.assert_allclose([div, sq], [div_b[0], sq_b[0]], rtol=1e-12)
    probes = jax.random.rademacher(jax.random.key(5), (3, *x[0].shape), jnp.float64)
    unbatched = value_divergence_and_frobenius(
        one, 1, batch_axis=None, method="hutchinson", return_stderr=True
    )(probes, params, x[0])
    batched = value_divergence_and_frobenius(f, 1, method="hutchinson", return_stderr=True)(
        probes[:, None], params, x[:1]
    )
    for (value, se), (value_b, se_b) in zip(unbatched[1:], batched[1:], strict=True):
        assert value.shape == se.shape == ()
        np.testing.assert_allclose([value, se], [value_b[0], se_b[0]], rtol=1e-12)
        assert se > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fwd", "rev", "auto"])
def test_log_abs_det_exact(mode):
    d = 5
    params = models.init_mlp(jax.random.key(0), (d, 9, d), jnp.float64)

    def flow(p, x):
        return x + 0.5 * models.mlp(p, x)

    x = jax.random.normal(jax.random.key(1), (4, d), jnp.float64)
    expected = np.linalg.slogdet(_blocks(flow, params, x))[1]
    got = log_abs_det(flow, 1, mode=mode, chunk_size=2)(params, x)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    ref = _reference(flow)
    g = jax.jit(jax.grad(lambda p, xx: log_abs_det(flow, 1, mode=mode)(p, xx).sum(), (0, 1)))(
        params, x
    )
    e = jax.grad(lambda p, xx: jnp.linalg.slogdet(ref(p, xx))[1].sum(), (0, 1))(params, x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(e), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)


def _flow_case(d=4):
    params = models.init_mlp(jax.random.key(5), (d, 12, d), jnp.float64)

    def flow(p, x):
        return 1.3 * x + 0.4 * models.mlp(p, x)

    x = jax.random.normal(jax.random.key(6), (3, d), jnp.float64)
    return flow, params, x


def _quadrature_reference(J, V):
    """``v^T log(J^T J) v / 2`` per sample and probe (dense eigendecomposition), ``(B, k)``."""
    w, U = jnp.linalg.eigh(jnp.swapaxes(J, 1, 2) @ J)
    logA = (U * jnp.log(w)[:, None, :]) @ jnp.swapaxes(U, 1, 2)
    return jnp.einsum("kbi,bij,kbj->bk", V, logA, V) / 2


@pytest.mark.slow
def test_slq_with_n_steps_is_the_quadratic_form_and_its_gradient():
    """With ``lanczos_steps = n`` the quadrature is exact: the estimate and its gradient are
    those of ``mean_k v_k^T log(J^T J) v_k / 2`` for the given probes."""
    flow, params, x = _flow_case()
    V = jax.random.normal(jax.random.key(7), (5, *x.shape), jnp.float64)
    slq = log_abs_det(flow, 1, method="slq", lanczos_steps=x.shape[1])
    ref = _reference(flow)
    np.testing.assert_allclose(
        slq(V, params, x), _quadrature_reference(ref(params, x), V).mean(1), rtol=1e-9
    )
    g = jax.jit(jax.grad(lambda p, xx: slq(V, p, xx).sum(), (0, 1)))(params, x)
    e = jax.jit(jax.grad(lambda p, xx: _quadrature_reference(ref(p, xx), V).mean(1).sum(), (0, 1)))(
        params, x
    )
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(e), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-10)


@pytest.mark.slow
def test_slq_unbiased_and_calibrated():
    """2000 draws of 4 probes: unbiased (4 Lanczos steps are exact at n = 4); >= 94 % within 2
    stderr (measured 0.989 over 16000 draws; 0.97-1.0 at 2-8 probes of either distribution)."""
    flow, params, x = _flow_case()
    exact = np.linalg.slogdet(_blocks(flow, params, x))[1]
    slq = log_abs_det(flow, 1, method="slq", num_probes=4, lanczos_steps=4, return_stderr=True)
    keys = jax.random.split(jax.random.key(8), 2000)
    est, se = jax.jit(jax.vmap(lambda k: slq(k, params, x)))(keys)
    est, se = np.asarray(est), np.asarray(se)
    assert np.all(np.abs(est.mean(0) - exact) < 4 * est.std(0) / np.sqrt(len(est)) + 1e-6)
    assert np.all(np.mean(np.abs(est - exact) <= 2 * se, axis=0) >= 0.94)


@pytest.mark.parametrize("differentiate", [False, True])
def test_slq_program_holds_one_eigh(differentiate):
    """The estimate with its stderr below ``n`` steps (two Gauss rules) and its gradient call one
    batched ``eigh``: two independent ones run at once on XLA:CPU, and jaxlib's LAPACK kernels
    wait for the thread pool they run on (the end-to-end calibration hung with 2 threads)."""
    W = jax.random.normal(jax.random.key(5), (12, 12))
    flow = lambda p, x: jnp.tanh(x @ (p * W))  # noqa: E731  (n = 12: 8 steps are below n)
    params, x = jnp.float32(0.5), jax.random.normal(jax.random.key(6), (3, 12))
    slq = log_abs_det(flow, 1, method="slq", num_probes=3, lanczos_steps=8, return_stderr=True)
    program = slq if not differentiate else jax.grad(lambda k, p, x: slq(k, p, x)[1].sum(), 1)
    jaxpr = str(jax.make_jaxpr(program)(jax.random.key(0), params, x))
    assert jaxpr.count("eigh[") == 1


@pytest.mark.slow
def test_slq_breakdown_is_exact():
    """``J = 2 I``: the Krylov space of every probe is one-dimensional (Lanczos breaks down at
    once); the estimate is exact and finite, as is its gradient. The terms agree, so the
    standard error is the shared recipe's floor ``s0 = kappa(k - 1) sqrt(2 sum ||B v||^2 / k^3)``
    (``B = log(A) / 2 = log(2) I``), kept for probes that coincide (docs/calibration.md),
    widened as one-signed terms are: ``s0 (1 + min(2 s0 / mean, 1) / 4)``."""
    x = jnp.ones((2, 4), jnp.float64)
    slq = log_abs_det(lambda s, x: s * x, 1, method="slq", num_probes=3, return_stderr=True)
    est, se = slq(jax.random.key(0), jnp.float64(2.0), x)
    np.testing.assert_allclose(est, 4 * np.log(2.0), rtol=1e-12)
    floor = t_factor(2) * np.sqrt(2 * 3 * 4 * np.log(2.0) ** 2 / 3**3)
    widened = floor * (1 + min(2 * floor / (4 * np.log(2.0)), 1.0) / 4)
    np.testing.assert_allclose(se, widened, rtol=1e-10)
    g = jax.jit(jax.grad(lambda s: slq(jax.random.key(0), s, x)[0].sum()))(jnp.float64(2.0))
    np.testing.assert_allclose(g, 2 * 4 / 2.0, rtol=1e-10)


def test_errors():
    f, params, x = _mlp_case(4, 7)
    from divjac import NonSquareJacobianError, NumProbesError, OptionError

    with pytest.raises(NonSquareJacobianError):
        log_abs_det(f, 1)(params, x)
    with pytest.raises(NonSquareJacobianError):
        value_divergence_and_frobenius(f, 1)(params, x)
    with pytest.raises(OptionError, match="method"):
        squared_frobenius_norm(f, 1, method="hutch++")
    g, params, x = _mlp_case()
    with pytest.raises(NumProbesError, match="num_probes >= 2"):
        squared_frobenius_norm(g, 1, method="hutchinson", num_probes=1, return_stderr=True)(
            jax.random.key(0), params, x
        )
    with pytest.raises(NumProbesError, match="2 probes"):
        log_abs_det(g, 1, method="slq", num_probes=1, return_stderr=True)(
            jax.random.key(0), params, x
        )


@pytest.mark.slow
@pytest.mark.parametrize("steps", [2, 4])
def test_slq_matches_matfree_on_the_same_probes(steps):
    """Each probe's quadrature term is matfree's SLQ log-det integrand on ``J_b^T J_b`` (halved),
    also with fewer Lanczos steps than ``n`` (where the quadrature is not exact)."""
    pytest.importorskip("matfree")
    from matfree import decomp, funm

    flow, params, x = _flow_case()
    V = jax.random.normal(jax.random.key(9), (3, *x.shape), jnp.float64)
    ours = log_abs_det(flow, 1, method="slq", lanczos_steps=steps)(V, params, x)
    J = _reference(flow)(params, x)
    integrand = funm.monte_carlo_funm_sym_logdet(decomp.tridiag_sym(steps))
    theirs = np.array(
        [
            [integrand(lambda v, A: A @ v, V[k, b], J[b].T @ J[b]) / 2 for k in range(3)]
            for b in range(x.shape[0])
        ]
    ).mean(1)
    np.testing.assert_allclose(ours, theirs, rtol=1e-8)


def test_log_abs_det_in_bfloat16():
    """Half precision has no LU nor eigensolver in JAX: the determinant and SLQ's quadrature
    are taken in float32 (they raised NotImplementedError), the result in bfloat16."""
    W = jnp.array([[2.0, 1, 0], [0, 3, 1], [1, 0, 2]])
    x = jax.random.normal(jax.random.key(1), (4, 3)) / 2
    f = lambda x: jnp.tanh(x @ W.astype(x.dtype).T)  # noqa: E731
    want = log_abs_det(f)(x)
    got = log_abs_det(f)(x.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.1)
    slq = log_abs_det(f, method="slq", num_probes=64)(jax.random.key(0), x.astype(jnp.bfloat16))
    assert slq.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(slq, np.float32)))


def test_hutchinson_auto_refuses_a_function_without_reverse_derivative():
    """``mode="auto"`` is ``||v^T J||^2`` from VJPs whatever the function: through a
    ``while_loop`` (no reverse derivative) it names ``mode="fwd"`` rather than switching to
    ``||J v||^2``, which the same probes give a different value."""
    from divjac import OptionError

    def f(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))[
            1
        ]

    x = jax.random.normal(jax.random.key(0), (3, 4), jnp.float64)
    probes = jax.random.rademacher(jax.random.key(1), (2, *x.shape), jnp.float64)
    with pytest.raises(OptionError, match="mode='fwd'"):
        squared_frobenius_norm(f, method="hutchinson")(probes, x)
    got = squared_frobenius_norm(f, method="hutchinson", mode="fwd")(probes, x)
    J = jax.vmap(jax.jacfwd(lambda z: f(z[None])[0]))(x)
    expected = (jnp.einsum("bmn,kbn->kbm", J, probes) ** 2).sum(-1).mean(0)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
