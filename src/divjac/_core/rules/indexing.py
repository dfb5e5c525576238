"""Gathers and scatters, with known or unknown indices.

An index that is not known at detection time (computed from the input, or traced) may point
anywhere along the axes it indexes: the *unknown-index smear* (:func:`~.reductions.spread`
along those axes) bounds every possible position. A gather smears its operand before reading
it; a scatter smears what it writes after routing it as if the unknown index were zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._deps import Deps, compose, gather, index_map, union
from ._op import Op
from .movement import broadcast_to, elementwise
from .reductions import spread

__all__ = ["gather_rule", "route", "scatter_rule", "select_rule"]


def gather_rule(op: Op) -> list[Deps]:
    """Output element ``r`` of output ``k`` is row ``src[k][r]`` of the inputs stacked in order.

    Params: ``src``: one flat index array per output (its shape; ``-1``: depends on nothing;
    ``None``: an output without derivative);
    ``unknown``: optional ``{input: axes}``, axes of an input its unknown indices may point
    along (the input is smeared along them first); ``n_sources``: how many leading inputs
    are read (default: all; the others are indices).
    """
    unknown = op.params.get("unknown") or {}
    ins = op.ins[: op.params.get("n_sources", len(op.ins))]
    sources = [spread(d, unknown.get(i, ())) for i, d in enumerate(ins)]
    return [
        op.empty(k) if src is None else index_map(s, sources, src)
        for k, (s, src) in enumerate(zip(op.out_shapes, op.params["src"], strict=True))
    ]


def select_rule(op: Op) -> list[Deps]:
    """Choosing between inputs by a mask: a known mask is a gather (params ``src``, see
    :func:`gather_rule`, the inputs broadcast to the output first); an unknown one
    (``src`` ``None``) may choose either input: element-wise."""
    if op.params.get("src") is None:
        return [elementwise(op.out_shapes[0], *op.ins)]
    full = [broadcast_to(d, op.out_shapes[0]) for d in op.ins]
    return gather_rule(op.replace(ins=full))


def route(
    base: Deps,
    source: Deps,
    target: np.ndarray,
    *,
    source_index: np.ndarray | None = None,
    overwrite: bool,
    unknown_axes: Sequence[int] | None = None,
) -> Deps:
    """``base`` with the elements of ``source`` added (or written) at flat positions ``target``.

    Element ``k`` routed is ``source`` element ``source_index[k]`` (default ``k``), written at
    ``target[k]`` of ``base`` (``-1``: nowhere). With ``overwrite`` the written positions lose
    what ``base`` held. ``unknown_axes``: the scatter's positions along these axes are unknown
    (routed as given, then smeared along them; nothing is known to be overwritten).
    """
    target = np.asarray(target, np.int64).ravel()
    rows = np.flatnonzero(target >= 0)
    cols = rows if source_index is None else np.asarray(source_index, np.int64).ravel()[rows]
    routed = compose(base.shape, target[rows], cols, source, n_in=source.size)
    if unknown_axes is not None:
        return union(base, spread(routed, unknown_axes))
    if overwrite:
        keep = np.arange(math.prod(base.shape))
        keep[target[rows]] = -1
        base = gather(base, keep.reshape(base.shape))
    return union(base, routed)


def scatter_rule(op: Op) -> list[Deps]:
    """Inputs: base, then the source at position ``source_input`` (default 1). Params:
    ``target``, ``source_index``, ``overwrite``, ``unknown_axes`` (see :func:`route`)."""
    p = op.params
    out = route(
        op.ins[0],
        op.ins[p.get("source_input", 1)],
        p["target"],
        source_index=p.get("source_index"),
        overwrite=p["overwrite"],
        unknown_axes=p.get("unknown_axes"),
    )
    return [out]
