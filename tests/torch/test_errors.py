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
