"""Graph colorings that compress sparse per-sample Jacobians.

A per-sample Jacobian sparsity pattern is a boolean scipy sparse matrix ``P`` of shape
``(n_out, n_in)``. Three colorings compress it (Curtis, Powell & Reid 1974; Coleman & Moré 1983;
survey: Gebremedhin, Manne & Pothen 2005, "What color is your Jacobian?"):

* **column coloring** (forward mode): columns ``j != j'`` may share a color only if no row has
  nonzeros in both. The conflict graph is the pattern of ``P^T P``. With the seed matrix ``S``
  (one-hot colors, ``S[j, colors[j]] = 1``), ``C = J @ S`` holds every nonzero of ``J`` once:
  ``J[i, j] = C[i, colors[j]]``.
* **row coloring** (reverse mode): the same on ``P^T``; ``R = S^T @ J``.
* **diagonal coloring** (for the trace, square ``P``): ``j != j'`` may share a color only if
  ``P[j, j'] == P[j', j] == 0``. The conflict graph is the pattern of ``P + P^T``, far smaller
  than ``P^T P``: a 3x3 'same' convolution on C channels needs 4C diagonal colors, 9C column colors.

Colorings are greedy (first fit) over a few vertex orders, keeping the one with the fewest colors;
the natural order, optimal on row-major image stencils, colors columns straight from ``P`` without
forming ``P^T P``, and a clique lower bound stops the search as soon as it is provably optimal.
For the probing trace estimator (Tang & Saad 2012; Stathopoulos, Laeuchli & Orginos 2013) the
diagonal pattern is restricted to pairs within a Chebyshev distance on the sample's grid.

The package has a module per stage: ``_graph`` (input checks, greedy coloring, vertex orders),
``_jacobian`` (column, row and diagonal colorings of a Jacobian pattern, validity checks) and
``_probing`` (distance-limited patterns and colorings for the probing estimator). It imports
NumPy and SciPy only.
"""

from __future__ import annotations

from ._graph import (
    ORDERS as ORDERS,
    SMALLEST_LAST_MAX_EDGES as SMALLEST_LAST_MAX_EDGES,
    IntArray as IntArray,
    OrderName as OrderName,
    SparseLike as SparseLike,
    as_pattern as as_pattern,
    greedy_coloring as greedy_coloring,
    vertex_order as vertex_order,
)
from ._jacobian import (
    MAX_CONFLICT_PAIRS as MAX_CONFLICT_PAIRS,
    column_coloring as column_coloring,
    diagonal_coloring as diagonal_coloring,
    is_valid_column_coloring as is_valid_column_coloring,
    is_valid_diagonal_coloring as is_valid_diagonal_coloring,
    is_valid_row_coloring as is_valid_row_coloring,
    row_coloring as row_coloring,
)
from ._probing import (
    Distance as Distance,
    lattice_coloring as lattice_coloring,
    lattice_pattern as lattice_pattern,
    probing_coloring as probing_coloring,
    restrict_to_distance as restrict_to_distance,
)

__all__ = [
    "MAX_CONFLICT_PAIRS",
    "ORDERS",
    "SMALLEST_LAST_MAX_EDGES",
    "as_pattern",
    "column_coloring",
    "diagonal_coloring",
    "greedy_coloring",
    "is_valid_column_coloring",
    "is_valid_diagonal_coloring",
    "is_valid_row_coloring",
    "lattice_coloring",
    "lattice_pattern",
    "probing_coloring",
    "restrict_to_distance",
    "row_coloring",
    "vertex_order",
]
