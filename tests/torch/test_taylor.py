"""The second-order engine (collapsed Taylor mode) against brute force: per-sample Hessians by
reverse over reverse (``jacrev`` of ``jacrev``, no forward-mode AD), float64."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.func import jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from divjac.torch import laplacian
from divjac.torch._compat import COMPILES
from divjac.torch._taylor import generic as _taylor_generic, sweep as _taylor
from divjac.torch._taylor.sweep import reference_sweep, second_order_sweep

D = torch.float64


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = D) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    g = x.reshape(x.shape[0], num_groups, -1)
    mean = g.mean(-1, keepdim=True)
    var = g.var(-1, unbiased=False, keepdim=True)
    y = ((g - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    y = y if weight is None else y * weight.reshape(shape)
    return y if bias is None else y + bias.reshape(shape)


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    dims = tuple(range(-len(normalized_shape), 0))
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, unbiased=False, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    y = y if weight is None else y * weight
    return y if bias is None else y + bias


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
    Hessians (differentiable: built by autograd on the captured parameters); attention in its
    math form (torch 2.14 on the CPU runs a flash kernel, whose backward has no derivative)."""
    K, B = v.shape[0], x.shape[0]
    v = v.expand(K, *x.shape)
    ys, firsts, seconds = [], [], []
    with _Composed(), sdpa_kernel(SDPBackend.MATH):
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


def _hessian_traces(u, x):
    """Per-sample ``tr(H)`` of the batch-first scalar ``u``, by dense Hessians."""
    return torch.stack([torch.func.hessian(lambda z: u(z[None])[0])(z).diagonal().sum() for z in x])


@pytest.mark.parametrize("method", ["exact", "auto"])
def test_laplacian_runs_its_calls_own_trace_on_the_current_tensors(method, monkeypatch):
    """``laplacian`` sweeps the trace its call found (the function it sweeps, bound to the
    call's arguments, is made anew at every call: tracing it would walk everything it reaches
    each time), with the current weights (updated in place). A captured tensor that is no
    module's (replaced between calls) is found by tracing the function, as before."""
    traced = []
    trace_again = _taylor._traced
    monkeypatch.setattr(
        _taylor, "_traced", lambda f, x, *rest: traced.append(1) or trace_again(f, x, *rest)
    )
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(D)
    state = {"A": _randn(2, 2, seed=20)}
    x = _randn(5, 3, seed=21)
    for u, retraced in (
        (lambda x: net(x)[..., 0] * net(x).square().sum(-1), False),
        (lambda x: torch.tanh(net(x) @ state["A"]).sum(-1), True),
    ):
        lap = laplacian(u, method=method)
        for step in range(3):
            traced.clear()
            torch.testing.assert_close(lap(x), _hessian_traces(u, x))
            assert bool(traced) == retraced
            with torch.no_grad():
                net[0].weight.mul_(1.5)
            state["A"] = _randn(2, 2, seed=22 + step)


@pytest.mark.parametrize("method", ["exact", "auto"])
def test_laplacian_runs_its_calls_own_trace_with_its_other_tensor_arguments(method, monkeypatch):
    """``u(params, x, t)`` with ``t`` and the weights passed as tensors (a PINN): the sweep
    runs the call's trace, its other inputs the call's own tensors (new ones at every call, or
    the same updated in place), not a trace of the bound function (which walked everything it
    reaches at every call); the gradients reach ``t`` and the weights. An integer argument (an
    index, whose values the sparse sweep may read) keeps the trace of the bound function."""
    traced = []
    trace_again = _taylor._traced
    monkeypatch.setattr(
        _taylor, "_traced", lambda f, x, *rest: traced.append(1) or trace_again(f, x, *rest)
    )

    def u(params, x, t):
        h = torch.tanh(torch.cat([x, t], 1) @ params["w"] + params["b"])
        return torch.tanh(h @ params["v"]) * t[:, 0]

    def brute(params, x, t):  # sample by sample: t is per sample
        return torch.cat(
            [
                _hessian_traces(lambda z, i=i: u(params, z, t[i : i + 1]), x[i : i + 1])
                for i in range(5)
            ]
        )

    lap = laplacian(u, argnums=1, method=method)
    x = _randn(5, 3, seed=40)
    for step in range(3):
        params = {
            "w": _randn(4, 6, seed=41 + step).requires_grad_(),
            "b": _randn(6, seed=44 + step),
            "v": _randn(6, seed=47 + step).requires_grad_(),
        }
        t = _randn(5, 1, seed=50 + step).requires_grad_()
        traced.clear()
        got = lap(params, x, t)
        assert not traced
        want = brute(params, x, t)
        torch.testing.assert_close(got, want)
        grads = torch.autograd.grad(got.square().sum(), (t, params["w"], params["v"]))
        wants = torch.autograd.grad(want.square().sum(), (t, params["w"], params["v"]))
        for g, w in zip(grads, wants, strict=True):
            torch.testing.assert_close(g, w)
        with torch.no_grad():
            params["b"].mul_(-2)  # in place, between calls of the same tensors
        torch.testing.assert_close(lap(params, x, t), brute(params, x, t))

    def picked(x, idx):
        return torch.tanh(x[:, idx]).square().sum(1)

    lap = laplacian(picked, method=method)
    for idx in ([0, 1], [2, 2]):
        index = torch.tensor(idx)
        traced.clear()
        torch.testing.assert_close(
            lap(x, index), _hessian_traces(lambda z, i=index: picked(z, i), x)
        )
        assert traced


def test_a_captured_tensor_is_found_by_the_walk_that_found_the_trace(monkeypatch):
    """A function of weights in a closure (no module: the trace cannot stand for them): the
    walk that finds the trace of the call's bound function also finds the tensors the sweep
    runs on (walked again before), and weights replaced between calls are used."""
    from divjac.torch import _detect

    walks = []
    for owner in (_detect, _taylor):
        original = owner.reach
        monkeypatch.setattr(
            owner, "reach", lambda *a, _o=original, **k: walks.append(1) or _o(*a, **k)
        )
    params = {"w": _randn(3, 5, seed=33), "v": _randn(5, seed=34)}

    def u(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ params["w"]) @ params["v"]

    lap = laplacian(u, method="exact")
    x = _randn(4, 3, seed=35)
    lap(x)
    for step in range(3):
        params["w"] = _randn(3, 5, seed=36 + step)  # replaced: a new tensor
        walks.clear()
        torch.testing.assert_close(lap(x), _hessian_traces(u, x))
        # The call's walk of u; of its bound function, by the sparse sweep's check (which
        # finds the trace and the tensors) and by the dense sweep (whose trace the memo finds):
        # 4 before.
        assert len(walks) == 3


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


def test_a_closure_made_anew_runs_the_graph_on_its_new_tensors(monkeypatch):
    """A closure made anew at each call over new tensors of the same shapes (as the exact
    bi-Laplacian makes its inner directions) finds its trace and runs the graph on the new
    tensors' values (the old ones alive or not)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(_taylor, "reference_sweep", refuse)
    x, v = _randn(3, 4, seed=40), _randn(2, 1, 4, seed=41)

    def make(A: torch.Tensor, c: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: torch.tanh(x @ A) * c

    for seed in (42, 44, 46):
        _check(make(_randn(4, 2, seed=seed), _randn(2, seed=seed + 1)), x, v)
    kept = [(_randn(4, 2, seed=seed), _randn(2, seed=seed + 1)) for seed in (48, 50)]
    for A, c in (*kept, kept[0]):
        _check(make(A, c), x, v)


def test_a_captured_tensor_reached_at_another_place_is_not_reused_there():
    """A history of weights shifted by one between calls (the old first weight is now the
    second), and two weights swapped: each captured tensor stands for the one at its place in
    the walk, never for a tensor of the trace's call that is still reached elsewhere (errors
    of 2.4 and 157 before)."""
    x, v = _randn(3, 4, seed=60), _randn(2, 1, 4, seed=61)

    def make(ws: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        a, b = ws
        return lambda x: torch.tanh(x @ a) + (x @ b) ** 3

    history = [_randn(4, 4, seed=62), _randn(4, 4, seed=63)]
    for seed in (64, 65, 66):
        _check(make(history), x, v)
        history = [_randn(4, 4, seed=seed), history[0]]
    _check(make(history[::-1]), x, v)  # the same tensors, roles swapped (an error of 157)


@pytest.mark.parametrize("nested", [False, True])
def test_bilaplacian_runs_the_graph_at_every_call(monkeypatch, nested):
    """The exact bi-Laplacian's outer sweep runs the graph of the inner sweep at every call, not
    only the first (its inner directions are new tensors each time), also where the weights lie
    deeper in what ``u`` reaches (``nested``: a list of layers, as the benchmark's MLP; the
    outer sweep's function once reached the call itself, and its walk did not find them);
    against nested Hessians."""
    from torch.func import hessian

    from divjac.models import torch as models
    from divjac.torch import bilaplacian

    W, b, w = _randn(4, 6, seed=50), _randn(6, seed=51), _randn(6, seed=52)
    params = models.init_mlp(50, (4, 6, 1), dtype=D)

    def u(x: torch.Tensor) -> torch.Tensor:
        if nested:
            return models.mlp(params, x)[:, 0]
        return torch.tanh(x @ W + b) @ w

    def lap(z: torch.Tensor) -> torch.Tensor:
        return torch.trace(hessian(lambda s: u(s[None])[0])(z))

    x = _randn(3, 4, seed=53)
    want = torch.stack([torch.trace(hessian(lap)(z)) for z in x])
    fn = bilaplacian(u)
    torch.testing.assert_close(fn(x), want, atol=1e-10, rtol=1e-9)

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(_taylor, "reference_sweep", refuse)
    for _ in range(2):
        torch.testing.assert_close(fn(x), want, atol=1e-10, rtol=1e-9)


def test_bilaplacian_of_a_function_with_a_value_dependent_branch():
    """The inner sweep of the exact bi-Laplacian runs the call's trace (the branch taken at the
    call's values), as the Laplacian's sweep does; it traced the function again inside the
    outer sweep's trace, where a Python branch on a tensor failed with a raw error."""
    from torch.func import hessian

    from divjac.torch import bilaplacian

    def u(z: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(z)
        if z.sum() > 0:
            h = 2 * h
        return h.pow(3).sum(-1)

    for shift in (0.1, 0.9):  # each branch
        x = torch.rand(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        x = x - shift

        def lap(z: torch.Tensor, b: int, x: torch.Tensor = x) -> torch.Tensor:
            one = lambda s: u(torch.cat([x[:b], s[None], x[b + 1 :]]))[b]  # noqa: E731
            return torch.trace(hessian(one)(z))

        want = torch.stack([torch.trace(hessian(lap)(x[b], b)) for b in range(3)])
        torch.testing.assert_close(bilaplacian(u)(x), want, atol=1e-10, rtol=1e-9)


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


def _check_own_rules(g, shared):
    """``g`` after a linear layer, by the sweep against dense derivatives, with no step of
    its program on the generic rule."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 4).to(D)
    x = _randn(2, 3, seed=29)

    def f(x: torch.Tensor) -> torch.Tensor:
        return g(torch.tanh(lin(x))) * lin(x).sum(1).reshape(-1, *([1] * (g(lin(x)).ndim - 1)))

    _check(f, x, _randn(2, 1 if shared else 2, 3, seed=30), collapse=False)
    plan = _taylor._PLANS[_taylor._traced(f, x)]
    assert all(step.rule is not _taylor_generic.generic for step in plan.steps)


@pytest.mark.parametrize(
    "g",
    [
        lambda h: h[..., 0],
        lambda h: h[:, 1:3].sin(),
        lambda h: h.reshape(-1, 2, 2)[:, 1, 1:].exp(),
        lambda h: h[:, None, :2].expand(-1, 3, -1)[:, 1].cos(),  # along a broadcast axis
        lambda h: h[..., None].squeeze(-1).tanh(),
        lambda h: h[:, :1, None].squeeze((1, 2)) * h[:, -1],
    ],
)
@pytest.mark.parametrize("shared", [True, False])
def test_elements_taken_along_an_axis(g, shared):
    """``select``, ``slice`` and ``squeeze`` by their own rules (not the generic one), on
    directions shared by the samples (broadcast along the batch axis) or per sample."""
    _check_own_rules(g, shared)


_ONES = torch.ones(2, 1, dtype=D)
_PICK = torch.tensor([2, 0, 2])
_GATHER = torch.tensor([[3, 0, 0], [1, 2, 3]])
_MASK = torch.tensor([True, False, True, True])
_ROWS = torch.tensor([[True, False, True, True], [False, False, False, True]])


@pytest.mark.parametrize(
    "g",
    [
        lambda h: torch.cat([h, h.sin(), _ONES], 1),
        lambda h: torch.cat([h[:, None, :2], h[:, None, 2:] ** 2], -1)[:, 0],
        lambda h: torch.cat([h[:1], h[1:].cos()], 0),
        lambda h: torch.stack([h, h.cos()], 1),
        lambda h: torch.stack([h[:, 0], _ONES[:, 0], h[:, 3] ** 2], -1),
        lambda h: torch.where(h > 0, h.sin(), h * h),
        lambda h: torch.where(h > 0.2, h, 0.0).exp(),
        lambda h: torch.where(_ROWS, 1.0, h.sin()),
        lambda h: h.masked_fill(h > 0.3, -1.0).exp(),
        lambda h: h.flip(-1) * h,
        lambda h: h.reshape(-1, 2, 2).flip(1, 2).exp(),
        lambda h: h.roll(1, -1) * h,
        lambda h: h.reshape(-1, 2, 2).roll((1, -1), (1, 2)).sin(),
        lambda h: h.repeat(1, 2) * h.repeat(1, 2).sin(),
        lambda h: h[:, None].repeat(1, 3, 1).cos(),
        lambda h: h.repeat(2, 1, 1).transpose(0, 1).exp(),
        lambda h: h.index_select(1, _PICK).sin(),
        lambda h: h.gather(1, _GATHER) ** 2,
        lambda h: h[:, _PICK] * h[:, _MASK].sum(1, keepdim=True),
        lambda h: h.reshape(-1, 2, 2)[:, _PICK[:2] // 2, _PICK[1:] // 2].exp(),
        lambda h: torch.cat(h.split(3, 1)[::-1], 1).sin(),
        lambda h: h.split([1, 3], 1)[1] * h.unbind(1)[0][:, None],
        lambda h: torch.stack(h.unbind(1)[::-1], 1) ** 2,
        lambda h: F.pad(h, (1, 2), value=3.0).sin(),
        lambda h: F.pad(h.reshape(-1, 2, 2), (-1, 1, 1, 0)).exp(),
    ],
)
@pytest.mark.parametrize("shared", [True, False])
def test_moves_of_elements(g, shared):
    """Concatenation, stacking, selection by a condition or a mask, flips, rolls, tiling,
    gathers, advanced indexing, splits and padding by their own rules, on shared and
    per-sample directions."""
    _check_own_rules(g, shared)


@pytest.mark.parametrize(
    "g",
    [
        lambda h: torch.softmax(h, -1),
        lambda h: torch.softmax(h.reshape(-1, 2, 2), 1) * h.reshape(-1, 2, 2),
        lambda h: torch.softmax(h.masked_fill(~_MASK, -torch.inf), -1).sin(),
        lambda h: F.log_softmax(h, 1) ** 2,
        lambda h: torch.logsumexp(h, 1),
        lambda h: torch.logsumexp(h.reshape(-1, 2, 2), (1, 2), keepdim=True).exp(),
        lambda h: torch.linalg.vector_norm(h, dim=1),
        lambda h: h.reshape(-1, 2, 2).norm(dim=-1, keepdim=True) * h.reshape(-1, 2, 2),
        lambda h: torch.linalg.vector_norm(h.reshape(-1, 2, 2), dim=(1, 2)).sin(),
        lambda h: F.layer_norm(h, (4,)).sin(),
        lambda h: F.layer_norm(h.reshape(-1, 2, 2), (2, 2), _W, _B).exp(),
        lambda h: F.layer_norm(h.reshape(-1, 2, 2), (2,), eps=0.1) ** 2,
        lambda h: h.var(-1) * h[:, 0],
        lambda h: h.reshape(-1, 2, 2).std((1, 2), keepdim=True).exp(),
        lambda h: torch.stack(torch.var_mean(h, 1, correction=0), -1).sin(),
        lambda h: torch.stack(torch.std_mean(h.reshape(-1, 2, 2), 1, keepdim=True), -1).exp(),
    ],
)
@pytest.mark.parametrize("shared", [True, False])
def test_reductions_by_their_own_formulas(g, shared):
    """Softmax, log-softmax, log-sum-exp, the 2-norm, layer normalization, variances and
    deviations by their own formulas (with masked entries, over several axes, with an
    affine map)."""
    _check_own_rules(g, shared)


@pytest.mark.parametrize(
    "g",
    [
        lambda h: F.group_norm(h.reshape(-1, 2, 2), 2, _W[0], _B[1]).exp(),
        lambda h: F.group_norm(h.reshape(-1, 2, 1, 2), 1).sin(),
        lambda h: F.avg_pool1d(h[:, None], 2).exp(),
        lambda h: F.adaptive_avg_pool2d(h.reshape(-1, 1, 2, 2) ** 2, 1),
        lambda h: F.pad(h.reshape(-1, 1, 4), (2, 1), mode="reflect").sin(),
        lambda h: F.pad(h.reshape(-1, 1, 2, 2), (1, 1, 0, 1), mode="replicate").exp(),
        lambda h: F.interpolate(h.reshape(-1, 1, 2, 2), scale_factor=2).sin(),
        lambda h: F.interpolate(h.reshape(-1, 1, 4), size=6, mode="linear").exp(),
        lambda h: F.pixel_shuffle(h.reshape(-1, 4, 1, 1), 2).sin(),
        lambda h: (
            F.max_pool2d(h.reshape(-1, 1, 2, 2).exp(), (1, 2)) * h.reshape(-1, 1, 2, 2)[..., :1]
        ),
        lambda h: F.max_pool1d(h[:, None], 2, stride=1).sin(),
        lambda h: h.clamp(-0.3, 0.4).exp() * h,
        lambda h: torch.clamp_min(h, 0.1).sin() + torch.clamp_max(h, 0.2) ** 2,
        lambda h: F.hardtanh(2 * h, -0.5, 0.5).exp() + F.relu6(3 * h) * h,
        lambda h: torch.maximum(h, h.flip(-1).cos()) * torch.minimum(h, _ONES),
        lambda h: torch.maximum(h, h) * h,  # a tie everywhere: half of each
        lambda h: h.amax(-1) * h.amin(1, keepdim=True)[:, 0],
        lambda h: h.reshape(-1, 2, 2).amax((1, 2)).exp() * h[:, 0],
        lambda h: torch.cat([h, h], 1).amax(-1) ** 2,  # ties shared evenly
        lambda h: h.max(1).values.sin() * h.min(-1, keepdim=True).values[:, 0],
        lambda h: h.cumsum(1).sin(),
        lambda h: torch.tril(h.reshape(-1, 2, 2)).exp() + torch.triu(h.reshape(-1, 2, 2), 1),
        lambda h: h.reshape(-1, 2, 2).diagonal(0, 1, 2).exp(),
        lambda h: torch.baddbmm(
            h.reshape(-1, 2, 2), h.reshape(-1, 2, 2).sin(), h.reshape(-1, 2, 2), beta=0.5, alpha=2.0
        ),
    ],
)
@pytest.mark.parametrize("shared", [True, False])
def test_convolutional_blocks(g, shared):
    """Group normalization (standardized per sample and group, with the jets of its
    statistics), pooling by averages and maxima, padding by reflection and replication,
    upsampling, pixel shuffles, clamps, maxima and minima (ties as torch's derivative
    shares them), cumulative sums, triangles, diagonals and batched products with an added
    term by their own rules."""
    _check_own_rules(g, shared)


_W = torch.tensor([[0.5, -1.0], [2.0, 1.5]], dtype=D)
_B = torch.tensor([[0.1, 0.0], [-0.3, 0.2]], dtype=D)


@pytest.mark.parametrize(
    "g",
    [
        F.gelu,
        lambda h: F.gelu(3 * h, approximate="tanh"),
        torch.erf,
        lambda h: F.elu(2 * h, 0.7),
        lambda h: F.selu(2 * h),
        lambda h: F.celu(2 * h, 0.5),
        lambda h: F.leaky_relu(h, 0.2) * h,
        torch.sinh,
        torch.cosh,
        torch.tan,
        torch.atan,
        torch.atanh,
        torch.asin,
        torch.acos,
        lambda h: torch.asinh(3 * h),
        lambda h: torch.log2(1.5 + h) + torch.log10(2 + h),
        torch.exp2,
        lambda h: F.mish(2 * h),
        lambda h: F.hardswish(4 * h),
    ],
)
def test_activations_by_their_own_derivatives(g):
    _check_own_rules(g, shared=False)


# Value-preserving steps ``[B, 4] -> [B, 4]`` swept by their own rules, composed at random.
_STEPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda h: torch.softmax(h, -1) * 4,
    "log_softmax": lambda h: F.log_softmax(h, 1),
    "layer_norm": lambda h: F.layer_norm(h, (4,), _W.reshape(-1), _B.reshape(-1)),
    "group_norm": lambda h: F.group_norm(h.reshape(-1, 2, 2), 2).reshape(-1, 4),
    "gelu": F.gelu,
    "mish": F.mish,
    "cat": lambda h: torch.cat([h[:, 2:].sin(), h[:, :2]], 1),
    "stack": lambda h: torch.stack([h, h.cos()], 1).sum(1),
    "where": lambda h: torch.where(h > 0, h, h * h),
    "maximum": lambda h: torch.maximum(h, h.flip(-1).sin()),
    "cumsum": lambda h: h.cumsum(1) / 2,
    "norm": lambda h: h * torch.linalg.vector_norm(h, dim=-1, keepdim=True),
    "logsumexp": lambda h: h - torch.logsumexp(h, -1, keepdim=True),
    "std": lambda h: h * h.std(-1, keepdim=True),
    "roll": lambda h: h.roll(1, -1) * h,
    "gather": lambda h: h.index_select(1, _PICK.flip(0)[:1].repeat(4)) + h,
    "pad": lambda h: F.pad(h, (1, 1), mode="reflect")[:, 1:-1].exp() / 3,
    "amax": lambda h: h * h.amax(-1, keepdim=True),
}


@given(
    steps=st.lists(st.sampled_from(sorted(_STEPS)), min_size=2, max_size=4),
    shared=st.booleans(),
    collapse=st.booleans(),
)
@settings(max_examples=20)
def test_random_compositions_of_the_own_rules(steps, shared, collapse):
    """Random chains of the operations with their own rules (normalizations, softmax, moves,
    selections), on shared or per-sample directions, collapsed or not, against float64
    Hessians, with no step of the program on the generic rule."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 4).to(D)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(lin(x))
        for name in steps:
            h = _STEPS[name](h)
        return h

    x = _randn(2, 3, seed=31)
    _check(f, x, _randn(2, 1 if shared else 2, 3, seed=32), collapse=collapse, atol=1e-9)
    plan = _taylor._PLANS[_taylor._traced(f, x)]
    assert all(step.rule is not _taylor_generic.generic for step in plan.steps)


def test_hardsigmoid_as_its_composed_form():
    """``hardsigmoid`` (``relu6(x + 3) / 6``; torch has no second derivative of it, so no
    brute force) by its own rule equals the sweep of its composed form (whose rules are
    checked against brute force above)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 4).to(D)
    x, v = _randn(5, 3, seed=29), _randn(2, 5, 3, seed=30)

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.hardsigmoid(4 * lin(x)) * lin(x)

    got = second_order_sweep(f, x, v)
    want = second_order_sweep(lambda x: F.relu6(4 * lin(x) + 3) / 6 * lin(x), x, v)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    plan = _taylor._PLANS[_taylor._traced(f, x)]
    assert all(step.rule is not _taylor_generic.generic for step in plan.steps)


@pytest.mark.parametrize(
    "g",
    [
        lambda h: (
            h.reshape(-1, 2, 1, 2)[:, _PICK[1:] // 2, :, _PICK[:2] // 2].transpose(0, 1).sin()
        ),
        lambda h: torch.linalg.vector_norm(h, 3, dim=1),
    ],
)
def test_the_generic_rule_where_the_own_ones_do_not_apply(g):
    """Indices apart from each other and a norm of another order go to the generic rule,
    which gets them right."""
    lin = nn.Linear(3, 4).to(D)
    x = _randn(2, 3, seed=29)
    _check(lambda x: g(torch.tanh(lin(x))), x, _randn(2, 2, 3, seed=30), collapse=False)


@pytest.mark.parametrize(
    "u",
    [
        lambda x: (torch.tanh(x).roll(2) * x).sin().sum(),  # rolled as flattened
        lambda x: F.layer_norm(x.tanh(), (2,), x.sum(0).sin(), x[0].cos()).exp().sum(),
        lambda x: x.sin().max() * x.cos().min() + (x * x).sum(),  # of all elements
    ],
)
def test_across_the_whole_value(u):
    """``roll`` without axes (of the flattened value), a layer normalization with a
    dependent weight and bias (the generic rule) and the maximum of all elements, in
    unbatched functions: the Laplacian against the trace of the Hessian by reverse over reverse (normalizations composed)."""
    x = _randn(3, 2, seed=31)
    with _Composed():
        want = jacrev(jacrev(u))(x).reshape(6, 6).trace()
    torch.testing.assert_close(laplacian(u, batch_axis=None)(x), want)


@pytest.mark.parametrize(
    "g", [lambda h: 1 - h * h, lambda h: torch.rsub(h.sin(), 2.0, alpha=3), lambda h: 2 - h]
)
def test_a_number_minus_the_value(g):
    """``rsub`` (``1 - h``, in the derivative of tanh as a user writes it) by its own rule."""
    _check_own_rules(g, shared=False)


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


# --- the linear-algebra family ------------------------------------------------------------------

_N = 3


def _mat(x: torch.Tensor) -> torch.Tensor:
    """A well-conditioned ``(B, 3, 3)`` matrix, nonlinear in ``x`` ``(B, 9)``."""
    return 2 * torch.eye(_N, dtype=x.dtype) + 0.4 * torch.sin(x).reshape(-1, _N, _N)


def _spd(x: torch.Tensor) -> torch.Tensor:
    m = _mat(x)
    return torch.eye(_N, dtype=x.dtype) + m @ m.mT


def _rhs(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x).reshape(-1, _N, _N)[..., :2]


_LA = torch.linalg
_LINALG_FAMILY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "solve": lambda x: _LA.solve(_mat(x), _rhs(x)),
    "solve_vector": lambda x: _LA.solve(_mat(x), _rhs(x)[..., 0]),
    "solve_ex": lambda x: _LA.solve_ex(_mat(x), _rhs(x))[0],
    "inv": lambda x: _LA.inv(_mat(x)),
    "inverse": lambda x: torch.inverse(_mat(x)),
    "det": lambda x: _LA.det(_mat(x)),
    "logdet": lambda x: torch.logdet(_spd(x)),
    "slogdet": lambda x: _LA.slogdet(_mat(x))[1],
    "cholesky": lambda x: _LA.cholesky(_spd(x)),
    "cholesky_solve": lambda x: torch.cholesky_solve(_rhs(x), _LA.cholesky(_spd(x))),
    "cholesky_inverse": lambda x: torch.cholesky_inverse(_LA.cholesky(_spd(x))),
    "qr": lambda x: torch.cat(_LA.qr(_mat(x)), -1),
    "eigh": lambda x: torch.cat([_LA.eigh(_spd(x))[0][..., None], _LA.eigh(_spd(x))[1]], -1),
    "eigvalsh": lambda x: _LA.eigvalsh(_spd(x)),
    "eig": lambda x: _LA.eig(_spd(x))[0].real,
    "eigvals": lambda x: _LA.eigvals(_spd(x)).real,
    "svd": lambda x: torch.cat([_LA.svd(_mat(x))[0], _LA.svd(_mat(x))[2]], -1),
    "svdvals": lambda x: _LA.svdvals(_mat(x)),
    "matrix_exp": lambda x: _LA.matrix_exp(0.3 * _mat(x)),
    "pinv": lambda x: _LA.pinv(_mat(x)),
    "pinv_hermitian": lambda x: _LA.pinv(_spd(x), hermitian=True),
    "matrix_power": lambda x: _LA.matrix_power(_mat(x), 3),
    "matrix_power_negative": lambda x: _LA.matrix_power(_mat(x), -2),
    "matrix_norm_fro": lambda x: _LA.matrix_norm(_mat(x)),
    "matrix_norm_nuc": lambda x: _LA.matrix_norm(_mat(x), "nuc"),
    "matrix_norm_2": lambda x: _LA.matrix_norm(_mat(x), 2),
    "matrix_norm_-2": lambda x: _LA.matrix_norm(_mat(x), -2),
    "vector_norm": lambda x: _LA.vector_norm(torch.sin(x), 3, dim=-1),
    "norm": lambda x: _LA.norm(torch.sin(x), dim=-1),
    "cond": lambda x: _LA.cond(_mat(x)),
    "cross": lambda x: _LA.cross(torch.sin(x[:, :3]), x[:, 3:6] ** 2),
    "vecdot": lambda x: _LA.vecdot(torch.sin(x), x**2),
    "lu_factor_lu_solve": lambda x: _LA.lu_solve(*_LA.lu_factor(_mat(x)), _rhs(x)),
    "lu": lambda x: torch.cat(_LA.lu(_mat(x))[1:], -1),
    "lu_unpack": lambda x: torch.cat(torch.lu_unpack(*_LA.lu_factor(_mat(x)))[1:], -1),
    "solve_triangular": lambda x: _LA.solve_triangular(torch.triu(_mat(x)), _rhs(x), upper=True),
    "householder_product": lambda x: _LA.householder_product(_mat(x), torch.tanh(x[:, :2])),
    "diagonal": lambda x: _LA.diagonal(_mat(x)) ** 2,
    "matmul": lambda x: _LA.matmul(_mat(x), _mat(x)),
}


# The kernels that jvp of jvp gets wrong run in the default suite; the rest of the family too,
# when the slow tests run.
_ROUTED = {
    "solve",
    "solve_vector",
    "det",
    "slogdet",
    "eigh",
    "householder_product",
    "cholesky_inverse",
}


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # the brute force's vmap
@pytest.mark.parametrize(
    "name",
    [
        n if n in _ROUTED else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(_LINALG_FAMILY)
    ],
)
def test_linalg_family_against_hessians(name):
    # torch's forward derivatives of the solve, determinant, eigen- and Householder kernels
    # are not differentiated right (jvp of jvp of torch.linalg.solve is off by a factor of
    # two, torch 2.13): the sweep must differentiate what it pushes through them otherwise.
    op = _LINALG_FAMILY[name]

    def f(x: torch.Tensor) -> torch.Tensor:
        return op(x).reshape(x.shape[0], -1)

    _check(f, _randn(2, _N * _N, seed=3), _randn(3, 2, _N * _N, seed=4), atol=1e-9)


@pytest.mark.parametrize("method", ["exact", "auto"])
def test_laplacian_through_linalg_solve(method):
    # The case: u(x) = sum solve(I + x x^T, x), 13 % off with jvp of jvp.
    from divjac.torch import laplacian

    def u(x: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(x.shape[-1], dtype=x.dtype)
        return _LA.solve(eye + x[:, :, None] * x[:, None, :], x).sum(-1)

    x = _randn(3, 4, seed=5)
    want = torch.stack([torch.func.hessian(lambda s: u(s[None])[0])(s).trace() for s in x])
    torch.testing.assert_close(laplacian(u, method=method)(x), want, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not COMPILES, reason=f"torch {torch.__version__} < 2.13: torch.compile refused")
@pytest.mark.filterwarnings("ignore::UserWarning:torch._dynamo")
@pytest.mark.parametrize("method", ["exact", "hutchinson"])
def test_compiled_laplacian_through_linalg_solve(method):
    # Issue 41: under torch.compile the sweep runs the reference (jvp of jvp of the whole
    # function), which torch differentiates wrong through a solve (37% off, silently).
    from divjac.torch import laplacian

    def u(x: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(x.shape[-1], dtype=x.dtype)
        return _LA.solve(eye + x[:, :, None] * x[:, None, :], x).sum(-1)

    x = _randn(3, 4, seed=5)
    want = torch.stack([torch.func.hessian(lambda s: u(s[None])[0])(s).trace() for s in x])
    lap = laplacian(u, method=method, num_probes=4 if method == "hutchinson" else None)
    probes = torch.eye(4, dtype=D)[:, None].expand(4, 3, 4)  # the unit basis: exact
    args = (probes, x) if method == "hutchinson" else (x,)
    torch._dynamo.reset()
    got = torch.compile(lambda *a: lap(*a), fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# householder_product's backward runs tril_, which torch's vmap batches by a loop (a warning)
@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("name", ["solve", "solve_vector", "slogdet", "householder_product"])
def test_bilaplacian_through_linalg_kernels(name):
    # Issue 41: the bi-Laplacian's outer sweep differentiates the program of the inner one,
    # whose forward derivatives of the linalg kernels read their saved factorizations (the
    # LU of the solve), which carry no derivative: 3.9 off for a batched solve. The
    # reference is reverse mode only (torch's double backward recomputes the factorization;
    # finite differences of its Laplacian agree to 1e-5).
    from divjac.torch import bilaplacian

    op = _LINALG_FAMILY[name]

    def u(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(op(x).reshape(x.shape[0], -1)).sum(-1)

    def lap(s: torch.Tensor) -> torch.Tensor:
        return torch.func.jacrev(torch.func.jacrev(lambda s: u(s[None])[0]))(s).trace()

    x = _randn(2, _N * _N, seed=3)
    want = torch.stack([torch.func.jacrev(torch.func.jacrev(lap))(s).trace() for s in x])
    torch.testing.assert_close(bilaplacian(u)(x), want, rtol=1e-9, atol=1e-10)


# --- copies: circular padding and in-place writes ------------------------------------------------


def _circular(x: torch.Tensor) -> torch.Tensor:
    h = F.pad(torch.tanh(x).reshape(-1, 1, x.shape[-1]), (1, 1), mode="circular")
    return (h[..., 1:] * h[..., :-1]).sum((-1, -2))


def _in_place(x: torch.Tensor) -> torch.Tensor:
    h = x.clone()
    h[:, 0] = torch.sin(x[:, 1])
    h.mul_(2)
    h.add_(x * x)
    return torch.tanh(h).sum(-1)


def _in_place_twin(x: torch.Tensor) -> torch.Tensor:
    h = torch.cat([torch.sin(x[:, 1:2]), x[:, 1:]], 1)
    return torch.tanh(2 * h + x * x).sum(-1)


@pytest.mark.parametrize("method", ["auto", "exact", "sparse", "hutchinson"])
@pytest.mark.parametrize(
    ("u", "twin"),
    [(_circular, _circular), (_in_place, _in_place_twin)],
    ids=["circular", "in_place"],
)
def test_laplacian_circular_padding_and_in_place_ops(u, twin, method):
    # Both reach the graph as aten.copy, which has no forward derivative in torch.
    from divjac.torch import laplacian

    x = _randn(3, 8, seed=6)
    H = torch.stack([torch.func.hessian(lambda s: twin(s[None])[0])(s) for s in x])
    if method == "hutchinson":
        probes = _randn(4, 3, 8, seed=7)
        got = laplacian(u, method=method, num_probes=4)(probes, x)
        want = torch.einsum("bij,kbi,kbj->b", H, probes, probes) / 4
    else:
        got = laplacian(u, method=method)(x)
        want = H.diagonal(0, 1, 2).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_laplacian_of_a_random_function_is_one_draws_laplacian_in_every_chunk(chunk_size):
    """A function that draws (a dropout mask) is differentiated at one draw: the one its
    first evaluation makes, the same in every chunk of directions; the generators are left
    where one evaluation leaves them (vmap's randomness 'error' mode crashed before)."""
    from divjac.torch import hessian_diagonal, laplacian

    p = torch.full((4, 3), 0.5, dtype=D)

    def u(x):
        return (torch.bernoulli(p) * x.sin()).sum(-1)

    x = torch.rand(4, 3, dtype=D, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    mask = torch.bernoulli(p)
    after_one = torch.get_rng_state()
    for transform, want in (
        (laplacian, -(mask * x.sin()).sum(-1)),
        (hessian_diagonal, -mask * x.sin()),
    ):
        torch.manual_seed(1)
        got = transform(u, chunk_size=chunk_size)(x)
        torch.testing.assert_close(got, want)
        assert torch.equal(torch.get_rng_state(), after_one)


@pytest.mark.parametrize("dependent", ["matrix", "vector", "both"])
def test_matrix_vector_products(dependent):
    """``mv`` by its own rule (the product with the vector as a column), with the matrix, the
    vector or both depending on the input; directions per sample and weighted."""
    m, v = _randn(2, 4, 3), _randn(3)

    def f(x):
        rows = x.reshape(x.shape[0], -1)[:, :3].sin() if dependent != "vector" else m[0]
        vec = x.reshape(-1)[:3].cos() if dependent != "matrix" else v
        return torch.mv(rows.reshape(-1, 3), vec).exp().reshape(x.shape[0], -1)

    x = _randn(2, 5) if dependent == "matrix" else _randn(1, 5)
    _check(f, x, _randn(4, x.shape[0], 5), weights=_randn(4).abs())


@torch.library.custom_op("divjac_test::rowflip", mutates_args=())
def _rowflip(x: torch.Tensor) -> torch.Tensor:
    return torch.flip(x, [-1])


@_rowflip.register_fake
def _(x):
    return torch.empty_like(x)


_rowflip.register_autograd(lambda ctx, g: torch.flip(g, [-1]))


def test_a_custom_operation_without_forward_derivative_is_named_with_no_false_fix():
    """A torch.library operation with a backward only: the Taylor sweep cannot push it, and
    the message does not send the user to hessian, which torch.func cannot run on it either."""
    from divjac import OptionError, UnsupportedOperationError, rules
    from divjac.torch import bilaplacian, hessian, register_rule

    register_rule(_rowflip, lambda op: [rules.rev(op.ins[0], [len(op.ins[0].shape) - 1])])
    u = lambda z: (torch.tanh(_rowflip(z)) * z).sum(-1)  # noqa: E731
    x = _randn(3, 4, seed=8)
    for transform in (laplacian(u, method="exact"), bilaplacian(u)):
        with pytest.raises(OptionError, match="no second-order result of it can be computed"):
            transform(x)
    for refused in (hessian(u), laplacian(u)):  # (auto: screened by the gradient's Hessian)
        with pytest.raises(UnsupportedOperationError, match=r"divjac_test\.rowflip"):
            refused(x)


def test_inputs_of_any_memory_layout():
    """The sweep replays the graph, whose views hold for the layout it was traced at: traced
    contiguous, a transposed view and a channels_last input raised torch's "view size is not
    compatible"; now traced at the call's own layout. Against ``torch.func.hessian`` (the
    bi-Laplacian: against its contiguous input's)."""
    from divjac.torch import bilaplacian, hessian_diagonal

    conv = nn.Conv2d(2, 2, 3, padding=1).double()
    W = _randn(18, 3, seed=2)

    def u(x):
        return torch.tanh(conv(x).reshape(x.shape[0], -1) @ W).pow(2).sum(1)

    x = _randn(2, 2, 3, 3, seed=1)
    hess = torch.stack([torch.func.hessian(lambda s: u(s[None])[0])(s) for s in x])
    hess = hess.reshape(2, 18, 18)
    diag = torch.diagonal(hess, dim1=1, dim2=2).reshape(x.shape)
    for laid in (
        x.transpose(2, 3).contiguous().transpose(2, 3),
        x.to(memory_format=torch.channels_last),
    ):
        assert not laid.is_contiguous()
        for method in ("exact", "sparse", "auto"):
            torch.testing.assert_close(
                laplacian(u, method=method)(laid), hess.diagonal(0, 1, 2).sum(1)
            )
            torch.testing.assert_close(hessian_diagonal(u, method=method)(laid), diag)
        torch.testing.assert_close(bilaplacian(u)(laid), bilaplacian(u)(x))
