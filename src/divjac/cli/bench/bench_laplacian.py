"""P9 in JAX: the Laplacian by divjac's collapsed Taylor sweep against folx and the Hessian trace.

Dense: MLP ``d -> 256 -> 256 -> 1`` (tanh), ``B = 64`` (issue 24's rows; also ``B = 256`` in full
mode), ``d`` in {16, 64, 256}, float32, jitted, best-of and median of one interleaved run:
``laplacian(method="exact")`` (the sweep over the unit basis, shared by the samples, one summed
second-order term, in chunks of directions that fit the CPU's cache) against ``folx.forward_laplacian`` (vmapped over the batch), ``vmap(trace(hessian))`` and
forward-over-reverse (``jvp`` of ``grad``, vmapped over the basis).

Blocks: a sum over 50 particles in 4-D of an MLP of each particle, a FermiNet-like net (16
electrons in 3-D, a one-electron layer, then a layer on ``[h_i, mean_j h_j]``), B = 64, and a
CNN on 16x16x3 (two 3x3 convolutions), B = 8: divjac's
exact Laplacian (its sweep storing first-order terms sparse, chosen by itself) against
``folx.forward_laplacian`` at its fastest ``sparsity_threshold`` of several, in one interleaved
run (best-of and median).

Sparse: 64 particles in 3-D, the energy a sum of pair terms (a small MLP of the distance) over
the pairs within 3 places of each other in a chain (a cutoff on a fixed neighbour list), B = 16,
and a CNN: ``laplacian(method="auto")`` (the sparse sweep or the indicator directions of a
diagonal coloring of the per-sample Hessian, whichever it counts cheaper) against folx with its
sparsity, and the colored sweep itself (the pattern of ``grad(sum u)`` from
:func:`divjac.jax.sparsity`).

P9-auto, on every case: ``laplacian(method="auto")`` against the best explicit method timed
with it (``"exact"``; the colors' sweep, and ``"exact"`` on the pairs): within 1.2x.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...jax import laplacian, sparsity
from ...jax._taylor import second_order_sweep
from ...models import jax as models
from ._harness import Result, interleaved_best_times, interleaved_times


def run(quick: bool) -> list[Result]:
    """Every row; without folx only the dense rows' columns that do not need it."""
    results: list[Result] = []
    for batch in (64,) if quick else (64, 256):
        for d in (16, 64) if quick else (16, 64, 256):
            results += _dense(d, batch=batch, repeat=9 if quick else 15)
    if importlib.util.find_spec("folx") is None:
        return results
    for block in _block_models(quick).values():
        results += _blocks(block, quick)
    results += _sparse(
        _pair_energy(32 if quick else 64), 96 if quick else 192, 16, "pairs", 2 if quick else 5
    )
    side = 8 if quick else 32
    results += _sparse(_conv_energy(), (side, side, 3), 4, "cnn", 2 if quick else 3)
    return results


def _folx(u: Callable[[jax.Array], jax.Array], threshold: int = 0) -> Callable[[jax.Array], Any]:
    """folx's forward Laplacian of the per-sample ``u``, vmapped over the batch."""
    import folx

    return jax.vmap(folx.forward_laplacian(u, sparsity_threshold=threshold))


def _sweep(
    u: Callable[[jax.Array], jax.Array], directions: jax.Array
) -> Callable[[jax.Array], jax.Array]:
    return lambda x: second_order_sweep(u, x, directions)[2]


def _dense(d: int, batch: int, repeat: int) -> list[Result]:
    params = models.init_mlp(jax.random.key(0), (d, 256, 256, 1))
    x = jax.random.normal(jax.random.key(1), (batch, d))
    u = lambda z: models.mlp(params, z)[..., 0]  # noqa: E731  (per sample and batched alike)
    basis = jnp.eye(d, dtype=x.dtype)
    ours = jax.jit(laplacian(u, method="exact"))
    auto = jax.jit(laplacian(u, method="auto"))
    has_folx = importlib.util.find_spec("folx") is not None
    folx_lap = jax.jit(lambda x: _folx(u)(x).laplacian)
    hess = jax.jit(jax.vmap(lambda z: jnp.trace(jax.hessian(u)(z))))

    def hvp_trace(z: jax.Array) -> jax.Array:  # forward-over-reverse: d Hessian-vector products
        hvp = lambda e: jax.jvp(jax.grad(u), (z,), (e,))[1] @ e  # noqa: E731
        return jax.vmap(hvp)(basis).sum()

    fwd_rev = jax.jit(jax.vmap(hvp_trace))
    ref = hess(x)
    errors = {
        name: float(jnp.max(jnp.abs(fn(x) - ref)) / jnp.max(jnp.abs(ref)))
        for name, fn in (("ours", ours), ("auto", auto), ("folx", folx_lap), ("fwd_rev", fwd_rev))
        if has_folx or name != "folx"
    }
    fns = {
        "ours": lambda: ours(x),
        "auto": lambda: auto(x),
        "folx": lambda: folx_lap(x),
        "hess": lambda: hess(x),
        "fwd_rev": lambda: fwd_rev(x),
    }
    times = interleaved_times(
        {k: fn for k, fn in fns.items() if has_folx or k != "folx"}, repeat=repeat
    )
    t = {k: min(ts) for k, ts in times.items()}
    median = {k: statistics.median(ts) for k, ts in times.items()}
    case = f"Laplacian, MLP {d}-256-256-1 tanh, B={batch}"
    ours_label = "laplacian(method='exact') (collapsed sweep of the unit basis)"
    extra = {
        "max_rel_err_vs_hessian": errors,
        "median_seconds": median,
        "load_average_1min": os.getloadavg()[0],
    }
    versus_folx = [
        Result(
            "P9",
            case,
            ours_label,
            "folx.forward_laplacian",
            t["ours"],
            t["folx"],
            target=1.0,
            extra={**extra, "median_ratio": median["ours"] / median["folx"]},
        )
    ]
    return [
        *(versus_folx if has_folx else []),
        Result(
            "P9-hess",
            case,
            ours_label,
            "vmap(trace(jax.hessian))",
            t["ours"],
            t["hess"],
            kind="gain",
            target=2.0 if d == 64 else None,
            extra={} if has_folx else {**extra, "folx": "not installed: no P9 row"},
        ),
        Result(
            "-",
            case,
            ours_label,
            "forward-over-reverse (d HVPs)",
            t["ours"],
            t["fwd_rev"],
            kind="gain",
        ),
        _auto_row(case, t["auto"], t["ours"], "laplacian(method='exact')"),
    ]


def _auto_row(case: str, auto: float, best: float, explicit: str, **extra: Any) -> Result:
    """``laplacian(method="auto")`` against the best explicit method: within 1.2x."""
    return Result(
        "P9-auto", case, "laplacian(method='auto')", explicit, auto, best, target=1.2, extra=extra
    )


_Block = tuple[Callable[[jax.Array], jax.Array], tuple[int, ...], int, tuple[int, ...], str]


def _block_models(quick: bool) -> dict[str, _Block]:
    """The blocks' rows: per-sample (and batched) ``u``, its sample shape, the batch, folx's
    thresholds to try, and the case."""
    keys = jax.random.split(jax.random.key(4), 6)
    normal = lambda i, shape, scale: jax.random.normal(keys[i], shape) * scale  # noqa: E731
    w1, b1 = normal(0, (4, 64), 0.5), normal(1, (64,), 1.0)
    w2, w3 = normal(2, (64, 64), 0.125), normal(3, (64,), 0.125)

    def particles(x: jax.Array) -> jax.Array:
        h = jnp.tanh(x.reshape(*x.shape[:-1], 50, 4) @ w1 + b1)
        return jnp.sum(jnp.tanh(h @ w2) @ w3, -1)

    v1, v2 = normal(4, (3, 64), 1.0), normal(5, (128, 64), 0.125)

    def ferminet(x: jax.Array) -> jax.Array:
        h = jnp.tanh(x.reshape(*x.shape[:-1], 16, 3) @ v1)
        g = jnp.broadcast_to(jnp.mean(h, axis=-2, keepdims=True), h.shape)
        h = jnp.tanh(jnp.concatenate([h, g], -1) @ v2) + h
        return jnp.sum(h @ w3, -1)

    few = (8, 16, 48) if quick else (4, 8, 16, 32, 64)
    return {
        "particles": (
            particles,
            (200,),
            64,
            few,
            "Laplacian, sum over 50 particles (4-D) of a 4-64-64-1 tanh MLP, B=64",
        ),
        "ferminet": (
            ferminet,
            (48,),
            64,
            few,
            "Laplacian, FermiNet-like (16 electrons, one-electron layer, [h_i, mean h] layer), "
            "B=64",
        ),
        "cnn": (
            _conv_energy(),
            (16, 16, 3),
            8,
            (128,) if quick else (64, 128, 256),
            "Laplacian, sum tanh(2 conv3x3, 8 channels) on 16x16x3, B=8",
        ),
    }


def _blocks(block: _Block, quick: bool) -> list[Result]:
    u, shape, batch, thresholds, case = block
    x = jax.random.normal(jax.random.key(5), (batch, *shape))
    ours = jax.jit(laplacian(u, method="exact"))
    fns: dict[str, Callable[[jax.Array], Any]] = {
        "ours": ours,
        "auto": jax.jit(laplacian(u, method="auto")),
    }
    for th in thresholds:
        fns[f"folx_{th}"] = jax.jit(lambda x, th=th: _folx(u, th)(x).laplacian)
    d = int(np.prod(shape))
    trace = lambda z: jnp.trace(jax.hessian(u)(z).reshape(d, d))  # noqa: E731
    ref = jax.jit(jax.vmap(trace))(x)
    err = max(
        float(jnp.max(jnp.abs(fns[k](x) - ref)) / jnp.max(jnp.abs(ref))) for k in ("ours", "auto")
    )
    times = interleaved_times(
        {k: partial(fn, x) for k, fn in fns.items()}, repeat=9 if quick else 15
    )
    best = {k: min(ts) for k, ts in times.items()}
    median = {k: statistics.median(ts) for k, ts in times.items()}
    folx_best = min((k for k in fns if k.startswith("folx")), key=best.__getitem__)
    row = Result(
        "P9-blocks",
        case,
        "laplacian(method='exact') (sparse first-order terms)",
        f"folx.forward_laplacian (sparsity_threshold={folx_best.split('_')[1]}, fastest of "
        f"{thresholds})",
        best["ours"],
        best[folx_best],
        target=1.0,
        extra={
            "max_rel_err_vs_hessian": err,
            "median_ratio": median["ours"] / median[folx_best],
            "median_seconds": median,
            "load_average_1min": os.getloadavg()[0],
        },
    )
    explicit = "laplacian(method='exact') (sparse first-order terms)"
    ratio = median["auto"] / median["ours"]
    return [row, _auto_row(case, best["auto"], best["ours"], explicit, median_ratio=ratio)]


def _pair_energy(n: int, reach: int = 3) -> Callable[[jax.Array], jax.Array]:
    """``u(x)`` of ``x`` ``[..., 3 n]``: a small MLP of the distance summed over the pairs
    ``(i, i + s)``, ``1 <= s <= reach``."""
    rng = np.random.default_rng(0)
    i, j = np.array([(a, a + s) for a in range(n) for s in range(1, reach + 1) if a + s < n]).T
    w1, b1 = (
        jnp.asarray(rng.normal(size=16), jnp.float32),
        jnp.asarray(rng.normal(size=16), jnp.float32),
    )
    w2 = jnp.asarray(rng.normal(size=16) / 4, jnp.float32)

    def u(x: jax.Array) -> jax.Array:
        p = x.reshape(*x.shape[:-1], n, 3)
        diff = p[..., i, :] - p[..., j, :]
        r = jnp.sqrt(jnp.sum(diff * diff, -1) + 1e-2)
        return jnp.sum(jnp.tanh(r[..., None] * w1 + b1) @ w2 * jnp.exp(-r), -1)

    return u


def _conv_energy() -> Callable[[jax.Array], jax.Array]:
    """``u(x) = sum tanh(cnn(x))`` of images ``[..., H, W, 3]``: two 3x3 convolutions (8
    channels, tanh), per-sample Hessian nonzero within 9x9 windows."""
    params = models.init_cnn(jax.random.key(3), channels=8, layers=2, out_channels=1)

    def u(x: jax.Array) -> jax.Array:
        batched = x if x.ndim == 4 else x[None]
        out = jnp.sum(jnp.tanh(models.cnn(params, batched)), axis=(1, 2, 3))
        return out if x.ndim == 4 else out[0]

    return u


def _sparse(
    u: Callable[[jax.Array], jax.Array], shape: Any, batch: int, name: str, repeat: int
) -> list[Result]:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    d = int(np.prod(shape))
    x = jax.random.normal(jax.random.key(2), (batch, *shape)) * (2.0 if name == "pairs" else 1.0)
    pattern = sparsity(jax.grad(lambda z: u(z).sum()))(x)  # per-sample Hessian pattern
    colors = np.asarray(pattern.diagonal_colors).reshape(-1)
    onehot = colors[None, :] == np.arange(pattern.n_diagonal_colors)[:, None]
    indicators = jnp.asarray(onehot.reshape(-1, 1, *shape), x.dtype)
    ours = jax.jit(laplacian(u, method="auto"))
    threshold = 6 if name == "pairs" else 128
    folx_sparse = jax.jit(lambda x: _folx(u, threshold)(x).laplacian)
    fns = {"ours": ours, "colors": jax.jit(_sweep(u, indicators)), "folx_sparse": folx_sparse}
    if name == "pairs":  # the dense methods, and the Hessian as reference, at this size only
        fns["exact"] = jax.jit(laplacian(u, method="exact"))  # the sparse sweep, here
        fns["dense"] = jax.jit(_sweep(u, jnp.eye(d, dtype=x.dtype).reshape(d, 1, *shape)))
        fns["folx_dense"] = jax.jit(lambda x: _folx(u)(x).laplacian)
        ref = jax.jit(jax.vmap(lambda z: jnp.trace(jax.hessian(u)(z))))(x)
    else:
        ref = folx_sparse(x)
    err = float(jnp.max(jnp.abs(ours(x) - ref)) / jnp.max(jnp.abs(ref)))
    t = interleaved_best_times({k: partial(fn, x) for k, fn in fns.items()}, repeat=repeat)
    case = (
        f"Laplacian, {d // 3} particles, pair terms within 3 (d={d}), B={batch}"
        if name == "pairs"
        else f"Laplacian, sum tanh(2 conv3x3) on {'x'.join(map(str, shape))}, B={batch}"
    )
    label = "laplacian(method='auto')"
    reference = "jax.hessian" if name == "pairs" else "folx"
    extra = {"colours": int(pattern.n_diagonal_colors), f"max_rel_err_vs_{reference}": err}
    rows = [
        Result(
            "P9-sparse",
            case,
            label,
            f"folx (sparsity_threshold={threshold})",
            t["ours"],
            t["folx_sparse"],
            kind="gain",
            target=3.0,
            extra=extra,
        ),
        _auto_row(case, t["ours"], t["colors"], f"{pattern.n_diagonal_colors} colours' sweep"),
    ]
    if name == "pairs":
        rows += [
            _auto_row(case, t["ours"], t["exact"], "laplacian(method='exact')"),
            Result(
                "-",
                case,
                label,
                f"second_order_sweep (unit basis, {d})",
                t["ours"],
                t["dense"],
                kind="gain",
            ),
            Result("-", case, label, "folx (dense)", t["ours"], t["folx_dense"], kind="gain"),
        ]
    return rows
