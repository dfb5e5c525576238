"""Stochastic divergences in divjac.torch: unbiased, calibrated, reproducible, differentiable."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from divjac import NumProbesError
from divjac.models import torch as models
from divjac.torch import divergence, sparsity
from tests.reference import torch_diagonal_blocks, traces

D = torch.float64


def _case():
    params = models.init_mlp(0, (6, 12, 6), D)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1), dtype=D)
    exact = traces(torch_diagonal_blocks(models.mlp, (params, x), 1), (6,))
    return params, x, exact


METHODS = [
    ("hutchinson", "rademacher", 4),
    ("hutchinson", "gaussian", 4),
    ("hutchinson", "sphere", 4),
    ("hutch++", "rademacher", 3),
    ("xtrace", "gaussian", 4),
    ("probing", "rademacher", 2),
]


@pytest.mark.parametrize(("method", "distribution", "num_probes"), METHODS)
def test_unbiased_over_many_generator_seeds(method, distribution, num_probes):
    params, x, exact = _case()
    # Hutch++ at 3 matvecs (its only estimate at n = 6) rests on one term, XTrace at 4 on two
    # (its only estimate at n = 6; a stderr needs 6 matvecs): no stderr.
    with_stderr = (method, num_probes) not in (("hutch++", 3), ("xtrace", 4))
    div = divergence(
        models.mlp,
        1,
        method=method,
        distribution=distribution,
        num_probes=num_probes,
        return_stderr=with_stderr,
    )
    draws = [div(torch.Generator().manual_seed(s), params, x) for s in range(300)]
    estimates = torch.stack([d[0] if with_stderr else d for d in draws]).numpy()
    mean = estimates.mean(0)
    sem = estimates.std(0, ddof=1) / np.sqrt(len(estimates))
    assert np.all(np.abs(mean - exact) <= 4.5 * sem + 1e-12), (mean, exact, sem)


def test_stderr_is_calibrated():
    params, x, _ = _case()
    # 5 < n = 6 probes: an estimate (8 would pay for the exact trace).
    div = divergence(models.mlp, 1, method="hutchinson", num_probes=5, return_stderr=True)
    draws = [div(torch.Generator().manual_seed(s), params, x) for s in range(300)]
    estimates = torch.stack([d[0] for d in draws]).numpy()
    reported = torch.stack([d[1] for d in draws]).numpy()
    spread = estimates.std(0, ddof=1)
    ratio = np.sqrt((reported**2).mean(0)) / spread
    # Student's factor (1.3 at 4 degrees of freedom) and the larger of two variance estimates:
    # conservative at a few probes (docs/calibration.md), never below the spread.
    assert np.all((ratio > 1.0) & (ratio < 2.5)), ratio


def test_same_seed_same_estimate_and_noise_can_be_kept_fixed():
    params, x, _ = _case()
    div = divergence(models.mlp, 1, method="hutch++", num_probes=3)  # 3 < n=6: an estimate
    a = div(torch.Generator().manual_seed(3), params, x)
    b = div(torch.Generator().manual_seed(3), params, x)
    c = div(torch.Generator().manual_seed(4), params, x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c)
    gen = torch.Generator().manual_seed(3)
    first, second = div(gen, params, x), div(gen, params, x)
    assert not torch.allclose(first, second)  # a generator advances, like any torch draw


def test_user_probes_are_reproducible_and_match_the_formula():
    params, x, _ = _case()
    probes = torch.randn(5, *x.shape, generator=torch.Generator().manual_seed(0), dtype=D)
    div = divergence(models.mlp, 1, method="hutchinson", num_probes=5)
    got = div(probes, params, x)
    torch.testing.assert_close(got, div(probes, params, x), rtol=0, atol=0)
    J = torch.as_tensor(torch_diagonal_blocks(models.mlp, (params, x), 1))
    expected = torch.einsum("kbi,bij,kbj->b", probes, J, probes) / 5
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    one = divergence(models.mlp, 1, method="hutchinson", num_probes=1)(probes[0], params, x)
    torch.testing.assert_close(one, torch.einsum("bi,bij,bj->b", probes[0], J, probes[0]))


def test_probes_follow_the_batch_axis():
    params, x, _ = _case()
    probes = torch.randn(4, *x.shape, generator=torch.Generator().manual_seed(0), dtype=D)
    f = lambda x: models.mlp(params, x.T).T  # noqa: E731  (batch on axis 1)
    got = divergence(f, batch_axis=1, method="hutchinson", num_probes=4)(
        probes.transpose(1, 2), x.T
    )
    expected = divergence(models.mlp, 1, method="hutchinson", num_probes=4)(probes, params, x)
    torch.testing.assert_close(got, expected)


def test_probing_with_a_valid_diagonal_coloring_is_exact():
    params = models.init_cnn(0, channels=3, layers=2, dtype=D)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=D)
    pattern = sparsity(models.cnn, argnums=1)(params, x)
    exact = divergence(models.cnn, 1, method="sparse")(params, x)
    est, stderr = divergence(
        models.cnn, 1, method="probing", num_probes=pattern.n_diagonal_colors, return_stderr=True
    )(torch.Generator().manual_seed(0), params, x)
    torch.testing.assert_close(est, exact, rtol=1e-10, atol=1e-12)
    assert torch.all(stderr == 0)
    # With a smaller budget, probing is a (distance-limited) estimate with an error bar.
    rough, err = divergence(models.cnn, 1, method="probing", num_probes=8, return_stderr=True)(
        torch.Generator().manual_seed(0), params, x
    )
    assert torch.all(torch.isfinite(rough)) and torch.all(err >= 0)


def test_probing_refuses_an_error_bar_from_one_repetition():
    """A budget that pays for one repetition of the colors gives one term per color: no error
    bar (as Hutchinson at one probe); the error names the least budget that gives one."""
    params = models.init_cnn(0, channels=3, layers=2, dtype=D)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=D)
    options = dict(method="probing", num_probes=12, probing_distance=(None, 1, 1))
    with pytest.raises(NumProbesError, match="num_probes >= 24"):
        divergence(models.cnn, 1, return_stderr=True, **options)(
            torch.Generator().manual_seed(0), params, x
        )
    est = divergence(models.cnn, 1, **options)(torch.Generator().manual_seed(0), params, x)
    assert torch.all(torch.isfinite(est))
    est, err = divergence(models.cnn, 1, return_stderr=True, **{**options, "num_probes": 24})(
        torch.Generator().manual_seed(0), params, x
    )
    assert torch.all(torch.isfinite(est)) and torch.all(err > 0)


@pytest.mark.parametrize("method", ["hutchinson", "hutch++", "xtrace"])
def test_gradients_flow_to_module_parameters(method):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).to(D)
    x = torch.randn(3, 4, dtype=D)
    num = {"hutchinson": 4, "hutch++": 6, "xtrace": 4}[method]
    k = {"hutchinson": 4, "hutch++": 4, "xtrace": 2}[method]
    probes = torch.randn(k, 3, 4, generator=torch.Generator().manual_seed(1), dtype=D)
    est = divergence(net, method=method, num_probes=num)(probes, x)
    (est**2).sum().backward()
    got = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    # The same estimator on the brute-force Jacobians, differentiated by autograd.
    from divjac._core import estimators

    J = torch.stack(
        [
            torch.autograd.functional.jacobian(lambda xi: net(xi[None])[0], x[b], create_graph=True)
            for b in range(3)
        ]
    )
    V = torch.movedim(probes, 0, -1)
    brute, _ = estimators.estimate_trace(method, lambda W: J @ W, V)
    torch.testing.assert_close(est, brute, rtol=1e-10, atol=1e-12)
    (brute**2).sum().backward()
    for g, p in zip(got, net.parameters(), strict=True):
        expected = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(g, expected, rtol=1e-8, atol=1e-12)


def test_xtrace_with_a_budget_of_n_matvecs_is_exact():
    """num_probes >= n pays for the n identity columns: the exact trace, standard error 0."""
    params, x, exact = _case()  # n = 6
    for num_probes in (6, 8, 12):
        div, err = divergence(
            models.mlp, 1, method="xtrace", num_probes=num_probes, return_stderr=True
        )(torch.Generator().manual_seed(0), params, x)
        torch.testing.assert_close(div, torch.as_tensor(exact), rtol=1e-12, atol=1e-12)
        assert torch.all(err == 0)
