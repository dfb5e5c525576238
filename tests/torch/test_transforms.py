"""divjac.torch transforms against brute-force float64 references (loops over samples)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import divjac
from divjac.models import torch as models
from divjac.torch import (
    _compat,
    divergence,
    divergence_from_pattern,
    grad_divergence,
    jacobian,
    jacobian_from_pattern,
    laplacian,
    sparse_jacobian,
    sparsity,
    value_and_divergence,
)
from tests.reference import torch_diagonal_blocks, traces

D = torch.float64


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = D) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


class Net(nn.Module):
    """The ``net(x, t)`` of the user story: cat(x, t) -> 100 tanh -> 100 tanh -> d."""

    def __init__(self, d: int, hidden: int = 100) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(d + 1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
        )
        self.head = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.cat([x, t], dim=1)))


def _mlp_case(dtype=D):
    params = models.init_mlp(0, (5, 16, 16, 5), dtype)
    return models.mlp, (params, _randn(4, 5, seed=1, dtype=dtype)), 1


def _cnn_case(dtype=D):
    params = models.init_cnn(0, channels=4, layers=2, dtype=dtype)
    return models.cnn, (params, _randn(3, 3, 5, 4, seed=2, dtype=dtype)), 1


def _elementwise_case(dtype=D):
    return (lambda x: torch.sin(x) * x**2), (_randn(6, 2, 3, seed=3, dtype=dtype),), 0


def _module_case(dtype=D):
    torch.manual_seed(0)
    net = Net(3).to(dtype)
    x, t = _randn(5, 3, seed=4, dtype=dtype), torch.rand(5, 1, dtype=dtype)
    return net, (x, t), 0


def _nonsquare_case(dtype=D):
    params = models.init_mlp(0, (4, 8, 7), dtype)
    return models.mlp, (params, _randn(5, 4, seed=6, dtype=dtype)), 1


def _batchnorm_eval_case(dtype=D):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2), nn.Tanh())
    net = net.to(dtype).eval()
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    return net, (_randn(3, 2, 4, 4, seed=7, dtype=dtype),), 0


CASES = {
    "mlp": _mlp_case,
    "cnn": _cnn_case,
    "elementwise": _elementwise_case,
    "module_xt": _module_case,
    "nonsquare": _nonsquare_case,
    "batchnorm_eval": _batchnorm_eval_case,
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["auto", "fwd", "rev", "sparse"])
def test_jacobian_matches_loop_over_samples(case, mode):
    f, args, argnum = CASES[case]()
    expected = torch_diagonal_blocks(f, args, argnum)
    got = jacobian(f, argnum, mode=mode)(*args)
    assert tuple(got.shape) == expected.shape
    np.testing.assert_allclose(got.detach(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["mlp", "cnn", "elementwise", "module_xt", "batchnorm_eval"])
@pytest.mark.parametrize("method", ["auto", "exact", "sparse"])
@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_divergence_matches_trace(case, method, chunk_size):
    f, args, argnum = CASES[case]()
    blocks = torch_diagonal_blocks(f, args, argnum)
    expected = traces(blocks, tuple(args[argnum].shape[1:]))
    got = divergence(f, argnum, method=method, chunk_size=chunk_size)(*args)
    np.testing.assert_allclose(got.detach(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtypes_follow_the_input(dtype):
    f, args, argnum = _mlp_case(dtype)
    jac = jacobian(f, argnum)(*args)
    div = divergence(f, argnum)(*args)
    assert jac.dtype == dtype and div.dtype == dtype
    assert jac.device == args[argnum].device
    expected = torch_diagonal_blocks(f, args, argnum)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(jac, expected, rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors():
    f, (params, x), _ = _mlp_case()
    params = [(w.cuda(), b.cuda()) for w, b in params]
    jac = jacobian(f, 1)(params, x.cuda())
    assert jac.is_cuda
    np.testing.assert_allclose(jac.cpu(), jacobian(f, 1)(_mlp_case()[1][0], x), rtol=1e-10)
    gen = torch.Generator(device="cuda").manual_seed(0)
    est = divergence(f, 1, method="hutchinson")(gen, params, x.cuda())
    assert est.is_cuda


def test_value_and_divergence_shares_the_forward_value():
    f, args, argnum = _cnn_case()
    value, div = value_and_divergence(f, argnum)(*args)
    np.testing.assert_allclose(value, f(*args), rtol=1e-12)
    np.testing.assert_allclose(div, divergence(f, argnum)(*args), rtol=1e-12)
    for method in ["exact", "sparse", "hutchinson"]:
        randomness = (torch.Generator().manual_seed(0),) if method == "hutchinson" else ()
        value, _ = value_and_divergence(f, argnum, method=method)(*randomness, *args)
        np.testing.assert_allclose(value, f(*args), rtol=1e-12)


def test_module_time_derivative_and_space_jacobian():
    net, (x, t), _ = _module_case()
    d_dt = jacobian(net, 1)(x, t)
    assert tuple(d_dt.shape) == (5, 3, 1)
    np.testing.assert_allclose(
        d_dt.detach(), torch_diagonal_blocks(net, (x, t), 1), rtol=1e-10, atol=1e-12
    )
    per_sample = torch.func.vmap(torch.func.jacrev(lambda xi, ti: net(xi[None], ti[None])[0], 1))
    np.testing.assert_allclose(d_dt[..., 0].detach(), per_sample(x, t)[..., 0].detach())
    assert tuple(jacobian(net, 0)(x, t).shape) == (5, 3, 3)


def test_seed_story_time_argument_and_image_batch():
    """``g(t, x)``, ``t (k,)``, ``x (k, d1, d2, d3)``: the Jacobian and divergence per sample."""
    conv = nn.Conv2d(2, 2, 3, padding=1).to(D)

    def g(t, x):
        return torch.tanh(conv(x)) * t[:, None, None, None] + x**2

    k, shape = 3, (2, 4, 5)
    t, x = torch.rand(k, dtype=D), _randn(k, *shape, seed=8)
    full = torch.autograd.functional.jacobian(lambda x: g(t, x), x)  # (k, *s, k, *s): k^2 work
    blocks = torch.stack([full[b, ..., b, :, :, :] for b in range(k)])
    J = jacobian(g, argnums=1)(t, x)
    assert tuple(J.shape) == (k, *shape, *shape)
    np.testing.assert_allclose(J.detach(), blocks, rtol=1e-10, atol=1e-12)
    mats = J.reshape(k, 40, 40)
    div = divergence(g, argnums=1)(t, x)
    assert tuple(div.shape) == (k,)
    np.testing.assert_allclose(
        div.detach(), torch.diagonal(mats, dim1=1, dim2=2).sum(1).detach(), rtol=1e-10
    )


def test_flatten_pitfall():
    """``autograd.grad`` w.r.t. a flattened view of ``x`` is None: the graph starts at ``x``."""
    x = _randn(2, 3, 4).requires_grad_()
    flat = x.flatten(1)
    y = torch.tanh(x).flatten(1)
    (grad,) = torch.autograd.grad(y.sum(), flat, allow_unused=True)
    assert grad is None
    J = jacobian(lambda x: torch.tanh(x).flatten(1))(x)  # differentiate w.r.t. x itself
    assert tuple(J.shape) == (2, 12, 3, 4)


def test_batch_axis_not_zero():
    W = _randn(3, 3)

    def f(x):  # batch on axis 1: x (d, B)
        return torch.tanh(W @ x) * x

    x = _randn(3, 6, seed=9)
    got = jacobian(f, batch_axis=1)(x)
    moved = lambda xb: f(xb.T).T  # noqa: E731  (batch first, for the reference)
    expected = torch_diagonal_blocks(moved, (x.T,), 0)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    np.testing.assert_allclose(
        divergence(f, batch_axis=1)(x), np.trace(expected, axis1=1, axis2=2), rtol=1e-12
    )
    assert tuple(divergence(f, batch_axis=-1)(x).shape) == (6,)


def test_single_sample_function():
    W = _randn(4, 4)
    f = lambda x: torch.tanh(W @ x)  # noqa: E731
    x = _randn(4, seed=10)
    expected = torch.autograd.functional.jacobian(f, x)
    np.testing.assert_allclose(jacobian(f, batch_axis=None)(x), expected, rtol=1e-12)
    np.testing.assert_allclose(divergence(f, batch_axis=None)(x), torch.trace(expected), rtol=1e-12)


def test_tuple_argnums_and_has_aux():
    net, (x, t), _ = _module_case()

    def with_aux(x, t):
        out = net(x, t)
        return out, {"norm": torch.sum(out**2), "label": "scalar"}

    (d_dx, d_dt), aux = jacobian(with_aux, (0, 1), has_aux=True)(x, t)
    assert tuple(d_dx.shape) == (5, 3, 3) and tuple(d_dt.shape) == (5, 3, 1)
    np.testing.assert_allclose(aux["norm"].detach(), torch.sum(net(x, t) ** 2).detach())
    for method in ["exact", "sparse", "hutchinson"]:
        randomness = (torch.Generator().manual_seed(0),) if method == "hutchinson" else ()
        div, aux2 = divergence(with_aux, 0, has_aux=True, method=method)(*randomness, x, t)
        assert set(aux2) == {"norm", "label"}
        if method != "hutchinson":
            np.testing.assert_allclose(
                div.detach(), torch.diagonal(d_dx, dim1=1, dim2=2).sum(1).detach(), rtol=1e-12
            )
    (value, _), _div2 = value_and_divergence(with_aux, 0, has_aux=True)(x, t)
    np.testing.assert_allclose(value.detach(), net(x, t).detach())


def _param_grads(module: nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()
    ]


@pytest.mark.parametrize("method", ["exact", "sparse"])
def test_divergence_loss_backpropagates_to_module_parameters(method):
    net, (x, t), _ = _module_case()
    loss = torch.sum(divergence(net, method=method)(x, t) ** 2)
    loss.backward()
    got = _param_grads(net)
    net.zero_grad()
    blocks = torch.stack(
        [
            torch.autograd.functional.jacobian(
                lambda xi, b=b: net(xi[None], t[b : b + 1])[0], x[b], create_graph=True
            )
            for b in range(x.shape[0])
        ]
    )
    brute = torch.sum(torch.diagonal(blocks, dim1=1, dim2=2).sum(1) ** 2)
    np.testing.assert_allclose(loss.detach(), brute.detach(), rtol=1e-12)
    brute.backward()
    for g, e in zip(got, _param_grads(net), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-12)


def test_jacobian_backpropagates_to_parameters_and_composes_with_vmap():
    f, (params, x), _ = _mlp_case()
    params = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in params]
    jacobian(f, 1, mode="sparse")(params, x).sum().backward()
    assert all(w.grad is not None for w, _ in params)
    xs = torch.stack([x, 2 * x])
    got = torch.func.vmap(lambda xx: divergence(f, 1)(params, xx))(xs)
    np.testing.assert_allclose(got[1].detach(), divergence(f, 1)(params, 2 * x).detach())


def test_grad_divergence_matches_finite_differences():
    f, (params, x), _ = _mlp_case()
    div = divergence(f, 1)
    got = grad_divergence(f, 1)(params, x)
    assert got.shape == x.shape
    eps = 1e-6
    fd = torch.zeros_like(x)
    for i in range(x.shape[1]):
        e = torch.zeros_like(x)
        e[:, i] = eps
        fd[:, i] = (div(params, x + e) - div(params, x - e)) / (2 * eps)
    np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-8)
    # Not scaled by 1/B: the same as each sample's gradient computed alone.
    np.testing.assert_allclose(got[:1], grad_divergence(f, 1)(params, x[:1]), rtol=1e-10)


def test_grad_divergence_backpropagates_to_parameters():
    net, (x, t), _ = _module_case()
    grad_divergence(net)(x, t).pow(2).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_laplacian_matches_hessian_trace():
    W = _randn(4, 4)

    def u(x):
        return torch.sum(torch.tanh(x @ W) ** 2, dim=1)

    x = _randn(6, 4, seed=11)
    hess = torch.stack(
        [torch.autograd.functional.hessian(lambda xi: u(xi[None])[0], x[b]) for b in range(6)]
    )
    expected = torch.diagonal(hess, dim1=1, dim2=2).sum(1)
    for method in ["exact", "sparse", "auto"]:
        np.testing.assert_allclose(laplacian(u, method=method)(x), expected, rtol=1e-10)
    # The Laplacian of each output component has the output's shape: (B, 1) for (B, 1).
    np.testing.assert_allclose(laplacian(lambda x: u(x)[:, None])(x), expected[:, None], rtol=1e-10)


def test_laplacian_of_a_cnn_energy_is_sparse_and_exact():
    params = models.init_cnn(0, channels=2, layers=2, dtype=D)

    def energy(x):
        return torch.sum(torch.tanh(models.cnn(params, x)) ** 2, dim=(1, 2, 3))

    x = _randn(2, 3, 5, 5, seed=12)
    hess = [
        torch.autograd.functional.hessian(lambda xi: energy(xi[None])[0], x[b]).reshape(75, 75)
        for b in range(2)
    ]
    expected = torch.stack([torch.trace(h) for h in hess])
    np.testing.assert_allclose(laplacian(energy, method="sparse")(x), expected, rtol=1e-10)


def test_sum_of_gradient_of_sum_is_not_the_divergence():
    """A popular wrong answer: summing the gradient of sum(f) adds the off-diagonal terms."""
    W = torch.tensor([[1.0, 2.0], [0.5, -1.0]], dtype=D)
    f = lambda x: torch.tanh(x @ W)  # noqa: E731  (not elementwise)
    x = _randn(3, 2)
    xg = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(f(xg).sum(), xg)
    wrong = grad.sum(1)
    right = divergence(f)(x)
    assert torch.all((wrong - right).abs() > 1e-3)
    (grad,) = torch.autograd.grad(torch.sin(xg).sum(), xg)
    np.testing.assert_allclose(grad.sum(1), divergence(torch.sin)(x), rtol=1e-12)


def test_value_dependent_control_flow_is_traced_on_values():
    W = _randn(3, 3)

    def f(x):
        if x.sum() > 0:  # cannot be traced on fake tensors: traced on the values instead
            return torch.tanh(x @ W)
        return x * 2.0

    for sign in (1.0, -1.0):
        x = sign * _randn(4, 3, seed=13).abs()
        np.testing.assert_allclose(
            jacobian(f)(x), torch_diagonal_blocks(f, (x,)), rtol=1e-12, atol=1e-14
        )


def test_train_and_eval_mode_are_traced_separately():
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(D)
    x = _randn(6, 3, seed=14)
    div = divergence(net)
    net.eval()
    div(x)
    net.train()
    from divjac import BatchCouplingError

    with pytest.raises(BatchCouplingError):
        div(x)
    assert int(net[1].num_batches_tracked) == 0  # divjac never updates running statistics


@given(
    batch=st.integers(1, 4),
    sample=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    axis=st.integers(0, 3),
    mode=st.sampled_from(["fwd", "rev", "auto"]),
)
def test_random_shapes_and_batch_axes(batch, sample, axis, mode):
    axis = axis % (len(sample) + 1)
    shape = list(sample)
    shape.insert(axis, batch)
    x = _randn(*shape)
    n = int(np.prod(sample))
    W = _randn(n, n, seed=1)

    def f(x):
        xs = torch.movedim(x, axis, 0).reshape(batch, n)
        ys = torch.tanh(xs @ W) + xs**2
        return torch.movedim(ys.reshape(batch, *sample), 0, axis)

    moved = lambda xb: torch.movedim(f(torch.movedim(xb, 0, axis)), axis, 0)  # noqa: E731
    expected = torch_diagonal_blocks(moved, (torch.movedim(x, axis, 0),), 0)
    got = jacobian(f, batch_axis=axis, mode=mode)(x)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        divergence(f, batch_axis=axis)(x), traces(expected, tuple(sample)), rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize(
    ("case", "reverse"), [("mlp", True), ("module_xt", True), ("cnn", False), ("blur", False)]
)
def test_tie_direction_follows_the_program(case, reverse):
    """Equal pass counts, few passes (nothing timed): rows (one forward, then backward passes)
    for dense layers, columns when the graph convolves (PyTorch's batched convolution backward
    is often the slower one; tests/torch/test_direction.py: many passes are timed)."""
    from divjac._backend import Point
    from divjac.torch._backend import BACKEND

    if case == "blur":
        fun, args, argnum = models.blur, (_randn(2, 6, 6),), 0
    else:
        fun, args, argnum = CASES[case]()
    traced = BACKEND.trace(fun, args, {}, argnum=argnum, batch_axis=0, has_aux=False)
    point = Point(fun, args[argnum], traced, False, args, {})
    assert BACKEND.prefer_reverse(point) is reverse


@pytest.mark.skipif(
    _compat.release() < (2, 13),
    reason="torch < 2.13 cannot trace a Generator argument: test_floor.py checks the refusal",
)
@pytest.mark.parametrize("method", ["auto", "exact", "hutchinson"])
def test_f_keywords_reach_f(method):
    """``generator=`` (and ``probes=``) are f's own keywords: divjac's randomness comes first."""

    def noisy(x, *, generator, probes=1.0):
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        return torch.tanh(x + noise) * probes

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def seeded(x):
        return noisy(x, generator=torch.Generator().manual_seed(7), probes=2.0)

    exact = traces(torch_diagonal_blocks(seeded, (x,)), (3,))
    div = divergence(noisy, method=method, num_probes=3 if method == "hutchinson" else None)
    randomness = (
        (torch.eye(3, dtype=x.dtype)[:, None].expand(3, 4, 3),) if method == "hutchinson" else ()
    )
    got = div(*randomness, x, generator=torch.Generator().manual_seed(7), probes=2.0)
    scale = 1.0  # hutchinson: a budget of n probes is the exact trace
    np.testing.assert_allclose(got.detach(), scale * exact, rtol=1e-10)


# --- the same options on every transform, and the staged API ------------------------------------

_W = torch.as_tensor(np.random.default_rng(0).normal(size=(3, 3)))
_XV = (
    torch.as_tensor(np.random.default_rng(1).normal(size=(4, 3))),
    torch.as_tensor(np.random.default_rng(2).normal(size=(4, 3))),
)


def _two_args(x, v):
    """Square in each argument: ``tanh(x W) * v``."""
    return torch.tanh(x @ _W) * v


def _one_sample_divergence(x, v, argnum):
    """``tr d f / d arg`` of one sample, by dense ``torch.func.jacfwd``."""
    return torch.trace(torch.func.jacfwd(_two_args, argnums=argnum)(x, v))


def test_every_transform_takes_tuple_argnums():
    x, v = _XV
    blocks = [torch_diagonal_blocks(_two_args, (x, v), argnum=a) for a in (0, 1)]
    divs = [traces(b, (3,)) for b in blocks]
    got = divergence(_two_args, (0, 1))(x, v)
    for g, d in zip(got, divs, strict=True):
        np.testing.assert_allclose(g, d, rtol=1e-12)
    value, got = value_and_divergence(_two_args, (0, 1))(x, v)
    np.testing.assert_allclose(value, _two_args(x, v))
    np.testing.assert_allclose(got[1], divs[1], rtol=1e-12)
    grads = grad_divergence(_two_args, (0, 1))(x, v)
    for a, g in enumerate(grads):
        one = torch.func.grad(_one_sample_divergence, argnums=a)
        per_sample = torch.func.vmap(one, (0, 0, None))(x, v, a)
        zeros = torch.zeros_like(x)  # the gradient w.r.t. v is a ZeroTensor (no numpy view)
        np.testing.assert_allclose(zeros + g, zeros + per_sample, rtol=1e-10)
    u = lambda x, v: torch.sum(_two_args(x, v) * x, dim=1)  # noqa: E731
    laps = laplacian(u, (0, 1))(x, v)
    for a, lap in enumerate(laps):
        one = torch.func.hessian(lambda x, v: torch.sum(_two_args(x, v) * x), argnums=a)
        hess = torch.func.vmap(one)(x, v)
        np.testing.assert_allclose(lap, torch.diagonal(hess, dim1=1, dim2=2).sum(1), rtol=1e-10)
    sparse = sparse_jacobian(_two_args, (0, 1))(x, v)
    patterns = sparsity(_two_args, (0, 1))(x, v)
    for block, matrix, pattern in zip(blocks, sparse, patterns, strict=True):
        np.testing.assert_allclose(matrix.to_dense(), block, rtol=1e-12)
        assert pattern.shape == (3, 3)
    with pytest.raises(divjac.ArgnumsError, match=r"argnums=\(\)"):
        divergence(_two_args, ())


def test_grad_divergence_and_laplacian_take_has_aux():
    x, v = _XV

    def with_aux(x, v):
        out = _two_args(x, v)
        return out, {"mean": torch.mean(out)}

    grad, aux = grad_divergence(with_aux, has_aux=True)(x, v)
    np.testing.assert_allclose(grad, grad_divergence(_two_args)(x, v), rtol=1e-12)
    np.testing.assert_allclose(aux["mean"], torch.mean(_two_args(x, v)))
    u = lambda x, v: torch.sum(_two_args(x, v), dim=1)  # noqa: E731
    lap, aux = laplacian(lambda x, v: (u(x, v), {"u": u(x, v)}), has_aux=True)(x, v)
    np.testing.assert_allclose(lap, laplacian(u)(x, v), rtol=1e-12)
    np.testing.assert_allclose(aux["u"], u(x, v))
    with pytest.raises(divjac.OutputError, match="pair"):
        laplacian(u, has_aux=True)(x, v)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr])
def test_sparse_jacobian_of_a_coupled_function_with_coupling_exact(layout):
    x = _XV[0]
    f = lambda x: torch.tanh(x) * torch.mean(x, dim=0)  # noqa: E731 - mixes samples
    with pytest.raises(divjac.BatchCouplingError):
        sparse_jacobian(f)(x)
    got = sparse_jacobian(f, coupling="exact", layout=layout)(x)
    np.testing.assert_allclose(got.to_dense(), torch_diagonal_blocks(f, (x,)), rtol=1e-12)
    with pytest.raises(divjac.OptionError, match="layout"):
        sparse_jacobian(f, layout=torch.strided)


def test_sparsity_is_a_transform_whose_calls_take_the_functions_own_keywords():
    x = _XV[0]

    def f(x, *, batch_axis, argnums):  # f's own keywords, named like divjac's options
        return torch.cumsum(x, dim=1) * batch_axis * argnums

    pattern = sparsity(f)(x, batch_axis=2.0, argnums=3.0)
    assert pattern.nnz == 6 and pattern.is_batch_independent
    with pytest.raises(divjac.ArgnumsError, match=r"sparsity\(f\)\(x\)"):
        sparsity(f, x)  # the eager form of earlier versions
    with pytest.raises(divjac.ArgnumsError, match="got float"):
        jacobian(f, 1.0)
    single = sparsity(lambda s: torch.cumsum(s, dim=0), batch_axis=None)(x[0])
    np.testing.assert_array_equal(single.todense(), pattern.todense())


def test_jacobian_and_divergence_from_a_pattern():
    f = lambda x: torch.cumsum(torch.sin(x), dim=1) ** 2  # noqa: E731
    x = torch.as_tensor(np.random.default_rng(3).normal(size=(5, 4)))
    pattern = sparsity(f)(x[:2])  # detected once, on another batch size
    blocks = torch_diagonal_blocks(f, (x,))
    np.testing.assert_allclose(jacobian_from_pattern(f, pattern)(x), blocks, rtol=1e-12)
    np.testing.assert_allclose(
        divergence_from_pattern(f, pattern)(x), traces(blocks, (4,)), rtol=1e-12
    )
    with_aux = lambda x: (f(x), x.sum())  # noqa: E731
    jac, aux = jacobian_from_pattern(with_aux, pattern, has_aux=True, chunk_size=1)(x)
    np.testing.assert_allclose(jac, blocks, rtol=1e-12)
    div, aux = divergence_from_pattern(with_aux, pattern, has_aux=True)(x)
    np.testing.assert_allclose(div, traces(blocks, (4,)), rtol=1e-12)
    np.testing.assert_allclose(aux, x.sum())
    g = lambda p, x: f(x.T).T * p  # noqa: E731 - the input in argument 1, batch on axis 1
    got = jacobian_from_pattern(g, pattern, 1, batch_axis=1)(2.0, x.T)
    np.testing.assert_allclose(got, 2.0 * blocks, rtol=1e-12)


def test_a_stale_pattern_is_refused():
    f = lambda x: torch.cumsum(x, dim=1)  # noqa: E731
    x = _XV[0]
    stale = sparsity(f)(torch.ones(2, 5, dtype=D))  # another sample shape
    for transform in (jacobian_from_pattern, divergence_from_pattern):
        with pytest.raises(divjac.PatternError, match=r"\(5,\).*\(3,\).*again"):
            transform(f, stale)(x)
    coupled = sparsity(lambda x: x - torch.mean(x, dim=0))(x)
    with pytest.raises(divjac.PatternError, match="mixes samples"):
        jacobian_from_pattern(f, coupled)(x)
    with pytest.raises(divjac.PatternTypeError, match="SparsityPattern"):
        divergence_from_pattern(f, coupled.csr)(x)


@pytest.mark.filterwarnings("ignore:`torch.jit.[a-z_]+` is deprecated")
@pytest.mark.parametrize("script", ["script", "trace"])
def test_torchscript_is_refused(script):
    """A TorchScript module (``torch.jit.script`` or ``trace``) runs its own autograd graph:
    PyTorch's forward-mode derivatives through it are dropped (``jacfwd`` wrong, second
    derivatives zero: a Laplacian of 0.0 for -0.20), and the walk's checks crashed on its
    views of C++ state (``dict_version expects a dict``). Every transform refuses it, naming
    the way out, in a closure too."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3)).double().eval()
    x = torch.randn(4, 3, dtype=torch.float64)
    module = torch.jit.script(eager) if script == "script" else torch.jit.trace(eager, x)
    with pytest.raises(divjac.UnsupportedOperationError, match="before scripting"):
        divergence(module)(x)
    with pytest.raises(divjac.UnsupportedOperationError, match="TorchScript"):
        jacobian(lambda z: module(z) * 2, mode="fwd")(x)
    with pytest.raises(divjac.UnsupportedOperationError, match="TorchScript"):
        divjac.torch.laplacian(lambda z: module(z).sin().sum(-1))(x)
