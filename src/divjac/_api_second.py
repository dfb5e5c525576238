"""The public second- and higher-order transforms, written once for :mod:`divjac.jax` and
:mod:`divjac.torch`, as :mod:`divjac._api`'s are (forwarding to :mod:`divjac._second` and
:mod:`divjac._operators`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

from . import _operators as O, _second as S
from ._call import (
    BiLaplacianMethod,
    Coupling,
    DiagonalMethod,
    Distribution,
    LaplacianMethod,
    Mode,
    OperatorMethod,
    WeightedMethod,
)
from ._public import Api, ArrayT, forward, transform

__all__ = [
    "bilaplacian",
    "derivative",
    "differential_operator",
    "hessian",
    "hessian_diagonal",
    "laplacian",
    "weighted_laplacian",
]


@transform
def laplacian(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import laplacian
        >>> laplacian(lambda x: jnp.sum(x**2, axis=1))(jnp.ones((2, 3))).tolist()
        [6.0, 6.0]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import laplacian
        >>> laplacian(lambda x: torch.sum(x**2, dim=1))(torch.ones(2, 3)).tolist()
        [6.0, 6.0]
    """
    return forward(S.laplacian, locals())


@transform
def bilaplacian(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import bilaplacian
        >>> bilaplacian(lambda x: jnp.sum(x**4, axis=1))(jnp.ones((2, 3))).tolist()
        [72.0, 72.0]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import bilaplacian
        >>> bilaplacian(lambda x: torch.sum(x**4, dim=1))(torch.ones(2, 3)).tolist()
        [72.0, 72.0]
    """
    return forward(S.bilaplacian, locals())


@transform
def weighted_laplacian(
    api: Api[ArrayT],
    u: Callable[..., Any],
    A: ArrayT | None = None,
    /,
    argnums: int = 0,
    *,
    factor: ArrayT | None = None,
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import weighted_laplacian
        >>> A = jnp.array([[2.0, 1.0], [1.0, 3.0]])
        >>> u = lambda x: x[:, 0] * x[:, 1]  # H = [[0, 1], [1, 0]]: tr(A H) = 2
        >>> weighted_laplacian(u, A)(jnp.ones((2, 2))).tolist()
        [2.0, 2.0]
        >>> weighted_laplacian(u, factor=jnp.eye(2))(jnp.ones((2, 2))).tolist()
        [0.0, 0.0]

    Example (PyTorch):
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
    inner = forward(
        S.weighted_laplacian,
        locals(),
        skip=1,  # the coefficient, first
        drop=("A", "factor", "coefficient"),
        is_factor=is_factor,
    )
    return _with_coefficient(inner, coefficient)


def _with_coefficient(inner: Callable[..., Any], coefficient: Any) -> Callable[..., Any]:
    """``inner`` with the coefficient as its first call argument. A function of its own: a
    closure in :func:`weighted_laplacian` would make its ``locals()`` (read by
    :func:`~divjac._public.forward`) hold unbound cells, which dynamo cannot read when the
    transform is built inside ``torch.compile``."""

    def weighted_fn(*args: Any, **kwargs: Any) -> Any:
        return inner(coefficient, *args, **kwargs)

    return weighted_fn


@transform
def hessian(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import hessian
        >>> hessian(lambda x: x[:, 0] ** 2 * x[:, 1])(jnp.ones((3, 2)))[0].tolist()
        [[2.0, 2.0], [2.0, 0.0]]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import hessian
        >>> hessian(lambda x: x[:, 0] ** 2 * x[:, 1])(torch.ones(3, 2))[0].tolist()
        [[2.0, 2.0], [2.0, 0.0]]
    """
    return forward(S.hessian, locals())


@transform
def hessian_diagonal(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import hessian_diagonal
        >>> hessian_diagonal(lambda x: jnp.sum(x**3, axis=1))(jnp.ones((2, 3))).tolist()
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import hessian_diagonal
        >>> hessian_diagonal(lambda x: torch.sum(x**3, dim=1))(torch.ones(2, 3)).tolist()
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """
    return forward(S.hessian_diagonal, locals())


@transform
def derivative(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import derivative
        >>> u = lambda x: x[:, 0] ** 3 * x[:, 1]  # d^3u/dx0^2 dx1 = 6 x0
        >>> derivative(u, (0, 0, 1))(jnp.array([[1.0, 2.0], [3.0, 4.0]])).round().tolist()
        [6.0, 18.0]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import derivative
        >>> u = lambda x: x[:, 0] ** 3 * x[:, 1]  # d^3u/dx0^2 dx1 = 6 x0
        >>> derivative(u, (0, 0, 1))(torch.tensor([[1.0, 2.0], [3.0, 4.0]])).round().tolist()
        [6.0, 18.0]
    """
    # Hashable: part of the key of a compiled program.
    return forward(O.derivative, locals(), alpha=tuple(alpha) if isinstance(alpha, list) else alpha)


@transform
def differential_operator(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import differential_operator
        >>> u = lambda x: x[:, 0] ** 4 + x[:, 0] * x[:, 1]  # u_xxxx + 2 u_xy = 24 + 2
        >>> op = differential_operator(u, [(1.0, (0, 0, 0, 0)), (2.0, (0, 1))])
        >>> op(jnp.ones((2, 2))).round().tolist()
        [26.0, 26.0]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import differential_operator
        >>> u = lambda x: x[:, 0] ** 4 + x[:, 0] * x[:, 1]  # u_xxxx + 2 u_xy = 24 + 2
        >>> op = differential_operator(u, [(1.0, (0, 0, 0, 0)), (2.0, (0, 1))])
        >>> op(torch.ones(2, 2)).round().tolist()
        [26.0, 26.0]
    """
    if not _numbers_only(terms):
        # Per-sample arrays and functions of the input are the caller's values, not constants
        # of a program reused across calls: traced where the call is.
        return forward(O.differential_operator, locals(), cached=False)
    static = tuple((c, tuple(alpha)) for c, alpha in terms)  # hashable: part of a key
    return forward(O.differential_operator, locals(), drop=("static",), terms=static)


def _numbers_only(terms: Any) -> bool:
    """Whether ``terms`` are pairs of a real number and a sequence of indices."""
    try:
        return all(
            isinstance(c, numbers.Real) and isinstance(alpha, Sequence) for c, alpha in terms
        )
    except (TypeError, ValueError):
        return False  # not pairs: the transform says what they should be
