"""The 11x11 'same' blur of one image: its sparse Jacobian at image sizes, against asdex.

Seed 002's function, ``jax.scipy.signal.convolve2d(img, kernel, mode="same")`` with the kernel
as an argument, through ``jit(divjac.jax.sparse_jacobian(batch_axis=None))`` and asdex's
``jacobian`` of the flattened function (jitted, as asdex is used), the kernel an argument of
both: closed over, the function is linear in a constant and XLA folds asdex's whole compressed
Jacobian into a constant at compile time (minutes of compiling, then a copy per call). Every
size and tool runs in a fresh subprocess, one at a time, which reports its colors, its first
call (detection, coloring and compilation), its best warm call and its peak resident memory
(``ru_maxrss``); the ratios compare runs made one after the other on the same machine. Full sizes: 256x256
and 512x512, and 1024x1024 with ``DIVJAC_BENCH_BLUR_1024=1`` (125 M nonzeros: minutes and
more than 6 GB of host memory); quick sizes: 64x64 and 128x128.
"""

from __future__ import annotations

import json
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

_SCRIPT = """
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
tool, size, kernel, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
from jax.scipy.signal import convolve2d
k = jnp.asarray(np.random.default_rng(0).uniform(size=(kernel, kernel)), jnp.float32)
img = jnp.asarray(np.random.default_rng(1).normal(size=(size, size)), jnp.float32)
found = {}
if tool == "divjac":
    from divjac.jax import sparse_jacobian, sparsity
    blur = lambda x, k: convolve2d(x, k, mode="same")
    fn = jax.jit(sparse_jacobian(blur, batch_axis=None))
    call = lambda: fn(img, k)
    count = lambda: sparsity(blur, batch_axis=None)(img, k).n_colors
else:
    import asdex
    flat = lambda v, k: convolve2d(v.reshape(size, size), k, mode="same").reshape(-1)
    start = time.perf_counter()
    jac = asdex.jacobian(flat, np.zeros(size * size, np.float32), np.asarray(k), argnums=0)
    fn = jax.jit(jac)
    v = img.reshape(-1)
    call = lambda: fn(v, k)
    count = None
start = time.perf_counter() if tool == "divjac" else start
out = call()
jax.block_until_ready(out.data)
first = time.perf_counter() - start
warm = float("inf")
for _ in range(repeat):
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
    for size in sizes:
        ours = _measure("divjac", size, repeat)
        theirs = _measure("asdex", size, repeat)
        case = f"11x11 'same' blur, one {size}x{size} image ({ours['nnz']} nonzeros)"
        extra: dict[str, Any] = {
            "colors": ours["colors"],
            "first_call_s": ours["first"],
            "peak_rss_mib": ours["rss_mib"],
            "result_mib": ours["result_mib"],
            "asdex": theirs,
        }
        label = "jit(sparse_jacobian(batch_axis=None)), warm"
        if "error" in theirs:
            results.append(
                Result(
                    "P22", case, label, "(asdex failed)", ours["warm"], ours["warm"], extra=extra
                )
            )
            continue
        results += [
            Result("P22", case, label, "jit(asdex.jacobian), warm", ours["warm"], theirs["warm"],
                   extra=extra),
            Result("P22", case, "first call (detection, coloring, compile)",
                   "asdex first call (detection, coloring, compile)", ours["first"],
                   theirs["first"], extra=extra),
        ]  # fmt: skip
    return results


def _measure(tool: str, size: int, repeat: int) -> dict[str, Any]:
    """One tool at one size, in a fresh process (its peak memory is its own)."""
    package = Path(__file__).resolve().parents[3]  # the folder holding the divjac package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, tool, str(size), str(KERNEL), str(repeat)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        if tool == "divjac":
            raise InternalError(f"divjac's blur at {size}x{size} failed:\n{done.stderr[-2000:]}")
        return {"error": done.stderr.strip().splitlines()[-1][:300] if done.stderr else "failed"}
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found
