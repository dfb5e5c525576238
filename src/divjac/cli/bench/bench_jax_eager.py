"""JAX transforms called eagerly (no ``jax.jit`` around them) against the same call jitted.

An eager call traces the function again where anything its last trace read may have changed
(``divjac.jax._trace_reuse``: here nothing, the weights being arguments) and runs one cached
compiled program; the target is eager / jit <= 1.3 on the built-in 3-layer CNN
(16 channels, tanh) on ``[8, 16, 16, 3]`` and on FFJORD's ODE function (concat-squash layers,
``d = 64``, ``B = 256``), float32. The jitted baseline takes the weights as arguments, as a
training loop does. An ODE solver passes the time as a Python float, a new one at every step:
that call against the same call with ``t`` a ``jnp`` scalar, target <= 1.2 (a float is a
weak-typed argument of the compiled program, not a constant that compiles a new one).
Medians of interleaved repeats (the machine may be loaded by others).
"""

from __future__ import annotations

import functools
import itertools
import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...jax import divergence, sparse_jacobian
from ...models import jax as models
from ._harness import Result, interleaved_times

_TARGET = 1.3
_FLOAT_TARGET = 1.2


def _medians(fns: dict[str, Callable[[], Any]], quick: bool) -> dict[str, float]:
    times = interleaved_times(fns, repeat=5 if quick else 11)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _eager_vs_jit(case: str, fn: Callable[..., Any], args: tuple[Any, ...], quick: bool) -> Result:
    jitted = jax.jit(fn)
    times = _medians(
        {"eager": functools.partial(fn, *args), "jit": functools.partial(jitted, *args)}, quick
    )
    return Result(
        id="P12",
        case=case,
        ours="divjac eager",
        baseline="jax.jit of the same call",
        ours_value=times["eager"],
        baseline_value=times["jit"],
        target=_TARGET,
    )


def _float_vs_scalar(case: str, fn: Callable[..., Any], params: Any, x: Any, quick: bool) -> Result:
    """``fn(params, t, x)`` with ``t`` a new Python float at every call, against a new ``jnp``
    scalar at every call."""
    floats = itertools.count(0.25, 1e-4)
    scalars = itertools.count(0.25, 1e-4)

    def with_float() -> Any:
        return fn(params, next(floats), x)

    def with_scalar() -> Any:
        return fn(params, jnp.float32(next(scalars)), x)

    times = _medians({"float": with_float, "jnp": with_scalar}, quick)
    return Result(
        id="P17",
        case=case,
        ours="t a new Python float",
        baseline="t a new jnp scalar",
        ours_value=times["float"],
        baseline_value=times["jnp"],
        target=_FLOAT_TARGET,
    )


def _cnn(quick: bool) -> list[Result]:
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
    return [
        _eager_vs_jit(f"eager call, CNN {list(shape)}: {name}", fn, (params, x), quick)
        for name, fn in transforms.items()
    ]


def _cnf(quick: bool) -> list[Result]:
    d, B = 64, 256
    params = models.init_concat_squash(jax.random.key(3), d)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((B, d)), jnp.float32)
    key = jax.random.key(5)
    hutchinson = divergence(models.concat_squash, 2, method="hutchinson", num_probes=1)

    def with_key(p: Any, t: Any, v: Any) -> Any:
        return hutchinson(key, p, t, v)

    transforms: dict[str, Callable[..., Any]] = {
        "exact divergence": divergence(models.concat_squash, 2, method="exact"),
        "sparse divergence": divergence(models.concat_squash, 2, method="sparse"),
        "hutchinson (1 probe)": with_key,
    }
    t = jnp.float32(0.5)
    results = [
        _eager_vs_jit(f"eager call, CNF d={d} B={B}: {name}", fn, (params, t, x), quick)
        for name, fn in transforms.items()
    ]
    for name in ("exact divergence", "hutchinson (1 probe)"):
        case = f"eager call, CNF d={d} B={B}: {name}, a new Python float t per call"
        results.append(_float_vs_scalar(case, transforms[name], params, x, quick))
    return results


def run(quick: bool) -> list[Result]:
    return [*_cnn(quick), *_cnf(quick)]
