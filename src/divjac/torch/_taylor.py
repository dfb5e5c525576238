"""Second-order directional derivatives of a batched function, for many directions at once.

The torch twin of :mod:`divjac.jax._taylor` (same contract): ``f(x)``, the first-order terms
``J v_k`` and the second-order terms ``v_k^T H v_k`` (each, or their weighted sum) of a
batch-first function.

This version is the generic reference: second-order Taylor mode (``jvp`` of ``jvp``) batched
over the directions with ``torch.func.vmap``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import jvp, vmap

__all__ = ["second_order_sweep"]


def second_order_sweep(
    f: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    directions: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    collapse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        ``(y, first, second)`` as in :func:`divjac.jax._taylor.second_order_sweep`.
    """
    v = directions.to(x.dtype).expand(directions.shape[0], *x.shape)

    def jet(vk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def first(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return jvp(f, (p,), (vk,))

        (y, d1), (_, d2) = jvp(first, (x,), (vk,))
        return y, d1, d2

    ys, d1, d2 = vmap(jet)(v)
    y = ys[0]
    if not collapse:
        return y, d1, d2
    if weights is None:
        return y, d1, d2.sum(0)
    w = weights.to(d2.dtype).reshape(weights.shape + (1,) * (d2.ndim - weights.ndim))
    return y, d1, (w * d2).sum(0)
