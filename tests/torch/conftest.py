"""Test settings of the PyTorch backend."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker: the workers already use every core, and
    # oversubscribed threads make the many small operations of these tests much slower.
    torch.set_num_threads(1)


def count_calls(monkeypatch, owner, name: str) -> list[int]:
    """``[n]``: the number of calls of ``owner.name`` from now on (patched for the test)."""
    count = [0]
    original = getattr(owner, name)

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return count


@pytest.fixture
def traces_made(monkeypatch):
    """The number of times a graph is traced (each miss of the cache traces once)."""
    from divjac.torch import _detect

    return count_calls(monkeypatch, _detect, "_trace_graph")


def pytest_collection_modifyitems(config, items):
    """Before torch 2.13 divjac refuses ``torch.compile`` (a :class:`~divjac.CompileError`,
    ``test_compile_is_refused_naming_the_release``, ``COMPILES`` checked by
    ``test_compiles_says_where_dynamo_falls_short``): the compiled cases are skipped there."""
    from divjac.torch._compat import COMPILES

    if COMPILES:
        return
    skip = pytest.mark.skip(reason=f"torch {torch.__version__} < 2.13: torch.compile refused")
    for item in items:
        compiled = item.path.name == "test_compile.py" or "-compiled" in item.name
        kept = ("refused_naming_the_release", "where_dynamo_falls_short")
        if compiled and not any(name in item.name for name in kept):
            item.add_marker(skip)
