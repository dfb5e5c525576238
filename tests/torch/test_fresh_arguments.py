"""Every second- and fourth-order transform computes at the call's own tensors (issue 41, 1-2):
a first call whose tensor the function also reaches (the module's buffer passed as ``t``, the
module's own parameters passed to ``functional_call``) must not bind later calls, whose new
tensors of the same shapes are other objects. Against brute force (per-sample Hessians and
the Hessian of the per-sample Laplacian by ``torch.func``), float64."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian

import divjac.torch as dt

D = torch.float64
B, DIM = 3, 2
A = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=D)

# name -> (the transform of u, the per-sample value from the per-sample function g(x_b))
TRANSFORMS: dict[str, tuple[Callable[..., Any], Callable[..., torch.Tensor]]] = {
    "laplacian": (dt.laplacian, lambda g, xb: hessian(g)(xb).trace()),
    "hessian_diagonal": (dt.hessian_diagonal, lambda g, xb: hessian(g)(xb).diagonal()),
    "weighted_laplacian": (
        lambda u, **kw: dt.weighted_laplacian(u, A, **kw),
        lambda g, xb: (A * hessian(g)(xb)).sum(),
    ),
    "bilaplacian": (
        dt.bilaplacian,
        lambda g, xb: hessian(lambda z: hessian(g)(z).trace())(xb).trace(),
    ),
}


class _Net(nn.Module):
    """``u(x, t)``, a tanh MLP of ``[x, t]``, with default times as a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(DIM + 1, 8, dtype=D)
        self.outer = nn.Linear(8, 1, dtype=D)
        self.register_buffer("times", torch.rand(B, 1, dtype=D))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(torch.cat([x, t], 1)))).squeeze(1)


def _brute(name: str, u: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The transform ``name`` of the batched ``u`` at ``x``, one sample at a time."""
    per_sample = TRANSFORMS[name][1]
    values = []
    for b in range(x.shape[0]):

        def g(xb: torch.Tensor, b: int = b) -> torch.Tensor:
            return u(torch.cat([x[:b], xb[None], x[b + 1 :]]))[b]

        values.append(per_sample(g, x[b]))
    return torch.stack(values)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_new_t_after_the_modules_buffer(name):
    """``t`` first the module's buffer, then new tensors: each call at its own ``t`` (the
    bi-Laplacian kept the buffer's values: errors 0.05-0.07)."""
    torch.manual_seed(0)
    net = _Net()
    transform = TRANSFORMS[name][0](net)
    x = torch.randn(B, DIM, dtype=D)
    for t in (net.times, torch.rand(B, 1, dtype=D), torch.rand(B, 1, dtype=D)):
        want = _brute(name, lambda z, t=t: net(z, t), x)
        torch.testing.assert_close(transform(x, t), want)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_new_t_in_a_closure_after_the_modules_buffer(name):
    """The same through a list the function reads ``t`` from: the same function object,
    whose fast checks compare the list's tensor by shape."""
    torch.manual_seed(1)
    net = _Net()
    times = [net.times]
    transform = TRANSFORMS[name][0](lambda z: net(z, times[0]))
    x = torch.randn(B, DIM, dtype=D)
    for t in (net.times, torch.rand(B, 1, dtype=D), torch.rand(B, 1, dtype=D)):
        times[0] = t
        want = _brute(name, lambda z, t=t: net(z, t), x)
        torch.testing.assert_close(transform(x), want)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_functional_parameters_replaced(name):
    """Parameters passed to ``functional_call``: first the module's own, then new tensors
    after an out-of-place SGD step. Values at the new tensors, and gradients w.r.t. them (the
    bi-Laplacian kept the module's values, error 0.36, and had no gradient)."""
    torch.manual_seed(2)
    net = _Net()

    def u(params: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return functional_call(net, params, (x, t))

    transform = TRANSFORMS[name][0](u, argnums=1)
    x, t = torch.randn(B, DIM, dtype=D), torch.rand(B, 1, dtype=D)
    params = dict(net.named_parameters())
    for _ in range(3):
        got = transform(params, x, t)
        want = _brute(name, lambda z, p=params: u(p, z, t), x)
        torch.testing.assert_close(got, want)
        leaves = list(params.values())
        grads = torch.autograd.grad(got.sum(), leaves, allow_unused=True)
        wanted = torch.autograd.grad(want.sum(), leaves, allow_unused=True)
        for grad, expected in zip(grads, wanted, strict=True):
            # None only where the brute force's is (the bi-Laplacian of the output bias)
            if expected is None:
                assert grad is None or not grad.any()
                continue
            assert grad is not None
            torch.testing.assert_close(grad, expected)
        params = {
            k: (p - 0.1 * (torch.zeros_like(p) if g is None else g)).detach().requires_grad_()
            for (k, p), g in zip(params.items(), grads, strict=True)
        }


@pytest.mark.parametrize("layer", [nn.RNN, nn.LSTM, nn.GRU])
def test_recurrent_layer_through_functional_call_with_new_parameters(layer):
    """A recurrent layer refers to its weights by weak references (``_flat_weight_refs``),
    which a trace through ``functional_call`` leaves on its own tensors: the second call
    compared those references (by their referents' elementwise ``==``) and raised torch's
    "FunctionalTensor on its own". Each call is at its own parameters."""
    torch.manual_seed(0)
    rnn = layer(3, 3, batch_first=True, dtype=D)

    def f(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(rnn, params, (x,))[0]

    x = torch.randn(2, 4, 3, dtype=D)
    div = dt.divergence(f, argnums=1)
    params = dict(rnn.named_parameters())
    for step in range(3):
        want = torch.stack(
            [
                torch.func.jacrev(lambda xb, b=b, p=params: f(p, xb[None])[0])(x[b])
                .reshape(12, 12)
                .trace()
                for b in range(2)
            ]
        )
        torch.testing.assert_close(div(params, x), want.detach())
        params = {k: (p.detach() + 0.05 * (step + 1)).requires_grad_() for k, p in params.items()}
