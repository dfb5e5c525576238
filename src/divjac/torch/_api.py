"""The public transforms of :mod:`divjac.torch`: divjac's transforms on torch tensors.

Each is a typed ``def`` calling the backend-neutral transform (:mod:`divjac._transforms`,
:mod:`divjac._divergence`) with :class:`~divjac.torch._backend.TorchBackend`; :mod:`divjac.jax`
has the same functions with the same signatures (``sparse_jacobian`` takes one more keyword,
``layout``). The shared docstring text comes from :mod:`divjac._docs`; the example of each is
PyTorch's (doctested). ``f`` may be a function or an ``nn.Module``; results stay on the autograd
graph of the module parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, overload

import torch

from .. import _divergence as D, _functionals as F, _second as S, _transforms as T
from .._call import (
    BiLaplacianMethod,
    Coupling,
    DiagonalMethod,
    Direction,
    Distribution,
    FrobeniusMethod,
    LaplacianMethod,
    LogDetMethod,
    Method,
    Mode,
    WeightedMethod,
)
from .._core import stochastic
from .._core.pattern import SparsityPattern
from .._docs import documented
from . import _ddp, _detect
from ._backend import BACKEND

__all__ = [
    "bilaplacian",
    "clear_caches",
    "divergence",
    "divergence_from_pattern",
    "grad_divergence",
    "hessian",
    "hessian_diagonal",
    "jacobian",
    "jacobian_from_pattern",
    "laplacian",
    "log_abs_det",
    "sparse_jacobian",
    "sparsity",
    "squared_frobenius_norm",
    "value_and_divergence",
    "value_divergence_and_frobenius",
    "weighted_laplacian",
]


@documented()
def jacobian(
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    mode: Mode = "auto",
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
) -> Callable[..., Any]:
    """{jacobian}

    Example:
        >>> import torch
        >>> from divjac.torch import jacobian
        >>> W = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> jacobian(lambda x: x @ W.T)(torch.ones(5, 2)).shape
        torch.Size([5, 2, 2])
    """
    return _ddp.transform(
        T.jacobian,
        BACKEND,
        f,
        argnums,
        batch_axis=batch_axis,
        mode=mode,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
    )


@documented()
def jacobian_from_pattern(
    f: Callable[..., Any],
    pattern: SparsityPattern,
    /,
    argnums: int = 0,
    *,
    batch_axis: int | None = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """{jacobian_from_pattern}

    Example:
        >>> import torch
        >>> from divjac.torch import jacobian_from_pattern, sparsity
        >>> f = lambda x: torch.cumsum(x, dim=1)
        >>> pattern = sparsity(f)(torch.ones(8, 5))
        >>> jacobian_from_pattern(f, pattern)(torch.ones(3, 5))[0].tolist()[1]
        [1.0, 1.0, 0.0, 0.0, 0.0]
    """
    return _ddp.transform(
        T.jacobian_from_pattern,
        BACKEND,
        f,
        pattern,
        argnums,
        batch_axis=batch_axis,
        chunk_size=chunk_size,
        has_aux=has_aux,
    )


@documented()
def divergence(
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    method: Method = "auto",
    mode: Direction = "auto",
    num_probes: int | None = None,
    distribution: Distribution = "rademacher",
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
    probing_distance: int | None = None,
) -> Callable[..., Any]:
    """{divergence}

    Example:
        >>> import torch
        >>> from divjac.torch import divergence
        >>> divergence(torch.sin)(torch.zeros(3, 4)).tolist()
        [4.0, 4.0, 4.0]
    """
    return _ddp.transform(
        D.divergence,
        BACKEND,
        f,
        argnums,
        batch_axis=batch_axis,
        method=method,
        mode=mode,
        num_probes=num_probes,
        distribution=distribution,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
        probing_distance=probing_distance,
    )


@documented()
def value_and_divergence(
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    method: Method = "auto",
    mode: Direction = "auto",
    num_probes: int | None = None,
    distribution: Distribution = "rademacher",
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
    probing_distance: int | None = None,
) -> Callable[..., Any]:
    """{value_and_divergence}

    Example:
        >>> import torch
        >>> from divjac.torch import value_and_divergence
        >>> y, div = value_and_divergence(lambda x: 2.0 * x)(torch.ones(2, 3))
        >>> tuple(y.shape), div.tolist()
        ((2, 3), [6.0, 6.0])
    """
    return _ddp.transform(
        D.value_and_divergence,
        BACKEND,
        f,
        argnums,
        batch_axis=batch_axis,
        method=method,
        mode=mode,
        num_probes=num_probes,
        distribution=distribution,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
        probing_distance=probing_distance,
    )


@documented()
def divergence_from_pattern(
    f: Callable[..., Any],
    pattern: SparsityPattern,
    /,
    argnums: int = 0,
    *,
    batch_axis: int | None = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """{divergence_from_pattern}

    Example:
        >>> import torch
        >>> from divjac.torch import divergence_from_pattern, sparsity
        >>> f = lambda x: torch.cumsum(x, dim=1) ** 2
        >>> pattern = sparsity(f)(torch.ones(8, 5))
        >>> divergence_from_pattern(f, pattern)(torch.ones(2, 5)).tolist()
        [30.0, 30.0]
    """
    return _ddp.transform(
        D.divergence_from_pattern,
        BACKEND,
        f,
        pattern,
        argnums,
        batch_axis=batch_axis,
        chunk_size=chunk_size,
        has_aux=has_aux,
    )


@documented()
def grad_divergence(
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    method: Method = "auto",
    mode: Direction = "auto",
    num_probes: int | None = None,
    distribution: Distribution = "rademacher",
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
    probing_distance: int | None = None,
) -> Callable[..., Any]:
    """{grad_divergence}

    Example:
        >>> import torch
        >>> from divjac.torch import grad_divergence
        >>> grad_divergence(lambda x: x**3)(torch.ones(2, 3)).tolist()
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """
    return _ddp.transform(
        D.grad_divergence,
        BACKEND,
        f,
        argnums,
        batch_axis=batch_axis,
        method=method,
        mode=mode,
        num_probes=num_probes,
        distribution=distribution,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
        probing_distance=probing_distance,
    )


@documented()
def laplacian(
    u: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    method: LaplacianMethod = "auto",
    num_probes: int | None = None,
    distribution: Distribution = "rademacher",
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
) -> Callable[..., Any]:
    """{laplacian}

    Example:
        >>> import torch
        >>> from divjac.torch import laplacian
        >>> laplacian(lambda x: torch.sum(x**2, dim=1))(torch.ones(2, 3)).tolist()
        [6.0, 6.0]
    """
    return _ddp.transform(
        S.laplacian,
        BACKEND,
        u,
        argnums,
        batch_axis=batch_axis,
        method=method,
        num_probes=num_probes,
        distribution=distribution,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
    )


@documented()
def bilaplacian(
    u: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    method: BiLaplacianMethod = "auto",
    num_probes: int | None = None,
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
) -> Callable[..., Any]:
    """{bilaplacian}

    Example:
        >>> import torch
        >>> from divjac.torch import bilaplacian
        >>> bilaplacian(lambda x: torch.sum(x**4, dim=1))(torch.ones(2, 3)).tolist()
        [72.0, 72.0]
    """
    return _ddp.transform(
        S.bilaplacian,
        BACKEND,
        u,
        argnums,
        batch_axis=batch_axis,
        method=method,
        num_probes=num_probes,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
    )


@documented()
def weighted_laplacian(
    u: Callable[..., Any],
    A: torch.Tensor | None = None,
    /,
    argnums: int = 0,
    *,
    factor: torch.Tensor | None = None,
    batch_axis: int | None = 0,
    method: WeightedMethod = "auto",
    num_probes: int | None = None,
    distribution: Distribution = "rademacher",
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
) -> Callable[..., Any]:
    """{weighted_laplacian}

    Example:
        >>> import torch
        >>> from divjac.torch import weighted_laplacian
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 3.0]])
        >>> u = lambda x: x[:, 0] * x[:, 1]  # H = [[0, 1], [1, 0]]: tr(A H) = 2
        >>> weighted_laplacian(u, A)(torch.ones(2, 2)).tolist()
        [2.0, 2.0]
        >>> weighted_laplacian(u, factor=torch.eye(2))(torch.ones(2, 2)).tolist()
        [0.0, 0.0]
    """
    coefficient, is_factor = S.coefficient_of(A, factor)
    inner = _ddp.transform(
        S.weighted_laplacian,
        BACKEND,
        u,
        argnums,
        is_factor=is_factor,
        batch_axis=batch_axis,
        method=method,
        num_probes=num_probes,
        distribution=distribution,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
    )

    def weighted_fn(*args: Any, **kwargs: Any) -> Any:
        return inner(coefficient, *args, **kwargs)

    return weighted_fn


@documented()
def hessian(
    u: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    mode: Mode = "auto",
    chunk_size: int | None = None,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """{hessian}

    Example:
        >>> import torch
        >>> from divjac.torch import hessian
        >>> hessian(lambda x: x[:, 0] ** 2 * x[:, 1])(torch.ones(3, 2))[0].tolist()
        [[2.0, 2.0], [2.0, 0.0]]
    """
    return _ddp.transform(
        S.hessian,
        BACKEND,
        u,
        argnums,
        batch_axis=batch_axis,
        mode=mode,
        chunk_size=chunk_size,
        has_aux=has_aux,
    )


@documented()
def hessian_diagonal(
    u: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    method: DiagonalMethod = "auto",
    num_probes: int | None = None,
    distribution: Distribution = "rademacher",
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
) -> Callable[..., Any]:
    """{hessian_diagonal}

    Example:
        >>> import torch
        >>> from divjac.torch import hessian_diagonal
        >>> hessian_diagonal(lambda x: torch.sum(x**3, dim=1))(torch.ones(2, 3)).tolist()
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """
    return _ddp.transform(
        S.hessian_diagonal,
        BACKEND,
        u,
        argnums,
        batch_axis=batch_axis,
        method=method,
        num_probes=num_probes,
        distribution=distribution,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
    )


@documented()
def squared_frobenius_norm(
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    method: FrobeniusMethod = "auto",
    mode: Direction = "auto",
    num_probes: int | None = None,
    distribution: Distribution = "rademacher",
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """{squared_frobenius_norm}

    Example:
        >>> import torch
        >>> from divjac.torch import squared_frobenius_norm
        >>> W = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> squared_frobenius_norm(lambda x: x @ W.T)(torch.ones(2, 2)).tolist()
        [30.0, 30.0]
    """
    return _ddp.transform(
        F.squared_frobenius_norm,
        BACKEND,
        f,
        argnums,
        batch_axis=batch_axis,
        method=method,
        mode=mode,
        num_probes=num_probes,
        distribution=distribution,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
    )


@documented()
def value_divergence_and_frobenius(
    f: Callable[..., Any],
    /,
    argnums: int = 0,
    *,
    batch_axis: int | None = 0,
    method: FrobeniusMethod = "auto",
    mode: Direction = "auto",
    num_probes: int | None = None,
    distribution: Distribution = "rademacher",
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """{value_divergence_and_frobenius}

    Example:
        >>> import torch
        >>> from divjac.torch import value_divergence_and_frobenius
        >>> y, div, sq_fro = value_divergence_and_frobenius(lambda x: 2.0 * x)(torch.ones(2, 3))
        >>> tuple(y.shape), div.tolist(), sq_fro.tolist()
        ((2, 3), [6.0, 6.0], [12.0, 12.0])
    """
    return _ddp.transform(
        F.value_divergence_and_frobenius,
        BACKEND,
        f,
        argnums,
        batch_axis=batch_axis,
        method=method,
        mode=mode,
        num_probes=num_probes,
        distribution=distribution,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
    )


@documented()
def log_abs_det(
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    method: LogDetMethod = "auto",
    mode: Direction = "auto",
    num_probes: int | None = None,
    lanczos_steps: int | None = None,
    distribution: Distribution = "rademacher",
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """{log_abs_det}

    Example:
        >>> import torch
        >>> from divjac.torch import log_abs_det
        >>> W = torch.tensor([[2.0, 1.0], [0.0, 3.0]])  # det 6
        >>> [round(v, 4) for v in log_abs_det(lambda x: x @ W.T)(torch.ones(2, 2)).tolist()]
        [1.7918, 1.7918]
    """
    return _ddp.transform(
        F.log_abs_det,
        BACKEND,
        f,
        argnums,
        batch_axis=batch_axis,
        method=method,
        mode=mode,
        num_probes=num_probes,
        lanczos_steps=lanczos_steps,
        distribution=distribution,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
    )


@overload
def sparsity(
    f: Callable[..., Any], /, argnums: int = 0, *, batch_axis: int | None = 0, has_aux: bool = False
) -> Callable[..., SparsityPattern]: ...


@overload
def sparsity(
    f: Callable[..., Any],
    /,
    argnums: Sequence[int],
    *,
    batch_axis: int | None = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[SparsityPattern, ...]]: ...


@documented()
def sparsity(
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """{sparsity}

    Example:
        >>> import torch
        >>> from divjac.torch import sparsity
        >>> p = sparsity(lambda x: torch.cumsum(x, dim=1))(torch.ones(8, 5))
        >>> p.nnz, p.n_diagonal_colors
        (15, 5)
    """
    return T.sparsity(BACKEND, _ddp.unwrapped(f), argnums, batch_axis=batch_axis, has_aux=has_aux)


@documented(
    layout="""``torch.sparse_coo`` (default; a 3-d COO tensor) or ``torch.sparse_csr`` (a
        batched CSR tensor: every sample shares the pattern)."""
)
def sparse_jacobian(
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
    layout: torch.layout = torch.sparse_coo,
) -> Callable[..., Any]:
    """{sparse_jacobian}

    Example:
        >>> import torch
        >>> from divjac.torch import sparse_jacobian
        >>> J = sparse_jacobian(torch.sin)(torch.zeros(2, 3))
        >>> tuple(J.shape), J._nnz()
        ((2, 3, 3), 6)
    """
    return _ddp.transform(
        T.sparse_jacobian,
        BACKEND,
        f,
        argnums,
        batch_axis=batch_axis,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
        layout=layout,
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
