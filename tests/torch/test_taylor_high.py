"""The collapsed Taylor sweep of order 3 and 4 in torch (divjac.torch._taylor.high) against
brute force: nested ``torch.func.jacfwd`` of ``s -> f(x + s v)`` per sample and direction,
float64; the fallback to nested second-order sweeps where an operation has no rule; autograd
w.r.t. parameters and inference mode through ``differential_operator`` built on it."""

from __future__ import annotations

import pytest
import torch
from torch.func import jacfwd, vmap

import divjac.torch as dt
from divjac.torch._taylor.high import taylor_sweep
from tests.reference import torch_composed_norms

B, N, K = 3, 4, 5
GEN = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=torch.float64)


W1, W2, W3 = _randn(N, 6) / 2, _randn(6, 6) / 2, _randn(6, 2)


def _mlp(x):  # closed-form derivatives (tanh, sigmoid, silu), products with constants
    return torch.nn.functional.silu(torch.sigmoid(torch.tanh(x @ W1) @ W2)) @ W3


def _products(x):  # products and quotients of two dependent operands, powers, views, a concat
    a, b = torch.sin(x), torch.exp(0.3 * x)
    outer = a[:, :, None] @ b[:, None, :]  # a matrix product of two dependent operands
    joined = torch.cat([outer.sum((1, 2))[:, None], x[:, :1] * x[:, 1:2]], dim=1)
    return (joined[:, 0] * joined[:, 1] * x[:, 0]) / (1.0 + x[:, 1] ** 2) + torch.log(
        1 + x[:, 2] ** 4
    )


def _custom(x):  # element-wise operations without a closed form here (nested jvp), relu
    y = torch.atan2(torch.erf(x), 1.0 + x**2) + torch.nn.functional.softplus(x) * torch.relu(x)
    return torch.special.expm1(y).sum(1, keepdim=True)


def _generic(x):  # operations of no rule here (by nested jvp in t): softmax, a layer norm
    # (three outputs), a product over an axis
    y = torch.softmax(torch.tanh(x @ W1), dim=-1)
    z = torch.nn.functional.layer_norm(y @ W2, (6,))
    return (z.prod(-1, keepdim=True) + z[:, :2]) * x[:, :1]


def _pairs(x):  # a sum over pairs of coordinates: views of transposed and broadcast terms
    pairs = torch.tanh(x @ W1[:, :4]).reshape(x.shape[0], -1, 2)
    return (torch.tanh(pairs.transpose(1, 2) @ W2[:2, :2]).reshape(x.shape[0], -1) ** 2).sum(1)


KERNEL = _randn(2, 1, 3, 3) / 2


def _conv(x):  # a convolution (linear in its input but for the bias), reshapes
    h = torch.nn.functional.conv2d(x.reshape(-1, 1, 2, 2), KERNEL.to(x.dtype), padding=1)
    return torch.tanh(h + 0.1).reshape(x.shape[0], -1).sum(1)


def _table(x):  # closed-form derivatives of the op-fact table's functions, piecewise linear ones
    y = (
        torch.cos(x) * torch.sqrt(2 + x)
        + torch.rsqrt(2 + x**2)
        + torch.reciprocal(3 + torch.sin(x))
    )
    y = y + torch.log(2 + x**2) * torch.exp(-x) + x**3 * torch.nn.functional.leaky_relu(x).abs()
    return (torch.nn.functional.silu(y) + torch.sigmoid(y)).sum(1)


FUNCTIONS = {
    "mlp": _mlp, "products": _products, "custom": _custom, "generic": _generic, "pairs": _pairs,
    "conv": _conv, "table": _table,
}  # fmt: skip


def _brute(f, x, v, order):
    """``(v_k . grad)^order f`` ``[K, B, *out]`` for directions ``v`` ``[K, B or 1, n]``."""

    def one(xi, vi):
        g = lambda s: f((xi + s * vi)[None])[0]  # noqa: E731
        for _ in range(order):
            g = jacfwd(g)
        return g(torch.zeros((), dtype=x.dtype))

    v = v.expand(v.shape[0], *x.shape)
    with torch_composed_norms():  # (torch's layer-norm kernel: wrong third derivatives)
        return torch.stack([vmap(one)(x, vk) for vk in v])


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("order", [2, 3, 4])
def test_taylor_sweep_is_nested_jacfwd(name, order):
    f = FUNCTIONS[name]
    x = _randn(B, N)
    shared, own = _randn(K, 1, N), _randn(K, B, N)
    w, wb = _randn(K), _randn(K, B)
    for v in (shared, own):
        want = _brute(f, x, v, order)
        for weights, expected in (
            (None, want),
            (w, torch.einsum("k,kb...->b...", w, want)),
            (wb, torch.einsum("kb,kb...->b...", wb, want)),
        ):
            got = taylor_sweep(f, x, v, order, weights=weights, chunk=2)
            assert got is not None, "the sweep has a rule for every operation here"
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_float32_convolution():
    """(Four nested ``jvp`` of a float32 convolution fail in torch 2.13: the sweep pushes a
    convolution as a linear map.)"""
    x, v = _randn(B, N), _randn(K, 1, N)
    got = taylor_sweep(_conv, x.float(), v.float(), 4, weights=None, chunk=K)
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _brute(_conv, x, v, 4), rtol=1e-4, atol=1e-4)


def test_an_operation_without_a_rule_falls_back_to_nested_sweeps():
    def f(x):  # a stack of dependent tensors has no rule of the sweep
        return torch.stack([torch.tanh(x @ W1), x @ W1]).prod(0) @ W3

    x, v = _randn(B, N), _randn(K, 1, N)
    assert taylor_sweep(f, x, v, 4, weights=None, chunk=K) is None
    terms = [(1.0, (i, i, i, i)) for i in range(N)] + [(0.5, (0, 1, 2))]
    got = dt.differential_operator(f, terms)(x)
    want = _operator_brute(f, terms, x)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def _operator_brute(f, terms, x):
    """``sum_k c_k d^alpha_k f`` per sample by nested ``jacfwd`` of the per-sample function."""
    total = 0
    for c, alpha in terms:
        g = lambda z: f(z[None])[0]  # noqa: E731
        for _ in alpha:
            g = jacfwd(g)
        total = total + c * vmap(g)(x)[(slice(None), Ellipsis, *alpha)]
    return total


TERMS = [(1.0, (i, i, i, i)) for i in range(N)] + [(-0.5, (0, 0, 3)), (2.0, (1, 2, 2, 3))]


def test_parameter_gradients_through_the_sweep():
    net = torch.nn.Sequential(
        torch.nn.Linear(N, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.SiLU(),
        torch.nn.Linear(8, 1),
    ).double()  # fmt: skip
    x = _randn(B, N)
    u = lambda z: net(z)[:, 0]  # noqa: E731
    assert taylor_sweep(u, x, _randn(K, 1, N), 4, weights=None, chunk=K) is not None
    got = dt.differential_operator(u, TERMS)(x)
    # (the last bias does not reach a derivative: its gradient is None, zero by brute force)
    grads = torch.autograd.grad(got.square().sum(), list(net.parameters()), allow_unused=True)
    params = dict(net.named_parameters())

    def loss(p):
        f = lambda z: torch.func.functional_call(net, p, (z,))[:, 0]  # noqa: E731
        return _operator_brute(f, TERMS, x).square().sum()

    want = torch.func.grad(loss)(params)
    for g, name in zip(grads, params, strict=True):
        g = torch.zeros_like(want[name]) if g is None else g
        torch.testing.assert_close(g, want[name], rtol=1e-9, atol=1e-10)


def test_inference_mode():
    x = _randn(B, N)
    want = _operator_brute(_custom, TERMS, x)
    with torch.inference_mode():
        got = dt.differential_operator(_custom, TERMS)(x.clone())
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
