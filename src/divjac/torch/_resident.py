"""Host arrays of a call's plan kept on the device of its passes.

A plan (kept with the trace, per context: :func:`~divjac.torch._backend._kept`) holds NumPy
index arrays and colorings. :func:`resident` makes each a tensor on a device once, while the
array lives, so that a steady-state call copies nothing from the host: on a GPU, each copy of
host data is a synchronous transfer at every step (a 64x64 image batch's sparse Jacobian
carries tens of MiB of indices).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from ._compile_setup import compiling

__all__: list[str] = []

_KEPT: dict[tuple[int, torch.device], tuple[weakref.ref[np.ndarray], torch.Tensor]] = {}


def resident(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` as a tensor on ``device``: one per host array and device, kept while the
    array lives (and made as a normal tensor under ``torch.inference_mode``: a later call may
    record a graph). Under ``torch.compile``: made in the trace, a constant of the graph."""
    if compiling():
        return torch.as_tensor(host, device=device)
    key = (id(host), device)
    found = _KEPT.get(key)
    if found is not None and found[0]() is host:
        return found[1]
    with torch.inference_mode(mode=False):
        tensor = torch.as_tensor(host, device=device)
    _KEPT[key] = (weakref.ref(host), tensor)
    # Dropped with the array (not at exit: the interpreter clears modules first).
    weakref.finalize(host, _KEPT.pop, key, None).atexit = False
    return tensor
