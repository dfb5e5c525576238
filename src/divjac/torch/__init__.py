"""divjac for PyTorch: per-sample Jacobians, divergences and sparsity of batched functions.

Built on ``torch.func`` (``jvp``, ``vjp``, ``vmap``); sparsity is detected on the ATen graph
traced with ``make_fx``. Importing this module imports PyTorch (and never JAX).
"""

from .._core.pattern import SparsityPattern as SparsityPattern
from ._api import (
    bilaplacian as bilaplacian,
    clear_caches as clear_caches,
    divergence as divergence,
    divergence_from_pattern as divergence_from_pattern,
    grad_divergence as grad_divergence,
    hessian as hessian,
    hessian_diagonal as hessian_diagonal,
    jacobian as jacobian,
    jacobian_from_pattern as jacobian_from_pattern,
    laplacian as laplacian,
    log_abs_det as log_abs_det,
    sparse_jacobian as sparse_jacobian,
    sparsity as sparsity,
    squared_frobenius_norm as squared_frobenius_norm,
    value_and_divergence as value_and_divergence,
    value_divergence_and_frobenius as value_divergence_and_frobenius,
    weighted_laplacian as weighted_laplacian,
)
from ._api_operators import (
    derivative as derivative,
    differential_operator as differential_operator,
)
from ._rules import register_rule as register_rule

__all__ = [
    "SparsityPattern",
    "bilaplacian",
    "clear_caches",
    "derivative",
    "differential_operator",
    "divergence",
    "divergence_from_pattern",
    "grad_divergence",
    "hessian",
    "hessian_diagonal",
    "jacobian",
    "jacobian_from_pattern",
    "laplacian",
    "log_abs_det",
    "register_rule",
    "sparse_jacobian",
    "sparsity",
    "squared_frobenius_norm",
    "value_and_divergence",
    "value_divergence_and_frobenius",
    "weighted_laplacian",
]
