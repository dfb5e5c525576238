"""The pairwise cover generator of the context matrices (:mod:`tests.pairwise`)."""

from __future__ import annotations

import itertools

import pytest

from tests.pairwise import all_pairs, each_value, missing_pairs

AXES = {
    "transform": [f"t{i}" for i in range(7)],
    "grad": ["grad", "no_grad", "inference", "enable_grad"],
    "dtype": ["float64", "float32"],
    "compiled": [False, True],
    "argument": ["plain", "reached", "functional", "equal", "in_place"],
}


def _no_compiled_t0(a: str, va: object, b: str, vb: object) -> bool:
    return not (a == "transform" and va == "t0" and b == "compiled" and vb)


@pytest.mark.parametrize("allowed", [None, _no_compiled_t0])
def test_every_allowed_pair_is_covered_by_allowed_rows(allowed) -> None:
    kwargs = {} if allowed is None else {"allowed": allowed}
    rows = all_pairs(AXES, **kwargs)
    assert not missing_pairs(AXES, rows, **kwargs)
    assert missing_pairs(AXES, rows[1:], **kwargs)  # and each row is needed for some pair
    if allowed is not None:
        for row in rows:
            for a, b in itertools.combinations(AXES, 2):
                assert allowed(a, row[a], b, row[b])
    full = 1
    for values in AXES.values():
        full *= len(values)
    assert 35 <= len(rows) <= 45 < full  # about 7 x 5, far below the product's 560
    assert rows == all_pairs(AXES, **kwargs)  # deterministic


def test_a_row_constraint_leaves_every_pair_to_other_rows() -> None:
    """A triple of values the plain cover holds (its first row's transform, grad mode and
    dtype) is in no row of the constrained cover; every pair is still held."""
    first = all_pairs(AXES)[0]
    triple = {name: first[name] for name in ("transform", "grad", "dtype")}

    def row_allowed(row: dict) -> bool:
        return any(row.get(name) != value for name, value in triple.items())

    rows = all_pairs(AXES, row_allowed=row_allowed)
    assert not missing_pairs(AXES, rows)
    assert all(row_allowed(row) for row in rows)


def test_each_value_holds_every_value_once_at_least() -> None:
    rows = each_value(AXES, _no_compiled_t0)
    assert len(rows) == 7
    for name, values in AXES.items():
        assert {row[name] for row in rows} == set(values)
    assert not any(row["transform"] == "t0" and row["compiled"] for row in rows)
