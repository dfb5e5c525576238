"""Issue 23 (4): the chunk planner's estimate of one pass against the memory a pass takes.

A pass's bytes are measured as the growth of peak memory from chunk ``c1`` to chunk ``c2``,
divided by ``c2 - c1`` (what is not per pass, the function's own forward and the results,
cancels out). Each row's value is the planner's estimate / the measured bytes per pass
(target: within [0.5, 2]; the row passes at <= 2, the lower bound is in ``extra``), with the peaks
at both chunks (memory follows the chunk).

- JAX: XLA's temporaries of the compiled call (``memory_analysis().temp_size_in_bytes``,
  exact and deterministic), the divergence alone and ``jax.grad`` of a loss on it (whose chunks
  are checkpointed).
- PyTorch on CPU: ``divergence(method="sparse")`` + backward on the U-Net of
  :mod:`divjac.models.torch`, each chunk size in a fresh process, the peak resident memory of
  the second call (the first traces and detects) above the memory resident before it: the
  kernel's high-water mark (``VmHWM``) reset through ``/proc/self/clear_refs``, with glibc's
  mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so that every tensor above it is
  mapped on allocation and unmapped when freed: resident memory then follows live tensors.
  ``tracemalloc`` does not see torch's allocations, and torch keeps no allocator statistics on
  CPU. Linux only (skipped elsewhere).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ..._errors import InternalError
from ._harness import Result

_LOW, _HIGH = 0.5, 2.0


def _row(case: str, estimate: int, small: tuple[int, float], large: tuple[int, float]) -> Result:
    (c1, peak1), (c2, peak2) = small, large
    per_pass = (peak2 - peak1) / (c2 - c1)
    return Result(
        "-", case, "planner's estimate per pass", "measured per pass", float(estimate),
        per_pass, unit="bytes", kind="ratio", target=_HIGH,
        extra={
            "in_range": _LOW <= estimate / per_pass <= _HIGH if per_pass > 0 else False,
            f"peak_at_chunk_{c1}": peak1,
            f"peak_at_chunk_{c2}": peak2,
            "peak_ratio": peak2 / peak1 if peak1 else float("inf"),
        },
    )  # fmt: skip


def _spy_estimates() -> tuple[list[int], Callable[[], None]]:
    """Record the bytes per pass the planner is given (and a function undoing the spy)."""
    from ..._core import plan

    seen: list[int] = []
    choose = plan.choose_chunk_size

    def spy(n_passes: int, bytes_per_pass: int, chunk_size: int | None, **kw: Any) -> int:
        seen.append(bytes_per_pass)
        return choose(n_passes, bytes_per_pass, chunk_size, **kw)

    plan.choose_chunk_size = spy

    def undo() -> None:
        plan.choose_chunk_size = choose

    return seen, undo


def _jax_rows(quick: bool) -> list[Result]:
    import jax
    import jax.numpy as jnp

    from ...models import jax as models

    key = jax.random.key(0)
    cases: list[tuple[str, Callable[..., Any], Any, Any]] = [
        (
            "MLP 64-256-256-64, B=32",
            models.mlp,
            models.init_mlp(key, (64, 256, 256, 64)),
            jax.random.normal(key, (32, 64)),
        ),
        (
            "CNN 3x16ch on [8, 16, 16, 3]",
            models.cnn,
            models.init_cnn(key, channels=16),
            jax.random.normal(key, (8, 16, 16, 3)),
        ),
    ]
    if not quick:
        cases += [
            (
                "U-Net 8ch on [4, 16, 16, 3]",
                models.unet,
                models.init_unet(key),
                jax.random.normal(key, (4, 16, 16, 3)),
            ),
            (
                "concat-squash CNF d=16, B=64",
                lambda p, x: models.concat_squash(p, jnp.float32(0.3), x),
                models.init_concat_squash(key, 16),
                jax.random.normal(key, (64, 16)),
            ),
        ]

    seen, undo = _spy_estimates()
    rows = []
    try:
        for name, f, params, x in cases:
            for grad in (False, True):
                small, large = (_jax_temp_bytes(f, params, x, c, grad=grad) for c in (4, 8))
                what = "sparse divergence + jax.grad" if grad else "sparse divergence"
                rows.append(_row(f"JAX {name}, {what}", seen[-1], small, large))
    finally:
        undo()
    return rows


def _jax_temp_bytes(
    f: Callable[..., Any], params: Any, x: Any, chunk: int, *, grad: bool
) -> tuple[int, float]:
    """XLA's temporaries of ``divergence(f, 1, method="sparse", chunk_size=chunk)`` (under
    ``jax.grad`` of its sum with ``grad``)."""
    import jax
    import jax.numpy as jnp

    from ...jax import divergence

    def call(p: Any, x: Any) -> Any:
        return divergence(f, 1, method="sparse", chunk_size=chunk)(p, x)

    fn = jax.grad(lambda p, x: jnp.sum(call(p, x))) if grad else call
    analysis = jax.jit(fn).lower(params, x).compile().memory_analysis()
    if analysis is None:
        raise InternalError("XLA gave no memory analysis of the compiled call")
    return chunk, float(analysis.temp_size_in_bytes)


_TORCH_CHILD = """
import json, sys
from divjac.cli.bench.bench_memory_plan import _torch_peak
print(json.dumps(_torch_peak(*map(int, sys.argv[1:]))))
"""


def _torch_peak(chunk: int, batch: int, channels: int, size: int) -> dict[str, float]:
    """In a child process: the estimate per pass and the peak resident bytes of the second
    ``divergence(method="sparse")`` + backward of the U-Net at ``chunk``."""
    import torch

    from ...models import torch as models
    from ...torch import divergence

    params = models.init_unet(0, channels=channels, in_channels=1)
    leaves = [t for v in params.values() for t in (v if isinstance(v, tuple) else (v,))]
    for t in leaves:
        t.requires_grad_(requires_grad=True)
    x = torch.randn(batch, 1, size, size, generator=torch.Generator().manual_seed(1))
    div = divergence(lambda x: models.unet(params, x), method="sparse", chunk_size=chunk)
    seen, _ = _spy_estimates()
    div(x).sum().backward()  # traces and detects
    for t in leaves:
        t.grad = None
    with open("/proc/self/clear_refs", "w") as reset:
        reset.write("5")  # the high-water mark back to the resident memory now
    before = _status("VmRSS")
    div(x).sum().backward()
    return {"peak": _status("VmHWM") - before, "estimate": seen[-1]}


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise InternalError(f"/proc/self/status has no {field}")


def _torch_rows(quick: bool) -> list[Result]:
    size, channels, batch = (16, 4, 2) if quick else (32, 8, 2)
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    measured = []
    for chunk in (16, 64):
        ran = subprocess.run(
            [sys.executable, "-c", _TORCH_CHILD, str(chunk), str(batch), str(channels), str(size)],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        measured.append((chunk, json.loads(ran.stdout.strip().splitlines()[-1])))
    (c1, m1), (c2, m2) = measured
    case = f"torch U-Net {channels}ch {size}x{size}, B={batch}, sparse divergence + backward (RSS)"
    return [_row(case, int(m1["estimate"]), (c1, m1["peak"]), (c2, m2["peak"]))]


def run(quick: bool) -> list[Result]:
    installed = [name for name in ("jax", "torch") if importlib.util.find_spec(name) is not None]
    if not installed:  # jax's ImportError: the suite skips this module, as those of one framework
        importlib.import_module("jax")
    rows = _jax_rows(quick) if "jax" in installed else []
    if "torch" in installed and os.path.exists("/proc/self/clear_refs"):
        rows += _torch_rows(quick)
    return rows
