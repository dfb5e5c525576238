"""``mode="auto"`` times a few passes of each direction where many are to come, and takes the
faster: on a U-Net with attention and GroupNorm rows are 1.5-1.7x faster than the columns the
convolution heuristic took (``divjac.torch._backend.prefer_reverse``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import divjac.torch as dj
from divjac.torch import _backend, _compat
from tests.reference import torch_diagonal_blocks, traces

D = torch.float64


def _net(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.Tanh(),
        nn.Dropout(dropout),
        nn.Conv2d(8, 3, 3, padding=1),
    ).to(D)


def _x(batch: int = 2, size: int = 5) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=D)


@pytest.fixture
def directions(monkeypatch):
    """The directions the passes are pushed in (``True``: rows), and the measurements, where
    measuring answers ``measured["answer"]``."""
    pushed: list[bool] = []
    measured: dict[str, object] = {"answer": True, "calls": 0}
    linearize = _backend.TorchBackend.linearize

    def spy(self, point, *, reverse):
        pushed.append(reverse)
        return linearize(self, point, reverse=reverse)

    def measure(backend, point):
        measured["calls"] = int(measured["calls"]) + 1
        return measured["answer"]

    monkeypatch.setattr(_backend.TorchBackend, "linearize", spy)
    monkeypatch.setattr(_backend, "_measured_reverse", measure)
    return pushed, measured


@pytest.mark.parametrize(("method", "answer"), [("exact", True), ("sparse", False)])
def test_auto_takes_the_measured_direction_once_per_context(directions, answer, method):
    pushed, measured = directions
    measured["answer"] = answer
    net, x = _net(), _x()
    expected = traces(torch_diagonal_blocks(net, (x,)), (3, 5, 5))
    div = dj.divergence(net, method=method)
    for context in (torch.no_grad, torch.no_grad, torch.inference_mode):
        pushed.clear()
        with context():
            got = div(x)
        torch.testing.assert_close(got, torch.as_tensor(expected), rtol=1e-10, atol=1e-12)
        assert set(pushed) == {answer}
    # no_grad once, inference_mode once; where divjac runs inference mode as no_grad (torch
    # 2.11, _compat.transforms_mode) the measurement of no_grad serves both
    assert measured["calls"] == (2 if _compat.differentiates_under_inference_mode() else 1)
    jac = dj.jacobian(net)
    with torch.no_grad():
        blocks = jac(x).reshape(2, 75, 75)
    torch.testing.assert_close(
        blocks, torch.as_tensor(torch_diagonal_blocks(net, (x,))).reshape(2, 75, 75)
    )
    assert pushed[-1] is answer


def test_nothing_is_measured_where_the_choice_is_fixed_or_timing_would_cost(directions):
    pushed, measured = directions
    x = _x()
    with torch.no_grad():
        dj.divergence(_net(), method="exact", mode="fwd")(x)  # the caller chose
        dj.divergence(_net(), method="hutchinson", num_probes=2)(torch.Generator(), x)  # few
        dj.divergence(_net(), method="exact")(_x(size=4))  # 48 passes: below MEASURED_FROM
        dj.divergence(_net(0.5).train(), method="exact", coupling="exact")(x)  # random draws
    assert measured["calls"] == 0
    assert pushed[:1] == [False]


def test_measured_choice_trains_to_the_brute_force_gradients():
    """With the real timing, on the graph: parameter gradients of the summed divergence equal
    those of the brute-force traces, whichever direction was measured faster."""
    net, x = _net(), _x()
    div = dj.divergence(net, method="exact")(x).sum()
    weights = list(net.parameters())[:-1]  # the last bias does not move the Jacobian
    grads = torch.autograd.grad(div, weights)

    def brute(x: torch.Tensor) -> torch.Tensor:
        jac = torch.func.vmap(torch.func.jacrev(lambda xb: net(xb[None])[0]))(x)
        return jac.reshape(2, 75, 75).diagonal(dim1=1, dim2=2).sum()

    expected = torch.autograd.grad(brute(x), weights)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_auto_pulls_rows_through_an_inexact_forward_derivative(directions):
    """``logcumsumexp``'s forward derivative is off by ~1e-6 in float64 (torch 2.13): auto
    pulls rows there whatever a timing would say, so the Jacobian is jacrev's to 1e-12 (the
    OpInfo sweep found jacobian and sparse 3.2e-6 off once columns were measured faster)."""
    pushed, measured = directions
    measured["answer"] = False  # columns faster: not what decides here
    x = torch.randn(5, 5, 5, generator=torch.Generator().manual_seed(2), dtype=D)

    def f(x):
        return torch.logcumsumexp(x, 1)

    expected = torch.func.jacrev(f)(x)
    for mode in ("auto", "sparse"):
        pushed.clear()
        got = dj.jacobian(f, batch_axis=None, mode=mode)(x)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        assert set(pushed) == {True}
    assert measured["calls"] == 0


def test_a_direction_whose_trial_passes_fail_leaves_the_other():
    """``tensor_split`` at tensor indices has no batched forward derivative (torch 2.13): the
    measurement's trial columns fail, so auto takes rows (it crashed in the OpInfo sweep)."""
    x = torch.randn(5, 5, 5, generator=torch.Generator().manual_seed(3), dtype=D)
    indices = torch.tensor([1, 2, 3])

    def f(x):  # as the sweep calls it: every piece
        return torch.cat([t.reshape(-1) for t in torch.tensor_split(x, indices)])

    got = dj.jacobian(f, batch_axis=None)(x)
    expected = torch.autograd.functional.jacobian(f, x)  # (torch.func's jacrev fails here too)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
