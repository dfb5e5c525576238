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


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(0)
