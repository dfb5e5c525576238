"""The accelerators present, for the device tests of ``make test-gpu`` (marker ``accelerator``).

JAX: the platforms of ``jax.devices()`` other than ``cpu`` (``gpu``, ``tpu``); torch: ``cuda``
and ``mps`` where available. A framework that is not installed contributes none. With
``DIVJAC_ACCELERATOR_TESTS_ON_CPU=1`` the CPU is listed too, so that the tests' bodies run (and
are proven to run) on a machine without an accelerator.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

ON_CPU = os.environ.get("DIVJAC_ACCELERATOR_TESTS_ON_CPU") == "1"
ALL = os.environ.get("DIVJAC_ACCELERATOR_TESTS") == "all"  # every variant, not a selection
NONE_PRESENT = (
    "no {what} accelerator present (set DIVJAC_ACCELERATOR_TESTS_ON_CPU=1 to run these tests' "
    "bodies on the CPU)"
)


def jax_platforms() -> list[str]:
    """The platforms of JAX's default backend other than the CPU (and ``cpu`` under the switch)."""
    if importlib.util.find_spec("jax") is None:
        return []
    import jax

    found = sorted({d.platform for d in jax.devices()} - {"cpu"})
    return [*found, "cpu"] if ON_CPU else found


def torch_devices() -> list[str]:
    """``cuda`` and ``mps`` where torch has them (and ``cpu`` under the switch)."""
    if importlib.util.find_spec("torch") is None:
        return []
    import torch

    found = ["cuda"] if torch.cuda.is_available() else []
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return [*found, "cpu"] if ON_CPU else found


def params_of(devices: list[str], what: str) -> list[Any]:
    """``devices`` as pytest parameters; one skipped parameter saying why when there are none."""
    if devices:
        return devices
    return [pytest.param(None, marks=pytest.mark.skip(reason=NONE_PRESENT.format(what=what)))]


def spied_planner(monkeypatch: pytest.MonkeyPatch, *, on_accelerator: bool) -> list[dict[str, Any]]:
    """The planner's inputs and chunks from now on; on an accelerator the host's cache size
    must not be read."""
    from divjac._core import plan

    seen: list[dict[str, Any]] = []
    choose = plan.choose_chunk_size

    def spy(n_passes: int, bytes_per_pass: int, chunk_size: int | None, **kw: Any) -> int:
        chunk = choose(n_passes, bytes_per_pass, chunk_size, **kw)
        seen.append({"n_passes": n_passes, "bytes_per_pass": bytes_per_pass, **kw, "chunk": chunk})
        return chunk

    def no_host_cache() -> int:
        raise AssertionError("the host's cache bounds a chunk on an accelerator")

    monkeypatch.setattr(plan, "choose_chunk_size", spy)
    if on_accelerator:
        monkeypatch.setattr(plan, "host_cache_bytes", no_host_cache)
    return seen
