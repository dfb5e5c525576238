"""Sparsity rules: dependency sets of array elements and how operations propagate them.

Sparsity detection is abstract interpretation: every intermediate array of the traced program
carries, for each of its elements (row-major), the set of *labels* it depends on (a
:class:`Deps`). A rule maps the dependency sets of an operation's inputs to those of its
outputs; it looks at shapes, static parameters and, where given, constant input values (gather
indices, masks), never at the values that depend on the labels, so a pattern holds for every
input of those shapes.

The rules are written once here (NumPy/SciPy only), one module per family, and shared by the
JAX (jaxpr) and PyTorch (ATen graph) interpreters. Every rule is vectorized (index arithmetic
and sparse products); none loops over elements. Rules may over-approximate (a dependency that
is structurally possible but numerically zero), they never under-approximate.
"""

from __future__ import annotations

from ._deps import (
    Deps as Deps,
    Shape as Shape,
    compose as compose,
    dense as dense,
    empty as empty,
    from_labels as from_labels,
    gather as gather,
    index_map as index_map,
    union as union,
)
from .conv import (
    axis_map as axis_map,
    conv as conv,
    window as window,
    window_pairs as window_pairs,
    window_transposed as window_transposed,
)
from .linalg import batched_dense as batched_dense, dot_general as dot_general
from .movement import (
    broadcast_in_dim as broadcast_in_dim,
    broadcast_to as broadcast_to,
    concatenate as concatenate,
    elementwise as elementwise,
    pad as pad,
    reshape as reshape,
    rev as rev,
    slice_ as slice_,
    stack as stack,
    transpose as transpose,
)
from .reductions import (
    cumulative as cumulative,
    reduce as reduce,
    sort_along as sort_along,
    spread as spread,
)

__all__ = [
    "Deps",
    "Shape",
    "axis_map",
    "batched_dense",
    "broadcast_in_dim",
    "broadcast_to",
    "compose",
    "concatenate",
    "conv",
    "cumulative",
    "dense",
    "dot_general",
    "elementwise",
    "empty",
    "from_labels",
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
    "window_pairs",
    "window_transposed",
]
