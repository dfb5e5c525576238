"""P8: memory of the exact divergence with ``chunk_size=c`` grows with ``c``, not with ``d``.

Peak temporary memory of the compiled computation (XLA's buffer assignment, exact and
deterministic), for an MLP ``d -> 256 -> d`` on a batch of 16, against the unchunked computation
and hand-written ``vmap(jacfwd)`` + trace. With chunking, memory is ``c`` passes of one batch
(about ``c * B * d`` numbers); without, it is all ``d`` passes at once (``B * d^2``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..._errors import InternalError
from ...jax import divergence
from ...models import jax as models
from ._harness import Result


def _temp_bytes(fn, *args) -> float:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    if analysis is None:
        raise InternalError("XLA gave no memory analysis of the compiled divergence")
    return float(analysis.temp_size_in_bytes)


def run(quick: bool) -> list[Result]:
    results = []
    chunk = 16
    for d in (256, 1024) if quick else (256, 1024, 4096):
        params = models.init_mlp(jax.random.key(0), (d, 256, d))
        x = jnp.ones((16, d))
        chunked = _temp_bytes(
            divergence(models.mlp, 1, method="exact", chunk_size=chunk), params, x
        )
        whole = _temp_bytes(divergence(models.mlp, 1, method="exact", chunk_size=d), params, x)
        hand = _temp_bytes(
            lambda p, x: jnp.trace(jax.vmap(jax.jacfwd(models.mlp, 1), (None, 0))(p, x), axis1=1, axis2=2),
            params, x,
        )  # fmt: skip
        per_pass = 16 * d * 4
        results.append(
            Result(
                "P8", f"MLP d={d}, B=16", f"chunk_size={chunk}", "vmap(jacfwd)+trace", chunked,
                hand, unit="bytes", kind="gain", target=None,
                extra={
                    "unchunked_bytes": whole,
                    "chunked_passes_in_flight": chunked / per_pass,
                    "unchunked_passes_in_flight": whole / per_pass,
                },
            )
        )  # fmt: skip
    results.append(_training(quick))
    return results


def _training(quick: bool) -> Result:
    """Issue 23 (4): the gradient of a loss on the sparse divergence of a CNN, whose chunks are
    rematerialized: XLA's temporaries at chunk 4 against chunk 16 (and unchunked)."""
    size, channels = (16, 16) if quick else (32, 32)
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(3, channels), (channels, channels), (channels, channels), (channels, 3)]
    params = [
        0.1 * jax.random.normal(k, (3, 3, a, b)) for k, (a, b) in zip(keys, shapes, strict=True)
    ]
    x = jax.random.normal(jax.random.key(1), (8, size, size, 3))

    def cnn(params, x):
        for i, w in enumerate(params):
            x = jax.lax.conv_general_dilated(
                x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            x = jnp.tanh(x) if i < len(params) - 1 else x
        return x

    def grad_at(chunk):
        def loss(params):
            return divergence(lambda x: cnn(params, x), method="sparse", chunk_size=chunk)(x).sum()

        return _temp_bytes(jax.grad(loss), params)

    small, large, whole = grad_at(4), grad_at(16), grad_at(10**6)
    return Result(
        "-", f"CNN 4x{channels}ch on [8, {size}, {size}, 3], sparse divergence + grad",
        "chunk_size=4", "chunk_size=16", small, large, unit="bytes", kind="gain", target=None,
        extra={"unchunked_bytes": whole},
    )  # fmt: skip
