"""Squared Frobenius norms, divergence + Frobenius from one set of passes, and log|det J| in
divjac.torch, against float64 brute force (values and gradients), with calibrated error bars."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from divjac.models import torch as models
from divjac.torch import log_abs_det, squared_frobenius_norm, value_divergence_and_frobenius
from tests.reference import torch_diagonal_blocks

D = torch.float64
EXACT = [("exact", "fwd"), ("exact", "rev"), ("sparse", "fwd"), ("sparse", "rev"), ("auto", "auto")]


def _stencil(scale, x):
    """``y_i = scale x_{i+1}^2 + tanh(x_{i-1})``: a structurally zero diagonal."""
    nxt = torch.nn.functional.pad(x[:, 1:], (0, 1))
    prv = torch.nn.functional.pad(x[:, :-1], (1, 0))
    return scale * nxt**2 + torch.tanh(prv)


def _case(name):
    gen = torch.Generator().manual_seed(1)
    if name == "stencil":
        return _stencil, torch.tensor(1.5, dtype=D), torch.randn(4, 11, generator=gen, dtype=D)
    d_in, d_out = (4, 7) if name == "wide" else (5, 5)
    params = models.init_mlp(0, (d_in, 9, d_out), D)
    return models.mlp, params, torch.randn(3, d_in, generator=gen, dtype=D)


def _blocks(f, params, x):
    return torch_diagonal_blocks(f, (params, x), 1).reshape(x.shape[0], -1, x[0].numel())


def _reference(f, params, x):
    """Differentiable brute force: per-sample Jacobians by torch.func.vmap(jacrev)."""
    one = torch.func.jacrev(lambda xb: f(params, xb[None])[0])
    return torch.func.vmap(one)(x)


@pytest.mark.parametrize(("method", "mode"), EXACT)
@pytest.mark.parametrize("name", ["mlp", "wide", "stencil"])
def test_squared_frobenius_norm_exact(name, method, mode):
    f, params, x = _case(name)
    expected = (_blocks(f, params, x) ** 2).sum((1, 2))
    got = squared_frobenius_norm(f, 1, method=method, mode=mode)(params, x)
    np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-12)


def test_an_unbatched_sample_is_the_batched_call_of_one():
    """``batch_axis=None``: scalars (and scalar error bars) equal to the batch of that sample."""
    f, params, x = _case("mlp")

    def one(p, xb):
        return f(p, xb[None])[0]

    y, div, sq = value_divergence_and_frobenius(one, 1, batch_axis=None)(params, x[0])
    y_b, div_b, sq_b = value_divergence_and_frobenius(f, 1)(params, x[:1])
    assert div.shape == sq.shape == ()
    torch.testing.assert_close(y, y_b[0], rtol=1e-14, atol=0)
    torch.testing.assert_close(torch.stack([div, sq]), torch.stack([div_b[0], sq_b[0]]))
    gen = torch.Generator().manual_seed(5)
    probes = torch.randint(0, 2, (3, *x[0].shape), generator=gen).to(D) * 2 - 1
    unbatched = value_divergence_and_frobenius(
        one, 1, batch_axis=None, method="hutchinson", return_stderr=True
    )(probes, params, x[0])
    batched = value_divergence_and_frobenius(f, 1, method="hutchinson", return_stderr=True)(
        probes[:, None], params, x[:1]
    )
    for (value, se), (value_b, se_b) in zip(unbatched[1:], batched[1:], strict=True):
        assert value.shape == se.shape == ()
        torch.testing.assert_close(torch.stack([value, se]), torch.stack([value_b[0], se_b[0]]))
        assert se > 0


@pytest.mark.parametrize(("method", "mode"), EXACT)
@pytest.mark.parametrize("name", ["mlp", "stencil"])
def test_value_divergence_and_frobenius_exact(name, method, mode):
    f, params, x = _case(name)
    blocks = _blocks(f, params, x)
    y, div, sq = value_divergence_and_frobenius(f, 1, method=method, mode=mode)(params, x)
    np.testing.assert_allclose(y.detach(), f(params, x).detach(), rtol=1e-14)
    np.testing.assert_allclose(div.detach(), np.trace(blocks, axis1=1, axis2=2), rtol=1e-12)
    np.testing.assert_allclose(sq.detach(), (blocks**2).sum((1, 2)), rtol=1e-12)


def _grad(out, inputs):
    """Gradients, zeros for inputs the output does not depend on (the last bias of ``J``)."""
    return torch.autograd.grad(out, inputs, allow_unused=True, materialize_grads=True)


def _leaves(params, x):
    return [t for pair in params for t in pair] + [x]


@pytest.mark.parametrize("method", ["exact", "sparse", "hutchinson"])
def test_gradients_to_inputs_and_params(method):
    """Gradients of ``sum(div * ||J||_F^2)`` w.r.t. every weight and the input; Hutchinson's
    with fixed probes against the same terms computed by brute force."""
    f, params, x = _case("mlp")
    params = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in params]
    x = x.clone().requires_grad_()
    probes = torch.randn(2, *x.shape, generator=torch.Generator().manual_seed(3), dtype=D)
    args = (probes, params, x) if method == "hutchinson" else (params, x)
    _, div, sq = value_divergence_and_frobenius(f, 1, method=method, mode="rev")(*args)
    got = _grad((div * sq).sum(), _leaves(params, x))
    J = _reference(f, params, x)
    if method == "hutchinson":
        pushed = torch.einsum("kbi,bij->kbj", probes, J)  # the rows v^T J of mode="rev"
        ref_div = torch.einsum("kbj,kbj->kb", pushed, probes).mean(0)
        ref_sq = (pushed**2).sum(-1).mean(0)
    else:
        ref_div, ref_sq = J.diagonal(dim1=1, dim2=2).sum(-1), (J**2).sum((1, 2))
    expected = _grad((ref_div * ref_sq).sum(), _leaves(params, x))
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-13)
    norm = squared_frobenius_norm(f, 1, method=method, mode="rev")(*args)
    np.testing.assert_allclose(norm.detach(), sq.detach(), rtol=1e-12)


def test_hutchinson_unbiased_and_calibrated():
    """2000 independent draws from one call (the batch repeated 667 times: each sample draws
    its own probes): unbiased; error bars cover as measured in JAX (see its test)."""
    f, params, x = _case("mlp")
    blocks = _blocks(f, params, x)
    exact_div, exact_sq = np.trace(blocks, axis1=1, axis2=2), (blocks**2).sum((1, 2))
    reps = 667
    xs = x.repeat(reps, 1)
    both = value_divergence_and_frobenius(
        f, 1, method="hutchinson", num_probes=4, return_stderr=True
    )
    _, (div, div_se), (sq, sq_se) = both(torch.Generator().manual_seed(0), params, xs)
    for est, se, exact, level in ((div, div_se, exact_div, 0.94), (sq, sq_se, exact_sq, 0.94)):
        est, se = est.detach().numpy().reshape(reps, 3), se.detach().numpy().reshape(reps, 3)
        assert np.all(np.abs(est.mean(0) - exact) < 4 * est.std(0) / np.sqrt(reps))
        assert np.all(np.mean(np.abs(est - exact) <= 2 * se, axis=0) >= level)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_hutchinson_budget_of_n_is_exact(mode):
    """``num_probes >= n``: the ``n`` coordinate directions, exact, stderr 0 (as JAX's)."""
    f, params, x = _case("mlp")
    blocks = _blocks(f, params, x)
    both = value_divergence_and_frobenius(
        f, 1, method="hutchinson", mode=mode, num_probes=7, return_stderr=True
    )
    _, (div, div_se), (sq, sq_se) = both(torch.Generator().manual_seed(0), params, x)
    np.testing.assert_allclose(div.detach(), np.trace(blocks, axis1=1, axis2=2), rtol=1e-12)
    np.testing.assert_allclose(sq.detach(), (blocks**2).sum((1, 2)), rtol=1e-12)
    assert torch.all(div_se == 0) and torch.all(sq_se == 0)


def _flow():
    params = models.init_mlp(5, (4, 12, 4), D)

    def flow(p, x):
        return 1.3 * x + 0.4 * models.mlp(p, x)

    return flow, params, torch.randn(3, 4, generator=torch.Generator().manual_seed(6), dtype=D)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_log_abs_det_exact_and_gradient(mode):
    flow, params, x = _flow()
    params = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in params]
    got = log_abs_det(flow, 1, mode=mode, chunk_size=2)(params, x)
    np.testing.assert_allclose(
        got.detach(), np.linalg.slogdet(_blocks(flow, params, x))[1], rtol=1e-12
    )
    expected = torch.linalg.slogdet(_reference(flow, params, x))[1]
    for a, b in zip(
        _grad(got.sum(), _leaves(params, x)[:-1]),
        _grad(expected.sum(), _leaves(params, x)[:-1]),
        strict=True,
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-13)


def test_slq_quadratic_form_gradient_and_calibration():
    """With ``lanczos_steps = n`` SLQ is ``mean v^T log(J^T J) v / 2`` for the given probes
    (value and gradient); over 2000 draws it is unbiased and its error bars cover >= 94 %."""
    flow, params, x = _flow()
    params = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in params]
    V = torch.randn(5, *x.shape, generator=torch.Generator().manual_seed(7), dtype=D)
    got = log_abs_det(flow, 1, method="slq", lanczos_steps=4)(V, params, x)
    J = _reference(flow, params, x)
    w, U = torch.linalg.eigh(J.transpose(1, 2) @ J)
    logA = U @ torch.diag_embed(torch.log(w)) @ U.transpose(1, 2)
    expected = torch.einsum("kbi,bij,kbj->bk", V, logA, V).mean(1) / 2
    np.testing.assert_allclose(got.detach(), expected.detach(), rtol=1e-9)
    for a, b in zip(
        _grad(got.sum(), _leaves(params, x)[:-1]),
        _grad(expected.sum(), _leaves(params, x)[:-1]),
        strict=True,
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-7, atol=1e-10)
    reps = 667
    with torch.no_grad():
        est, se = log_abs_det(
            flow, 1, method="slq", num_probes=4, lanczos_steps=4, return_stderr=True
        )(torch.Generator().manual_seed(0), params, x.repeat(reps, 1))
    exact = np.linalg.slogdet(_blocks(flow, params, x))[1]
    est, se = est.numpy().reshape(reps, 3), se.numpy().reshape(reps, 3)
    assert np.all(np.abs(est.mean(0) - exact) < 4 * est.std(0) / np.sqrt(reps))
    assert np.all(np.mean(np.abs(est - exact) <= 2 * se, axis=0) >= 0.94)


def test_log_abs_det_in_bfloat16():
    """The determinant and SLQ's quadrature in float32 for a half-precision Jacobian (no LU
    nor eigensolver there), the result in bfloat16."""
    W = torch.tensor([[2.0, 1, 0], [0, 3, 1], [1, 0, 2]])
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)) / 2
    f = lambda x: torch.tanh(x @ W.to(x.dtype).T)  # noqa: E731
    got = log_abs_det(f)(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), log_abs_det(f)(x), atol=0.1, rtol=0.05)
    slq = log_abs_det(f, method="slq", num_probes=64)(torch.Generator(), x.bfloat16())
    assert slq.dtype == torch.bfloat16 and torch.isfinite(slq).all()
