"""Jacobian functionals beyond the trace, side by side with the code their users write.

- R1 (torch): the RNODE regularizer on FFJORD's ODE function (``B = 256``, ``d`` in {2, 64}, one
  probe, forward + backward to the parameters): ``value_divergence_and_frobenius`` against the
  Hutchinson divergence alone (``<= 1.1x``: the norm comes from the same VJP) and against RNODE's
  hand-written code (one ``autograd.grad`` VJP ``g = e^T J``, then ``g . e`` and ``||g||^2``,
  ``<= 1.0x``).
- R2 (JAX): the exact squared Frobenius norm of the 3-layer CNN on ``[8, 32, 32, 3]`` by colouring
  against the norm of the dense per-sample Jacobian (``vmap(jacfwd)``), ``>= 20x``.
- R3 (JAX): exact ``log_abs_det`` of a residual MLP at ``d = 64``, ``B = 256`` against
  ``vmap(jacfwd)`` + ``slogdet``, ``<= 1.2x``.
- R4 (JAX): SLQ's estimate of ``log|det J|`` of a residual CNN at ``d = 3072`` against the exact
  value (by colouring + LU), over several keys (one draw within ``2`` stderr is a random event):
  the fraction of draws within ``2`` stderr, ``>=`` the fraction a calibrated estimator
  (coverage ``0.94``) falls below with probability under 1 % (``0.75`` at 8 or 16 draws); the
  mean and largest ``|z|`` reported beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._harness import Result, interleaved_best_times
from .bench_calibration import TARGET

B = 256


def run(quick: bool) -> list[Result]:
    repeat = 5 if quick else 15
    results: list[Result] = []
    for d in (2, 64):
        results += _rnode(d, repeat)
    results.append(_sparse_frobenius(32, 2 if quick else 5))
    results.append(_log_det(64, repeat))
    results.append(_slq(16 if quick else 32, 4 if quick else 8))
    return results


def _rnode(d: int, repeat: int) -> list[Result]:
    import torch

    from ...models import torch as models
    from ...torch import value_and_divergence, value_divergence_and_frobenius

    f = models.ConcatSquashODE(d)
    t = torch.tensor(0.5)
    x = torch.randn(B, d, generator=torch.Generator().manual_seed(d)).requires_grad_()
    probes = torch.randn(1, B, d, generator=torch.Generator().manual_seed(1))
    both = value_divergence_and_frobenius(lambda x: f(t, x), method="hutchinson", num_probes=1)
    alone = value_and_divergence(lambda x: f(t, x), method="hutchinson", num_probes=1)

    def rnode() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = f(t, x)
        g = torch.autograd.grad(y, x, probes[0], create_graph=True)[0]
        return y, (g * probes[0]).sum(1), g.square().sum(1)

    def step(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            y, div, *rest = fn()
            loss = y.square().mean() + div.mean() + sum(r.mean() for r in rest)
            loss.backward()

        return run

    fns = {
        "ours": step(lambda: both(probes, x)),
        "divergence": step(lambda: alone(probes, x)),
        "rnode": step(rnode),
    }
    _, div, sq = both(probes, x)
    _, ref_div, ref_sq = rnode()
    with torch.no_grad():
        err = float(max((div - ref_div).abs().max(), (sq - ref_sq).abs().max() / ref_sq.max()))
    times = interleaved_best_times(fns, repeat=repeat, min_time=0.02)
    case = f"FFJORD ODEfunc d={d}, B={B}, 1 probe, forward+backward (torch)"
    label = "value_divergence_and_frobenius(hutchinson)"
    return [
        Result(
            "R1",
            case,
            label,
            "value_and_divergence(hutchinson) alone",
            times["ours"],
            times["divergence"],
            target=1.10,
        ),
        Result(
            "R1",
            case,
            label,
            "RNODE's hand-written VJP code",
            times["ours"],
            times["rnode"],
            target=1.0,
            extra={"max_rel_diff": err},
        ),
    ]


def _sparse_frobenius(size: int, repeat: int) -> Result:
    import jax
    import jax.numpy as jnp

    from ...jax import squared_frobenius_norm
    from ...models import jax as models

    params = models.init_cnn(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, size, size, 3))
    ours = jax.jit(squared_frobenius_norm(models.cnn, 1, method="sparse"))

    def one(p: Any, xb: jax.Array) -> jax.Array:
        return models.cnn(p, xb[None])[0]

    dense = jax.jit(
        lambda p, x: jnp.sum(jax.vmap(jax.jacfwd(one, 1), (None, 0))(p, x) ** 2, (1, 2, 3, 4, 5, 6))
    )
    err = float(jnp.max(jnp.abs(ours(params, x) - dense(params, x)) / dense(params, x)))
    times = interleaved_best_times(
        {"ours": lambda: ours(params, x), "dense": lambda: dense(params, x)},
        repeat=repeat,
        min_time=0.0,
        settle=1,  # the dense Jacobian frees gigabytes between two calls of ours
    )
    return Result(
        "R2",
        f"3-layer CNN [8,{size},{size},3], exact squared Frobenius norm (JAX)",
        "squared_frobenius_norm(sparse)",
        "vmap(jacfwd) + sum of squares",
        times["ours"],
        times["dense"],
        kind="gain",
        target=20.0,
        extra={"max_rel_diff": err},
    )


def _residual_mlp(d: int) -> tuple[Callable[..., Any], Any]:
    import jax

    from ...models import jax as models

    params = models.init_mlp(jax.random.key(0), (d, 128, d))

    def flow(p: Any, x: jax.Array) -> jax.Array:
        return x + 0.5 * models.mlp(p, x)

    return flow, params


def _log_det(d: int, repeat: int) -> Result:
    import jax
    import jax.numpy as jnp

    from ...jax import log_abs_det

    flow, params = _residual_mlp(d)
    x = jax.random.normal(jax.random.key(1), (B, d))
    ours = jax.jit(log_abs_det(flow, 1))

    def one(p: Any, xb: jax.Array) -> jax.Array:
        return flow(p, xb[None])[0]

    brute = jax.jit(
        lambda p, x: jnp.linalg.slogdet(jax.vmap(jax.jacfwd(one, 1), (None, 0))(p, x))[1]
    )
    err = float(jnp.max(jnp.abs(ours(params, x) - brute(params, x))))
    times = interleaved_best_times(
        {"ours": lambda: ours(params, x), "brute": lambda: brute(params, x)},
        repeat=repeat,
        min_time=0.02,
    )
    return Result(
        "R3",
        f"residual MLP d={d}, B={B}, exact log|det J| (JAX)",
        "log_abs_det(exact)",
        "vmap(jacfwd) + slogdet",
        times["ours"],
        times["brute"],
        target=1.2,
        extra={"max_abs_diff": err},
    )


def _slq(size: int, keys: int) -> Result:
    """SLQ's calibration at ``d = 3 size^2``: ``keys`` independent draws on each of 2 samples,
    the fraction of the ``2 keys`` draws whose ``estimate +- 2 stderr`` covers the exact value,
    against the fraction a calibrated estimator (coverage :data:`TARGET`) falls below with
    probability under 1 % (a single draw misses 6 % of the time)."""
    import jax
    import numpy as np
    from scipy.stats import binom

    from ...jax import log_abs_det
    from ...models import jax as models

    params = models.init_cnn(jax.random.key(0))

    def flow(p: Any, x: jax.Array) -> jax.Array:
        return x + 0.2 * models.cnn(p, x)

    x = jax.random.normal(jax.random.key(1), (2, size, size, 3))
    exact = np.asarray(jax.jit(log_abs_det(flow, 1))(params, x))
    slq = jax.jit(log_abs_det(flow, 1, method="slq", num_probes=16, return_stderr=True))
    draws = [slq(key, params, x) for key in jax.random.split(jax.random.key(2), keys)]
    estimates = np.stack([np.asarray(e) for e, _ in draws])  # (keys, 2)
    stderrs = np.stack([np.asarray(s) for _, s in draws])
    z = np.abs(estimates - exact) / stderrs
    n = z.size
    # A bias smaller than one draw's stderr shows in the mean over the keys: its error in
    # units of its own stderr (reported, not a target: a finite number of Lanczos steps biases SLQ).
    pooled = (estimates.mean(0) - exact) / (np.sqrt((stderrs**2).mean(0)) / np.sqrt(keys))
    return Result(
        "R4",
        f"residual CNN d={size * size * 3}, B=2, SLQ (16 probes, 30 steps) vs exact, "
        f"{keys} keys (JAX)",
        "SLQ +- 2 stderr",
        "truth within (fraction of draws)",
        1.0,
        float(np.mean(z <= 2)),
        unit="coverage",
        kind="gain",
        target=float(binom.ppf(0.01, n, TARGET)) / n,
        extra={
            "draws": n,
            "mean_abs_z": float(z.mean()),
            "max_abs_z": float(z.max()),
            "exact": [float(v) for v in exact],
            "estimate_mean": [float(v) for v in estimates.mean(0)],
            "z_of_the_mean": [float(v) for v in pooled],
        },
    )
