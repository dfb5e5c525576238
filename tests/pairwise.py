"""All-pairs covers of test axes: every pair of values of any two axes in at least one row.

A full product of ``k`` axes of ``n`` values has ``n**k`` rows; a pairwise cover has about
``n**2`` (the product of the two largest axes, a few more by the greedy choice), and still
meets every interaction of two axes, where most context defects live (a transform under a
grad mode, a dtype with a compiled call, a method with a changed argument).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Row = dict[str, Any]
Allowed = Callable[[str, Any, str, Any], bool]
Cost = Callable[[Row], float]
"""The estimated cost of running a row (possibly partial: the axes chosen so far)."""
RowAllowed = Callable[[Row], bool]
"""Whether a (partial) row may be run: a constraint among three axes or more, which leaves
every pair of values to other rows."""


def _always(a: str, va: Any, b: str, vb: Any) -> bool:
    return True


def pairs_of(axes: Mapping[str, Sequence[Any]], allowed: Allowed = _always) -> set[tuple]:
    """The pairs ``((axis, index), (axis, index))`` a cover must hold: those ``allowed``."""
    names = list(axes)
    found = set()
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for (ia, va), (ib, vb) in itertools.product(enumerate(axes[a]), enumerate(axes[b])):
                if allowed(a, va, b, vb):
                    found.add(((a, ia), (b, ib)))
    return found


def _row_pairs(names: Sequence[str], row: Mapping[str, int]) -> set[tuple]:
    kept = [n for n in names if n in row]
    return {((a, row[a]), (b, row[b])) for i, a in enumerate(kept) for b in kept[i + 1 :]}


def _values(axes: Mapping[str, Sequence[Any]], indices: Mapping[str, int]) -> Row:
    """The values of a (partial) row given by their indices."""
    return {name: axes[name][i] for name, i in indices.items()}


def _unit(row: Row) -> float:
    return 1.0


def _any_row(row: Row) -> bool:
    return True


def all_pairs(
    axes: Mapping[str, Sequence[Any]],
    allowed: Allowed = _always,
    cost: Cost = _unit,
    row_allowed: RowAllowed = _any_row,
) -> list[Row]:
    """A deterministic greedy pairwise cover of ``axes`` (name -> values).

    Every allowed pair of values of two axes is in some row; every row is allowed pair by pair
    (``allowed(axis_a, value_a, axis_b, value_b)``, a constraint between two axes) and as a
    whole (``row_allowed``, on the axes chosen so far). Each row starts from the costliest pair
    still uncovered and fills the other axes, in order, with the allowed value that covers most
    new pairs per unit of ``cost`` (of the row so far with that value; the cheapest where none
    covers a new pair, the first on a tie): a costly value meets the others in cheap rows (an
    expensive model in a cheap context), and every pair is still held.
    """
    names = list(axes)
    uncovered = pairs_of(axes, allowed)
    # the costliest pairs first, while the cheap values to complete their rows are still new
    order = sorted(uncovered, key=lambda p: (-cost(_values(axes, dict(p))), p))
    rows: list[Row] = []
    while uncovered:
        start = next(p for p in order if p in uncovered)
        chosen = {start[0][0]: start[0][1], start[1][0]: start[1][1]}
        for name in names:
            if name in chosen:
                continue
            best, score = None, (-1.0, -float("inf"))
            for index, value in enumerate(axes[name]):
                fits = all(
                    allowed(*sorted_pair(name, value, other, axes[other][chosen[other]], names))
                    for other in chosen
                )
                row = {**chosen, name: index}
                values = _values(axes, row)
                if not fits or not row_allowed(values):
                    continue
                new = len(_row_pairs(names, row) & uncovered)
                price = cost(values)
                if (new / price, -price) > score:
                    best, score = index, (new / price, -price)
            if best is None:
                raise ValueError(f"no allowed value of axis {name!r} fits the row {chosen}")
            chosen[name] = best
        uncovered -= _row_pairs(names, chosen)
        rows.append({name: axes[name][chosen[name]] for name in names})
    return rows


def sorted_pair(a: str, va: Any, b: str, vb: Any, names: Sequence[str]) -> tuple:
    """``(a, va, b, vb)`` with the axes in their declared order (``allowed``'s convention)."""
    return (a, va, b, vb) if names.index(a) < names.index(b) else (b, vb, a, va)


def each_value(axes: Mapping[str, Sequence[Any]], allowed: Allowed = _always) -> list[Row]:
    """A small cover: every value of every axis in at least one row (as many rows as the
    longest axis), the other axes cycling through the allowed values."""
    names = list(axes)
    rows = []
    for i in range(max(len(v) for v in axes.values())):
        row: Row = {}
        for name in names:
            values = axes[name]
            for shift in range(len(values)):
                value = values[(i + shift) % len(values)]
                if all(allowed(*sorted_pair(name, value, o, row[o], names)) for o in row):
                    row[name] = value
                    break
            else:
                raise ValueError(f"no allowed value of axis {name!r} fits the row {row}")
        rows.append(row)
    return rows


def missing_pairs(
    axes: Mapping[str, Sequence[Any]], rows: Sequence[Mapping[str, Any]], allowed: Allowed = _always
) -> set[tuple]:
    """The allowed pairs of ``axes`` that no row of ``rows`` holds (empty for a cover)."""
    names = list(axes)
    held: set[tuple] = set()
    for row in rows:
        held |= _row_pairs(names, {name: list(axes[name]).index(row[name]) for name in names})
    return pairs_of(axes, allowed) - held
