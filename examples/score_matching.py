"""Sliced score matching with divjac: the loss, its gradient w.r.t. the parameters, training.

Score matching (Hyvarinen, 2005) fits a score model ``s(x) ~ grad log p(x)`` without knowing
``p``, by minimizing ``E[ tr(ds/dx) + |s(x)|^2 / 2 ]``. The trace is the per-sample divergence of
``s``. Sliced score matching (Song, Garg, Shi & Ermon, 2019) replaces it by ``v^T (ds/dx) v`` for
random ``v``: exactly Hutchinson's estimator, here ``divergence(method="hutchinson",
num_probes=1)``, one batched JVP whatever the dimension (the "variance-reduced" form keeps
``|s|^2 / 2`` exact). The exact loss uses ``divergence(method="auto")``: ``d`` passes.

The data are Gaussian, ``x ~ N(mu, Sigma)``, so the true score ``-Sigma^{-1} (x - mu)`` is known
and the fitted score can be checked; every step draws a fresh batch (a finite data set lets the
model overfit: score matching rewards sharp negative divergences at the data points).

Run: ``python examples/score_matching.py``
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from divjac.jax import divergence
from divjac.models import jax as models

score = models.mlp  # s(params, x): [B, d] -> [B, d]


def sliced_loss(params: Any, x: jax.Array, key: jax.Array, num_probes: int = 1) -> jax.Array:
    """Sliced score matching loss (variance-reduced): ``mean(v^T J v + |s|^2 / 2)``."""
    trace = divergence(
        score, argnums=1, method="hutchinson", num_probes=num_probes, distribution="gaussian"
    )(key, params, x)  # the randomness comes first; f's own arguments follow
    s = score(params, x)
    return jnp.mean(trace + 0.5 * jnp.sum(s**2, axis=1))


def exact_loss(params: Any, x: jax.Array) -> jax.Array:
    """Score matching loss with the exact per-sample divergence: ``mean(tr J + |s|^2 / 2)``."""
    trace = divergence(score, argnums=1)(params, x)
    return jnp.mean(trace + 0.5 * jnp.sum(score(params, x) ** 2, axis=1))


def main(small: bool = False) -> dict[str, Any]:
    """Train a score model by sliced score matching; returns losses, gradients and the fit."""
    d, batch, steps, hidden = (4, 64, 20, 32) if small else (8, 512, 1500, 64)
    key = jax.random.key(0)
    k_data, k_params, k_train, k_eval = jax.random.split(key, 4)
    mu = jnp.linspace(-1.0, 1.0, d)
    scales = jnp.linspace(0.5, 1.5, d)  # Sigma = diag(scales^2)

    def sample(k: jax.Array, n: int) -> jax.Array:
        return mu + scales * jax.random.normal(k, (n, d))

    data = sample(k_data, 8 * batch)  # held out: the losses and the fit are measured on it
    params = models.init_mlp(k_params, (d, hidden, hidden, d))

    loss_and_grad = jax.jit(jax.value_and_grad(sliced_loss))
    loss, grads = loss_and_grad(params, data[:batch], k_eval)
    many = jax.jit(lambda p, x, k: sliced_loss(p, x, k, num_probes=64))(params, data, k_eval)
    exact = jax.jit(exact_loss)(params, data)
    print(f"sliced loss, 1 probe: {float(loss):.4f}; 64 probes: {float(many):.4f}")
    print(f"exact score matching loss:              {float(exact):.4f}")

    optimizer = optax.adam(3e-3)
    state = optimizer.init(params)

    @jax.jit
    def step(p: Any, s: Any, x: jax.Array, k: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, g = jax.value_and_grad(sliced_loss)(p, x, k)
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s, value

    losses = []
    trained = params
    for i, k in enumerate(jax.random.split(k_train, steps)):
        k_batch, k_probe = jax.random.split(k)
        trained, state, value = step(trained, state, sample(k_batch, batch), k_probe)
        losses.append(float(value))
        if not small and i % 300 == 0:
            print(f"step {i:4d}: sliced loss {value:.4f}")

    true_score = -(data - mu) / scales**2
    fit = jnp.sqrt(jnp.mean((score(trained, data) - true_score) ** 2))
    scale = jnp.sqrt(jnp.mean(true_score**2))
    # For a Gaussian the minimum of the loss is -E|true score|^2 / 2 = -sum(1/scales^2) / 2.
    print(f"after {steps} steps: exact loss {float(jax.jit(exact_loss)(trained, data)):.4f} "
          f"(optimum {float(-0.5 * jnp.sum(1 / scales**2)):.4f})")  # fmt: skip
    print(f"relative RMS error of the fitted score: {float(fit / scale):.3f}")
    return {
        "params": params,
        "data": data,
        "batch": batch,
        "key": k_eval,
        "loss": loss,
        "grads": grads,
        "sliced_loss_many": many,
        "exact_loss": exact,
        "losses": losses,
        "trained": trained,
        "score_error": float(fit / scale),
        "optimum": float(-0.5 * jnp.sum(1 / scales**2)),
        "sqrt_d": math.sqrt(d),
    }


if __name__ == "__main__":
    main()
