"""The public transforms of :mod:`divjac.torch`: :mod:`divjac._transforms` bound to PyTorch.

Each function is the backend-neutral transform with :class:`~divjac.torch._backend.TorchBackend`
filled in; its docstring carries a PyTorch example (doctested). ``f`` may be a function or an
``nn.Module``; results stay on the autograd graph of the module parameters.
"""

from __future__ import annotations

import functools

from .. import _transforms as T
from .._core import stochastic
from . import _detect
from ._backend import BACKEND

_bind = functools.partial(T.bind, backend=BACKEND, module=__name__)


jacobian = _bind(
    T.jacobian,
    """
    >>> import torch
    >>> from divjac.torch import jacobian
    >>> W = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> jacobian(lambda x: x @ W.T)(torch.ones(5, 2)).shape
    torch.Size([5, 2, 2])
    """,
)

divergence = _bind(
    T.divergence,
    """
    >>> import torch
    >>> from divjac.torch import divergence
    >>> divergence(torch.sin)(torch.zeros(3, 4)).tolist()
    [4.0, 4.0, 4.0]
    """,
)

value_and_divergence = _bind(
    T.value_and_divergence,
    """
    >>> import torch
    >>> from divjac.torch import value_and_divergence
    >>> y, div = value_and_divergence(lambda x: 2.0 * x)(torch.ones(2, 3))
    >>> tuple(y.shape), div.tolist()
    ((2, 3), [6.0, 6.0])
    """,
)

grad_divergence = _bind(
    T.grad_divergence,
    """
    >>> import torch
    >>> from divjac.torch import grad_divergence
    >>> grad_divergence(lambda x: x**3)(torch.ones(2, 3)).tolist()
    [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """,
)

laplacian = _bind(
    T.laplacian,
    """
    >>> import torch
    >>> from divjac.torch import laplacian
    >>> laplacian(lambda x: torch.sum(x**2, dim=1))(torch.ones(2, 3)).tolist()
    [6.0, 6.0]
    """,
)

sparsity = _bind(
    T.sparsity,
    """
    >>> import torch
    >>> from divjac.torch import sparsity
    >>> p = sparsity(lambda x: torch.cumsum(x, dim=1), torch.ones(8, 5))
    >>> p.nnz, p.n_diagonal_colors
    (15, 5)
    """,
)

sparse_jacobian = _bind(
    T.sparse_jacobian,
    """
    >>> import torch
    >>> from divjac.torch import sparse_jacobian
    >>> J = sparse_jacobian(torch.sin)(torch.zeros(2, 3))
    >>> tuple(J.shape), J._nnz()
    ((2, 3, 3), 6)
    """,
    notes="""
    Args:
        layout: ``torch.sparse_coo`` (default; a 3-d COO tensor) or ``torch.sparse_csr`` (a
            batched CSR tensor: every sample shares the pattern).
    """,
    options=BACKEND.sparse_format,
)


def clear_caches() -> None:
    """Drop every trace and detection that ``divjac.torch`` has cached.

    Never needed for correct results: a cached detection is reused only when the traced
    program and everything it read are unchanged (see ``docs/how-it-works.md``, "Caching").
    Use it to free memory, or to time a first call.
    """
    _detect.CACHE.clear()
    _detect.clear_memos()
    stochastic.clear_plans()
