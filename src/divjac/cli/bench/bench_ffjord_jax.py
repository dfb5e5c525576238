"""The CNF hot path in JAX (the JAX half of :mod:`.bench_ffjord`, FFJORD's concat-squash ODE
function, ``B = 256``, float32, jitted): ``divjac.jax`` Hutchinson against a hand-written
``vmap`` of ``jax.jvp`` (F5), and a whole training step in diffrax (F6, where diffrax is
installed).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

from ._harness import Result, interleaved_best_times

B = 256


def run(quick: bool) -> list[Result]:
    repeat = 5 if quick else 15
    results = [_jax(d, repeat) for d in ((2, 64) if quick else (2, 64, 784))]
    for d in () if importlib.util.find_spec("diffrax") is None else (2,) if quick else (2, 64):
        results.append(_jax_training_step(d, 3 if quick else 7))
    return results


def _jax(d: int, repeat: int) -> Result:
    import jax
    import jax.numpy as jnp

    from ...jax import divergence as jdivergence
    from ...models import jax as jmodels

    params = jmodels.init_concat_squash(jax.random.key(0), d)
    x = jax.random.normal(jax.random.key(1), (B, d))
    probes = jax.random.rademacher(jax.random.key(2), (16, B, d), dtype=jnp.float32)
    t = jnp.float32(0.5)
    ours = jax.jit(jdivergence(jmodels.concat_squash, 2, method="hutchinson"))

    @jax.jit
    def hand(probes: jax.Array, params: Any, t: jax.Array, x: jax.Array) -> jax.Array:
        # Arguments, not constants: XLA would fold the whole forward pass of constants.
        def one(v: jax.Array) -> jax.Array:
            _, pushed = jax.jvp(lambda x: jmodels.concat_squash(params, t, x), (x,), (v,))
            return jnp.sum(pushed * v, axis=1)

        return jnp.mean(jax.vmap(one)(probes), axis=0)

    args = (probes, params, t, x)
    err = float(jnp.max(jnp.abs(ours(*args) - hand(*args))))
    times = interleaved_best_times(
        {"ours": lambda: ours(*args), "hand": lambda: hand(*args)}, repeat=repeat
    )
    return Result(
        "F5",
        f"concat-squash ODE d={d}, B={B}, 16 probes, jit (JAX)",
        "divergence(hutchinson)",
        "vmap(jax.jvp) Hutchinson",
        times["ours"],
        times["hand"],
        target=1.10,
        extra={"max_abs_diff": err},
    )


def _jax_training_step(d: int, repeat: int) -> Result:
    """A jitted CNF training step in diffrax (fixed-step Tsit5, 8 steps, Hutchinson with one
    fixed probe): divjac's ``value_and_divergence`` against a hand-written ``jax.jvp``."""
    import diffrax
    import jax
    import jax.numpy as jnp

    from ...jax import value_and_divergence as jvalue_and_divergence
    from ...models import jax as jmodels

    params = jmodels.init_concat_squash(jax.random.key(3), d)
    x = jax.random.normal(jax.random.key(4), (B, d))
    probe = jax.random.rademacher(jax.random.key(5), (B, d), dtype=jnp.float32)
    field = jvalue_and_divergence(jmodels.concat_squash, 2, method="hutchinson", num_probes=1)

    def ours(params: Any, t: jax.Array, z: jax.Array) -> tuple[jax.Array, jax.Array]:
        return field(probe, params, t, z)

    def hand(params: Any, t: jax.Array, z: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, pushed = jax.jvp(lambda z: jmodels.concat_squash(params, t, z), (z,), (probe,))
        return y, jnp.sum(pushed * probe, axis=1)

    def step(vector_field: Callable[..., Any]) -> Callable[[Any], Any]:
        def nll(params: Any) -> jax.Array:
            def dynamics(t: Any, state: Any, args: Any) -> Any:
                dz, div = vector_field(params, t, state[0])
                return dz, -div

            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(dynamics), diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=0.125,
                y0=(x, jnp.zeros(B)), stepsize_controller=diffrax.ConstantStepSize(),
            )  # fmt: skip
            z, minus = sol.ys[0][-1], sol.ys[1][-1]
            return jnp.mean(0.5 * jnp.sum(z**2, axis=1) - minus)

        return jax.jit(jax.value_and_grad(nll))

    runs = {"ours": step(ours), "hand": step(hand)}
    err = abs(float(runs["ours"](params)[0]) - float(runs["hand"](params)[0]))
    calls = {k: functools.partial(fn, params) for k, fn in runs.items()}
    t = interleaved_best_times(calls, repeat=repeat, min_time=0.0)
    return Result(
        "F6",
        f"CNF training step d={d}, B={B}: diffrax Tsit5 (8 steps) + grad, jit (JAX)",
        "value_and_divergence(hutchinson)",
        "hand-written jax.jvp",
        t["ours"],
        t["hand"],
        target=1.10,
        extra={"abs_diff_loss": err},
    )
