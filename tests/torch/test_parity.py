"""The same architecture with the same weights gives the same numbers in JAX and PyTorch."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

import jax
import jax.numpy as jnp
import torch

import divjac.jax as dj
import divjac.torch as dt
from divjac.models import jax as jmodels, torch as tmodels, unet_layers

RTOL, ATOL = 1e-10, 1e-12


def _nchw_to_nhwc_index(c: int, h: int, w: int) -> np.ndarray:
    """``perm[i]``: the NHWC flat index of the element with NCHW flat index ``i``."""
    ci, hi, wi = np.unravel_index(np.arange(c * h * w), (c, h, w))
    return (hi * w + wi) * c + ci


def _mlp():
    params = jmodels.init_mlp(jax.random.key(0), (4, 16, 16, 4), jnp.float64)
    x = np.array(jax.random.normal(jax.random.key(1), (5, 4), jnp.float64))
    return (jmodels.mlp, params, jnp.asarray(x)), (tmodels.mlp, tmodels.from_jax(params), x)


def _cnn():
    params = jmodels.init_cnn(jax.random.key(0), channels=4, layers=3, dtype=jnp.float64)
    x = np.array(jax.random.normal(jax.random.key(2), (2, 8, 8, 3), jnp.float64))
    jax_case = (jmodels.cnn, params, jnp.asarray(x))
    torch_case = (tmodels.cnn, tmodels.cnn_params_from_jax(params), x.transpose(0, 3, 1, 2))
    return jax_case, torch_case


def test_mlp_jacobian_and_divergences():
    (jf, jp, jx), (tf, tp, tx) = _mlp()
    tx = torch.as_tensor(tx)
    np.testing.assert_allclose(
        dt.jacobian(tf, 1)(tp, tx), dj.jacobian(jf, 1)(jp, jx), rtol=RTOL, atol=ATOL
    )
    for method in ("exact", "sparse", "auto"):
        np.testing.assert_allclose(
            dt.divergence(tf, 1, method=method)(tp, tx),
            dj.divergence(jf, 1, method=method)(jp, jx),
            rtol=RTOL,
            atol=ATOL,
        )


def test_mlp_xt_time_derivative():
    params = jmodels.init_mlp_xt(jax.random.key(3), 3, hidden=8, dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(4), (4, 3), jnp.float64)
    t = jax.random.uniform(jax.random.key(5), (4, 1), jnp.float64)
    tp = tmodels.from_jax(params)
    got = dt.jacobian(tmodels.mlp_xt, 2)(
        tp, torch.as_tensor(np.array(x)), torch.as_tensor(np.array(t))
    )
    np.testing.assert_allclose(got, dj.jacobian(jmodels.mlp_xt, 2)(params, x, t), rtol=RTOL)


def test_cnn_jacobian_divergence_pattern_and_colors():
    (jf, jp, jx), (tf, tp, tx) = _cnn()
    tx = torch.as_tensor(tx)
    # Jacobians: NHWC x NHWC in JAX, NCHW x NCHW in torch.
    J_jax = np.asarray(dj.jacobian(jf, 1, mode="sparse")(jp, jx))
    J_torch = dt.jacobian(tf, 1, mode="sparse")(tp, tx).numpy()
    np.testing.assert_allclose(J_torch, J_jax.transpose(0, 3, 1, 2, 6, 4, 5), rtol=RTOL, atol=ATOL)
    for method in ("exact", "sparse"):
        np.testing.assert_allclose(
            dt.divergence(tf, 1, method=method)(tp, tx),
            dj.divergence(jf, 1, method=method)(jp, jx),
            rtol=RTOL,
            atol=ATOL,
        )
    # Patterns: identical up to the NCHW <-> NHWC permutation of both axes.
    p_jax = dj.sparsity(jf, argnums=1)(jp, jx)
    p_torch = dt.sparsity(tf, argnums=1)(tp, tx)
    perm = _nchw_to_nhwc_index(3, 8, 8)
    permuted = p_jax.csr[perm][:, perm]
    assert (permuted != p_torch.csr).nnz == 0
    assert p_torch.is_batch_independent and p_jax.is_batch_independent
    assert p_torch.n_colors == p_jax.n_colors
    assert p_torch.n_row_colors == p_jax.n_row_colors
    assert p_torch.n_diagonal_colors == p_jax.n_diagonal_colors


def test_cnn_module_matches_the_functional_model():
    (_, jp, jx), (tf, tp, tx) = _cnn()
    net = tmodels.CNN(tp)
    tx = torch.as_tensor(tx)
    np.testing.assert_allclose(net(tx).detach(), tf(tp, tx), rtol=1e-12)
    np.testing.assert_allclose(
        dt.divergence(net)(tx).detach(), dj.divergence(jmodels.cnn, 1)(jp, jx), rtol=RTOL
    )
    mlp_params = tmodels.init_mlp(0, (3, 5, 3), torch.float64)
    mlp_net = tmodels.MLP(mlp_params)
    x = torch.randn(4, 3, dtype=torch.float64)
    np.testing.assert_allclose(mlp_net(x).detach(), tmodels.mlp(mlp_params, x), rtol=1e-12)


def test_blur_sparse_jacobian_and_pattern():
    x = jax.random.normal(jax.random.key(6), (2, 12, 12), jnp.float64)
    kernel = jmodels.gaussian_kernel(5, 1.0, jnp.float64)
    tk = torch.as_tensor(np.array(kernel))
    tx = torch.as_tensor(np.array(x))
    np.testing.assert_allclose(tmodels.blur(tx, tk), jmodels.blur(x, kernel), rtol=1e-12)
    J_jax = dj.sparse_jacobian(jmodels.blur)(x, kernel).todense()
    J_torch = dt.sparse_jacobian(tmodels.blur)(tx, tk).to_dense()
    np.testing.assert_allclose(J_torch, J_jax, rtol=RTOL, atol=ATOL)
    p_jax, p_torch = dj.sparsity(jmodels.blur)(x, kernel), dt.sparsity(tmodels.blur)(tx, tk)
    assert (p_jax.csr != p_torch.csr).nnz == 0
    assert (p_jax.n_colors, p_jax.n_diagonal_colors) == (
        p_torch.n_colors,
        p_torch.n_diagonal_colors,
    )


def test_stochastic_estimates_agree_for_the_same_probes():
    (jf, jp, jx), (tf, tp, tx) = _mlp()
    # Gaussian probes: Rademacher sketches in 4 dimensions are often collinear, and the
    # low-rank part of Hutch++/XTrace then depends on an arbitrary basis (both stay unbiased).
    probes = np.array(jax.random.normal(jax.random.key(7), (6, 5, 4), jnp.float64))
    for method, num, k in (("hutchinson", 6, 6), ("hutch++", 6, 4), ("xtrace", 6, 3)):
        got = dt.divergence(tf, 1, method=method, num_probes=num, return_stderr=True)(
            torch.as_tensor(probes[:k]), tp, torch.as_tensor(tx)
        )
        expected = dj.divergence(jf, 1, method=method, num_probes=num, return_stderr=True)(
            jnp.asarray(probes[:k]), jp, jx
        )
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
@pytest.mark.parametrize("d_out", [4, 3])
def test_hutchinson_frobenius_has_one_definition_per_mode(mode, d_out):
    """The same probes give the same Hutchinson ``||J||_F^2`` in JAX and PyTorch: ``||J v||^2``
    from JVPs with ``mode="fwd"``, ``||v^T J||^2`` from VJPs with ``"rev"`` and ``"auto"``
    (RNODE's recipe), each equal to the brute force from the dense per-sample Jacobians. Once,
    ``"auto"`` gave ``||J v||^2`` in JAX (JVPs) and ``||v^T J||^2`` in PyTorch (VJPs)."""
    params = jmodels.init_mlp(jax.random.key(0), (4, 16, 16, d_out), jnp.float64)
    x = np.array(jax.random.normal(jax.random.key(1), (5, 4), jnp.float64))
    tp, tx = tmodels.from_jax(params), torch.as_tensor(x)
    J = np.asarray(dj.jacobian(jmodels.mlp, 1)(params, jnp.asarray(x)))  # (B, m, n)
    rows = mode != "fwd"
    probes = np.array(
        jax.random.normal(jax.random.key(8), (2, 5, d_out if rows else 4), jnp.float64)
    )
    if rows:  # ||v_b^T J_b||^2
        expected = (np.einsum("kbm,bmn->kbn", probes, J) ** 2).sum(-1).mean(0)
    else:  # ||J_b v_b||^2
        expected = (np.einsum("bmn,kbn->kbm", J, probes) ** 2).sum(-1).mean(0)
    for name in ("squared_frobenius_norm", "value_divergence_and_frobenius"):
        if name == "value_divergence_and_frobenius" and d_out != 4:
            continue
        options = {"method": "hutchinson", "mode": mode}
        got_jax = getattr(dj, name)(jmodels.mlp, 1, **options)(
            jnp.asarray(probes), params, jnp.asarray(x)
        )
        got_torch = getattr(dt, name)(tmodels.mlp, 1, **options)(torch.as_tensor(probes), tp, tx)
        if name == "value_divergence_and_frobenius":
            got_jax, got_torch = got_jax[2], got_torch[2]
        np.testing.assert_allclose(got_jax, expected, rtol=1e-12)
        np.testing.assert_allclose(got_torch.detach(), expected, rtol=1e-12)


def test_unet_and_concat_squash_match_their_jax_twins():
    rng = np.random.default_rng(3)  # NumPy weights: each new shape of jax.random compiles
    jp = {
        name: (rng.standard_normal((3, 3, c_in, c_out)) / 6, rng.standard_normal(c_out) / 10)
        for name, (c_in, c_out) in unet_layers(4, 3).items()
    }
    jp["global"] = rng.standard_normal((8, 8)) / 10
    tp = {name: tmodels.cnn_params_from_jax([jp[name]])[0] for name in jp if name != "global"}
    tp["global"] = torch.tensor(np.asarray(jp["global"]))
    x = rng.standard_normal((2, 8, 8, 3))
    y_jax = np.asarray(jax.jit(jmodels.unet)(jp, jnp.asarray(x)))
    y_torch = tmodels.unet(tp, torch.as_tensor(x.transpose(0, 3, 1, 2))).numpy()
    np.testing.assert_allclose(y_torch.transpose(0, 2, 3, 1), y_jax, rtol=1e-12, atol=1e-14)

    net = tmodels.ConcatSquashODE(3, hidden=(5, 5)).double()
    layers = [
        {
            "w": layer.layer.weight.detach().numpy().T,
            "b": layer.layer.bias.detach().numpy(),
            "gate_w": layer.gate.weight.detach().numpy().T,
            "gate_b": layer.gate.bias.detach().numpy(),
            "shift_w": layer.shift.weight.detach().numpy().T,
        }
        for layer in net.layers
    ]
    xs = rng.standard_normal((4, 3))
    t = 0.4
    np.testing.assert_allclose(
        net(torch.tensor(t, dtype=torch.float64), torch.as_tensor(xs)).detach().numpy(),
        np.asarray(jmodels.concat_squash(layers, jnp.float64(t), jnp.asarray(xs))),
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        dt.divergence(net, 1)(torch.tensor(t, dtype=torch.float64), torch.as_tensor(xs))
        .detach()
        .numpy(),
        np.asarray(
            dj.divergence(jmodels.concat_squash, 2)(layers, jnp.float64(t), jnp.asarray(xs))
        ),
        rtol=1e-10,
    )
