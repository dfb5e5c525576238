"""P1, P2 and exact divergence in JAX: divjac vs hand-written vmap(jacfwd/jacrev) and full-batch jacfwd.

MLP ``d -> 256 -> 256 -> d`` (tanh), ``B = 64``, ``d`` in {16, 128}, float32, everything jitted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...jax import divergence, jacobian
from ...models import jax as models
from ._harness import Result, interleaved_best_times


def run(quick: bool) -> list[Result]:
    results: list[Result] = []
    for d in (16, 128):
        results += _case(d, repeat=3 if quick else 7)
    return results


def _case(d: int, repeat: int) -> list[Result]:
    params = models.init_mlp(jax.random.key(0), (d, 256, 256, d))
    x = jax.random.normal(jax.random.key(1), (64, d))
    f = models.mlp
    ours = jax.jit(jacobian(f, 1))
    vfwd = jax.jit(jax.vmap(jax.jacfwd(f, 1), (None, 0)))
    vrev = jax.jit(jax.vmap(jax.jacrev(f, 1), (None, 0)))

    def full(p, x):
        J = jax.jacfwd(f, 1)(p, x)  # (B, d, B, d): B^2 work, then the diagonal blocks
        return jax.vmap(lambda b: J[b, :, b, :])(jnp.arange(x.shape[0]))

    full_jit = jax.jit(full)
    div = jax.jit(divergence(f, 1, method="exact"))
    div_ref = jax.jit(
        lambda p, x: jnp.trace(jax.vmap(jax.jacfwd(f, 1), (None, 0))(p, x), axis1=1, axis2=2)
    )
    t = interleaved_best_times(
        {
            "ours": lambda: ours(params, x),
            "vfwd": lambda: vfwd(params, x),
            "vrev": lambda: vrev(params, x),
            "full": lambda: full_jit(params, x),
            "div": lambda: div(params, x),
            "div_ref": lambda: div_ref(params, x),
        },
        repeat=repeat,
    )
    best_hand = min(t["vfwd"], t["vrev"])
    hand = "vmap(jacfwd)" if t["vfwd"] <= t["vrev"] else "vmap(jacrev)"
    case = f"MLP d={d}, B=64"
    return [
        Result("P1", case, "jacobian", hand, t["ours"], best_hand, target=1.10),
        Result(
            "P2",
            case,
            "jacobian",
            "jacfwd(full batch)+diag",
            t["ours"],
            t["full"],
            kind="gain",
            target=20.0,
        ),
        Result(
            "P1-div",
            case,
            "divergence exact",
            "vmap(jacfwd)+trace",
            t["div"],
            t["div_ref"],
            target=1.10,
        ),
    ]
