"""The public first-order transforms, written once for :mod:`divjac.jax` and :mod:`divjac.torch`.

Each is a backend-generic ``def`` (:func:`~divjac._public.transform`) taking the framework's
:class:`~divjac._public.Api` first, then its public signature, and forwarding every parameter to
its backend-neutral transform (:mod:`divjac._transforms`, :mod:`divjac._divergence`,
:mod:`divjac._functionals`); :func:`~divjac._public.bind` makes each framework's function of it,
with the shared docstring text of :mod:`divjac._docs` and the framework's example.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, overload

from . import _divergence as D, _functionals as F, _transforms as T
from ._call import (
    Coupling,
    Direction,
    Distribution,
    FrobeniusMethod,
    LogDetMethod,
    Method,
    Mode,
)
from ._core.pattern import SparsityPattern
from ._public import Api, ArrayT, bind, forward, transform

__all__ = [
    "Sparsity",
    "bound_sparsity",
    "divergence",
    "divergence_from_pattern",
    "grad_divergence",
    "jacobian",
    "jacobian_from_pattern",
    "log_abs_det",
    "sparse_jacobian",
    "sparsity",
    "squared_frobenius_norm",
    "value_and_divergence",
    "value_divergence_and_frobenius",
]


@transform
def jacobian(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import jacobian
        >>> W = jnp.array([[1.0, 2.0], [3.0, 4.0]])
        >>> jacobian(lambda x: x @ W.T)(jnp.ones((5, 2))).shape
        (5, 2, 2)

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import jacobian
        >>> W = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> jacobian(lambda x: x @ W.T)(torch.ones(5, 2)).shape
        torch.Size([5, 2, 2])
    """
    return forward(T.jacobian, locals())


@transform
def jacobian_from_pattern(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import jacobian_from_pattern, sparsity
        >>> f = lambda x: jnp.cumsum(x, axis=1)
        >>> pattern = sparsity(f)(jnp.ones((8, 5)))
        >>> jacobian_from_pattern(f, pattern)(jnp.ones((3, 5)))[0].tolist()[1]
        [1.0, 1.0, 0.0, 0.0, 0.0]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import jacobian_from_pattern, sparsity
        >>> f = lambda x: torch.cumsum(x, dim=1)
        >>> pattern = sparsity(f)(torch.ones(8, 5))
        >>> jacobian_from_pattern(f, pattern)(torch.ones(3, 5))[0].tolist()[1]
        [1.0, 1.0, 0.0, 0.0, 0.0]
    """
    return forward(T.jacobian_from_pattern, locals())


@transform
def sparsity(
    api: Api[ArrayT],
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """{sparsity}

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import sparsity
        >>> p = sparsity(lambda x: jnp.cumsum(x, axis=1))(jnp.ones((8, 5)))
        >>> p.nnz, p.n_diagonal_colors
        (15, 5)

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import sparsity
        >>> p = sparsity(lambda x: torch.cumsum(x, dim=1))(torch.ones(8, 5))
        >>> p.nnz, p.n_diagonal_colors
        (15, 5)
    """
    return forward(T.sparsity, locals(), traced_only=True)


@transform
def sparse_jacobian(
    api: Api[ArrayT],
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
) -> Callable[..., Any]:
    """{sparse_jacobian}

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import sparse_jacobian
        >>> J = sparse_jacobian(lambda x: jnp.sin(x))(jnp.zeros((2, 3)))
        >>> J.shape, J.nse
        ((2, 3, 3), 3)
    """
    return forward(T.sparse_jacobian, locals(), layout=None)  # PyTorch's takes a layout


@transform
def divergence(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import divergence
        >>> divergence(lambda x: jnp.sin(x))(jnp.zeros((3, 4))).tolist()
        [4.0, 4.0, 4.0]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import divergence
        >>> divergence(torch.sin)(torch.zeros(3, 4)).tolist()
        [4.0, 4.0, 4.0]
    """
    return forward(D.divergence, locals())


@transform
def value_and_divergence(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import value_and_divergence
        >>> y, div = value_and_divergence(lambda x: 2.0 * x)(jnp.ones((2, 3)))
        >>> y.shape, div.tolist()
        ((2, 3), [6.0, 6.0])

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import value_and_divergence
        >>> y, div = value_and_divergence(lambda x: 2.0 * x)(torch.ones(2, 3))
        >>> tuple(y.shape), div.tolist()
        ((2, 3), [6.0, 6.0])
    """
    return forward(D.value_and_divergence, locals())


@transform
def divergence_from_pattern(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import divergence_from_pattern, sparsity
        >>> f = lambda x: jnp.cumsum(x, axis=1) ** 2
        >>> pattern = sparsity(f)(jnp.ones((8, 5)))
        >>> divergence_from_pattern(f, pattern)(jnp.ones((2, 5))).tolist()
        [30.0, 30.0]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import divergence_from_pattern, sparsity
        >>> f = lambda x: torch.cumsum(x, dim=1) ** 2
        >>> pattern = sparsity(f)(torch.ones(8, 5))
        >>> divergence_from_pattern(f, pattern)(torch.ones(2, 5)).tolist()
        [30.0, 30.0]
    """
    return forward(D.divergence_from_pattern, locals())


@transform
def grad_divergence(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import grad_divergence
        >>> grad_divergence(lambda x: x**3)(jnp.ones((2, 3))).tolist()
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import grad_divergence
        >>> grad_divergence(lambda x: x**3)(torch.ones(2, 3)).tolist()
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """
    return forward(D.grad_divergence, locals())


@transform
def squared_frobenius_norm(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import squared_frobenius_norm
        >>> W = jnp.array([[1.0, 2.0], [3.0, 4.0]])
        >>> squared_frobenius_norm(lambda x: x @ W.T)(jnp.ones((2, 2))).tolist()
        [30.0, 30.0]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import squared_frobenius_norm
        >>> W = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> squared_frobenius_norm(lambda x: x @ W.T)(torch.ones(2, 2)).tolist()
        [30.0, 30.0]
    """
    return forward(F.squared_frobenius_norm, locals())


@transform
def value_divergence_and_frobenius(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import value_divergence_and_frobenius
        >>> y, div, sq_fro = value_divergence_and_frobenius(lambda x: 2.0 * x)(jnp.ones((2, 3)))
        >>> y.shape, div.tolist(), sq_fro.tolist()
        ((2, 3), [6.0, 6.0], [12.0, 12.0])

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import value_divergence_and_frobenius
        >>> y, div, sq_fro = value_divergence_and_frobenius(lambda x: 2.0 * x)(torch.ones(2, 3))
        >>> tuple(y.shape), div.tolist(), sq_fro.tolist()
        ((2, 3), [6.0, 6.0], [12.0, 12.0])
    """
    return forward(F.value_divergence_and_frobenius, locals())


@transform
def log_abs_det(
    api: Api[ArrayT],
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

    Example (JAX):
        >>> import jax.numpy as jnp
        >>> from divjac.jax import log_abs_det
        >>> W = jnp.array([[2.0, 1.0], [0.0, 3.0]])  # det 6
        >>> [round(v, 4) for v in log_abs_det(lambda x: x @ W.T)(jnp.ones((2, 2))).tolist()]
        [1.7918, 1.7918]

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import log_abs_det
        >>> W = torch.tensor([[2.0, 1.0], [0.0, 3.0]])  # det 6
        >>> [round(v, 4) for v in log_abs_det(lambda x: x @ W.T)(torch.ones(2, 2)).tolist()]
        [1.7918, 1.7918]
    """
    return forward(F.log_abs_det, locals())


class Sparsity(Protocol):
    """What type checkers see of a framework's :func:`sparsity`: one pattern for one
    ``argnums``, a tuple of them for a sequence."""

    @overload
    def __call__(
        self,
        f: Callable[..., Any],
        /,
        argnums: int = 0,
        *,
        batch_axis: int | None = 0,
        has_aux: bool = False,
    ) -> Callable[..., SparsityPattern]: ...

    @overload
    def __call__(
        self,
        f: Callable[..., Any],
        /,
        argnums: Sequence[int],
        *,
        batch_axis: int | None = 0,
        has_aux: bool = False,
    ) -> Callable[..., tuple[SparsityPattern, ...]]: ...


def bound_sparsity(api: Api[Any]) -> Sparsity:
    """:func:`sparsity` bound to ``api`` (:func:`~divjac._public.bind`), as type checkers see it:
    with its overloads."""
    bound = bind(api, sparsity)
    return bound
