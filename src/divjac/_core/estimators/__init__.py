"""Stochastic and probing trace estimators over an abstract batched matvec.

Every estimator here works per sample on a batch of ``B`` square matrices ``J_b`` (``n x n``), the
per-sample Jacobians, seen only through a batched matvec::

    matvec(V) -> W    with V, W of shape (B, n, k) and W[b] = J_b @ V[b]

The backends implement it with one batched JVP per column, so the cost of an estimator is the
total number of columns it passes to ``matvec`` (its *matvec budget*, ``num_probes`` per sample).
The estimators pass all the columns of a stage in one call: Hutchinson and probing call ``matvec``
once, Hutch++ and XTrace twice. ``J_b`` need not be symmetric (Jacobians of vector fields are not),
and only products with ``J_b`` are used, never with its transpose.

The math is written once with the Python array API standard (each array's own namespace; only
torch tensors need ``array_api_compat``), so it runs unchanged on NumPy arrays, ``jax.numpy``
arrays (inside ``jax.jit`` / ``jax.grad``) and torch tensors (inside ``torch.func`` transforms
and ordinary autograd); nothing here imports a framework, mutates an array in place, or draws
random numbers. The backends draw the random test vectors
(JAX keys, torch generators) and pass them in; :func:`num_random_vectors` says how many each
method needs and :func:`normalize_probes` turns raw draws into probes.

Each estimator returns ``(estimate, stderr)``, two arrays of shape ``(B,)``. The standard error is
meant to be read as a confidence interval: ``estimate +- 2 * stderr`` covers the exact trace at
least 94 % of the time (for normally distributed terms; 95.4 % for many terms). It is built in
two steps:

1. An unbiased estimate ``V`` of the variance of the estimate, with ``nu`` degrees of freedom: the
   sample variance of the independent terms the estimate averages, over their number (Hutchinson,
   the Hutchinson part of Hutch++; ``nu = k - 1``), pooled over the color classes (probing), or
   with a covariance correction for XTrace's dependent terms (see each estimator).
2. Student's correction for estimating the variance from few terms: ``stderr = kappa(nu) *
   sqrt(V)`` with ``kappa(nu) = max(1, t_nu(0.97) / 2)`` (``t_nu(p)``: the quantile of Student's
   t with ``nu`` degrees of freedom), so that ``estimate +- 2 * stderr`` is at least the 94 %
   Student-t interval, and ``stderr`` is never below the usual standard error ``sqrt(V)``,
   which it equals from ``nu = 19`` on. ``kappa`` is 5.29 at ``nu = 1`` (a 94 % interval from
   two terms is wide), 1.95 at ``nu = 2``, 1.30 at ``nu = 4``, 1.12 at ``nu = 7`` and 1.02 at
   ``nu = 15``; it is computed by the Cornish-Fisher expansion of the t quantile (Abramowitz &
   Stegun 26.7.5) with a fifth term that makes it exact at ``nu = 1``, within 0.6 % for every
   ``nu >= 1``, also fractional (probing estimates its degrees of freedom).

A single term has no sample variance; the estimators then return a conservative error estimate,
never NaN: for a Hutchinson term ``v^T A v`` with ``E[v v^T] = I``, ``Var(v^T A v)`` is
``||A + A^T||_F^2 / 2 <= 2 ||A||_F^2`` (Gaussian), less for Rademacher and sphere probes, and
``||A v||^2`` is an unbiased estimate of ``||A||_F^2``: ``stderr = sqrt(2) ||A v||`` estimates an
upper bound of the standard deviation, about ``sqrt(2)`` too large for non-symmetric ``A``.

One module per estimator, named after its paper: :mod:`.hutchinson` (Girard 1989; Hutchinson
1990), :mod:`.meyer2020hutchpp` (Hutch++), :mod:`.epperly2024xtrace` (XTrace),
:mod:`.tang2012probing` (probing; Stathopoulos, Laeuchli & Orginos 2013),
:mod:`.ubaru2017slq` (``log|det J|`` by stochastic Lanczos quadrature on ``J^T J``); ``_budget`` holds the
matvec budgets and the probes, ``_common`` the shared checks and the standard error's recipe.
"""

from __future__ import annotations

from ._budget import (
    DISTRIBUTIONS as DISTRIBUTIONS,
    METHODS as METHODS,
    check_stderr_budget as check_stderr_budget,
    estimate_trace as estimate_trace,
    normalize_probes as normalize_probes,
    num_random_vectors as num_random_vectors,
)
from ._common import (
    Array as Array,
    Matvec as Matvec,
    column_dots as column_dots,
    diagonal_mean_and_stderr as diagonal_mean_and_stderr,
    mean_and_stderr as mean_and_stderr,
    namespace as namespace,
    squared_norm_mean_and_stderr as squared_norm_mean_and_stderr,
)
from .epperly2024xtrace import xtrace as xtrace
from .hutchinson import hutchinson as hutchinson, hutchinson_from_terms as hutchinson_from_terms
from .meyer2020hutchpp import hutch_plus_plus as hutch_plus_plus
from .tang2012probing import probe_matrix as probe_matrix, probing as probing
from .ubaru2017slq import (
    MIN_GAUGED_STEPS as MIN_GAUGED_STEPS,
    default_lanczos_steps as default_lanczos_steps,
    slq_log_abs_det as slq_log_abs_det,
)

__all__ = [
    "DISTRIBUTIONS",
    "METHODS",
    "MIN_GAUGED_STEPS",
    "check_stderr_budget",
    "column_dots",
    "default_lanczos_steps",
    "diagonal_mean_and_stderr",
    "estimate_trace",
    "hutch_plus_plus",
    "hutchinson",
    "hutchinson_from_terms",
    "mean_and_stderr",
    "namespace",
    "normalize_probes",
    "num_random_vectors",
    "probe_matrix",
    "probing",
    "slq_log_abs_det",
    "squared_norm_mean_and_stderr",
    "xtrace",
]
