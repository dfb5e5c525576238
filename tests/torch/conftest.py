"""Test settings of the PyTorch backend."""

from __future__ import annotations

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker: the workers already use every core, and
    # oversubscribed threads make the many small operations of these tests much slower.
    torch.set_num_threads(1)
