"""Test settings of the PyTorch backend."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker: the workers already use every core, and
    # oversubscribed threads make the many small operations of these tests much slower.
    torch.set_num_threads(1)


@pytest.fixture
def traces_made(monkeypatch):
    """The number of times a graph is traced (each miss of the cache traces once)."""
    from divjac.torch import _detect

    count = [0]
    original = _detect._trace_graph

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(_detect, "_trace_graph", counting)
    return count
