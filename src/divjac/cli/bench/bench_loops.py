"""Sparsity detection of loops: a ``lax.scan`` against the same program with its steps written out.

Both give the same pattern (the scan rule is exact: the body's local pattern unrolled over the
steps); the scan follows the body once, the written-out program has every step's equations.
Cases: the 40-step local RNN of issue 14 (tridiagonal coupling), a rotating RNN (``jnp.roll``)
and a ``fori_loop`` of a one-sided stencil. Reported, no target; ``extra`` holds the densities.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from ._harness import Result, interleaved_best_times


def run(quick: bool) -> list[Result]:
    if importlib.util.find_spec("jax") is None:
        return []
    steps, width = (20, 8) if quick else (40, 16)
    return [_case(name, make, steps, width, 3 if quick else 5) for name, make in _cases().items()]


def _cases() -> dict[str, Callable[[Any, int], tuple[Callable[..., Any], tuple[int, ...]]]]:
    import jax.numpy as jnp
    from jax import lax

    def shift(h: Any, k: int) -> Any:
        pad = [(0, 0)] * (h.ndim - 1)
        return (
            jnp.pad(h[..., :-k], [*pad, (k, 0)]) if k > 0 else jnp.pad(h[..., -k:], [*pad, (0, -k)])
        )

    def scanned(step: Callable[[Any, Any], Any]) -> Callable[[Any, int], Any]:
        def make(scan: Any, steps: int) -> Any:
            def f(x: Any) -> Any:
                ys = scan(step, jnp.ones(x.shape[::2]), jnp.swapaxes(x, 0, 1))[1]
                return jnp.swapaxes(ys, 0, 1)

            return f

        return make

    def local(h: Any, xt: Any) -> Any:
        h = jnp.tanh(0.5 * h + 0.3 * shift(h, 1) + 0.2 * shift(h, -1) + xt)
        return h, h

    def rolled(h: Any, xt: Any) -> Any:
        h = jnp.sin(jnp.roll(h, 1, -1) + xt)
        return h, 2 * h

    def fori(scan: Any, steps: int) -> Any:
        body = lambda c: jnp.tanh(0.5 * shift(c, 1) + c)  # noqa: E731
        if scan is lax.scan:
            return lambda x: lax.fori_loop(0, steps, lambda i, c: body(c), x)

        def written(x: Any) -> Any:
            for _ in range(steps):
                x = body(x)
            return x

        return written

    return {"local RNN": scanned(local), "rotating RNN": scanned(rolled), "fori_loop": fori}


def _written_scan(f: Any, init: Any, xs: Any) -> Any:
    import jax.numpy as jnp

    carry, ys = init, []
    for t in range(xs.shape[0]):
        carry, y = f(carry, xs[t])
        ys.append(y)
    return carry, jnp.stack(ys)


def _case(name: str, make: Any, steps: int, width: int, repeat: int) -> Result:
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from ...jax import clear_caches, sparsity

    shape = (2, 4 * width) if name == "fori_loop" else (2, steps, width)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape))
    fns = {"scan": make(lax.scan, steps), "written": make(_written_scan, steps)}
    density = {k: float(sparsity(f)(x).density) for k, f in fns.items()}

    def detect(f: Any) -> Callable[[], Any]:
        def first_call() -> Any:
            clear_caches()
            return sparsity(f)(x)

        return first_call

    t = interleaved_best_times({k: detect(f) for k, f in fns.items()}, repeat=repeat)
    return Result(
        "-",
        f"JAX: {name}, {steps} steps, input {shape}",
        "sparsity of the loop",
        "sparsity of its steps written out",
        t["scan"],
        t["written"],
        extra={"density": density["scan"], "written_density": density["written"]},
    )
