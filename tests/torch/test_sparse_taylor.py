"""The exact Laplacian's sweep that stores first-order terms sparse in PyTorch
(divjac.torch._taylor.sparse) against brute force: the trace of each sample's Hessian
(``torch.func.hessian``, float64); its choice by ``laplacian(method="exact" / "auto")`` where
it pays and not where it does not; its index computed once per trace and its results fresh
when the weights change; gradients w.r.t. the weights; every context users call it from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch.func import hessian, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from divjac.torch import laplacian
from divjac.torch._taylor import sparse as _taylor_sparse
from divjac.torch._taylor.sparse import sparse_laplacian
from divjac.torch._taylor.sweep import program_of
from tests.reference import block_architectures

D = torch.float64
EVERYWHERE = 10**9  # passes and budget large enough that the sparse sweep is always taken


def _brute(u, x):
    """Per-sample ``tr(H)`` ``[B, *out]`` of the batch-first ``u``."""

    def one(z):
        h = hessian(lambda q: u(q[None])[0])(z)
        out_shape = h.shape[: h.ndim - 2 * z.ndim]
        n = z.numel()
        return torch.diagonal(h.reshape(*out_shape, n, n), 0, -2, -1).sum(-1)

    with sdpa_kernel(SDPBackend.MATH):  # the other kernels have no forward derivative
        return vmap(one)(x)


def _check(u, x, rtol=1e-10):
    ref = _brute(u, x)
    got = sparse_laplacian(u, x, EVERYWHERE, EVERYWHERE)
    assert got is not None and got.shape == ref.shape
    np.testing.assert_allclose(
        got.detach(), ref.detach(), rtol=rtol, atol=rtol * (1 + float(ref.detach().abs().max()))
    )
    return ref


def _share(u, x):
    program = program_of(u, x)
    return _taylor_sparse._layouts(program, x).share


def _params(seed, *shapes, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=D) * scale for s in shapes]


def _particles(n, dim, width, seed=0):
    layer = torch.nn.Linear(dim, width).double()
    torch.nn.init.normal_(layer.weight, std=0.5, generator=torch.Generator().manual_seed(seed))
    (w2,) = _params(seed, (width,))

    def u(x):
        h = torch.tanh(layer(x.reshape(x.shape[0], n, dim)))
        return torch.sin(h @ w2).pow(2).sum(-1)

    u.layer = layer
    return u


def _ferminet(n, dim, width, seed=1):
    v1, v2, v3 = _params(seed, (dim, width), (2 * width, width), (width,))

    def u(x):
        h = torch.tanh(x.reshape(x.shape[0], n, dim) @ v1)
        g = h.mean(1, keepdim=True).expand_as(h)
        h = F.softplus(torch.cat([h, g], -1) @ v2) + h
        return (h @ v3).sum(-1) + (x**2).sum(-1)

    return u


def _banded(x):
    """Neighbour products and a padded, reversed, transposed stencil: unions of few inputs."""
    a = torch.sin(x[:, 1:] * x[:, :-1])
    b = F.pad(torch.exp(-x[:, 2:] * x[:, :-2]), (1, 1))
    c = torch.flip(b, [1])[:, 1:] + a
    grid = c.reshape(x.shape[0], -1, 3).transpose(1, 2)
    return grid.amax(1).pow(2).sum(-1) + (x / (2 + x**2)).sum(-1)


_MLP = _params(3, (10, 16), (16,))


def _mlp(x):
    w1, w2 = _MLP
    return torch.tanh(x @ w1[: x.shape[1]]) @ w2


_KERNELS = _params(4, (4, 2, 3, 3), (3, 4, 3, 3))


def _cnn(x):
    """Two 3x3 convolutions (the second strided, dilated, with a bias), then the dense sweep."""
    k1, k2 = _KERNELS
    h = torch.tanh(F.conv2d(x.reshape(x.shape[0], 2, 10, 10), k1, padding=1))
    out = F.conv2d(h, k2, torch.ones(3, dtype=D), stride=2, padding=2, dilation=2)
    return torch.sin(out).sum((1, 2, 3))


_MIXED = _params(5, (4, 4))[0]


def _mixed_ops(x):
    """relu, pow, a quotient of two dependent operands, amax, a product with the dependent
    operand on the right (bmm), where, slices, index_select, softmax, logsumexp, a
    concatenation with a constant, mean with keepdim, and a detached branch."""
    w = _MIXED
    p = x.reshape(x.shape[0], 3, 4)
    h = torch.relu(p @ w) + torch.tanh(p) ** 3
    r = (w @ h.transpose(1, 2)).transpose(1, 2)  # W @ h: the dependent operand on the right
    q = torch.where(p > 0, r, torch.cos(r)) / (1.5 + torch.sin(p))
    picked = q.index_select(2, torch.tensor([0, 2]))
    s = torch.softmax(picked, -1) * torch.logsumexp(q, -1, keepdim=True)
    wide = torch.cat([s, torch.ones_like(s[..., :1])], -1).mean(-1, keepdim=True)
    return (
        (q.amax(-1) * q[..., 0]).sum(-1)
        + torch.log1p(p[..., 1:] ** 2).sum((1, 2))
        + wide.sum((1, 2)) * p.detach().sum((1, 2))
    )


_EMBED = _params(6, (4, 8), (8,))


def _electrons(x):
    """Per-electron distances (a norm over each electron's coordinates) and features, then
    attention over the electrons (softmax of scaled dot products, as ``sdpa``'s math form)."""
    w, v = _EMBED
    r = x.reshape(x.shape[0], 4, 3)
    distance = torch.linalg.vector_norm(r, dim=-1, keepdim=True)
    h = torch.tanh(torch.cat([r, distance], -1) @ w)
    mixed = F.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None])[:, 0]
    return (mixed @ v).sum(-1) + distance.sum((1, 2))


def _distances(x):
    """A sum over electrons of an MLP of each one's distance and coordinates."""
    w, v = _EMBED
    r = x.reshape(x.shape[0], -1, 3)
    distance = torch.linalg.vector_norm(r, dim=-1, keepdim=True)
    return (torch.tanh(torch.cat([r, distance], -1) @ w) @ v).sum(-1)


@pytest.mark.parametrize(
    "name, u, d",
    [
        ("electrons", _electrons, 12),
        ("distances", _distances, 15),
        ("particles", _particles(6, 3, 8), 18),
        ("ferminet", _ferminet(5, 3, 8), 15),
        ("banded", _banded, 13),
        ("mlp", _mlp, 10),
        ("cnn", _cnn, 200),
        ("mixed", _mixed_ops, 12),
    ],
)
def test_sparse_sweep_against_hessian_trace(name, u, d):
    x = torch.randn(3, d, dtype=D, generator=torch.Generator().manual_seed(7))
    _check(u, x)


def test_vector_output_particles_as_an_axis_and_a_linear_function():
    x = torch.randn(2, 8, dtype=D, generator=torch.Generator().manual_seed(8))
    pairs = lambda x: x.reshape(x.shape[0], 4, 2)  # noqa: E731
    _check(lambda x: torch.tanh(pairs(x)).sum(-1) * pairs(x)[..., 0], x)
    _check(lambda x: 3 * pairs(x)[..., 1], x)  # linear: no second-order term
    _check(lambda x: pairs(x).repeat(1, 1, 0).sin().sum(-1) + pairs(x).sin().sum(-1), x)  # empty
    layer = _particles(5, 3, 6)
    p = torch.randn(2, 5, 3, dtype=D, generator=torch.Generator().manual_seed(9))
    _check(lambda p: layer(p.reshape(p.shape[0], -1)), p)  # particles as an axis of the input


def test_cost_follows_the_sparsity():
    assert _share(_particles(10, 4, 8), torch.ones(2, 40, dtype=D)) < 0.2  # 4 of 40 inputs
    assert _share(_mlp, torch.ones(2, 10, dtype=D)) >= 1.0  # dense from the first product
    assert _share(_banded, torch.ones(2, 31, dtype=D)) < 0.5
    assert _share(_distances, torch.ones(2, 30, dtype=D)) < 0.3  # through the norms
    # A convolution takes the dense terms (its windows laid by gathers were slower than the
    # dense sweep, which runs the convolution itself).
    assert _share(_cnn, torch.ones(2, 200, dtype=D)) >= 1.0
    assert sparse_laplacian(_mlp, torch.ones(2, 10, dtype=D), 10, EVERYWHERE) is None
    # Within the passes, but not within a budget of two passes' memory.
    assert sparse_laplacian(_particles(10, 4, 8), torch.ones(2, 40, dtype=D), 40, 2) is None


@pytest.fixture
def sparse_calls(monkeypatch):
    """The shapes of the inputs each sparse sweep that was taken ran at."""
    calls = []
    inner = _taylor_sparse.sparse_laplacian

    def spy(f, x, passes, budget, traced=None):
        lap = inner(f, x, passes, budget, traced)
        if lap is not None:
            calls.append(tuple(x.shape))
        return lap

    monkeypatch.setattr(_taylor_sparse, "sparse_laplacian", spy)
    return calls


@pytest.mark.parametrize("method", ["exact", "auto"])
def test_laplacian_takes_the_sparse_sweep_where_it_pays(sparse_calls, method):
    u, x = _particles(8, 3, 16), torch.randn(3, 24, dtype=D)
    got = laplacian(u, method=method)(x).detach()
    np.testing.assert_allclose(got, _brute(u, x).detach(), rtol=1e-10, atol=1e-9)
    if method == "exact":
        assert sparse_calls == [(3, 24)]
    x = torch.randn(3, 10, dtype=D)
    before = list(sparse_calls)
    np.testing.assert_allclose(laplacian(_mlp, method=method)(x), _brute(_mlp, x), rtol=1e-10)
    assert sparse_calls == before  # a dense MLP stays on the dense sweep


def test_the_index_is_computed_once_and_new_weights_are_used(monkeypatch):
    """The index depends on the graph's structure only: it is computed at a trace's first
    call, and a weight updated in place (an optimizer step) gives the fresh Laplacian at the
    next without computing it again; a module given a new weight tensor too."""
    u, x = _particles(6, 3, 8), torch.randn(4, 18, dtype=D)
    _check(u, x)
    built = []
    inner = _taylor_sparse._Indexing.__init__
    monkeypatch.setattr(
        _taylor_sparse._Indexing, "__init__", lambda self, *a: built.append(1) or inner(self, *a)
    )
    with torch.no_grad():
        u.layer.weight.mul_(1.7)
        u.layer.bias.add_(0.3)
    _check(u, x)
    assert built == []
    u.layer.weight = torch.nn.Parameter(u.layer.weight.detach() * -0.5)  # a new trace
    _check(u, x)


@pytest.mark.parametrize("context", ["grad", "no_grad", "inference_mode"])
def test_contexts_and_the_gradient_in_the_weights(context):
    """Under ``no_grad`` and ``inference_mode`` (evaluation), and with gradients on: the
    gradient of a PINN-like loss w.r.t. the weights through the sparse sweep equals the one
    through the Hessian trace."""
    (w,) = _params(14, (3, 8))
    w.requires_grad_(True)

    def net(x):
        h = torch.tanh(x.reshape(x.shape[0], 6, 3) @ w)
        return torch.sin(h.sum(-1)).pow(2).sum(-1)

    x = torch.randn(3, 18, dtype=D)
    assert _share(net, x) < 0.5
    lap = laplacian(net, method="exact")
    if context == "grad":
        (got,) = torch.autograd.grad(lap(x).square().sum(), w)
        (want,) = torch.autograd.grad(_brute(net, x).square().sum(), w)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
        return
    manager = torch.no_grad() if context == "no_grad" else torch.inference_mode()
    with manager:
        got = lap(x)
    np.testing.assert_allclose(got, _brute(net, x).detach(), rtol=1e-10, atol=1e-9)


def test_float32_and_the_api_with_other_arguments(sparse_calls):
    """Particles as ``(B, P, D)``, the Laplacian in the second argument, another per-sample
    argument, a Python float and float32."""
    layer = torch.nn.Linear(3, 16)

    def u(scale, x, shift):
        h = torch.tanh(layer(x) + shift) * scale[:, None, None]
        return h.sum((1, 2))

    scale = torch.arange(1.0, 4.0)
    x = torch.randn(3, 10, 3)
    got = laplacian(u, argnums=1, method="exact")(scale, x, 0.25)
    assert got.dtype == torch.float32 and sparse_calls == [(3, 10, 3)]
    ref = torch.cat(
        [
            _brute(
                lambda z, i=i: u(scale[i : i + 1], z.reshape(1, 10, 3), 0.25), x[i].reshape(1, 30)
            )
            for i in range(3)
        ]
    )
    np.testing.assert_allclose(got.detach(), ref.detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["exact", "auto"])
def test_a_rewritten_graph_runs_on_the_calls_other_tensors(monkeypatch, method):
    """A FermiNet-like layer on ``[h_i, mean_j h_j]`` (its product split over the parts, on a
    copy of the graph) whose weight and ``t`` are arguments: the copy's inputs are the call's
    tensors, each in its place (the sparse sweep runs the call's trace), and the gradients
    reach them."""
    n, dim, width = 6, 3, 8
    (v2,) = _params(5, (2 * width, width))
    v2.requires_grad_(True)
    torch.manual_seed(5)
    first, last = torch.nn.Linear(dim, width).double(), torch.nn.Linear(width, 1).double()
    rewritten = []
    _taylor_sparse._LAYOUTS.clear()  # (the other method's call laid this trace out)
    distribute = _taylor_sparse._distributed
    monkeypatch.setattr(
        _taylor_sparse,
        "_distributed",
        lambda gm, x_pos: (lambda g: rewritten.append(g is not None) or g)(distribute(gm, x_pos)),
    )

    def u(x, t, v2):  # constants: the modules' parameters (the call's trace runs)
        h = torch.tanh(first(x.reshape(x.shape[0], n, dim)) + t[:, :, None])
        g = h.mean(1, keepdim=True).expand_as(h)
        h = F.softplus(torch.cat([h, g], -1) @ v2) + h
        return last(h).sum((1, 2))

    x, t = torch.randn(3, n * dim, dtype=D), torch.randn(3, 1, dtype=D)
    got = laplacian(u, method=method)(x, t, v2)
    assert rewritten and all(rewritten)
    want = torch.cat(
        [_brute(lambda z, i=i: u(z, t[i : i + 1], v2), x[i : i + 1]) for i in range(3)]
    )
    np.testing.assert_allclose(got.detach(), want.detach(), rtol=1e-10, atol=1e-10)
    (g_got,) = torch.autograd.grad(got.square().sum(), v2)
    (g_want,) = torch.autograd.grad(want.square().sum(), v2)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-9, atol=1e-10)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(**block_architectures())
def test_random_block_architectures(n, dim, width, act, pool, seed):
    """Per-block layers, then a pooling or a FermiNet-like mixing, then a dense head."""
    w1, b1, w2, w3 = _params(seed, (dim, width), (width,), (2 * width, width), (width,))
    fn = {"tanh": torch.tanh, "softplus": F.softplus, "sin": torch.sin}[act]

    def u(x):
        h = fn(x.reshape(x.shape[0], n, dim) @ w1 + b1)
        if pool == "mix":
            g = h.mean(1, keepdim=True).expand_as(h)
            return (fn(torch.cat([g, h], -1) @ w2) @ w3).sum(-1)
        pooled = {"sum": h.sum(1), "mean": h.mean(1), "max": h.amax(1)}[pool]
        return fn(pooled @ w2[:width]) @ w3

    x = torch.randn(2, n * dim, dtype=D, generator=torch.Generator().manual_seed(seed))
    _check(u, x)


def test_an_index_tensor_changed_in_place_is_read_anew():
    """The index of a gather by the caller's integer tensor follows its values: changed in
    place (a new pairing of the particles), the next call pairs as the tensor says now."""
    perm = torch.tensor([1, 0, 3, 2, 5, 4])

    def u(x):
        p = x.reshape(x.shape[0], 6, 2)
        return (torch.sin(p * p.index_select(1, perm)).sum(-1) ** 2).sum(-1)

    x = torch.randn(3, 12, dtype=D, generator=torch.Generator().manual_seed(16))
    _check(u, x)
    perm.copy_(torch.tensor([5, 2, 1, 4, 3, 0]))
    _check(u, x)
    perm[0] = 0  # a particle paired with itself: a square, whose Hessian differs
    _check(u, x)


def _pairs(n, reach):
    """A pair potential over a chain's neighbours within ``reach`` (terms of two particles
    read by indexing with constant indices)."""
    pairs = [(a, a + s) for a in range(n) for s in range(1, reach + 1) if a + s < n]
    i, j = torch.tensor(pairs).T
    w1, b1, w2 = _params(17, (8,), (8,), (8,))

    def u(x):
        p = x.reshape(x.shape[0], n, 3)
        diff = p[:, i, :] - p[:, j, :]
        r = torch.sqrt((diff * diff).sum(-1) + 0.1)
        return ((torch.tanh(r[..., None] * w1 + b1) @ w2) * torch.exp(-r)).sum(-1)

    return u


@pytest.mark.parametrize("reach, sparse", [(6, True), (1, False)])
def test_auto_weighs_the_sparse_sweep_against_the_hessian_colors(sparse_calls, reach, sparse):
    """``auto`` takes the sparse sweep where its cost is at most half that of the colors'
    passes (pair terms within 6 places: 21 colors), the colors' passes otherwise (nearest
    neighbours: 6 colors)."""
    from divjac.torch import sparsity

    u, x = (
        _pairs(14, reach),
        torch.randn(2, 42, dtype=D, generator=torch.Generator().manual_seed(20)),
    )
    gradient = lambda z: torch.func.vmap(torch.func.grad(lambda q: u(q[None])[0]))(z)  # noqa: E731
    colors = sparsity(gradient)(x).n_diagonal_colors
    assert (2 * _share(u, x) * 42 <= colors) == sparse
    np.testing.assert_allclose(laplacian(u, method="auto")(x), _brute(u, x), rtol=1e-10, atol=1e-9)
    assert sparse_calls == ([(2, 42)] if sparse else [])
