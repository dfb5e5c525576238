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
    return results
