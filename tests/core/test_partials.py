"""The interpolation weights of mixed partials (:mod:`divjac._core.partials`): exact in
rationals, checked against the expansion ``(v . grad)^d u = sum_|m|=d d!/m! v^m d^m u``."""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import product

import numpy as np
import pytest

from divjac._core import partials

COUNTS = [(1,), (4,), (1, 1), (2, 1), (1, 3), (2, 2), (1, 1, 1), (2, 1, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("counts", COUNTS)
def test_weights_pick_out_the_mixed_partial(counts):
    """``sum_v w_v d!/m! v^m`` is 1 at ``m = counts`` and 0 at every other ``|m| = d``: the
    combination of directional derivatives is the mixed partial, for every ``u``."""
    d, s = sum(counts), len(counts)
    weights = partials.interpolation(counts)
    assert all(w != 0 and math.gcd(*v) == 1 for v, w in weights.items())
    for m in product(range(d + 1), repeat=s):
        if sum(m) != d:
            continue
        multinomial = Fraction(math.factorial(d), math.prod(math.factorial(c) for c in m))
        got = sum(
            w * multinomial * math.prod(Fraction(a) ** b for a, b in zip(v, m, strict=True))
            for v, w in weights.items()
        )
        assert got == (1 if m == tuple(counts) else 0), m


def test_on_a_random_polynomial():
    """``d^2 u / dx0 dx1`` of a random quartic from its directional derivatives in floats."""
    rng = np.random.default_rng(0)
    coef = rng.normal(size=(5, 5))  # u = sum_ab coef_ab x0^a x1^b, a + b <= 4

    def directional(x, v, d):  # (v . grad)^d u at x by the binomial expansion of u(x + t v)
        total = 0.0
        for a, b in product(range(5), repeat=2):
            if a + b > 4 or a + b < d:
                continue
            # d^d/dt^d (x0 + t v0)^a (x1 + t v1)^b at t = 0
            for i in range(d + 1):
                j = d - i
                if i > a or j > b:
                    continue
                ta = math.perm(a, i) * v[0] ** i * x[0] ** (a - i)
                tb = math.perm(b, j) * v[1] ** j * x[1] ** (b - j)
                total += coef[a, b] * math.comb(d, i) * ta * tb
        return total

    x = rng.normal(size=2)
    exact = sum(
        coef[a, b] * a * b * x[0] ** (a - 1) * x[1] ** (b - 1)
        for a, b in product(range(5), repeat=2)
        if a + b <= 4 and a and b
    )
    got = sum(float(w) * directional(x, v, 2) for v, w in partials.interpolation((1, 1)).items())
    assert got == pytest.approx(exact, rel=1e-12)


def test_plan_groups_by_order_and_shares_directions():
    plans = partials.plan([(0, 0), (1, 1), (0, 1), (2, 2, 2, 2), (0,)], 3)
    assert [p.order for p in plans] == [1, 2, 4]
    second = plans[1]
    # u_xx, u_yy, u_xy share e0 and e1: 3 directions, not 5.
    assert len(second.directions) == 3
    assert second.weights.shape == (3, 5)
    assert np.allclose(second.weights[:, 3:], 0)
