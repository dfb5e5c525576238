"""JAX transforms called eagerly (no ``jax.jit`` around them) against the same call jitted.

An eager call traces the function again (so new weights and closures are always used) and runs
one cached compiled program; the target is eager / jit <= 1.3 on the built-in 3-layer CNN
(16 channels, tanh) on ``[8, 16, 16, 3]``, float32 (quick mode: fewer repeats; at smaller sizes
the ~4 ms of re-tracing per eager call dominates). The jitted
baseline takes the weights as arguments, as a training loop does. Best of interleaved repeats.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ...jax import divergence, sparse_jacobian
from ...models import jax as models
from ._harness import Result, interleaved_best_times

_TARGET = 1.3


def run(quick: bool) -> list[Result]:
    params = models.init_cnn(jax.random.key(0), channels=16, layers=3)
    shape = (8, 16, 16, 3)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    key = jax.random.key(2)
    hutchinson = divergence(models.cnn, 1, method="hutchinson", num_probes=8)

    def with_key(p: Any, v: Any) -> Any:
        return hutchinson(key, p, v)

    transforms: dict[str, Callable[..., Any]] = {
        "exact divergence": divergence(models.cnn, 1, method="exact"),
        "sparse divergence": divergence(models.cnn, 1, method="sparse"),
        "sparse_jacobian": sparse_jacobian(models.cnn, 1),
        "hutchinson (8 probes)": with_key,
    }
    results = []
    for name, fn in transforms.items():
        jitted = jax.jit(fn)
        times = interleaved_best_times(
            {
                "eager": functools.partial(fn, params, x),
                "jit": functools.partial(jitted, params, x),
            },
            repeat=3 if quick else 7,
        )
        results.append(
            Result(
                id="-",
                case=f"eager call, CNN {list(shape)}: {name}",
                ours="divjac eager",
                baseline="jax.jit of the same call",
                ours_value=times["eager"],
                baseline_value=times["jit"],
                target=_TARGET,
            )
        )
    return results
