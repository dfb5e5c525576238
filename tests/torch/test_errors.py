"""The errors of divjac.torch that only torch has (the rest: tests/test_errors.py, on both
backends)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import divjac
from divjac.torch import divergence, sparse_jacobian, sparsity
from tests.reference import torch_diagonal_blocks, traces


def test_bad_layout():
    with pytest.raises(ValueError, match="layout must be"):
        sparse_jacobian(lambda x: x, layout=torch.strided)


def test_unknown_operation_is_dense_with_a_warning_naming_it():
    def f(x):
        return torch.histc(x, bins=4).sum() * x  # histc has no sparsity rule

    with pytest.warns(divjac.DenseFallbackWarning, match="aten.histc"):
        pattern = sparsity(f)(torch.rand(3, 2))
    assert not pattern.is_batch_independent  # conservative, never an under-approximation


def _bn_net(train: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh()).double()
    return net.train(train)


def test_batchnorm_train_mode_is_detected_and_eval_mode_is_fine():
    x = torch.randn(6, 3, dtype=torch.float64)
    train = _bn_net(True)
    with pytest.raises(divjac.BatchCouplingError, match="BatchNorm in training"):
        divergence(train)(x)
    assert not sparsity(train)(x).is_batch_independent
    evaluation = _bn_net(False)
    div = divergence(evaluation)(x)
    expected = traces(torch_diagonal_blocks(evaluation, (x,)), (3,))
    np.testing.assert_allclose(div.detach(), expected, rtol=1e-10)


@pytest.mark.parametrize("method", ["exact", "sparse", "auto"])
def test_coupling_exact_gives_true_diagonal_blocks_of_batchnorm_in_training(method):
    x = torch.randn(5, 3, dtype=torch.float64)
    train = _bn_net(True)
    got = divergence(train, coupling="exact", method=method)(x).detach()
    assert int(train[1].num_batches_tracked) == 0  # divjac never updates running statistics
    expected = traces(torch_diagonal_blocks(train, (x,)), (3,))
    np.testing.assert_allclose(got, expected, rtol=1e-10)


@pytest.mark.parametrize("name", ["divergence", "laplacian", "hessian_diagonal", "bilaplacian"])
def test_the_functions_shape_error_alone(name, caplog, capfd):
    """A shape error of the function's own (``t`` with ``B + 1`` rows) raises torch's error
    as plain torch would, without the fake tensors' ERROR log of their trace (about 90 lines
    a call)."""
    import divjac.torch as dt

    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3))

    def f(x, t):
        y = net(torch.cat([x, t], 1)[:, :3])
        return y if name == "divergence" else y.sum(1)

    x, t = torch.randn(4, 3), torch.randn(5, 1)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match") as raised:
        f(x, t)
    with caplog.at_level("DEBUG"), pytest.raises(RuntimeError) as got:
        getattr(dt, name)(f)(x, t)
    assert str(got.value) == str(raised.value)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert "Traceback" not in capfd.readouterr().err
