"""The second-order engine (collapsed Taylor mode) against brute force: per-sample Hessians by
reverse over reverse (``jacrev`` of ``jacrev``, no forward-mode AD), float64."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import jacrev
from torch.overrides import TorchFunctionMode

from divjac.torch import _taylor
from divjac.torch._taylor import reference_sweep, second_order_sweep

D = torch.float64


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = D) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    g = x.reshape(x.shape[0], num_groups, -1)
    mean = g.mean(-1, keepdim=True)
    var = g.var(-1, unbiased=False, keepdim=True)
    y = ((g - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return y * weight.reshape(shape) + bias.reshape(shape)


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    dims = tuple(range(-len(normalized_shape), 0))
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


class _Composed(TorchFunctionMode):
    """Group and layer normalizations composed of means and variances: the reverse-over-
    reverse-over-reverse derivatives of torch's kernels (the parameter gradients of a Hessian)
    are wrong (torch 2.13)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.group_norm:
            return _group_norm(*args, **kwargs)
        if func is F.layer_norm:
            return _layer_norm(*args, **kwargs)
        return func(*args, **kwargs)


def _brute(
    f: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    v: torch.Tensor,
    weights: torch.Tensor | None = None,
    collapse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, J v_k, sum_k w_k v_k^T H v_k)`` sample by sample from dense Jacobians and
    Hessians (differentiable: built by autograd on the captured parameters)."""
    K, B = v.shape[0], x.shape[0]
    v = v.expand(K, *x.shape)
    ys, firsts, seconds = [], [], []
    with _Composed():
        for b in range(B):
            _sample(f, x, v, b, ys, firsts, seconds)
    y, first, second = torch.stack(ys), torch.stack(firsts, 1), torch.stack(seconds, 1)
    if not collapse:
        return y, first, second
    if weights is None:
        return y, first, second.sum(0)
    w = weights.reshape(weights.shape + (1,) * (second.ndim - weights.ndim))
    return y, first, (w * second).sum(0)


def _sample(f, x, v, b, ys, firsts, seconds):
    def one(s: torch.Tensor) -> torch.Tensor:
        # Sample b of f with its input replaced (f acts on each sample separately).
        return f(torch.cat([x[:b], s[None], x[b + 1 :]]))[b]

    K, xb = v.shape[0], x[b]
    n = xb.numel()
    y = one(xb)
    J = jacrev(one)(xb).reshape(-1, n)
    H = jacrev(jacrev(one))(xb).reshape(-1, n, n)
    vb = v[:, b].reshape(K, n)
    ys.append(y)
    firsts.append((vb @ J.T).reshape(K, *y.shape))
    seconds.append(torch.einsum("oij,ki,kj->ko", H, vb, vb).reshape(K, *y.shape))


def _check(f, x, v, weights=None, collapse=True, atol=1e-10):
    got = second_order_sweep(f, x, v, weights=weights, collapse=collapse)
    want = _brute(f, x, v, weights, collapse)
    for name, g, w in zip(("y", "first", "second"), got, want, strict=True):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-9, msg=name)
    return got


class Elementwise(nn.Module):
    """An MLP through tanh, softplus, exp, log, sin, products and divisions."""

    def __init__(self, d: int, out: int = 1) -> None:
        super().__init__()
        self.a = nn.Linear(d, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        g = F.softplus(self.b(h), beta=2.0) + torch.exp(-h) * torch.sin(h)
        g = g * torch.log(1 + h**2) + h / (1.5 + torch.cos(g)) + torch.sigmoid(h) ** 3
        r = torch.sqrt(1 + g * g) + torch.rsqrt(2 + h * h) - 1 / (2 + h * h)
        return self.c(r * F.silu(g)) + (x * x).sum(1, keepdim=True) / (1 + x[:, :1] ** 2)


def _module(m: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return m.to(D)


@pytest.mark.parametrize("shared", [True, False])
def test_elementwise_mlp(shared):
    d, B = 5, 4
    f = _module(Elementwise(d))
    x = _randn(B, d, seed=1)
    v = torch.eye(d, dtype=D)[:, None] if shared else _randn(3, B, d, seed=2)
    _check(f, x, v)


def test_vector_output_weights_and_collapse():
    d, B = 4, 3
    f = _module(Elementwise(d, out=3))
    x = _randn(B, d, seed=3)
    v = _randn(5, B, d, seed=4)
    _check(f, x, v, weights=_randn(5, seed=5))
    _check(f, x, v, weights=_randn(5, B, seed=6))
    _check(f, x, v, collapse=False)
    _check(f, x, v[:, :1], weights=_randn(5, B, seed=7))  # shared, weights per sample


def test_net_x_t():
    """``net(x, t)`` with ``t`` fixed: the Laplacian in ``x``."""
    d, B = 3, 4
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(d + 1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 1)).to(D)  # fmt: skip
    t = _randn(B, 1, seed=8)
    x = _randn(B, d, seed=9)
    _, _, lap = _check(lambda x: net(torch.cat([x, t], 1))[:, 0], x, torch.eye(d, dtype=D)[:, None])
    assert lap.shape == (B,)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, stride=2)
        self.norm2 = nn.LayerNorm([4, 3, 3])
        self.head = nn.Linear(36, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm1(self.conv1(x)))
        h = torch.tanh(self.norm2(self.conv2(h)))
        return self.head(h.flatten(1))


@pytest.mark.parametrize("collapse", [True, False])
def test_cnn_groupnorm_layernorm(collapse):
    B = 2
    f = _module(SmallCNN())
    x = _randn(B, 2, 5, 5, seed=10)
    v = _randn(3, 1, 2, 5, 5, seed=11)
    _check(f, x, v, collapse=collapse)


def test_attention():
    """Self-attention by ``scaled_dot_product_attention``: products of dependent operands
    (``bmm``), softmax by the generic rule."""
    torch.manual_seed(0)
    proj = nn.Linear(4, 12).to(D)

    def f(x: torch.Tensor) -> torch.Tensor:
        q, k, v = proj(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v).sum(-1)

    x = _randn(2, 3, 4, seed=12)
    _check(f, x, _randn(4, 2, 3, 4, seed=13), weights=_randn(4, seed=14))


def test_float32():
    f = _module(Elementwise(3)).float()
    x = _randn(4, 3, seed=15, dtype=torch.float32)
    v = torch.eye(3)[:, None]
    got = second_order_sweep(f, x, v)
    want = _brute(f.double(), x.double(), v.double())
    f.float()
    assert all(g.dtype == torch.float32 for g in got)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4)


def test_laplacian_loss_param_gradients():
    """``loss.backward()`` of a Laplacian loss gives the brute-force gradients of the weights
    (through GroupNorm and LayerNorm too)."""
    basis = torch.eye(3, dtype=D)[:, None]
    for f, x, v in (
        (_module(Elementwise(3)), _randn(3, 3, seed=16), basis),  # the Laplacian
        (_module(SmallCNN()), _randn(2, 2, 5, 5, seed=17), _randn(3, 2, 2, 5, 5, seed=18)),
    ):
        params = list(f.parameters())
        lap = second_order_sweep(f, x, v)[2]
        got = torch.autograd.grad(lap.square().sum(), params, materialize_grads=True)
        brute = _brute(f, x, v)[2].square().sum()
        want = torch.autograd.grad(brute, params, materialize_grads=True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-8)


def test_inputs_and_constants_changed_between_calls():
    """The trace is reused; the values are the current ones: a weight updated in place, and a
    captured tensor replaced by another of the same shape."""
    f = _module(Elementwise(3))
    x = _randn(2, 3, seed=18)
    v = _randn(2, 2, 3, seed=19)
    _check(f, x, v)
    with torch.no_grad():
        f.a.weight.mul_(2)
    _check(f, x, v)
    state = {"A": _randn(3, 3, seed=20)}

    def g(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ state["A"])

    _check(g, x, v)
    state["A"] = _randn(3, 3, seed=21)
    _check(g, x, v)


def test_linear_and_constant_functions():
    x = _randn(3, 4, seed=22)
    v = _randn(2, 1, 4, seed=23)
    A = _randn(4, 2, seed=24)
    _, first, second = _check(lambda x: x @ A, x, v)
    assert float(second.abs().max()) == 0
    _, first, second = _check(lambda x: torch.ones(x.shape[0], 2, dtype=D), x, v)
    assert float(first.abs().max()) == 0


def test_the_graph_runs_without_the_reference(monkeypatch):
    """The fast path does not fall back to the reference on these models."""

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(_taylor, "reference_sweep", refuse)
    second_order_sweep(_module(SmallCNN()), _randn(2, 2, 5, 5), _randn(2, 1, 2, 5, 5))
    second_order_sweep(_module(Elementwise(3)), _randn(2, 3), torch.eye(3, dtype=D)[:, None])


def test_reference_sweep_with_layer_norm():
    """The reference composes layer normalization (torch's second forward derivative of its
    kernel is wrong, torch 2.13)."""
    f = _module(nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 2)))
    x = _randn(3, 4, seed=25)
    v = _randn(3, 3, 4, seed=26)
    for got, want in zip(reference_sweep(f, x, v), _brute(f, x, v), strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize(
    "g",
    [
        torch.expm1,
        lambda h: torch.log1p(h * h),
        torch.relu,
        torch.abs,
        lambda h: (1 + h * h) ** 0.5,
        lambda h: (2 + h) ** -1.5,
        lambda h: F.softplus(h, beta=3.0, threshold=1.0),
        torch.reciprocal,
        lambda h: torch.where(h > 0, h * h, torch.sinh(h)),  # the generic rule (sinh)
        lambda h: torch.softmax(h, -1),
        lambda h: torch.maximum(h, h.flip(-1)) * h,
    ],
)
def test_element_wise_rules(g):
    """Each rule on its own, per direction (with a linear layer around it, away from the kinks
    of relu and abs)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 4).to(D)
    x = _randn(2, 3, seed=27) + 0.5

    def f(x: torch.Tensor) -> torch.Tensor:
        return g(lin(x)) * lin(x).sum(1, keepdim=True)

    _check(f, x, _randn(2, 2, 3, seed=28), collapse=False)


def test_functional_parameters(monkeypatch):
    """A function of weights held in a closure (``u(params, x)``): the fast path, and the
    values of the weights passed now."""

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(_taylor, "reference_sweep", refuse)
    params = [(_randn(3, 5, seed=29), _randn(5, seed=30)), (_randn(5, 1, seed=31), _randn(1))]

    def u(params, x):
        for w, b in params[:-1]:
            x = torch.tanh(x @ w + b)
        w, b = params[-1]
        return (x @ w + b)[:, 0]

    x = _randn(4, 3, seed=32)
    _check(lambda x: u(params, x), x, torch.eye(3, dtype=D)[:, None])
