"""Second-order directional derivatives of a batched function, for many directions at once.

``second_order_sweep(f, x, directions)`` is the engine of the Laplacian and of the other
second-order operators: with directions ``v_k`` it gives ``f(x)``, the first-order terms
``J v_k`` and the second-order terms ``v_k^T H v_k`` (each, or their weighted sum). With the
unit basis the summed second-order term is the Laplacian; with a factor ``S`` of ``A = S S^T``
it is ``sum_ij A_ij d2f/dx_i dx_j``; with the indicators of a diagonal coloring of a sparse
Hessian it is again the Laplacian, in ``#colors`` directions.

This version is the generic reference: second-order Taylor mode (``jvp`` of ``jvp``) batched
over the directions with ``vmap``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["second_order_sweep"]


def second_order_sweep(
    f: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    directions: jax.Array,
    *,
    weights: jax.Array | None = None,
    collapse: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``f(x)``, ``J v_k`` and ``v_k^T H v_k`` of a batch-first function.

    Args:
        f: ``[B, *in] -> [B, *out]``, batch first, acting on each sample separately (the caller
            has checked coupling).
        x: the point, ``[B, *in]``.
        directions: ``[K, B, *in]``, or ``[K, 1, *in]`` for directions shared by all samples.
        weights: ``None`` (all 1), ``[K]`` or ``[K, B]``: the weight of each direction in the
            collapsed sum.
        collapse: return the weighted sum over ``k`` of the second-order terms (``[B, *out]``)
            instead of each of them (``[K, B, *out]``, unweighted).

    Returns:
        ``(y, first, second)``: ``y = f(x)`` ``[B, *out]``; ``first[k] = J v_k`` ``[K, B, *out]``;
        ``second`` as ``collapse`` says.
    """
    v = jnp.broadcast_to(directions, (directions.shape[0], *x.shape)).astype(x.dtype)

    def jet(vk: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        def first(p: jax.Array) -> tuple[jax.Array, jax.Array]:
            return jax.jvp(f, (p,), (vk,))

        (y, d1), (_, d2) = jax.jvp(first, (x,), (vk,))
        return y, d1, d2

    ys, d1, d2 = jax.vmap(jet)(v)
    y = ys[0]
    if not collapse:
        return y, d1, d2
    return y, d1, _weighted_sum(d2, weights)


def _weighted_sum(terms: Any, weights: jax.Array | None) -> jax.Array:
    """``sum_k w_k terms[k]`` with ``w`` of shape ``[K]`` or ``[K, B]`` (``None``: all 1)."""
    if weights is None:
        return terms.sum(0)
    w = weights.reshape(weights.shape + (1,) * (terms.ndim - weights.ndim)).astype(terms.dtype)
    return (w * terms).sum(0)
