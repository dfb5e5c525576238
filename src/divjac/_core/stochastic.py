"""Planning the stochastic divergence methods, shared by the backends (NumPy only).

The backends draw the random vectors (JAX keys, torch generators) and run the matvecs; what is
decided here is the same in both: how many probes a method spends by default, which coloring
probing uses within its budget, whether user-given probes fit, and what to say when no source of
randomness was given.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._errors import MissingKeyError, NumProbesError
from . import coloring
from .detection import LRU
from .pattern import SparsityPattern

__all__ = [
    "DEFAULT_NUM_PROBES",
    "caller_shape",
    "check_probes_shape",
    "default_num_probes",
    "missing_randomness",
    "probing_plan",
]

DEFAULT_NUM_PROBES = {"hutchinson": 16, "hutch++": 15, "xtrace": 16, "probing": 16}
"""Default matvec budget per sample of each stochastic method."""


def default_num_probes(method: str, n: int) -> int:
    """The default budget of ``method`` for ``n`` input elements per sample.

    Hutch++ and XTrace are capped where their low-rank part would exceed ``n`` columns.

    Example:
        >>> default_num_probes("hutch++", 4), default_num_probes("hutchinson", 4)
        (12, 16)
    """
    num = DEFAULT_NUM_PROBES[method]
    if method == "hutch++":
        return min(num, 3 * n)
    if method == "xtrace":
        return min(num, 2 * n)
    return num


CHANNEL_AXIS_MAX = 4
"""Axes of at most this length (channels) are never split by probing's distance: the elements of
one pixel interact strongly and should not share a probe."""


def probing_plan(
    pattern: SparsityPattern | None,
    in_sample: Sequence[int],
    *,
    num_probes: int | None,
    probing_distance: coloring.Distance | None,
    need_stderr: bool = True,
) -> tuple[np.ndarray, bool, int]:
    """``(colors, exact, repetitions)`` of probing within the matvec budget.

    The exact diagonal coloring of the detected pattern is used when it fits the budget (probing
    is then exact). Otherwise elements are colored so that same-colored elements lie far apart on
    the per-sample grid (hierarchical probing, Stathopoulos, Laeuchli & Orginos 2013): the
    largest Chebyshev distance whose coloring fits the budget, short axes (channels, at most
    :data:`CHANNEL_AXIS_MAX` long) never split. One repetition uses all the budget's colors,
    unless a standard error is needed, which takes at least two repetitions.

    Args:
        pattern: the detected per-sample pattern of a batch-independent function, or ``None``
            (not detected, or the batch is coupled).
        in_sample: per-sample input shape (the lattice of distance-based colorings).
        num_probes: the matvec budget per sample (``None``: the default).
        probing_distance: color the pattern restricted to this Chebyshev distance instead of
            choosing it from the budget: an int (for every axis longer than
            :data:`CHANNEL_AXIS_MAX`) or one entry per axis (``None``: the whole axis).
        need_stderr: keep at least two repetitions so that a standard error can be computed.

    Returns:
        The color of each input element, whether the coloring is a valid diagonal coloring of
        the true pattern (probing is then exact), and the number of repetitions (random sign
        vectors) that fit the budget.
    """
    key = (id(pattern), tuple(in_sample), num_probes, probing_distance, need_stderr)
    cached = _PLANS.get(key)
    if cached is not None and cached[0] is pattern:
        return cached[1]
    plan = _probing_plan(pattern, in_sample, num_probes, probing_distance, need_stderr)
    _PLANS.put(key, (pattern, plan))
    return plan


# Recent probing plans (colorings cost more than the passes), by pattern identity and options.
_PLANS: LRU[tuple[SparsityPattern | None, tuple[np.ndarray, bool, int]]] = LRU(16)


def clear_plans() -> None:
    """Drop the cached probing plans."""
    _PLANS.clear()


def _probing_plan(
    pattern: SparsityPattern | None,
    in_sample: Sequence[int],
    num_probes: int | None,
    probing_distance: coloring.Distance | None,
    need_stderr: bool,
) -> tuple[np.ndarray, bool, int]:
    budget = num_probes or DEFAULT_NUM_PROBES["probing"]
    if probing_distance is None and pattern is not None and pattern.n_diagonal_colors <= budget:
        return pattern.diagonal_colors, True, 1
    csr = pattern.csr if pattern is not None and pattern.density < 0.5 else None
    whole = [a for a, size in enumerate(in_sample) if size <= CHANNEL_AXIS_MAX]
    if probing_distance is not None:
        distance = probing_distance
        if isinstance(distance, int):
            distance = tuple(None if a in whole else distance for a in range(len(in_sample)))
        local = (
            coloring.restrict_to_distance(csr, in_sample, distance)
            if csr is not None
            else coloring.lattice_pattern(in_sample, distance)
        )
        colors = coloring.diagonal_coloring(local)
    else:
        max_colors = max(budget // 2, 1) if need_stderr else budget
        colors, _ = coloring.probing_coloring(
            csr, in_sample, max_colors=max_colors, whole_axes=whole
        )
    n_colors = int(colors.max()) + 1
    exact = pattern is not None and coloring.is_valid_diagonal_coloring(pattern.csr, colors)
    return colors, exact, 1 if exact else max(budget // n_colors, 1)


def caller_shape(
    in_sample: Sequence[int], batch_size: int, batch_axis: int | None
) -> tuple[int, ...]:
    """The shape of the differentiated input as the caller passes it."""
    if batch_axis is None:
        return tuple(in_sample)
    shape = list(in_sample)
    shape.insert(batch_axis, batch_size)
    return tuple(shape)


def check_probes_shape(
    shape: Sequence[int],
    x_shape: Sequence[int],
    k: int | None,
    *,
    fname: str,
    shaped_as: str = "the differentiated input",
) -> bool:
    """Check the caller's ``probes`` of ``shape``; ``True`` when they lack the leading ``k`` axis.

    Probes have the shape ``x_shape`` of the array they are shaped as (one probe) or
    ``(k, *x_shape)``; ``k`` random vectors per sample are needed (``None``: any number).

    Raises:
        NumProbesError: the shape fits neither (a transposed array, say), or holds a number of
            probes other than ``k``.

    Example:
        >>> check_probes_shape((3, 4, 2), (4, 2), None, fname="divergence")
        False
        >>> check_probes_shape((2, 4), (4, 2), None, fname="divergence")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        divjac._errors.NumProbesError: divergence: probes must have shape (k, 4, 2) ...
    """
    shape, x_shape = tuple(shape), tuple(x_shape)
    single = shape == x_shape
    if single:
        shape = (1, *shape)
    if shape[1:] != x_shape:
        expected = ", ".join(map(str, x_shape))
        raise NumProbesError(
            f"{fname}: probes must have shape (k, {expected}) (k probes per sample, each of the "
            f"shape of {shaped_as}, {x_shape}) or {x_shape} (one probe); got an array of shape "
            f"{tuple(shape[1:]) if single else shape}. (A transposed or flattened array is not "
            "read as probes.)"
        )
    if k is not None and shape[0] != k:
        raise NumProbesError(
            f"{fname}: this method needs {k} random vectors per sample for the requested "
            f"num_probes; got {shape[0]} probes. Pass num_probes matching the probes "
            "(hutchinson: k, hutch++: 3k/2, xtrace: 2k, probing: repetitions) or draw k."
        )
    return single


def missing_randomness(fname: str, example: str, got: str) -> MissingKeyError:
    """The error for a stochastic method called without its randomness first.

    ``example`` is a source of randomness of the framework; ``got`` names what came first.

    Example:
        >>> str(missing_randomness("divergence", "jax.random.key(0)", "nothing"))[:41]
        'divergence: a stochastic method takes its'
    """
    return MissingKeyError(
        f"{fname}: a stochastic method takes its randomness as the first argument of the "
        f"transformed function, before f's own: call it as fn({example}, *args, **kwargs), or "
        f"pass your own probes first (a floating array of shape (k, *x.shape)); got {got}. "
        "(The same key or seed gives the same estimate: reuse it, or the probes, to keep the "
        "noise fixed, e.g. across an ODE solve. Keywords such as key= now reach f.)"
    )
