"""Shared test configuration: float64 references, hypothesis profiles, optional frameworks."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("default", deadline=None, max_examples=25, print_blob=True)
settings.register_profile("thorough", deadline=None, max_examples=200, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

try:
    import jax

    jax.config.update("jax_enable_x64", True)
except ImportError:  # pragma: no cover - the jax extra is not installed
    pass


def pytest_configure(config: pytest.Config) -> None:
    """One BLAS/OpenMP thread per xdist worker: the workers already fill the cores, and
    OpenBLAS's spinning threads in two processes on two cores slowed batched ``eigh`` and
    matrix-vector products (SLQ's calibration cells) more than 4x. Set before the workers start,
    so that they inherit it; a value the caller set is kept."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, "1")
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""))


FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
"""XLA flags of the test runs: the tests compile thousands of small programs and run each a few
times, so compile time is most of the JAX suite's time; LLVM without its optimizing passes
compiles them ~1.6x faster (the pairwise context matrix: 113 s -> 71 s on one model) and runs
the same HLO, so the values are the same up to float round-off. Benchmarks never set them."""


def xla_flags(given: str) -> str:
    """``given`` with :data:`FAST_COMPILE` added, each flag the caller did not set."""
    flags = given.split()
    ours = [f for f in FAST_COMPILE if not any(g.startswith(f.split("=")[0] + "=") for g in flags)]
    return " ".join([*flags, *ours])


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)


def once_per_session(
    tmp_path_factory: pytest.TempPathFactory, name: str, compute, timeout_s: float = 900.0
):
    """``compute()`` (JSON-serializable) run once per test session, whatever the number of xdist
    workers: the first worker to ask computes it, the others wait for its file (a subprocess
    or process group that several workers would otherwise each start)."""
    import json
    import time

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this session
    done, claim = root / f"{name}.json", root / f"{name}.claim"
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another worker computes it
        deadline = time.monotonic() + timeout_s
        while not done.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"{name}: another test worker did not finish in {timeout_s:.0f} s")
            time.sleep(0.5)
        result = json.loads(done.read_text())
        if "__failed__" in result:
            pytest.fail(f"{name} failed in another test worker: {result['__failed__']}")
        return result
    os.close(fd)
    try:
        result = compute()
    except BaseException as err:
        done.write_text(json.dumps({"__failed__": repr(err)[-2000:]}))
        raise
    partial = done.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    partial.replace(done)  # atomic: a waiting worker never reads half a file
    return result
