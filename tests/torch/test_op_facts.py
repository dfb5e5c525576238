"""The op-fact table of the torch backend (:mod:`divjac.torch._ops`): an element-wise operation is
one entry, and every transform that reads the table handles it (detection, the Taylor sweep,
the sparse sweep, the Laplacian), against brute force."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.func import hessian, vmap

import divjac
from divjac.torch import _ops, laplacian, sparsity
from divjac.torch._interpret import REGISTRY
from divjac.torch._rules import register_elementwise
from divjac.torch._taylor import sparse as _taylor_sparse
from divjac.torch._taylor.sparse import sparse_laplacian
from divjac.torch._taylor.sweep import program_of, second_order_sweep

D = torch.float64
N, DIM, WIDTH = 6, 2, 5  # particles of 2 coordinates: an element depends on 2 of the 12 inputs
EVERYWHERE = 10**9


# ``cube(x) = x^3``, opaque to torch's forward mode (a custom operator with a backward only): a
# second derivative can only come from the table's ``(3 x^2, 6 x)``.
@torch.library.custom_op("divjac_test::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@cube.register_fake
def _(x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 3 * x * x


cube.register_autograd(_backward, setup_context=_setup)


@pytest.fixture
def registered(monkeypatch):
    """``cube`` registered in the op-fact table for one test (the tables restored after it)."""
    op = torch.ops.divjac_test.cube.default
    monkeypatch.setattr(_ops, "_UNTAGGED", set(_ops._UNTAGGED))
    monkeypatch.setitem(_ops.DERIVATIVES, op, None)
    monkeypatch.setitem(REGISTRY._rules, op._schema.name, None)
    register_elementwise(op, lambda x, y: (3 * x * x, 6 * x))


def _per_particle(g):
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(DIM, WIDTH, generator=gen, dtype=D) * 0.5
    w2 = torch.randn(WIDTH, generator=gen, dtype=D) * 0.5

    def u(x):
        h = torch.tanh(x.reshape(x.shape[0], N, DIM) @ w1)
        return (g(h) @ w2).sum(-1)

    return u


def _brute(u, x):
    one = lambda z: torch.trace(hessian(lambda q: u(q[None])[0])(z))  # noqa: E731
    return vmap(one)(x)


def test_a_registered_elementwise_operation_reaches_every_transform(registered):
    x = torch.randn(3, N * DIM, generator=torch.Generator().manual_seed(1), dtype=D)
    u = _per_particle(cube)
    ref = _brute(_per_particle(lambda h: h**3), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", divjac.DenseFallbackWarning)
        pattern = sparsity(cube)(x)
    np.testing.assert_array_equal(pattern.csr.toarray(), np.eye(N * DIM, dtype=bool))
    eye = torch.eye(N * DIM, dtype=D)[:, None]
    _, _, dense = second_order_sweep(u, x, eye)
    np.testing.assert_allclose(dense, ref, rtol=1e-10)
    got = sparse_laplacian(u, x, EVERYWHERE, EVERYWHERE)
    assert got is not None
    np.testing.assert_allclose(got, ref, rtol=1e-10)
    # Kept sparse through it, as through a built-in element-wise operation.
    as_sin = _per_particle(torch.sin)
    share = _taylor_sparse._layouts(program_of(u, x), x).share
    assert share == _taylor_sparse._layouts(program_of(as_sin, x), x).share
    np.testing.assert_allclose(laplacian(u, method="exact")(x), ref, rtol=1e-10)
