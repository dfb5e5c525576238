"""The branches of the torch seam (``divjac/torch/_compat.py``) for the floor of the declared
range, torch 2.11, taken on every torch by pretending (the compiled transforms' refusal is
``test_compile.py::test_compile_is_refused_naming_the_release``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import divjac
import divjac.torch as dj
from divjac.torch import _compat


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_inference_mode_where_torch_func_differentiates_nothing_there(monkeypatch, mode):
    """torch 2.11's ``torch.func`` returns zeros under ``torch.inference_mode``, silently:
    there divjac's transforms leave it, without gradients, and return what they return under
    ``torch.no_grad()``; inference tensors (inputs, and weights of a model made under
    inference mode, which no autograd tape takes) included."""
    if _compat.differentiates_under_inference_mode():
        monkeypatch.setattr(_compat, "differentiates_under_inference_mode", lambda: False)
    net = _mlp()
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = dj.jacobian(net, mode=mode)(x), dj.divergence(net)(x), dj.laplacian(net)(x)
    with torch.inference_mode():
        made_here = _mlp()
        xi = x.clone()
        for model in (net, made_here):
            got = dj.jacobian(model, mode=mode)(xi), dj.divergence(model)(xi)
            got += (dj.laplacian(model)(xi),)
            for g, w in zip(got, want, strict=True):
                assert not g.requires_grad
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_generator_passed_to_an_operation_is_traced_or_refused_naming_the_way_out():
    """torch 2.11's ``make_fx`` cannot trace an operation passed a ``torch.Generator``
    (``randn(generator=g)``): divjac raises :class:`UnsupportedOperationError` naming the ways
    out (no raw ``NotImplementedError``); torch 2.13 on traces it, and the result is exact."""

    def noisy(x, *, generator):
        return torch.tanh(x + torch.randn(x.shape, generator=generator, dtype=x.dtype))

    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    div = dj.divergence(noisy)
    if _compat.release() < (2, 13):
        with pytest.raises(divjac.UnsupportedOperationError, match=r"torch\.manual_seed"):
            div(x, generator=torch.Generator().manual_seed(7))
        return
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    want = (1 - torch.tanh(x + noise) ** 2).sum(1)
    torch.testing.assert_close(div(x, generator=torch.Generator().manual_seed(7)), want)


@pytest.mark.filterwarnings("ignore::divjac.DenseFallbackWarning")  # histogram: no rule
@pytest.mark.parametrize("transform", ["jacobian", "laplacian"])
def test_an_operation_torch_has_no_derivative_of_is_refused_naming_it(transform):
    """torch raises a bare ``RuntimeError`` on an operation it has no derivative of
    (``histogram``; ``aminmax`` on torch 2.11): divjac names the operation, the torch and the
    way out."""

    def f(x):
        return torch.histogram(x, bins=3)[0] * x[:3]

    x = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    call = {
        "jacobian": lambda: dj.jacobian(f, batch_axis=None)(x),
        "laplacian": lambda: dj.laplacian(lambda x: f(x).sum(), batch_axis=None)(x),
    }[transform]
    with pytest.raises(divjac.UnsupportedOperationError, match=r"aten::histogram.*no derivative"):
        call()


def test_aminmax_without_derivative_names_the_ops_and_the_torch_that_have_them(monkeypatch):
    """torch 2.11 has no derivative of ``aminmax`` (pytorch/pytorch#148808, 2.13 has): the
    refusal names ``torch.amin`` and ``torch.amax`` and ``torch>=2.13``; from 2.13 on torch
    differentiates it (``test_conformance.py``)."""
    refusal = RuntimeError("derivative for aten::aminmax is not implemented")
    monkeypatch.setattr(_compat, "release", lambda: (2, 11))
    op, way_out = _compat.missing_derivative(refusal)
    assert op == "aten::aminmax"
    assert "torch.amin and torch.amax" in way_out and "torch>=2.13" in way_out
    assert "#148808" in way_out
    assert _compat.missing_derivative(RuntimeError("another error")) is None
