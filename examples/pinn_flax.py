"""A physics-informed neural network (PINN) in Flax for the heat equation, with divjac derivatives.

The heat equation ``du/dt = Laplacian(u)`` on ``x in [0, 1]^d``, ``t in [0, 1]``, with
``u(x, 0) = prod_i sin(pi x_i)`` and ``u = 0`` on the boundary, has the solution
``u(x, t) = exp(-d pi^2 t) prod_i sin(pi x_i)``. A PINN ``u = net(params, x, t)`` is trained to
make the residual ``du/dt - Laplacian(u)`` vanish at random collocation points (Raissi, Perdikaris
& Karniadakis, 2019).

divjac gives every per-sample derivative from batched passes over the collocation batch:

* ``du/dt``:  ``jacobian(net.apply, argnums=2)`` (one pass: ``t`` has one element per sample),
* ``du/dx``:  ``jacobian(net.apply, argnums=1)`` (``d`` passes),
* ``Laplacian(u)``: ``laplacian(u, argnums=1)`` (forward-over-reverse, ``d`` passes),

and they compose with ``jax.grad`` w.r.t. the parameters for training (optax Adam).

Run: ``python examples/pinn_flax.py``
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from divjac.jax import jacobian, laplacian


class PINN(nn.Module):
    """``u(x, t)``: ``x (B, d)``, ``t (B, 1)`` -> ``(B, 1)``."""

    hidden: int = 64

    @nn.compact
    def __call__(self, x: jax.Array, t: jax.Array) -> jax.Array:
        h = jnp.concatenate([x, t], axis=-1)
        h = nn.tanh(nn.Dense(self.hidden)(h))
        h = nn.tanh(nn.Dense(self.hidden)(h))
        return nn.Dense(1)(h)


def derivatives(net: PINN, params: Any, x: jax.Array, t: jax.Array) -> dict[str, jax.Array]:
    """``u``, ``du/dt (B,)``, ``du/dx (B, d)`` and the Laplacian in ``x`` ``(B,)``."""

    def u(p: Any, x: jax.Array, t: jax.Array) -> jax.Array:  # one scalar per sample: (B,)
        return net.apply(p, x, t)[:, 0]

    return {
        "u": u(params, x, t),
        "u_t": jacobian(net.apply, argnums=2)(params, x, t)[:, 0, 0],
        "u_x": jacobian(net.apply, argnums=1)(params, x, t)[:, 0, :],
        "laplacian": laplacian(u, argnums=1)(params, x, t),
    }


def exact_solution(x: jax.Array, t: jax.Array) -> jax.Array:
    d = x.shape[1]
    return jnp.exp(-d * jnp.pi**2 * t[:, 0]) * jnp.prod(jnp.sin(jnp.pi * x), axis=1)


def sample_points(key: jax.Array, d: int, n: int) -> dict[str, jax.Array]:
    """Collocation points inside, on the initial slice ``t = 0`` and on the boundary."""
    k = jax.random.split(key, 5)
    x_bnd = jax.random.uniform(k[3], (n, d))
    side = jax.random.randint(k[4], (n,), 0, d)
    x_bnd = x_bnd.at[jnp.arange(n), side].set(jnp.round(x_bnd[jnp.arange(n), side]))
    return {
        "x": jax.random.uniform(k[0], (n, d)),
        "t": jax.random.uniform(k[1], (n, 1)),
        "x0": jax.random.uniform(k[2], (n, d)),
        "x_bnd": x_bnd,
        "t_bnd": jax.random.uniform(k[4], (n, 1)),
    }


def main(small: bool = False) -> dict[str, Any]:
    """Train the PINN; returns the network, its parameters and derivatives at test points."""
    d, n, steps = (2, 64, 20) if small else (2, 512, 1000)
    net = PINN(hidden=16 if small else 64)
    key = jax.random.key(0)
    pts = sample_points(key, d, n)
    params = net.init(jax.random.key(1), pts["x"], pts["t"])

    def loss(p: Any) -> jax.Array:
        der = derivatives(net, p, pts["x"], pts["t"])
        residual = der["u_t"] - der["laplacian"]
        u0 = net.apply(p, pts["x0"], jnp.zeros((n, 1)))[:, 0]
        initial = u0 - jnp.prod(jnp.sin(jnp.pi * pts["x0"]), axis=1)
        boundary = net.apply(p, pts["x_bnd"], pts["t_bnd"])[:, 0]
        return jnp.mean(residual**2) + jnp.mean(initial**2) + jnp.mean(boundary**2)

    optimizer = optax.adam(1e-2 if small else 3e-3)
    state = optimizer.init(params)

    @jax.jit
    def step(p: Any, s: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    losses = []
    for i in range(steps):
        params, state, value = step(params, state)
        losses.append(float(value))
        if not small and i % 200 == 0:
            print(f"step {i:4d}: loss {value:.3e}")

    test = sample_points(jax.random.key(2), d, 256)
    der = jax.jit(lambda p, x, t: derivatives(net, p, x, t))(params, test["x"], test["t"])
    error = jnp.sqrt(jnp.mean((der["u"] - exact_solution(test["x"], test["t"])) ** 2))
    print(f"loss {losses[0]:.3e} -> {losses[-1]:.3e} after {steps} steps")
    print(f"RMS error of u vs the exact solution: {float(error):.3e}")
    print(f"residual du/dt - Laplacian(u): RMS {float(jnp.sqrt(jnp.mean((der['u_t'] - der['laplacian']) ** 2))):.3e}")  # fmt: skip
    return {
        "net": net,
        "params": params,
        "x": test["x"],
        "t": test["t"],
        "losses": losses,
        "error": error,
        **der,
    }


if __name__ == "__main__":
    main()
