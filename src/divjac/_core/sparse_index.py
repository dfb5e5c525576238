"""The static index of a sweep that stores first-order terms sparse (both frameworks).

An intermediate ``z`` of shape ``S`` (batch included) carries first-order terms ``[m, *S]`` and
an index ``idx`` ``[m, *S]`` of NumPy integers: ``terms[j][e]`` is ``dz_e / dx_{idx[j][e]}``
(``x``'s per-sample position), ``-1`` where ``e`` depends on fewer than ``m`` inputs (a zero
term). The index is computed once per program from its structure; these are its operations.
"""

from __future__ import annotations

import numpy as np

__all__ = ["compressed", "positions", "union"]


def union(stacked: np.ndarray) -> np.ndarray:
    """``[m, *S]``: per element, the distinct inputs of ``stacked`` ``[M, *S]`` in increasing
    order, ``-1`` after them (at least one slot; all ``-1`` where ``M`` is 0, a sum over an
    empty axis)."""
    core, shape = compressed(stacked)
    if core.shape[0] == 0:
        return np.full((1, *shape), -1, np.int64)
    top = np.iinfo(np.int64).max
    a = np.sort(np.where(core < 0, top, core.astype(np.int64)), axis=0)
    a[1:][a[1:] == a[:-1]] = top
    a.sort(axis=0)
    m = max(int((a != top).sum(0).max(initial=0)), 1)
    a = a[:m]
    a[a == top] = -1
    return np.broadcast_to(a, (m, *shape))


def compressed(a: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """``a`` with its axes (past the first) along which it is constant cut to length 1, and its
    shape past the first axis (broadcasting the result back restores it)."""
    core = a
    for axis in range(1, a.ndim):
        if core.shape[axis] > 1:
            first = np.take(core, [0], axis=axis)
            if (core == first).all():
                core = first
    return core, tuple(a.shape[1:])


def positions(have: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Where the terms indexed by ``have`` ``[m, *S]`` go to be indexed by ``want`` ``[m', *S]``
    (per element a superset of ``have``'s inputs): ``[m', *core]`` (``S`` with the axes along
    which both are constant cut to one), the slot of ``have`` holding ``want``'s input, ``m``
    (a zero term appended after them) where ``have`` has none."""
    m = have.shape[0]
    both, _ = compressed(
        np.concatenate([have, np.broadcast_to(want, (want.shape[0], *have.shape[1:]))])
    )
    held, wanted = both[:m], both[m:]
    pos = np.full(wanted.shape, m, np.int64)
    for j in range(m):
        pos[(wanted == held[j]) & (wanted >= 0)] = j
    return pos
