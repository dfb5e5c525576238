"""Brute-force float64 references the tests compare against (slow, obviously correct)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


@contextlib.contextmanager
def torch_composed_norms() -> Iterator[None]:
    """Layer and instance normalizations written out as means and variances, for the torch
    references of derivatives above the first: torch's kernels have wrong higher derivatives
    (torch 2.13 and 2.14.1: ``F.layer_norm``'s third and fourth, forward and reverse, off by
    1-30 %, pytorch/pytorch#175754 and #196700; ``F.instance_norm``'s second forward
    derivative, through training-mode batch normalization, #186256 and #196699), which finite
    differences of the reference's own Hessian show. Their values are unchanged."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    def normalized(x: Any, dims: tuple[int, ...], eps: float) -> Any:
        centred = x - x.mean(dims, keepdim=True)
        return centred / torch.sqrt((centred * centred).mean(dims, keepdim=True) + eps)

    def affine(y: Any, weight: Any, bias: Any, shape: tuple[int, ...]) -> Any:
        y = y if weight is None else y * weight.reshape(shape)
        return y if bias is None else y + bias.reshape(shape)

    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # type: ignore[no-untyped-def]
        dims = tuple(range(input.ndim - len(normalized_shape), input.ndim))
        return affine(normalized(input, dims, eps), weight, bias, tuple(normalized_shape))

    def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,  # type: ignore[no-untyped-def]
                      use_input_stats=True, momentum=0.1, eps=1e-5):  # fmt: skip
        if not use_input_stats:
            return F.instance_norm(
                input, running_mean, running_var, weight, bias, False, momentum, eps
            )
        y = normalized(input, tuple(range(2, input.ndim)), eps)
        return affine(y, weight, bias, (-1,) + (1,) * (input.ndim - 2))

    composed = {F.layer_norm: layer_norm, F.instance_norm: instance_norm}

    class Composed(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return composed.get(func, func)(*args, **(kwargs or {}))

    with Composed():
        yield


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


def _coefficient(c: Any, xb: Any, b: int) -> float:
    """The coefficient of a term at sample ``b``: a number, a per-sample array ``(B,)``, or a
    function of the per-sample input ``xb``."""
    if callable(c):
        return float(c(xb))
    arr = np.asarray(c.detach() if hasattr(c, "detach") else c, dtype=np.float64)
    return float(arr if arr.ndim == 0 else arr[b])


def _combine(
    terms: list[tuple[Any, tuple[int, ...]]], partials: list[np.ndarray], samples: Any
) -> np.ndarray:
    """``sum_k c_k * partials[k]`` per sample (``samples``: the inputs, batch first)."""
    return sum(
        np.stack([_coefficient(c, samples[b], b) * p[b] for b in range(len(p))])
        for (c, _), p in zip(terms, partials, strict=True)
    )


def jax_partials(
    u: Callable[..., Any],
    args: tuple[Any, ...],
    alphas: list[tuple[int, ...]],
    argnum: int = 0,
    batch_axis: int = 0,
) -> list[np.ndarray]:
    """Per-sample mixed partials ``d^|alpha| u / dx_alpha`` (``alpha`` flat per-sample input
    indices with repetition) by nested dense ``jax.jacfwd`` of sample ``b``'s output w.r.t.
    sample ``b``'s flattened input, a Python loop over samples (the diagonal blocks by
    definition, also for functions that mix samples). One ``(B, *out_sample)`` array per alpha.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.moveaxis(args[argnum], batch_axis, 0)
    shape = x.shape[1:]
    order = max(len(a) for a in alphas)
    out: list[list[np.ndarray]] = [[] for _ in alphas]
    for b in range(x.shape[0]):

        def sample_out(flat: Any, b: int = b) -> Any:
            full = jnp.moveaxis(x.at[b].set(flat.reshape(shape)), 0, batch_axis)
            call = list(args)
            call[argnum] = full
            return jnp.moveaxis(u(*call), batch_axis, 0)[b]

        flat = x[b].reshape(-1)
        nested = [sample_out]
        for _ in range(order):
            nested.append(jax.jacfwd(nested[-1]))
        for i, alpha in enumerate(alphas):
            out[i].append(np.asarray(nested[len(alpha)](flat)[(..., *alpha)], np.float64))
    return [np.stack(o) for o in out]


def jax_operator(
    u: Callable[..., Any],
    args: tuple[Any, ...],
    terms: list[tuple[Any, tuple[int, ...]]],
    argnum: int = 0,
    batch_axis: int = 0,
) -> np.ndarray:
    """``sum_k c_k d^{alpha_k} u`` per sample from :func:`jax_partials` (float64 numpy)."""
    import jax.numpy as jnp

    partials = jax_partials(u, args, [a for _, a in terms], argnum, batch_axis)
    return _combine(terms, partials, jnp.moveaxis(args[argnum], batch_axis, 0))


def torch_partials(
    u: Callable[..., Any],
    args: tuple[Any, ...],
    alphas: list[tuple[int, ...]],
    argnum: int = 0,
) -> list[np.ndarray]:
    """:func:`jax_partials` in torch: nested ``torch.func.jacfwd`` per sample (batch first),
    normalizations composed (:func:`torch_composed_norms`)."""
    import torch
    from torch.func import jacfwd

    x = args[argnum].detach()
    shape = x.shape[1:]
    order = max(len(a) for a in alphas)
    out: list[list[np.ndarray]] = [[] for _ in alphas]
    for b in range(x.shape[0]):

        def sample_out(flat: Any, b: int = b) -> Any:
            full = torch.cat([x[:b], flat.reshape(shape)[None], x[b + 1 :]])
            call = list(args)
            call[argnum] = full
            return u(*call)[b]

        nested = [sample_out]
        for _ in range(order):
            nested.append(jacfwd(nested[-1]))
        with torch_composed_norms():
            for i, alpha in enumerate(alphas):
                value = nested[len(alpha)](x[b].reshape(-1))[(..., *alpha)]
                out[i].append(value.detach().to(torch.float64).numpy())
    return [np.stack(o) for o in out]


def torch_operator(
    u: Callable[..., Any],
    args: tuple[Any, ...],
    terms: list[tuple[Any, tuple[int, ...]]],
    argnum: int = 0,
) -> np.ndarray:
    """``sum_k c_k d^{alpha_k} u`` per sample from :func:`torch_partials` (float64 numpy)."""
    return _combine(terms, torch_partials(u, args, [a for _, a in terms], argnum), args[argnum])


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
