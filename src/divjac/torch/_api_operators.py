"""The linear differential operators of :mod:`divjac.torch` (:mod:`divjac._operators` with
:class:`~divjac.torch._backend.TorchBackend`), as :mod:`divjac.torch._api`'s transforms are
written."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import _operators as O
from .._call import Coupling, OperatorMethod
from .._docs import documented
from . import _ddp
from ._backend import BACKEND

__all__ = ["derivative", "differential_operator"]


@documented()
def derivative(
    u: Callable[..., Any],
    alpha: Sequence[int],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
) -> Callable[..., Any]:
    """{derivative}

    Example:
        >>> import torch
        >>> from divjac.torch import derivative
        >>> u = lambda x: x[:, 0] ** 3 * x[:, 1]  # d^3u/dx0^2 dx1 = 6 x0
        >>> derivative(u, (0, 0, 1))(torch.tensor([[1.0, 2.0], [3.0, 4.0]])).round().tolist()
        [6.0, 18.0]
    """
    return _ddp.transform(
        O.derivative,
        BACKEND,
        u,
        argnums,
        alpha=alpha,
        batch_axis=batch_axis,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
    )


@documented()
def differential_operator(
    u: Callable[..., Any],
    terms: Sequence[tuple[Any, Sequence[int]]],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    method: OperatorMethod = "auto",
    num_probes: int | None = None,
    return_stderr: bool = False,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
) -> Callable[..., Any]:
    """{differential_operator}

    Example:
        >>> import torch
        >>> from divjac.torch import differential_operator
        >>> u = lambda x: x[:, 0] ** 4 + x[:, 0] * x[:, 1]  # u_xxxx + 2 u_xy = 24 + 2
        >>> op = differential_operator(u, [(1.0, (0, 0, 0, 0)), (2.0, (0, 1))])
        >>> op(torch.ones(2, 2)).round().tolist()
        [26.0, 26.0]
    """
    return _ddp.transform(
        O.differential_operator,
        BACKEND,
        u,
        argnums,
        terms=terms,
        batch_axis=batch_axis,
        method=method,
        num_probes=num_probes,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
    )
