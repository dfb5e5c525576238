"""Sparsity rules, for giving an operation of your own a rule (``register_rule``).

A rule is a function ``Op -> list[Deps]``: from what an operation's inputs depend on to what each
of its outputs depends on. A :class:`Deps` holds, for every element of an array (row-major), the
set of labels (input elements) it depends on; build a rule's results from ``op.ins`` with the
functions here, which are the ones divjac's own rules are made of. See ``docs/rules.md``.
"""

from __future__ import annotations

from ._core.rules import (
    Deps as Deps,
    Op as Op,
    Rule as Rule,
    RuleError as RuleError,
    axis_map as axis_map,
    broadcast_in_dim as broadcast_in_dim,
    broadcast_to as broadcast_to,
    compose as compose,
    concatenate as concatenate,
    cumulative as cumulative,
    dense as dense,
    dot_general as dot_general,
    elementwise as elementwise,
    empty as empty,
    gather as gather,
    index_map as index_map,
    pad as pad,
    reduce as reduce,
    reshape as reshape,
    rev as rev,
    slice_ as slice_,
    sort_along as sort_along,
    spread as spread,
    stack as stack,
    transpose as transpose,
    union as union,
    window as window,
)

__all__ = [
    "Deps",
    "Op",
    "Rule",
    "RuleError",
    "axis_map",
    "broadcast_in_dim",
    "broadcast_to",
    "compose",
    "concatenate",
    "cumulative",
    "dense",
    "dot_general",
    "elementwise",
    "empty",
    "gather",
    "index_map",
    "pad",
    "reduce",
    "reshape",
    "rev",
    "slice_",
    "sort_along",
    "spread",
    "stack",
    "transpose",
    "union",
    "window",
]
