"""P6 and the stochastic estimators in JAX: error at an equal matvec budget, probing, throughput.

(a) a linear map whose Jacobian is low-rank plus small noise (target: Hutch++ and XTrace >= 4x
lower relative RMS error than Hutchinson at 30 matvecs per sample); (b) a small MLP and a CNN
(reported); (c) probing vs Hutchinson at an equal number of passes on a small U-Net whose
receptive field is the whole 32x32x3 image (target >= 10x lower variance); (d) time per probe
vs one hand-written batched JVP (target <= 1.2x).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...jax import divergence
from ...models import jax as models
from ._harness import ESTIMATOR_BUDGET, Result, best_time, cost_rows, interleaved_best_times


def _draws(div, args, keys):
    """``div(k, *args)`` for every key, a bounded number of draws at once (memory)."""
    return jax.jit(lambda keys: jax.lax.map(lambda k: div(k, *args), keys, batch_size=20))(keys)


def _rms_errors(f, args, argnum, exact, methods, budget, n_keys):
    """Relative RMS error of each method over ``n_keys`` independent draws."""
    errors = {}
    keys = jax.random.split(jax.random.key(0), n_keys)
    scale = float(jnp.sqrt(jnp.mean(exact**2)))
    for method in methods:
        div = divergence(f, argnum, method=method, num_probes=budget)
        est = _draws(div, args, keys)
        errors[method] = float(jnp.sqrt(jnp.mean((est - exact) ** 2))) / scale
    return errors


def _accuracy_rows(case, errors, target):
    base = errors["hutchinson"]
    return [
        Result(
            "P6" if target else "-", case, m, "hutchinson (same budget)", errors[m], base,
            unit="rel. RMS error", kind="gain", target=target,
        )
        for m in ("hutch++", "xtrace")
    ]  # fmt: skip


def run(quick: bool) -> list[Result]:
    results: list[Result] = []
    n_keys = 100 if quick else 400
    budget = 30
    methods = ("hutchinson", "hutch++", "xtrace")

    # (a) low-rank plus noise, d = 200
    d, rank = 200, 5
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    A = jax.random.normal(k1, (d, rank)) @ jax.random.normal(k2, (rank, d)) / np.sqrt(d)
    A = A + 1e-3 * jax.random.normal(k3, (d, d))
    x = jax.random.normal(jax.random.key(2), (4, d))
    linear = lambda x, A: x @ A.T  # noqa: E731
    exact = jnp.trace(A) * jnp.ones(4)
    errors = _rms_errors(linear, (x, A), 0, exact, methods, budget, n_keys)
    results += _accuracy_rows("low-rank+noise d=200, 30 matvecs", errors, 4.0)

    # (b) an MLP and a CNN: reported, gains may be small
    params = models.init_mlp(jax.random.key(3), (64, 256, 64))
    xm = jax.random.normal(jax.random.key(4), (4, 64))
    exact = divergence(models.mlp, 1, method="exact")(params, xm)
    errors = _rms_errors(models.mlp, (params, xm), 1, exact, methods, budget, n_keys)
    results += _accuracy_rows("MLP 64-256-64, 30 matvecs", errors, None)
    cnn_params = models.init_cnn(jax.random.key(5), channels=8, layers=3)
    xc = jax.random.normal(jax.random.key(6), (2, 16, 16, 3))
    exact = divergence(models.cnn, 1, method="exact")(cnn_params, xc)
    errors = _rms_errors(models.cnn, (cnn_params, xc), 1, exact, methods, budget, n_keys)
    results += _accuracy_rows("CNN 16x16x3, 30 matvecs", errors, None)

    # (c) probing vs Hutchinson on a U-Net whose receptive field is the whole image
    unet_params = models.init_unet(jax.random.key(7), channels=8)
    xu = jax.random.normal(jax.random.key(8), (2, 32, 32, 3))
    exact = divergence(models.unet, 1, method="exact", chunk_size=256)(unet_params, xu)
    keys = jax.random.split(jax.random.key(9), 50 if quick else 200)
    for passes in (27, 48) if quick else (27, 48, 108):
        variances = {}
        for method in ("hutchinson", "probing"):
            div = divergence(models.unet, 1, method=method, num_probes=passes)
            est = _draws(div, (unet_params, xu), keys)
            variances[method] = float(jnp.mean((est - exact) ** 2))
        results.append(
            Result(
                "-", f"U-Net 32x32x3, {passes} passes", "probing", "hutchinson (same passes)",
                variances["probing"], variances["hutchinson"], unit="MSE", kind="gain",
                target=10.0,
            )
        )  # fmt: skip

    # (d) throughput: time per probe vs one hand-written batched JVP
    k = 16
    hutch = jax.jit(divergence(models.cnn, 1, method="hutchinson", num_probes=k))
    key = jax.random.key(10)
    v = jax.random.rademacher(key, xc.shape, xc.dtype)

    @jax.jit
    def one_jvp(params, x, v):
        _, t = jax.jvp(lambda x: models.cnn(params, x), (x,), (v,))
        return jnp.sum((t * v).reshape(x.shape[0], -1), axis=1)

    t_est = best_time(lambda: hutch(key, cnn_params, xc), repeat=5) / k
    t_jvp = best_time(lambda: one_jvp(cnn_params, xc, v), repeat=5)
    results.append(
        Result(
            "-", "CNN 16x16x3, per probe", f"hutchinson ({k} probes) / {k}",
            "one batched jax.jvp", t_est, t_jvp, target=1.2,
        )
    )  # fmt: skip
    results += cost_rows("JAX", _jax_costs(quick))
    return results


def _jax_costs(quick: bool) -> dict[str, dict[str, float]]:
    cases = {
        "CNN 3x3 16ch [8,32,32,3], n=3072": (
            models.cnn,
            models.init_cnn(jax.random.key(11), channels=16, layers=3),
        ),
        "U-Net 8ch [8,32,32,3], n=3072": (models.unet, models.init_unet(jax.random.key(12))),
    }
    x = jax.random.normal(jax.random.key(13), (8, 32, 32, 3))
    key = jax.random.key(14)
    times = {}
    for case, (f, params) in cases.items():
        fns = {}
        for method in ("hutchinson", "hutch++", "xtrace"):
            div = jax.jit(divergence(f, 1, method=method, num_probes=ESTIMATOR_BUDGET))
            fns[method] = lambda div=div, params=params: div(key, params, x)
        times[case] = interleaved_best_times(fns, repeat=3 if quick else 7, min_time=0.0)
    return times
