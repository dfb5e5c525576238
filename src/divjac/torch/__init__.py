"""divjac for PyTorch: per-sample Jacobians, divergences and sparsity of batched functions.

Built on ``torch.func`` (``jvp``, ``vjp``, ``vmap``); sparsity is detected on the ATen graph
traced with ``make_fx``. Importing this module imports PyTorch (and never JAX). Its transforms are
the backend-generic ones of :mod:`divjac._api` and :mod:`divjac._api_second`, bound to PyTorch
(:mod:`divjac.torch._api`).
"""

from .. import _api as G, _api_second as G2
from .._core.pattern import SparsityPattern as SparsityPattern
from .._public import bind
from . import _api
from ._api import API, clear_caches as clear_caches
from ._rules import register_rule as register_rule

sparsity = G.bound_sparsity(API)
divergence = bind(API, G.divergence)
divergence_from_pattern = bind(API, G.divergence_from_pattern)
grad_divergence = bind(API, G.grad_divergence)
jacobian = bind(API, G.jacobian)
jacobian_from_pattern = bind(API, G.jacobian_from_pattern)
log_abs_det = bind(API, G.log_abs_det)
sparse_jacobian = bind(API, _api.sparse_jacobian)
squared_frobenius_norm = bind(API, G.squared_frobenius_norm)
value_and_divergence = bind(API, G.value_and_divergence)
value_divergence_and_frobenius = bind(API, G.value_divergence_and_frobenius)
bilaplacian = bind(API, G2.bilaplacian)
derivative = bind(API, G2.derivative)
differential_operator = bind(API, G2.differential_operator)
hessian = bind(API, G2.hessian)
hessian_diagonal = bind(API, G2.hessian_diagonal)
laplacian = bind(API, G2.laplacian)
weighted_laplacian = bind(API, G2.weighted_laplacian)

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
