"""The cost of a cache hit: what an eager call pays to know its cached detection is still valid.

JAX traces ``f`` at every eager call and looks its detections up by a fingerprint of the
program; PyTorch checks guards on everything the function reaches (see "Caching" in
``docs/how-it-works.md``). On a 10M-parameter MLP, each check is timed against the eager call of
the same divergence (exact, detection cached after the first call). Reported, no target
(DESIGN.md has none; the reliability issue asks for the number).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ._harness import Result, interleaved_best_times

SIZES = (64, 2048, 2048, 2048, 64)  # 8.7M parameters
QUICK_SIZES = (64, 2048, 2048, 64)


def run(quick: bool) -> list[Result]:
    sizes = QUICK_SIZES if quick else SIZES
    repeat = 3 if quick else 7
    measures = {"jax": _jax, "torch": _torch}
    return [
        measure(sizes, repeat)
        for framework, measure in measures.items()
        if importlib.util.find_spec(framework) is not None
    ]


def _result(framework: str, n_params: int, t: dict[str, float]) -> Result:
    return Result(
        "-",
        f"{framework}: MLP {n_params / 1e6:.1f}M params, B=8, d=64, eager",
        "cache hit (the check alone)",
        "the eager exact divergence",
        t["check"],
        t["call"],
        extra={"params": n_params},
    )


def _timed(
    backend: Any, divergence: Any, f: Any, args: tuple[Any, ...], repeat: int
) -> dict[str, float]:
    div = divergence(f, 1, method="exact")

    def check() -> object:
        traced = backend.trace(f, args, {}, argnum=1, batch_axis=0, has_aux=False)
        return traced.detect(per_sample=False)

    return interleaved_best_times({"check": check, "call": lambda: div(*args)}, repeat=repeat)


def _jax(sizes: tuple[int, ...], repeat: int) -> Result:
    import jax

    from ...jax import divergence
    from ...jax._backend import BACKEND
    from ...models import jax as models

    params = models.init_mlp(jax.random.key(0), sizes)
    x = jax.random.normal(jax.random.key(1), (8, sizes[0]))
    n_params = sum(int(p.size) for p in jax.tree_util.tree_leaves(params))
    return _result("JAX", n_params, _timed(BACKEND, divergence, models.mlp, (params, x), repeat))


def _torch(sizes: tuple[int, ...], repeat: int) -> Result:
    import torch

    from ...models import torch as models
    from ...torch import divergence
    from ...torch._backend import BACKEND

    params = models.init_mlp(0, sizes, torch.float32)
    x = torch.randn(8, sizes[0])
    n_params = sum(int(p.numel()) for layer in params for p in layer)
    return _result(
        "PyTorch", n_params, _timed(BACKEND, divergence, models.mlp, (params, x), repeat)
    )
