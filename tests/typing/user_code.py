"""A user's file calling every public function of divjac.jax and divjac.torch.

Not run by pytest: mypy checks it against divjac's signatures (``mypy src/divjac tests/typing``),
so a public function that loses its types (or a wrong option in a signature) fails the check.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

import divjac
import divjac.jax as dj
import divjac.torch as dt

if sys.version_info >= (3, 11):
    from typing import assert_type
else:
    from typing_extensions import assert_type


def jax_user(x: jax.Array, key: jax.Array) -> None:
    def f(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    jac = dj.jacobian(f, 0, batch_axis=0, mode="sparse", chunk_size=8, coupling="exact")
    assert_type(jac, Callable[..., Any])
    jac(x)
    dj.jacobian(f, (0,), has_aux=False)(x)
    dj.divergence(f, method="hutch++", num_probes=6, distribution="gaussian")(key, x)
    dj.divergence(f, method="probing", probing_distance=2, return_stderr=True)(key, x)
    dj.value_and_divergence(f, method="xtrace", num_probes=4)(key, x)
    dj.grad_divergence(f, method="exact", has_aux=False)(x)
    dj.divergence(f, method="exact", mode="rev")(x)
    dj.value_and_divergence(f, method="hutchinson", mode="fwd")(key, x)
    dj.laplacian(lambda x: jnp.sum(x**2, axis=1), method="sparse", has_aux=False)(x)
    dj.laplacian(lambda x: x**2, method="stde", num_probes=2)(key, x)
    dj.weighted_laplacian(lambda x: x**2, jnp.eye(x.shape[1]), 0, method="exact")(x)
    dj.weighted_laplacian(lambda x: x**2, factor=x[:, :, None], method="hutchinson")(key, x)
    dj.hessian(lambda x: jnp.sum(x**2, axis=1), mode="sparse")(x)
    dj.hessian_diagonal(
        lambda x: jnp.sum(jnp.sin(x), axis=1), method="hutchinson", coupling="raise"
    )(key, x)
    dj.sparse_jacobian(f, coupling="raise", chunk_size=None)(x)
    pattern = dj.sparsity(f, batch_axis=0)(x)
    assert_type(pattern, dj.SparsityPattern)
    assert_type(dj.sparsity(f, (0,))(x), tuple[dj.SparsityPattern, ...])
    n_colors: int = pattern.n_colors
    dj.jacobian_from_pattern(f, pattern, 0, batch_axis=0, chunk_size=n_colors)(x)
    dj.divergence_from_pattern(f, pattern, has_aux=False)(x)
    dj.clear_caches()


def torch_user(x: torch.Tensor, generator: torch.Generator) -> None:
    model = torch.nn.Linear(x.shape[1], x.shape[1])
    dt.jacobian(model, 0, batch_axis=0, mode="rev", chunk_size=8, coupling="exact")(x)
    dt.jacobian(model, (0,), has_aux=False)(x)
    dt.divergence(torch.tanh, method="hutchinson", num_probes=4)(generator, x)
    dt.value_and_divergence(model, method="auto", return_stderr=True)(x)
    dt.grad_divergence(model, method="sparse", has_aux=False)(x)
    dt.grad_divergence(model, mode="rev")(x)
    dt.divergence(model, method="xtrace", mode="auto")(generator, x)
    dt.laplacian(lambda x: (x**2).sum(1), method="exact", has_aux=False)(x)
    dt.laplacian(model, method="hutchinson", distribution="gaussian")(generator, x)
    dt.weighted_laplacian(model, torch.eye(x.shape[1]), method="auto", chunk_size=4)(x)
    dt.weighted_laplacian(model, factor=torch.eye(x.shape[1]))(x)
    dt.hessian(lambda x: (x**2).sum(1), mode="fwd", has_aux=False)(x)
    dt.hessian_diagonal(lambda x: (x**2).sum(1), method="sparse", chunk_size=2)(x)
    dt.sparse_jacobian(model, layout=torch.sparse_csr, coupling="raise")(x)
    pattern = dt.sparsity(model, 0)(x)
    assert_type(pattern, dt.SparsityPattern)
    dt.jacobian_from_pattern(model, pattern, 0, chunk_size=4)(x)
    dt.divergence_from_pattern(model, pattern, batch_axis=0)(x)
    dt.clear_caches()
    divjac.clear_caches()


def same_signatures() -> None:
    """divjac.jax and divjac.torch expose the same functions (STYLE rule 3)."""
    jax_jacobian: Callable[..., Any] = dj.jacobian
    torch_jacobian: Callable[..., Any] = dt.jacobian
    assert jax_jacobian is not torch_jacobian
