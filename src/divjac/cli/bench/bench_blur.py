"""The 11x11 'same' blur of one image: its sparse Jacobian at image sizes, against asdex.

Seed 002's function, ``jax.scipy.signal.convolve2d(img, kernel, mode="same")`` with the kernel
as an argument, through ``jit(divjac.jax.sparse_jacobian(batch_axis=None))`` and asdex's
``jacobian`` of the flattened function (jitted, as asdex is used), the kernel an argument of
both: closed over, the function is linear in a constant and XLA folds asdex's whole compressed
Jacobian into a constant at compile time (minutes of compiling, then a copy per call). Every
size and tool runs in a fresh subprocess, one at a time, which reports its colors, its first
call (detection, coloring and compilation), its best warm call and its peak resident memory
(``ru_maxrss``; each call's result is released before the next call, so that one is alive at a
time); the ratios compare runs made one after the other on the same machine. Full sizes:
256x256 and 512x512, and 1024x1024 with ``DIVJAC_BENCH_BLUR_1024=1`` (125 M nonzeros: minutes);
quick sizes: 64x64 and 128x128. Rows: warm time against asdex, first call against the warm
call, peak memory against the result's own size, the growth of the warm time in pixels, and a
batch ``[8, 128, 128]`` (one blur per image, per-sample Jacobians) against ``vmap`` of asdex.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax  # noqa: F401  (the rows run JAX in subprocesses: skipped without it, as the others)

from ..._errors import InternalError
from ._harness import Result

SIZES = (256, 512)
LARGE = 1024
QUICK_SIZES = (64, 128)
KERNEL = 11
BATCH = 8
BATCHED = 128

_SCRIPT = """
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
tool, size, kernel, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
from jax.scipy.signal import convolve2d
k = jnp.asarray(np.random.default_rng(0).uniform(size=(kernel, kernel)), jnp.float32)
img = jnp.asarray(np.random.default_rng(1).normal(size=(size, size)), jnp.float32)
batch = int(sys.argv[5])  # 0: one image; B: B images, one blur each, per-sample Jacobians
if batch:
    img = jnp.asarray(np.random.default_rng(1).normal(size=(batch, size, size)), jnp.float32)
found = {}
if tool == "divjac":
    from divjac.jax import sparse_jacobian, sparsity
    blur = lambda x, k: convolve2d(x, k, mode="same")
    if batch:
        blurs = jax.vmap(blur, in_axes=(0, None))
        fn = jax.jit(sparse_jacobian(blurs))
        count = lambda: sparsity(blurs)(img, k).n_colors
    else:
        fn = jax.jit(sparse_jacobian(blur, batch_axis=None))
        count = lambda: sparsity(blur, batch_axis=None)(img, k).n_colors
    call = lambda: fn(img, k)
else:
    import asdex
    flat = lambda v, k: convolve2d(v.reshape(size, size), k, mode="same").reshape(-1)
    start = time.perf_counter()
    jac = asdex.jacobian(flat, np.zeros(size * size, np.float32), np.asarray(k), argnums=0)
    fn = jax.jit(jax.vmap(jac, in_axes=(0, None)) if batch else jac)
    v = img.reshape(batch, -1) if batch else img.reshape(-1)
    call = lambda: fn(v, k)
    count = None
start = time.perf_counter() if tool == "divjac" else start
out = call()
jax.block_until_ready(out.data)
first = time.perf_counter() - start
warm = float("inf")
for _ in range(repeat):
    out = None  # the previous result, released: the peak is one call's
    start = time.perf_counter()
    out = call()
    jax.block_until_ready(out.data)
    warm = min(warm, time.perf_counter() - start)
found["nnz"] = int(out.nse)
found["result_mib"] = (out.data.nbytes + out.indices.nbytes) / 2**20
found["colors"] = count() if count else None
found.update(first=first, warm=warm, rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
print(json.dumps(found))
"""


def run(quick: bool) -> list[Result]:
    sizes: tuple[int, ...] = QUICK_SIZES if quick else SIZES
    if not quick and os.environ.get("DIVJAC_BENCH_BLUR_1024") == "1":
        sizes = (*sizes, LARGE)
    repeat = 2 if quick else 3
    results = []
    warm: dict[int, float] = {}
    for size in sizes:
        ours = _measure("divjac", size, repeat)
        theirs = _measure("asdex", size, repeat)
        warm[size] = ours["warm"]
        case = f"11x11 'same' blur, one {size}x{size} image ({ours['nnz']} nonzeros)"
        extra: dict[str, Any] = {
            "colors": ours["colors"],
            "first_call_s": ours["first"],
            "peak_rss_mib": ours["rss_mib"],
            "result_mib": ours["result_mib"],
            "asdex": theirs,
        }
        label = "jit(sparse_jacobian(batch_axis=None)), warm"
        results += [
            Result("P22", case, "first call (detection, coloring, compile)", "warm call",
                   ours["first"], ours["warm"], target=3.0 if size == 256 else None, extra=extra),
            Result("P22", case, "peak resident memory", "the result (values and indices)",
                   ours["rss_mib"], ours["result_mib"], unit="MiB",
                   target=2.0 if size >= SIZES[0] else None, extra=extra),
        ]  # fmt: skip
        if "error" in theirs:
            results.append(
                Result(
                    "P22", case, label, "(asdex failed)", ours["warm"], ours["warm"], extra=extra
                )
            )
            continue
        results += [
            Result("P22", case, label, "jit(asdex.jacobian), warm", ours["warm"], theirs["warm"],
                   target=1.0, extra=extra),
            Result("P22", case, "first call (detection, coloring, compile)",
                   "asdex first call (detection, coloring, compile)", ours["first"],
                   theirs["first"], extra=extra),
        ]  # fmt: skip
    small, large = sizes[0], sizes[-1]
    exponent = math.log(warm[large] / warm[small]) / math.log((large / small) ** 2)
    results.append(
        Result("P22", f"11x11 blur, warm time from {small}x{small} to {large}x{large}",
               "growth exponent in pixels", "linear (1)", exponent, 1.0, unit="exponent",
               target=1.1)
    )  # fmt: skip
    size = QUICK_SIZES[0] if quick else BATCHED
    ours = _measure("divjac", size, repeat, BATCH)
    theirs = _measure("asdex", size, repeat, BATCH)
    case = f"11x11 'same' blur, [{BATCH}, {size}, {size}], per-sample Jacobians"
    if "error" not in theirs:
        results.append(
            Result("P22", case, "jit(sparse_jacobian()), warm",
                   "jit(vmap(asdex.jacobian)), warm", ours["warm"], theirs["warm"], target=1.0,
                   extra={"colors": ours["colors"], "asdex": theirs})
        )  # fmt: skip
    return results


def _measure(tool: str, size: int, repeat: int, batch: int = 0) -> dict[str, Any]:
    """One tool at one size, in a fresh process (its peak memory is its own)."""
    package = Path(__file__).resolve().parents[3]  # the folder holding the divjac package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, tool, str(size), str(KERNEL), str(repeat), str(batch)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        if tool == "divjac":
            raise InternalError(
                f"divjac's blur at {size}x{size} (batch {batch}) failed:\n{done.stderr[-2000:]}"
            )
        return {"error": done.stderr.strip().splitlines()[-1][:300] if done.stderr else "failed"}
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found
