"""Mixed partial derivatives as exact combinations of directional derivatives (pure NumPy).

A mixed partial of order ``d``, ``d^|i| u / dx^i`` for a multi-index ``i`` (``|i| = d``), is a
linear combination of the ``d``-th directional derivatives ``(v . grad)^d u`` along the integer
directions ``v`` with ``|v| = d`` supported on ``i``'s indices (Griewank, Utke & Walther 2000,
"Evaluating higher derivative tensors by forward propagation of univariate Taylor series",
Math. Comp. 69, section 3): with the Taylor coefficients ``f_j = (j . grad)^d u / d!``,

    ``d^i u = sum_j gamma_ij f_j``,
    ``gamma_ij = sum_{0 < k <= i} (-1)^{|i - k|} C(i, k) C(d k / |k|, j) (|k| / d)^d``,

binomials of multi-indices the products of their components' (the upper one rational). Each
direction is then reduced to its primitive vector ``j / g`` (``g = gcd(j)``), whose
derivative is ``g^-d`` times ``j``'s: the terms of an operator share their directions.

A linear operator ``sum_t c_t d^{alpha_t} u`` is planned per order: the distinct directions
of that order and, per term, each direction's weight (:func:`plan`); the coefficients ``c_t``
(numbers, per-sample arrays, functions of the input) multiply the weights where they are known.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import product

import numpy as np

__all__ = ["MAX_ORDER", "OrderPlan", "interpolation", "merged", "plan"]

MAX_ORDER = 4
"""The highest order of a mixed partial the transforms compute."""


def _binomial(top: Fraction, n: int) -> Fraction:
    """``C(top, n)`` for a rational ``top`` and a natural ``n``."""
    result = Fraction(1)
    for t in range(n):
        result *= (top - t) / (t + 1)
    return result


def _multi_indices(bound: Sequence[int]) -> list[tuple[int, ...]]:
    """The multi-indices ``0 <= k <= bound`` (componentwise)."""
    return list(product(*(range(b + 1) for b in bound)))


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """The multi-indices of ``parts`` natural numbers summing to ``total``."""
    if parts == 1:
        return [(total,)]
    return [
        (first, *rest)
        for first in range(total + 1)
        for rest in _compositions(total - first, parts - 1)
    ]


def interpolation(counts: Sequence[int]) -> dict[tuple[int, ...], Fraction]:
    """``d^i u / dx^i = sum_v w_v (v . grad)^d u`` for the multi-index ``i = counts`` (``d =
    sum(counts)``, each count positive): ``{v: w_v}`` over primitive integer directions ``v``
    (one component per count), the weights nonzero.
    """
    i = tuple(int(c) for c in counts)
    d = sum(i)
    weights: dict[tuple[int, ...], Fraction] = {}
    for j in _compositions(d, len(i)):
        gamma = Fraction(0)
        for k in _multi_indices(i):
            size = sum(k)
            if size == 0:
                continue
            sign = -1 if (d - size) % 2 else 1
            term = Fraction(sign * math.prod(math.comb(a, b) for a, b in zip(i, k, strict=True)))
            for jm, km in zip(j, k, strict=True):
                term *= _binomial(Fraction(d * km, size), jm)
            gamma += term * Fraction(size, d) ** d
        if gamma == 0:
            continue
        # d^i u = sum_j gamma_ij (j . grad)^d u / d!, j = g * v with v primitive.
        g = math.gcd(*j)
        v = tuple(c // g for c in j)
        weights[v] = weights.get(v, Fraction(0)) + gamma * g**d / math.factorial(d)
    return {v: w for v, w in weights.items() if w != 0}


@dataclass(frozen=True)
class OrderPlan:
    """The directions of one order of an operator and their weights per term.

    Attributes:
        order: the order ``d`` of the directional derivatives.
        directions: ``(K, n)`` integer directions in the flat per-sample input.
        weights: ``(K, T)``: ``weights[k, t]`` is direction ``k``'s weight in term ``t`` (zero
            for a term of another order), so that term ``t`` is
            ``sum_k weights[k, t] (v_k . grad)^d u``.
    """

    order: int
    directions: np.ndarray
    weights: np.ndarray


def plan(alphas: Sequence[Sequence[int]], n: int) -> list[OrderPlan]:
    """The plans of the orders of the terms ``d^{alpha_t} u`` (``alphas``: checked flat indices
    below ``n`` with repetition), in increasing order, each order's directions distinct."""
    by_order: dict[int, dict[tuple[int, ...], dict[int, Fraction]]] = {}
    for t, alpha in enumerate(alphas):
        support = sorted(set(alpha))
        counts = [list(alpha).count(s) for s in support]
        table = by_order.setdefault(len(alpha), {})
        for v, w in interpolation(counts).items():
            dense = [0] * n
            for s, c in zip(support, v, strict=True):
                dense[s] = c
            table.setdefault(tuple(dense), {})[t] = w
    plans = []
    for order in sorted(by_order):
        table = by_order[order]
        directions = np.array(list(table), dtype=np.int64).reshape(len(table), n)
        weights = np.zeros((len(table), len(alphas)))
        for k, per_term in enumerate(table.values()):
            for t, w in per_term.items():
                weights[k, t] = float(w)
        plans.append(OrderPlan(order, directions, weights))
    return plans


def merged(plan_: OrderPlan, constants: np.ndarray, colors: np.ndarray) -> OrderPlan:
    """``plan_`` with its weights folded with the terms' number coefficients ``constants``
    (weights ``(K', 1)``: one term) and, from order 2, its pure powers ``(a e_i . grad)^d u``
    merged per color of ``colors``, a diagonal coloring of the Hessian's pattern.

    Inputs ``i != j`` of one color have ``H_ij = 0`` wherever ``u`` is defined, so ``u`` is a
    sum of a function without ``x_j`` and one without ``x_i``, and every mixed partial of
    ``x_i`` and ``x_j`` is zero: ``(sum_i s_i e_i . grad)^d u = sum_i s_i^d d^d u/dx_i^d``
    over a color's inputs. The pure powers of one color (and, for an even ``d``, one sign of
    weight) become one direction ``sum_i |w_i|^(1/d) e_i`` (signed for an odd ``d``) of weight
    1 (or -1); the other directions are kept."""
    w = plan_.weights @ constants
    d = plan_.order
    nonzero = plan_.directions != 0
    pure = (nonzero.sum(1) == 1) & (w != 0) & (d > 1)
    kept = [(plan_.directions[k].astype(float), w[k]) for k in np.flatnonzero(~pure)]
    groups: dict[tuple[int, int], np.ndarray] = {}
    for k in np.flatnonzero(pure):
        (i,) = np.flatnonzero(nonzero[k])
        weight = w[k] * float(plan_.directions[k, i]) ** d  # of d^d u/dx_i^d
        sign = int(np.sign(weight)) if d % 2 == 0 else 1
        scale = (abs(weight) ** (1 / d)) * (1 if d % 2 == 0 else np.sign(weight))
        direction = groups.setdefault((int(colors[i]), sign), np.zeros(plan_.directions.shape[1]))
        direction[i] = scale
    kept += [(v, float(sign)) for (_, sign), v in groups.items()]
    n = plan_.directions.shape[1]
    directions = np.array([v for v, _ in kept]).reshape(len(kept), n)
    return OrderPlan(d, directions, np.array([[c] for _, c in kept]).reshape(len(kept), 1))
