"""Brute-force float64 references the tests compare against (slow, obviously correct)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def jax_diagonal_blocks(
    f: Callable[..., Any], args: tuple[Any, ...], argnum: int = 0, batch_axis: int = 0
) -> np.ndarray:
    """Per-sample Jacobians ``d f(x)[b] / d x[b]`` by a Python loop over samples.

    Sample ``b`` of the input is replaced by a variable and sample ``b`` of the output is
    differentiated with dense ``jax.jacfwd``: the diagonal blocks of the batched Jacobian by
    definition, also for functions that mix samples. Shape ``(B, *out_sample, *in_sample)``.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.moveaxis(args[argnum], batch_axis, 0)
    blocks = []
    for b in range(x.shape[0]):

        def sample_out(xb: Any, b: int = b) -> Any:
            full = jnp.moveaxis(x.at[b].set(xb), 0, batch_axis)
            call = list(args)
            call[argnum] = full
            return jnp.moveaxis(f(*call), batch_axis, 0)[b]

        blocks.append(np.asarray(jax.jacfwd(sample_out)(x[b])))
    return np.stack(blocks)


def traces(blocks: np.ndarray, sample_shape: tuple[int, ...]) -> np.ndarray:
    """Traces of per-sample Jacobians ``(B, *s, *s)`` reshaped to ``(B, n, n)`` matrices."""
    n = int(np.prod(sample_shape))
    return np.trace(np.asarray(blocks).reshape(len(blocks), n, n), axis1=1, axis2=2)


def torch_diagonal_blocks(
    f: Callable[..., Any], args: tuple[Any, ...], argnum: int = 0
) -> np.ndarray:
    """Per-sample Jacobians by a loop over samples with ``torch.autograd.functional.jacobian``."""
    import torch

    x = args[argnum]
    blocks = []
    for b in range(x.shape[0]):

        def sample_out(xb: Any, b: int = b) -> Any:
            full = torch.cat([x[:b], xb[None], x[b + 1 :]])
            call = list(args)
            call[argnum] = full
            return f(*call)[b]

        blocks.append(torch.autograd.functional.jacobian(sample_out, x[b]).detach().numpy())
    return np.stack(blocks)


def block_architectures() -> dict[str, Any]:
    """The hypothesis strategies of the sparse sweeps' random networks (both frameworks):
    ``n`` blocks of ``dim`` inputs, a per-block layer of ``width``, an activation, then a
    pooling over the blocks or a FermiNet-like mixing (``pool``), and a seed."""
    from hypothesis import strategies as st

    return {
        "n": st.integers(2, 5),
        "dim": st.integers(1, 3),
        "width": st.integers(2, 6),
        "act": st.sampled_from(["tanh", "softplus", "sin"]),
        "pool": st.sampled_from(["sum", "mean", "max", "mix"]),
        "seed": st.integers(0, 2**16),
    }
