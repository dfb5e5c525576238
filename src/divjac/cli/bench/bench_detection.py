"""P10 and the first call: sparsity detection time vs batch and image size, both backends, asdex.

The 3-layer 3x3 CNN of :mod:`divjac.models` (16 channels, ``tanh``) on ``B`` images of
``H x H x 3`` (JAX ``NHWC``, PyTorch ``NCHW``): ``divjac.jax.sparsity`` and
``divjac.torch.sparsity`` timed fresh (every cache cleared before each call; the process-wide
warm-up, e.g. PyTorch importing ``torch._dynamo`` for ``make_fx``, is paid once before the
timings: the memory rows report it, ``first_detection_in_process_s``), side by side at each
size, against asdex's ``jacobian_sparsity`` on one sample (asdex has no batch). The peak host memory of one detection
at ``256 x 256 x 3`` is measured in a fresh subprocess per backend (the most ``tracemalloc``
saw allocated at once during it, past imports and a small warm-up detection; with the
process's ``ru_maxrss``, which the imports alone may set).

A size whose detection takes too long (``TIME_CAP``) is not run at the larger batches (each
costs at least what the previous batch cost): the cases not run are listed in the rows'
``extra``. asdex is not run past the first image size it takes that long on.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..._errors import DetectionMemoryError
from ._harness import Result

BATCHES = (1, 2, 8, 64, 256, 1024)
SIZES = (32, 64, 128, 256)
QUICK_BATCHES = (1, 2, 8)
QUICK_SIZES = (8, 16)
MEMORY_SIZE = 256
QUICK_MEMORY_SIZE = 64
MEMORY_BUDGET_MIB = 1024.0
# A detection slower than this (seconds) stops the larger batches of its size and backend.
TIME_CAP = 60.0
QUICK_TIME_CAP = 5.0

Detect = Callable[[int, int], float]


def run(quick: bool) -> list[Result]:
    batches, sizes = (QUICK_BATCHES, QUICK_SIZES) if quick else (BATCHES, SIZES)
    cap = QUICK_TIME_CAP if quick else TIME_CAP
    repeat = 1 if quick else 2
    backends = {
        name: make()[0]
        for name, make in (("jax", _jax), ("torch", _torch))
        if importlib.util.find_spec(name) is not None
    }
    times: dict[tuple[str, int, int], float] = {}
    skipped: dict[str, list[str]] = {name: [] for name in backends}
    for size in sizes:
        slow: set[str] = set()
        for batch in batches:
            for name, detect in backends.items():  # interleaved: the same load for both
                if name in slow:
                    skipped[name].append(f"B={batch} {size}x{size}")
                    continue
                try:
                    t = _fresh_time(functools.partial(detect, batch, size), repeat)
                except DetectionMemoryError:
                    slow.add(name)
                    skipped[name].append(f"B={batch} {size}x{size} (memory budget)")
                    continue
                times[name, batch, size] = t
                if t > cap:
                    slow.add(name)
    asdex = _asdex_times(sizes, repeat, cap) if importlib.util.find_spec("asdex") else {}
    results = _time_rows(times, asdex, batches, sizes, skipped, cap)
    memory_size = QUICK_MEMORY_SIZE if quick else MEMORY_SIZE
    results += [_memory_row(name, memory_size) for name in backends]
    return results


def _fresh_time(fn: Callable[[], float], repeat: int) -> float:
    """Best of ``repeat`` fresh detections (each clears the caches; see the backends)."""
    best = fn()
    for _ in range(repeat - 1):
        if best > 2.0:  # slow enough to time once
            break
        best = min(best, fn())
    return best


def _jax() -> tuple[Detect, float]:
    """The timed fresh detection, and the first detection of the process (8x8, seconds)."""
    import jax
    import jax.numpy as jnp

    from ...jax import clear_caches, sparsity
    from ...models import jax as models

    params = models.init_cnn(jax.random.key(0), channels=16, layers=3)
    rng = np.random.default_rng(0)

    def detect(batch: int, size: int) -> float:
        x = jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32)
        clear_caches()
        start = time.perf_counter()
        sparsity(models.cnn, argnums=1)(params, x)
        return time.perf_counter() - start

    return detect, detect(1, 8)  # the process-wide warm-up


def _torch() -> tuple[Detect, float]:
    """As :func:`_jax`; the first detection imports ``torch._dynamo`` (``make_fx`` needs it)."""
    import torch

    from ...models import torch as models
    from ...torch import clear_caches, sparsity

    params = models.init_cnn(0, channels=16, layers=3)
    gen = torch.Generator().manual_seed(0)

    def detect(batch: int, size: int) -> float:
        x = torch.randn(batch, 3, size, size, generator=gen)
        clear_caches()
        start = time.perf_counter()
        sparsity(models.cnn, argnums=1)(params, x)
        return time.perf_counter() - start

    return detect, detect(1, 8)  # the process-wide warm-up


def _asdex_times(sizes: tuple[int, ...], repeat: int, cap: float) -> dict[int, float]:
    """asdex's ``jacobian_sparsity`` of one sample (flat in, flat out), at every size up to
    the first one slower than ``cap`` seconds."""
    import asdex
    import jax
    import jax.numpy as jnp

    from ...models import jax as models

    params = models.init_cnn(jax.random.key(0), channels=16, layers=3)
    times = {}
    for size in sizes:
        shape = (1, size, size, 3)
        flat = lambda v, shape=shape: models.cnn(params, v.reshape(shape)).reshape(-1)  # noqa: E731
        v = jnp.zeros(size * size * 3, jnp.float32)

        def once(flat: Any = flat, v: Any = v) -> float:
            start = time.perf_counter()
            asdex.jacobian_sparsity(flat, v)
            return time.perf_counter() - start

        times[size] = _fresh_time(once, repeat)
        if times[size] > cap:
            break
    return times


def _time_rows(
    times: dict[tuple[str, int, int], float],
    asdex: dict[int, float],
    batches: tuple[int, ...],
    sizes: tuple[int, ...],
    skipped: dict[str, list[str]],
    cap: float,
) -> list[Result]:
    results = []
    note = {
        "not_run": {name: found for name, found in skipped.items() if found},
        "cap_s": cap,
    }
    for size in sizes:
        for batch in batches:
            jax_t, torch_t = times.get(("jax", batch, size)), times.get(("torch", batch, size))
            if jax_t is not None and torch_t is not None:
                # The target (torch within 1.5x of JAX) at 64x64 and 256x256, one image.
                target = 1.5 if batch == 1 and size in (64, 256) else None
                results.append(
                    Result(
                        "P10" if target else "-",
                        f"CNN B={batch} {size}x{size}x3, fresh detection",
                        "divjac.torch.sparsity", "divjac.jax.sparsity", torch_t, jax_t,
                        target=target, extra=note,
                    )
                )  # fmt: skip
            if jax_t is not None and size in asdex:
                results.append(
                    Result(
                        "-", f"CNN B={batch} {size}x{size}x3 vs one sample, fresh detection",
                        "divjac.jax.sparsity (the batch)", "asdex.jacobian_sparsity (1 sample)",
                        jax_t, asdex[size], extra=note,
                    )
                )  # fmt: skip
        for name in ("jax", "torch"):
            two, many = times.get((name, 2, size)), times.get((name, 64, size))
            if two is not None and many is not None and size == 32:
                results.append(
                    Result(
                        "P10", f"{name}: CNN {size}x{size}x3, detection at B=64 vs B=2",
                        "B=64", "B=2", many, two, target=1.3, extra=note,
                    )
                )  # fmt: skip
    return results


_MEMORY_SCRIPT = """
import json, resource, sys, tracemalloc
backend, size = sys.argv[1], int(sys.argv[2])
from divjac.cli.bench.bench_detection import _jax, _torch
detect, first = _jax() if backend == "jax" else _torch()  # imports, a small warm-up detection
tracemalloc.start()
seconds = detect(1, size)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak": peak, "rss_kib": rss, "seconds": seconds, "first": first}))
"""


def _memory_row(backend: str, size: int) -> Result:
    """Peak host memory of one detection, in a fresh process: what it allocates at most at
    once (``tracemalloc``: NumPy's and SciPy's arrays too), and the process's ``ru_maxrss``."""
    package = Path(__file__).resolve().parents[3]  # the folder holding the divjac package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, backend, str(size)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    peak = found["peak"] / (1 << 20)
    return Result(
        "-", f"{backend}: CNN B=1 {size}x{size}x3, host memory of one detection",
        "peak allocated (MiB)", "1 GiB", peak, MEMORY_BUDGET_MIB, unit="MiB",
        target=1.0 if size == MEMORY_SIZE else None,
        extra={
            "process_max_rss_mib": found["rss_kib"] / 1024,
            "seconds": found["seconds"],
            "first_detection_in_process_s": found["first"],  # 8x8, with the imports it needs
        },
    )  # fmt: skip
