"""Every divjac.torch error is raised with a message that names the problem and the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import divjac
from divjac.torch import (
    divergence,
    jacobian,
    laplacian,
    sparse_jacobian,
    sparsity,
    value_and_divergence,
)
from tests.reference import torch_diagonal_blocks, traces

X = torch.ones(4, 3)
GEN = torch.Generator().manual_seed(0)


def test_divergence_of_nonsquare_jacobian_names_both_shapes():
    f = lambda x: torch.cat([x, x], dim=1)  # noqa: E731
    with pytest.raises(divjac.NonSquareJacobianError, match=r"\(6,\).*\(3,\)"):
        divergence(f)(X)
    same_size = lambda x: x.reshape(4, 3, 1) * 2.0  # noqa: E731
    with pytest.raises(divjac.NonSquareJacobianError, match="reshape the output"):
        divergence(same_size)(X)


def test_output_batch_size_must_match():
    with pytest.raises(divjac.BatchSizeMismatchError, match=r"batch size 2 .* batch size 4"):
        jacobian(lambda x: x[:2])(X)


def test_integer_input_is_refused_with_a_cast_hint():
    with pytest.raises(divjac.InputDtypeError, match=r"torch.int32.*x\.float\(\)"):
        divergence(lambda x: x * 2)(torch.ones(4, 3, dtype=torch.int32))
    assert issubclass(divjac.InputDtypeError, TypeError)


def test_integer_output_is_refused():
    with pytest.raises(divjac.OutputError, match="floating output"):
        jacobian(lambda x: (x > 0).int())(X)


def test_argnums_out_of_range():
    with pytest.raises(divjac.ArgnumsError, match=r"argnums=2 is out of range .* 2 positional"):
        jacobian(lambda x, y: x * y, 2)(X, X)
    with pytest.raises(divjac.ArgnumsError, match="must be an int"):
        divergence(lambda x: x, argnums="x")(X)


def test_argnums_must_select_a_tensor():
    with pytest.raises(divjac.ArgnumsError, match=r"type dict.*\.backward\(\)"):
        jacobian(lambda p, x: p["w"] * x, 0)({"w": 1.0}, X)


def test_batch_axis_out_of_range():
    with pytest.raises(divjac.BatchAxisError, match=r"batch_axis=2 .* shape \(4, 3\)"):
        jacobian(lambda x: x, batch_axis=2)(X)
    with pytest.raises(divjac.BatchAxisError, match="batch_axis=None for a single-sample"):
        divergence(lambda x: x)(torch.ones(()))
    with pytest.raises(divjac.BatchAxisError, match="function's output"):
        jacobian(lambda x: x.sum(), batch_axis=0)(X)


def test_output_must_be_one_tensor():
    with pytest.raises(divjac.OutputError, match="single array; got tuple"):
        jacobian(lambda x: (x, x))(X)
    with pytest.raises(divjac.OutputError, match="has_aux=True needs"):
        jacobian(lambda x: x, has_aux=True)(X)


def test_laplacian_needs_a_scalar_per_sample():
    with pytest.raises(divjac.OutputError, match="one scalar per sample"):
        laplacian(lambda x: x**2)(X)


def test_bad_options():
    with pytest.raises(ValueError, match="mode must be one of"):
        jacobian(lambda x: x, mode="forward")
    with pytest.raises(ValueError, match="method must be one of"):
        divergence(lambda x: x, method="hutch")
    with pytest.raises(ValueError, match="coupling must be one of"):
        divergence(lambda x: x, coupling="ignore")
    with pytest.raises(ValueError, match="distribution must be one of"):
        divergence(lambda x: x, method="hutchinson", distribution="uniform")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        divergence(lambda x: x, chunk_size=0)(X)
    with pytest.raises(ValueError, match="layout must be"):
        sparse_jacobian(lambda x: x, layout=torch.strided)


def test_stochastic_method_without_generator():
    with pytest.raises(
        divjac.MissingKeyError, match=r"fn\(torch.Generator\(\).manual_seed\(0\), \*args"
    ):
        divergence(lambda x: x, method="hutchinson")(X)
    with pytest.raises(divjac.MissingKeyError, match="got int"):
        divergence(lambda x: x, method="hutchinson")(0, X)
    assert issubclass(divjac.MissingKeyError, TypeError)


def test_num_probes_errors():
    with pytest.raises(divjac.NumProbesError, match="multiple of 3"):
        divergence(lambda x: x, method="hutch++", num_probes=4)(GEN, X)
    with pytest.raises(divjac.NumProbesError, match="even"):
        divergence(lambda x: x, method="xtrace", num_probes=3)(GEN, X)
    with pytest.raises(divjac.NumProbesError, match="method='exact' costs n=3"):
        divergence(lambda x: x, method="xtrace", num_probes=8)(GEN, X)
    with pytest.raises(divjac.NumProbesError, match="needs 4 random vectors"):
        divergence(lambda x: x, method="hutchinson", num_probes=4)(torch.ones(2, 4, 3), X)
    with pytest.raises(divjac.NumProbesError, match="shape of the differentiated input"):
        divergence(lambda x: x, method="hutchinson")(torch.ones(16, 3, 4), X)


def test_unknown_operation_is_dense_with_a_warning_naming_it():
    def f(x):
        return torch.histc(x, bins=4).sum() * x  # histc has no sparsity rule

    with pytest.warns(divjac.DenseFallbackWarning, match="aten.histc"):
        pattern = sparsity(f, torch.rand(3, 2))
    assert not pattern.is_batch_independent  # conservative, never an under-approximation


# --- batch coupling -------------------------------------------------------------------------


def center(x):
    return x - torch.mean(x, dim=0)


def _bn_net(train: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh()).double()
    return net.train(train)


def test_coupled_functions_raise_everywhere():
    x = torch.randn(5, 3)
    transforms = [
        jacobian(center),
        divergence(center),
        value_and_divergence(center),
        sparse_jacobian(center),
        divergence(center, method="hutchinson"),
    ]
    for fn in transforms:
        with pytest.raises(divjac.BatchCouplingError, match="output sample 0 depends on input"):
            fn(GEN, x) if fn is transforms[-1] else fn(x)


def test_batchnorm_train_mode_is_detected_and_eval_mode_is_fine():
    x = torch.randn(6, 3, dtype=torch.float64)
    train = _bn_net(True)
    with pytest.raises(divjac.BatchCouplingError, match="BatchNorm in training"):
        divergence(train)(x)
    assert not sparsity(train, x).is_batch_independent
    evaluation = _bn_net(False)
    div = divergence(evaluation)(x)
    expected = traces(torch_diagonal_blocks(evaluation, (x,)), (3,))
    np.testing.assert_allclose(div.detach(), expected, rtol=1e-10)


@pytest.mark.parametrize("method", ["exact", "sparse", "auto"])
def test_coupling_exact_gives_true_diagonal_blocks(method):
    x = torch.randn(5, 3, dtype=torch.float64)
    blocks = torch_diagonal_blocks(center, (x,))
    np.testing.assert_allclose(jacobian(center, coupling="exact")(x), blocks, rtol=1e-12)
    np.testing.assert_allclose(
        jacobian(center, coupling="exact", mode="rev")(x), blocks, rtol=1e-12
    )
    got = divergence(center, coupling="exact", method=method)(x)
    np.testing.assert_allclose(got, traces(blocks, (3,)), rtol=1e-12)

    train = _bn_net(True)
    got = divergence(train, coupling="exact", method=method)(x).detach()
    assert int(train[1].num_batches_tracked) == 0  # divjac never updates running statistics
    expected = traces(torch_diagonal_blocks(train, (x,)), (3,))
    np.testing.assert_allclose(got, expected, rtol=1e-10)
