"""``divjac demo``: the user stories on built-in models, with timings."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table


def _timed(fn: Callable[[], Any], repeat: int = 3) -> tuple[Any, float]:
    """Result and best wall time (seconds) of ``fn`` after one warm-up (compilation) call."""
    import jax

    out = jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return out, best


def run_demo() -> None:
    import jax.numpy as jnp
    import numpy as np

    import jax
    from divjac.jax import divergence, grad_divergence, jacobian, laplacian, sparsity
    from divjac.models import jax as models

    console = Console()
    key = jax.random.key(0)

    console.rule("[bold]Story 1: per-sample Jacobian and divergence of an image CNN")
    params = models.init_cnn(key, channels=16, layers=3)
    small = jax.random.normal(key, (4, 16, 16, 3))
    jac = jax.jit(jacobian(models.cnn, 1))
    out, t_jac = _timed(lambda: jac(params, small))
    console.print(f"jacobian on x {small.shape}: shape {out.shape} in {t_jac * 1e3:.1f} ms")
    images = jax.random.normal(key, (8, 32, 32, 3))
    pattern = sparsity(models.cnn, params, images, argnums=1)
    table = Table("method", "passes", "time (ms)", "max |error| vs exact")
    exact, t_exact = _timed(
        lambda: jax.jit(divergence(models.cnn, 1, method="exact"))(params, images), 1
    )
    sparse_fn = jax.jit(divergence(models.cnn, 1, method="sparse"))
    sparse, t_sparse = _timed(lambda: sparse_fn(params, images))
    table.add_row("exact (dense)", str(pattern.csr.shape[1]), f"{t_exact * 1e3:.1f}", "0")
    table.add_row(
        "sparse (diagonal coloring)",
        str(pattern.n_diagonal_colors),
        f"{t_sparse * 1e3:.1f}",
        f"{float(jnp.max(jnp.abs(sparse - exact))):.2e}",
    )
    console.print(f"divergence on x {images.shape}: per-sample pattern {pattern}")
    console.print(table)

    console.rule("[bold]Story 2: derivatives of net(params, x, t)")
    d = 2
    net_params = models.init_mlp_xt(key, d)
    x = jax.random.normal(key, (256, d))
    t = jnp.full((256, 1), 0.5)
    time_jac = jax.jit(lambda p, x, t: jacobian(models.mlp_xt, 2)(p, x, t)[..., 0])
    space_jac = jax.jit(jacobian(models.mlp_xt, 1))
    grad_div = jax.jit(grad_divergence(models.mlp_xt, 1))

    def loss(p: Any) -> jax.Array:
        return jnp.mean(divergence(models.mlp_xt, 1)(p, x, t) ** 2)

    param_grad = jax.jit(jax.grad(loss))
    d_dt, t_dt = _timed(lambda: time_jac(net_params, x, t))
    d_dx, t_dx = _timed(lambda: space_jac(net_params, x, t))
    gdiv, t_gdiv = _timed(lambda: grad_div(net_params, x, t))
    _, t_grad = _timed(lambda: param_grad(net_params))
    table = Table("quantity", "shape", "time (ms)")
    table.add_row("d out/dt", str(d_dt.shape), f"{t_dt * 1e3:.2f}")
    table.add_row("d out/dx", str(d_dx.shape), f"{t_dx * 1e3:.2f}")
    table.add_row("grad_x div", str(gdiv.shape), f"{t_gdiv * 1e3:.2f}")
    table.add_row("grad_params mean(div^2)", "pytree", f"{t_grad * 1e3:.2f}")
    console.print(table)

    console.rule("[bold]Story 3: Laplacian of a scalar field")
    W = jax.random.normal(key, (8, 8)) / np.sqrt(8)

    def u(x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(x @ W) ** 2, axis=1)

    xs = jax.random.normal(key, (128, 8))
    lap_fn = jax.jit(laplacian(u))
    lap, t_lap = _timed(lambda: lap_fn(xs))
    hess = jax.vmap(jax.hessian(lambda z: jnp.sum(jnp.tanh(z @ W) ** 2)))(xs)
    err = float(jnp.max(jnp.abs(lap - jnp.trace(hess, axis1=1, axis2=2))))
    console.print(
        f"laplacian on x {xs.shape}: shape {lap.shape} in {t_lap * 1e3:.2f} ms, max |error| vs Hessian trace {err:.1e}"
    )
