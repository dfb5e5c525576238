"""The pairs of a sliding window come in CSR order, int32 where they fit, and composing them
with an input's own dependency sets needs no sparse product: the pattern of a stencil costs a
few times its own size on the host, not ten (issue 46: a 1024x1024 blur)."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest

import divjac._core.rules.conv  # noqa: F401  (the module; the package exports a function of its name)

window_pairs = sys.modules["divjac._core.rules.conv"].window_pairs


def reference_pairs(in_shape, window, strides, padding, base, dil):
    """Every (output, input) pair, element by element."""
    out_shape, pairs = [], set()
    for size, k, s, (lo, hi), b, d in zip(
        in_shape, window, strides, padding, base, dil, strict=True
    ):
        dilated = (size - 1) * b + 1
        out_shape.append(max((dilated + lo + hi - ((k - 1) * d + 1)) // s + 1, 0))
    for o in itertools.product(*(range(n) for n in out_shape)):
        for t in itertools.product(*(range(k) for k in window)):
            p = [
                oi * s + ti * d - lo
                for oi, ti, s, d, (lo, _) in zip(o, t, strides, dil, padding, strict=True)
            ]
            if all(
                0 <= pi < (n - 1) * b + 1 and pi % b == 0
                for pi, n, b in zip(p, in_shape, base, strict=True)
            ):
                pairs.add(
                    (
                        np.ravel_multi_index(o, out_shape),
                        np.ravel_multi_index(
                            [pi // b for pi, b in zip(p, base, strict=True)], in_shape
                        ),
                    )
                )
    return tuple(out_shape), pairs


@pytest.mark.parametrize(
    ("in_shape", "window", "strides", "padding", "base", "dil"),
    [
        ((9, 7), (3, 5), (1, 1), ((1, 1), (2, 2)), (1, 1), (1, 1)),
        ((8, 6), (3, 2), (2, 3), ((0, 2), (1, 0)), (1, 1), (2, 1)),
        ((5, 4, 3), (2, 3, 1), (1, 2, 1), ((1, 0), (0, 2), (0, 0)), (2, 1, 1), (1, 1, 1)),
        ((4,), (7,), (1,), ((0, 0),), (1,), (1,)),  # a window larger than the input: no pair
    ],
)
def test_window_pairs_are_the_pairs_in_csr_order(in_shape, window, strides, padding, base, dil):
    out_shape, rows, cols = window_pairs(in_shape, window, strides, padding, base, dil)
    want_shape, want = reference_pairs(in_shape, window, strides, padding, base, dil)
    assert out_shape == want_shape
    assert set(zip(rows.tolist(), cols.tolist(), strict=True)) == want
    assert len(rows) == len(want)
    assert rows.dtype == cols.dtype == np.int32
    order = np.lexsort((cols, rows))
    np.testing.assert_array_equal(order, np.arange(len(rows)))  # already sorted, no duplicate


def test_window_pairs_of_a_large_window_are_made_in_blocks(monkeypatch: pytest.MonkeyPatch):
    conv = sys.modules["divjac._core.rules.conv"]
    args = ((23, 19), (5, 4), (1, 2), ((2, 2), (1, 2)))
    whole = window_pairs(*args)
    monkeypatch.setattr(conv, "_PAIRS_BLOCK", 7)
    blocked = window_pairs(*args)
    assert whole[0] == blocked[0]
    np.testing.assert_array_equal(whole[1], blocked[1])
    np.testing.assert_array_equal(whole[2], blocked[2])
