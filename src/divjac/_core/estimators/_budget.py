"""The matvec budget of each method, probe preparation, and the dispatch by method name."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..._errors import InternalError, NumProbesError, OptionError
from ._common import Array, Matvec, check_probes, is_int, namespace
from .epperly2024xtrace import xtrace
from .hutchinson import hutchinson
from .meyer2020hutchpp import hutch_plus_plus

__all__ = [
    "DISTRIBUTIONS",
    "METHODS",
    "check_stderr_budget",
    "estimate_trace",
    "normalize_probes",
    "num_random_vectors",
]


METHODS: tuple[str, ...] = ("hutchinson", "hutch++", "xtrace")
"""The stochastic trace estimators, as named by ``divergence(method=...)``."""


DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "gaussian", "sphere")
"""The probe distributions :func:`normalize_probes` accepts."""


def num_random_vectors(
    method: str, num_probes: int | np.integer[Any], n: int | np.integer[Any]
) -> int:
    """Number of random vectors of length ``n`` per sample that a method needs.

    ``num_probes`` is the matvec budget per sample (the number of JVP passes). Hutchinson spends
    one matvec per random vector; Hutch++ spends ``num_probes / 3`` on the sketch ``J S``, as many
    on ``J Q`` and as many on the Hutchinson probes ``G`` (so ``2 * num_probes / 3`` random
    vectors, ``S`` then ``G``); XTrace spends two matvecs per random vector (``J Omega`` and
    ``J Q``).

    Args:
        method: ``"hutchinson"``, ``"hutch++"`` or ``"xtrace"``.
        num_probes: The matvec budget per sample: a positive integer for ``"hutchinson"``, a
            positive multiple of 3 for ``"hutch++"``, a positive even number for ``"xtrace"``.
        n: The number of input elements per sample (``J_b`` is ``n x n``).

    Returns:
        The number ``k`` of random vectors to draw: probes of shape ``(B, n, k)``.

    Raises:
        NumProbesError: ``num_probes`` does not fit the method, or the low-rank part of Hutch++
            (``num_probes / 3``) or XTrace (``num_probes / 2``) would exceed ``n``, in which case
            ``method="exact"`` (``n`` passes) is cheaper.
        OptionError: ``method`` is not a stochastic method.

    Example:
        >>> num_random_vectors("hutchinson", 10, n=100)
        10
        >>> num_random_vectors("hutch++", 30, n=100)
        20
        >>> num_random_vectors("xtrace", 30, n=100)
        15
    """
    if method not in METHODS:
        raise OptionError(
            f"method={method!r} is not a stochastic trace estimator: use one of "
            f"{', '.join(repr(m) for m in METHODS)}."
        )
    if not is_int(n) or n < 1:
        raise InternalError(f"num_random_vectors: n={n!r} must be a positive integer")
    divisor = {"hutchinson": 1, "hutch++": 3, "xtrace": 2}[method]
    needs = {
        "hutchinson": "a positive integer (1, 2, 3, ...)",
        "hutch++": "a positive multiple of 3 (3, 6, 9, ...)",
        "xtrace": "a positive even number (2, 4, 6, ...)",
    }[method]
    if not is_int(num_probes) or num_probes < 1 or num_probes % divisor:
        raise NumProbesError(
            f"num_probes={num_probes!r} is not accepted by method={method!r}: it needs {needs}."
        )
    num_probes = int(num_probes)
    rank = num_probes // divisor
    if method != "hutchinson" and rank > n:
        raise NumProbesError(
            f"num_probes={num_probes} is too large for method={method!r} with n={n} input "
            f"elements per sample: its low-rank part would have {rank} > n={n} columns. "
            f"Exact divergence is cheaper: method='exact' costs n={n} passes and has no error "
            f"(or use num_probes <= {divisor * n})."
        )
    return {"hutchinson": num_probes, "hutch++": 2 * rank, "xtrace": rank}[method]


def check_stderr_budget(method: str, num_probes: int, n: int, *, fname: str) -> None:
    """Refuse a standard error that would rest on a single stochastic term.

    One term ``v^T J v`` has no sample variance, and no bound computed from it holds: for a
    nearly rank-one ``J`` the probe can miss the dominant direction, and then both the term and
    its image ``J v`` are small (measured coverage of the single-term bound: 0.78-0.88,
    docs/calibration.md). Hutchinson needs 2 probes for a standard error, Hutch++ 6 matvecs,
    unless the budget pays for the exact trace. XTrace needs 3 test vectors (6 matvecs): its
    two leave-one-out terms at 4 matvecs share their test vectors, and their spread covered
    0.93 on small Hessians (PINN d = 5, a Gaussian bump).

    Raises:
        NumProbesError: ``num_probes`` leaves too few terms (``method`` and ``num_probes``
            are checked by :func:`num_random_vectors` first).

    Example:
        >>> check_stderr_budget("xtrace", 6, 16, fname="divergence")
        >>> check_stderr_budget("hutchinson", 1, 1, fname="divergence")  # exact: n = 1
    """
    k = num_random_vectors(method, num_probes, n)
    terms, exact = {
        "hutchinson": (k, k >= n),
        "hutch++": (k // 2, 3 * (k // 2) >= n),
        "xtrace": (k, 2 * k >= n),
    }[method]
    fewest = 3 if method == "xtrace" else 2
    if terms < fewest and not exact:
        least = {"hutchinson": 2, "hutch++": 6, "xtrace": 6}[method]
        raise NumProbesError(
            f"{fname}: return_stderr=True with method={method!r} needs num_probes >= {least}; "
            f"got num_probes={num_probes}, which leaves {terms} stochastic term(s), too few "
            "for a trustworthy error bar. Pass more probes, or return_stderr=False."
        )


def normalize_probes(raw: Array, distribution: str) -> Array:
    """Turn raw random draws into probes with ``E[v v^T] = I``.

    Args:
        raw: Random draws of shape ``(B, n, k)``, one probe per column: random signs (+-1) for
            ``"rademacher"``, standard normal for ``"gaussian"`` and ``"sphere"``.
        distribution: ``"rademacher"`` and ``"gaussian"`` return ``raw`` as it is; ``"sphere"``
            scales each column to norm ``sqrt(n)``, which makes standard normal draws uniform on
            the sphere of radius ``sqrt(n)`` (so ``E[v v^T] = I`` still holds).

    Returns:
        The probes, shape ``(B, n, k)``, same namespace and dtype as ``raw``.

    Raises:
        OptionError: ``distribution`` is not one of :data:`DISTRIBUTIONS`.
        NumProbesError: ``raw`` is not 3-d.
        InputDtypeError: ``raw`` does not have a real floating dtype.

    Example:
        >>> import numpy as np
        >>> raw = np.random.default_rng(0).standard_normal((2, 4, 3))
        >>> probes = normalize_probes(raw, "sphere")
        >>> np.allclose(np.linalg.norm(probes, axis=1), 2.0)
        True
    """
    if distribution not in DISTRIBUTIONS:
        raise OptionError(
            f"distribution={distribution!r} is not a probe distribution: use one of "
            f"{', '.join(repr(d) for d in DISTRIBUTIONS)}."
        )
    xp = namespace(raw)
    check_probes(raw, "raw", xp)
    if distribution != "sphere":
        return raw
    n = raw.shape[-2]
    norms = xp.linalg.vector_norm(raw, axis=-2, keepdims=True)
    return raw * (math.sqrt(n) / norms)


def estimate_trace(method: str, matvec: Matvec, probes: Array) -> tuple[Array, Array]:
    """Dispatch to the stochastic estimator named by ``method``.

    Args:
        method: ``"hutchinson"``, ``"hutch++"`` or ``"xtrace"``.
        matvec: Batched matvec, ``(B, n, k) -> (B, n, k)``, ``W[b] = J_b @ V[b]``.
        probes: ``(B, n, k)`` with ``k = num_random_vectors(method, num_probes, n)``.

    Returns:
        ``(estimate, stderr)``, each of shape ``(B,)``.

    Raises:
        OptionError: ``method`` is not one of :data:`METHODS`.

    Example:
        >>> import numpy as np
        >>> J = np.stack([np.eye(3), 2 * np.eye(3)])
        >>> probes = np.ones((2, 3, 2))
        >>> estimate_trace("hutchinson", lambda V: J @ V, probes)[0]
        array([3., 6.])
    """
    if method == "hutchinson":
        return hutchinson(matvec, probes)
    if method == "hutch++":
        return hutch_plus_plus(matvec, probes)
    if method == "xtrace":
        return xtrace(matvec, probes)
    raise OptionError(
        f"method={method!r} is not a stochastic trace estimator: use one of "
        f"{', '.join(repr(m) for m in METHODS)}."
    )
