"""Training a regularized CNF (FFJORD + RNODE penalties) in JAX.

The JAX twin of ``rnode_torch.py``: RNODE (Finlay et al. 2020, "How to train your neural
ODE") adds the kinetic energy ``integral ||f||^2 dt`` and the Jacobian penalty
``integral ||J_f||_F^2 dt`` to FFJORD's maximum likelihood. divjac's
``value_divergence_and_frobenius`` gives ``f``, its divergence and ``||J_f||_F^2`` from one set
of passes (one pass per Hutchinson probe, or exactly), inside a fixed-step RK4 written with
``lax.scan`` and differentiated with ``jax.grad``.

Run: ``python examples/rnode_jax.py``
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from divjac.jax import value_divergence_and_frobenius
from divjac.models import jax as models


def velocity(params: Any, z: jax.Array, t: jax.Array) -> jax.Array:
    """The vector field ``f(z, t)``: the built-in ``net(x, t)`` MLP, ``z (B, d)``, scalar ``t``."""
    return models.mlp_xt(params, z, jnp.broadcast_to(t, (z.shape[0], 1)).astype(z.dtype))


def losses(
    params: Any, x: jax.Array, probes: jax.Array | None, *, steps: int = 8
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-sample ``(-log p(x), kinetic energy, Jacobian penalty)`` over ``t in [0, 1]``.

    ``probes``: one Hutchinson probe per sample, fixed across the solve (``None``: exact).
    """
    method = "exact" if probes is None else "hutchinson"
    field = value_divergence_and_frobenius(velocity, argnums=1, method=method)
    noise = () if probes is None else (probes,)

    def dynamics(t: jax.Array, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        dz, div, sq_fro = field(*noise, params, state[0], t)
        return dz, -div, jnp.sum(dz**2, 1), sq_fro

    h = 1.0 / steps

    def rk4(state: tuple[jax.Array, ...], t: jax.Array) -> tuple[tuple[jax.Array, ...], None]:
        def moved(s: tuple[jax.Array, ...], k: tuple[jax.Array, ...], c: float) -> Any:
            return tuple(a + c * b for a, b in zip(s, k, strict=True))

        k1 = dynamics(t, state)
        k2 = dynamics(t + h / 2, moved(state, k1, h / 2))
        k3 = dynamics(t + h / 2, moved(state, k2, h / 2))
        k4 = dynamics(t + h, moved(state, k3, h))
        step = tuple((a + 2 * b + 2 * c + d) / 6 for a, b, c, d in zip(k1, k2, k3, k4, strict=True))
        return moved(state, step, h), None

    zero = jnp.zeros(x.shape[0], x.dtype)
    times = jnp.arange(steps, dtype=x.dtype) * h
    (z1, minus_integral, kinetic, jacobian), _ = jax.lax.scan(rk4, (x, zero, zero, zero), times)
    log_base = -0.5 * jnp.sum(z1**2, 1) - 0.5 * x.shape[1] * math.log(2 * math.pi)
    return -(log_base - minus_integral), kinetic, jacobian


def two_moons(key: jax.Array, n: int) -> jax.Array:
    """A small 2-d data set: two interleaved half circles with noise."""
    k1, k2, k3 = jax.random.split(key, 3)
    angle = math.pi * jax.random.uniform(k1, (n,))
    x = jnp.stack([jnp.cos(angle), jnp.sin(angle)], 1)
    lower = jnp.stack([1 - x[:, 0], 0.5 - x[:, 1]], 1)
    x = jnp.where(jax.random.bernoulli(k2, 0.5, (n,))[:, None], x, lower)
    return x + 0.05 * jax.random.normal(k3, (n, 2))


def main(small: bool = False) -> dict[str, Any]:
    batch, iterations, hidden = (16, 3, 16) if small else (256, 200, 64)
    params = models.init_mlp_xt(jax.random.key(0), 2, hidden, jnp.zeros(()).dtype)

    def loss_fn(params: Any, key: jax.Array) -> jax.Array:
        data_key, probe_key = jax.random.split(key)
        x = two_moons(data_key, batch)
        probes = jax.random.normal(probe_key, x.shape, x.dtype)
        nll, kinetic, jacobian = losses(params, x, probes, steps=2 if small else 8)
        return jnp.mean(nll + 0.01 * kinetic + 0.01 * jacobian)

    @jax.jit
    def step(params: Any, key: jax.Array) -> tuple[Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, key)
        return jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads), loss

    history = []
    for it, key in enumerate(jax.random.split(jax.random.key(1), iterations)):
        params, loss = step(params, key)
        history.append(float(loss))
        if not small and it % 20 == 0:
            print(f"step {it:4d}  loss {float(loss):.4f}")
    return {"params": params, "history": history}


if __name__ == "__main__":
    main()
