"""The cost of a cache hit: what an eager call pays to know its cached detection is still valid.

JAX traces ``f`` at every eager call and looks its detections up by a fingerprint of the program
(see "Caching" in ``docs/how-it-works.md``): on a 10M-parameter MLP, that check against the eager
call of the same divergence, and the eager divergence against a hand-written eager
``vmap(jacfwd)`` + trace. Reported, no target (DESIGN.md has none; the reliability issue asks
for the number).
"""

from __future__ import annotations

import jax.numpy as jnp

import jax
from _harness import Result, interleaved_best_times
from divjac.jax import _detect, divergence
from divjac.models import jax as models


def run(quick: bool) -> list[Result]:
    sizes = (64, 2048, 2048, 64) if quick else (64, 2048, 2048, 2048, 64)
    params = models.init_mlp(jax.random.key(0), sizes)
    n_params = sum(p.size for p in jax.tree_util.tree_leaves(params))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    div = divergence(models.mlp, 1, method="sparse")  # detection cached after the first call

    def check() -> object:
        traced = _detect.trace(models.mlp, (params, x), {}, argnum=1, batch_axis=0, has_aux=False)
        return traced.detect(per_sample=True)

    def hand() -> jax.Array:
        jac = jax.vmap(jax.jacfwd(models.mlp, 1), (None, 0))(params, x)
        return jnp.trace(jac, axis1=1, axis2=2)

    t = interleaved_best_times(
        {"check": check, "call": lambda: div(params, x), "hand": hand},
        repeat=3 if quick else 7,
    )
    case = f"MLP {n_params / 1e6:.1f}M params, B=8, d=64, eager (no jit)"
    return [
        Result("-", case, "cache hit: trace + fingerprint + lookup", "the eager call",
               t["check"], t["call"], extra={"params": int(n_params)}),
        Result("-", case, "eager divergence (sparse, cached)", "eager vmap(jacfwd)+trace",
               t["call"], t["hand"]),
    ]  # fmt: skip
