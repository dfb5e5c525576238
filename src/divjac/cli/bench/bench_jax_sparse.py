"""P3, P4, P5 in JAX: exact divergence of a CNN from its sparsity, against dense and asdex.

3-layer 3x3 'same' conv stack (16 channels, tanh, 3 output channels) on ``[8, 32, 32, 3]``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from ...jax import _detect, divergence, sparsity
from ...models import jax as models
from ._harness import Result, best_time


def _dense_reference(params, x):
    """Hand-written dense divergence: per-sample vmap(jacfwd) + trace."""
    per_sample = lambda xi: models.cnn(params, xi[None])[0]  # noqa: E731
    J = jax.vmap(jax.jacfwd(per_sample))(x)
    n = x[0].size
    return jnp.trace(J.reshape(x.shape[0], n, n), axis1=1, axis2=2)


def _asdex_divergence(params, x):
    """asdex on the batched function: detect, color the Jacobian, decompress, take the diagonal."""
    import asdex

    B, n = x.shape[0], x[0].size
    flat = lambda v, p: models.cnn(p, v.reshape(x.shape)).reshape(-1)  # noqa: E731
    pattern = asdex.jacobian_coloring(flat, x.reshape(-1), params)
    jac = asdex.jacobian_from_coloring(flat, pattern)

    def div(v, p):
        J = jac(v.reshape(-1), p)
        rows, cols = J.indices[:, 0], J.indices[:, 1]
        on_diag = jnp.where(rows == cols, J.data, 0.0)
        return jax.ops.segment_sum(on_diag, rows // n, num_segments=B)

    return jax.jit(div), pattern


def run(quick: bool) -> list[Result]:
    key = jax.random.key(0)
    params = models.init_cnn(key, channels=16, layers=3)
    x = jax.random.normal(jax.random.key(1), (8, 32, 32, 3))
    repeat = 2 if quick else 5
    pattern = sparsity(models.cnn, argnums=1)(params, x)
    sparse = jax.jit(divergence(models.cnn, 1, method="sparse"))
    dense = jax.jit(_dense_reference)
    ours_value = sparse(params, x)
    dense_value = dense(params, x)
    rel = float(jnp.max(jnp.abs(ours_value - dense_value) / jnp.abs(dense_value)))
    t_sparse = best_time(lambda: sparse(params, x), repeat=repeat)
    t_dense = best_time(lambda: dense(params, x), repeat=max(repeat // 2, 1))
    case = "CNN 3x3x3 16ch [8,32,32,3]"
    results = [
        Result(
            "P3", case, f"sparse ({pattern.n_diagonal_colors} passes)",
            "vmap(jacfwd)+trace (3072 passes)", t_sparse, t_dense, kind="gain", target=30.0,
            extra={"max_rel_error": rel, "colors": pattern.n_diagonal_colors},
        ),
    ]  # fmt: skip
    try:
        asdex_div, asdex_pattern = _asdex_divergence(params, x)
    except ImportError:
        asdex_div = None
    if asdex_div is not None:
        asdex_value = asdex_div(x, params)
        t_asdex = best_time(lambda: asdex_div(x, params), repeat=repeat)
        results.append(
            Result(
                "P4", case, f"sparse ({pattern.n_diagonal_colors} passes)",
                f"asdex jacobian + diag ({asdex_pattern.num_colors} passes)",
                t_sparse, t_asdex, kind="gain", target=1.0,
                extra={"max_abs_diff": float(jnp.max(jnp.abs(asdex_value - ours_value)))},
            )
        )  # fmt: skip
    results += _detection(params, quick)
    return results


def _detection(params, quick: bool) -> list[Result]:
    """P5: detection + coloring of a 64x64x3 CNN (first call), and the cached second call."""
    out = []
    for batch in (1, 8):
        x = jnp.zeros((batch, 64, 64, 3))
        _detect.CACHE.clear()
        start = time.perf_counter()
        p = sparsity(models.cnn, argnums=1)(params, x)
        _ = p.diagonal_colors, p.colors
        first = time.perf_counter() - start
        start = time.perf_counter()
        again = sparsity(models.cnn, argnums=1)(params, x)
        _ = again.diagonal_colors, again.colors
        second = time.perf_counter() - start
        out.append(
            Result(
                "P5", f"detect+color CNN [{batch},64,64,3]", "first call", "budget 2 s",
                first, 2.0, kind="ratio", target=1.0,
                extra={"cached_call_s": second, "diag_colors": p.n_diagonal_colors, "colors": p.n_colors},
            )
        )  # fmt: skip
        if quick:
            break
    return out
