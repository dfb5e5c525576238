"""The bi-Laplacian in JAX: divjac's exact ``bilaplacian`` against nested Hessians.

The MLP ``16 -> W -> W -> 1`` (tanh), float32, both jitted: ``bilaplacian(u)`` (the collapsed
sweep of the unit basis through the collapsed sweep of the unit basis) against what a user
writes by hand, ``vmap`` over the samples of the trace of ``jax.hessian`` of the Laplacian
``trace(jax.hessian(u))``. Target: at least 3x faster.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...jax import bilaplacian
from ...models import jax as models
from ._harness import Result, bilaplacian_row


def run(quick: bool) -> list[Result]:
    d, width, batch = (16, 64, 64) if quick else (16, 128, 128)
    params = models.init_mlp(jax.random.key(0), (d, width, width, 1))
    x = jax.random.normal(jax.random.key(1), (batch, d))

    def u(z: jax.Array) -> jax.Array:  # per sample and batched alike
        return models.mlp(params, z)[..., 0]

    def laplacian(z: jax.Array) -> jax.Array:
        return jnp.trace(jax.hessian(u)(z))

    ours = jax.jit(bilaplacian(u))
    nested = jax.jit(jax.vmap(lambda z: jnp.trace(jax.hessian(laplacian)(z))))
    want = nested(x)
    rel_err = float(jnp.max(jnp.abs(ours(x) - want)) / jnp.max(jnp.abs(want)))
    case = f"bi-Laplacian, MLP {d}-{width}-{width}-1 tanh, B={batch}, float32, jit"
    return [
        bilaplacian_row(
            "JAX",
            case,
            lambda: ours(x),
            lambda: nested(x),
            rel_err=rel_err,
            repeat=3 if quick else 7,
            min_time=0.05,
        )
    ]
