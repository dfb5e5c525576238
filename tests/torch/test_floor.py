"""The branches of the torch seam (``divjac/torch/_compat.py``) for the floor of the declared
range, torch 2.11, taken on every torch by pretending (the compiled transforms' refusal is
``test_compile.py::test_compile_is_refused_naming_the_release``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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
        monkeypatch.setattr(_compat, "_FUNC_UNDER_INFERENCE_MODE", False)
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
