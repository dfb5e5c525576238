"""P3, P4, P5 and S1, S2 in JAX: sparse divergences and Jacobians against dense, asdex, sparsejac.

P3-P5: a 3-layer 3x3 'same' conv stack (16 channels, tanh, 3 output channels) on
``[8, 32, 32, 3]``. S1: steady-state (jitted) sparse Jacobians on the benchmark cases of asdex
(heat-equation RHS, a 1-D ConvNet, the Hessian of Rosenbrock, N=200; single function with
``batch_axis=None`` and a batch of 32 through ``vmap``) and of sparsejac (``x ** 2`` on 10000
elements, a squared 3x3 'valid' convolution on 20x20). S2: the sparse result (BCOO) against the
dense one (``jacobian(mode="sparse")``) of the same passes, batched. Times are medians-free best
times measured interleaved in one run (:func:`~._harness.interleaved_best_times`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...jax import _detect, divergence, jacobian, sparse_jacobian, sparsity
from ...models import jax as models
from ._harness import Result, best_time, interleaved_best_times


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
    results += _versus_asdex(quick)
    results += _versus_sparsejac(quick)
    results += _result_formats(quick)
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


# --- S1, S2: sparse Jacobians on the cases of asdex and sparsejac ----------------------------

_N = 200  # the size of asdex's benchmark cases


def _heat(u: jax.Array) -> jax.Array:
    """The right-hand side of the 1-D heat equation with Dirichlet boundaries (tridiagonal)."""
    left = -2 * u[0:1] + u[1:2]
    interior = u[:-2] - 2 * u[1:-1] + u[2:]
    right = u[-2:-1] - 2 * u[-1:]
    return jnp.concatenate([left, interior, right])


def _convnet_params(n: int) -> list[tuple[jax.Array, jax.Array]]:
    """Weights of the 1-D ConvNet of asdex's benchmarks: widths 1 -> 8 -> 4 -> 2, kernels 5, 3, 3."""
    rng = np.random.default_rng(0)
    shapes = [(5, 1, 8), (3, 8, 4), (3, 4, 2)]
    return [
        (
            jnp.asarray(rng.normal(size=s) / np.sqrt(s[0] * s[1]), jnp.float32),
            jnp.asarray(0.1 * rng.normal(size=s[2]), jnp.float32),
        )
        for s in shapes
    ]


def _convnet(params: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    """``(N,) -> (2 N,)``: three 'same' 1-D convolutions with ReLU (Flax's ``nn.Conv`` layout)."""
    h = x[None, :, None]
    for w, b in params:
        h = lax.conv_general_dilated(h, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
        h = jax.nn.relu(h + b)
    return h.reshape(-1)


def _rosenbrock(x: jax.Array) -> jax.Array:
    return jnp.sum((1 - x[:-1]) ** 2 + 100 * (x[1:] - x[:-1] ** 2) ** 2)


def _data(matrix: Any) -> Any:
    """The array a sparse result holds (its values), or the dense result itself."""
    return getattr(matrix, "data", matrix)


def _timed(fns: dict[str, Callable[[], Any]], quick: bool) -> dict[str, float]:
    """Interleaved best times; a few warm-up calls each (the first calls of a jitted program
    are slower for a while, whatever the library)."""
    return interleaved_best_times(fns, repeat=3 if quick else 9, warmup=5, min_time=0.02)


def _versus_asdex(quick: bool) -> list[Result]:
    """S1 against asdex: the sparse Jacobian of one function, and of a vmapped batch of 32."""
    try:
        import asdex
    except ImportError:
        return []
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=_N), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(32, _N)), jnp.float32)
    zeros = np.zeros(_N, np.float32)
    params = _convnet_params(_N)
    convnet = lambda v: _convnet(params, v)  # noqa: E731
    single = {
        "heat-equation RHS": (_heat, asdex.jacobian(_heat, zeros), "asdex.jacobian"),
        "1-D ConvNet": (convnet, asdex.jacobian(convnet, zeros), "asdex.jacobian"),
        "Rosenbrock Hessian": (
            jax.grad(_rosenbrock),
            asdex.hessian(_rosenbrock, zeros),
            "asdex.hessian",
        ),
    }
    results = []
    for name, (f, theirs, label) in single.items():
        ours = sparse_jacobian(f, batch_axis=None)
        fns = {
            "ours": _call(jax.jit(ours), x),
            "theirs": _call(jax.jit(theirs), x),
            "ours_vmap": _call(jax.jit(jax.vmap(ours)), xs),
            "ours_batch": _call(jax.jit(sparse_jacobian(jax.vmap(f))), xs),
            "theirs_vmap": _call(jax.jit(jax.vmap(theirs)), xs),
        }
        t = _timed(fns, quick)
        results += [
            Result(
                "S1", f"{name} N={_N}", "sparse_jacobian(batch_axis=None)", label,
                t["ours"], t["theirs"], target=1.0,
            ),
            Result(
                "S1", f"{name} N={_N}, vmap over 32", "vmap(sparse_jacobian(batch_axis=None))",
                f"vmap({label})", t["ours_vmap"], t["theirs_vmap"], target=1.0,
            ),
            Result(
                "S1", f"{name} N={_N}, batch of 32", "sparse_jacobian(vmap(f))",
                f"vmap({label})", t["ours_batch"], t["theirs_vmap"], target=1.0,
            ),
        ]  # fmt: skip
    return results


def _call(fn: Callable[[jax.Array], Any], x: jax.Array) -> Callable[[], Any]:
    return lambda: _data(fn(x))


def _squared_conv2d(x: jax.Array) -> jax.Array:
    image = x.reshape(20, 20)
    return jax.scipy.signal.convolve2d(image, jnp.ones((3, 3)), mode="valid").reshape(-1) ** 2


def _versus_sparsejac(quick: bool) -> list[Result]:
    """S1 against sparsejac (given the pattern; the best of its jacfwd and jacrev)."""
    try:
        import sparsejac
        from jax.experimental import sparse as jsparse
    except ImportError:
        return []
    rng = np.random.default_rng(2)
    cases = {
        "x ** 2, 10000": (lambda v: v**2, 10000),
        "3x3 valid conv ** 2, 20x20": (_squared_conv2d, 400),
    }
    results = []
    for name, (f, n) in cases.items():
        x = jnp.asarray(rng.uniform(size=n), jnp.float32)
        pattern = jsparse.BCOO.fromdense(jax.jacfwd(f)(x) != 0)
        fns = {
            "ours": _call(jax.jit(sparse_jacobian(f, batch_axis=None)), x),
            "jacfwd": _call(jax.jit(sparsejac.jacfwd(f, pattern)), x),
            "jacrev": _call(jax.jit(sparsejac.jacrev(f, pattern)), x),
        }
        t = _timed(fns, quick)
        best = "jacfwd" if t["jacfwd"] <= t["jacrev"] else "jacrev"
        results.append(
            Result(
                "S1", name, "sparse_jacobian(batch_axis=None)", f"sparsejac.{best}",
                t["ours"], t[best], target=1.0,
            )
        )  # fmt: skip
    return results


def _result_formats(quick: bool) -> list[Result]:
    """S2: the BCOO result against the dense result of the same passes (one batch)."""
    rng = np.random.default_rng(3)
    params = _convnet_params(_N)
    cases = {
        "heat-equation RHS": jax.vmap(_heat),
        "1-D ConvNet": jax.vmap(lambda v: _convnet(params, v)),
    }
    results = []
    for batch in (32,) if quick else (32, 256):
        xs = jnp.asarray(rng.normal(size=(batch, _N)), jnp.float32)
        for name, f in cases.items():
            fns = {
                "sparse": _call(jax.jit(sparse_jacobian(f)), xs),
                "dense": _call(jax.jit(jacobian(f, mode="sparse")), xs),
            }
            t = _timed(fns, quick)
            results.append(
                Result(
                    "S2", f"{name} N={_N}, B={batch}", "sparse_jacobian (BCOO)",
                    'jacobian(mode="sparse") (dense)', t["sparse"], t["dense"], target=1.0,
                )
            )  # fmt: skip
    return results
