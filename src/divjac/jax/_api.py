"""The public transforms of :mod:`divjac.jax`: divjac's transforms on JAX arrays.

Each is a typed ``def`` calling the backend-neutral transform (:mod:`divjac._transforms`,
:mod:`divjac._divergence`) with :class:`~divjac.jax._backend.JaxBackend`; :mod:`divjac.torch`
has the same functions with the same signatures. The shared docstring text comes from
:mod:`divjac._docs`; the example of each is JAX's (doctested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, overload

import jax

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
from .._core.plan import STOCHASTIC_METHODS
from .._docs import documented
from . import _detect, _eager
from ._backend import BACKEND
from ._refusals import leaked_tracers_refused

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


def _compiled_when_eager(
    transform: Callable[..., Callable[..., Any]],
    f: Callable[..., Any],
    *positional: Any,
    skip: int = 0,
    **options: Any,
) -> Callable[..., Any]:
    """``transform(BACKEND, f, *positional, **options)`` (``positional``: ``argnums``, after the
    pattern of a ``*_from_pattern`` transform, keyed by identity), run as one cached compiled
    program when called outside ``jax.jit`` (:mod:`divjac.jax._eager`); JAX's failures to
    differentiate a ``custom_jvp`` rule are named (:mod:`divjac.jax._refusals`)."""
    call = _eager.compiled_when_eager(
        lambda g: transform(BACKEND, g, *positional, **options),
        f,
        (transform.__name__, positional, tuple(sorted(options.items()))),
        skip=skip,
        functional=BACKEND.functional,
        randomness=lambda r: BACKEND.is_randomness(r) or D._is_probes(BACKEND, r),
    )
    return leaked_tracers_refused(transform.__name__)(call)  # a context, used as a decorator


def _randomness(method: str) -> int:
    """Leading arguments of a call that are not the function's: a stochastic method's key."""
    stochastic_methods = (*STOCHASTIC_METHODS, *S.SWEEP_STOCHASTIC, *F.STOCHASTIC_METHODS)
    return 1 if method in stochastic_methods else 0


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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import jacobian
        >>> W = jnp.array([[1.0, 2.0], [3.0, 4.0]])
        >>> jacobian(lambda x: x @ W.T)(jnp.ones((5, 2))).shape
        (5, 2, 2)
    """
    return _compiled_when_eager(
        T.jacobian,
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import jacobian_from_pattern, sparsity
        >>> f = lambda x: jnp.cumsum(x, axis=1)
        >>> pattern = sparsity(f)(jnp.ones((8, 5)))
        >>> jacobian_from_pattern(f, pattern)(jnp.ones((3, 5)))[0].tolist()[1]
        [1.0, 1.0, 0.0, 0.0, 0.0]
    """
    options: dict[str, Any] = dict(batch_axis=batch_axis, chunk_size=chunk_size, has_aux=has_aux)
    return _compiled_when_eager(T.jacobian_from_pattern, f, pattern, argnums, **options)


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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import divergence
        >>> divergence(lambda x: jnp.sin(x))(jnp.zeros((3, 4))).tolist()
        [4.0, 4.0, 4.0]
    """
    return _compiled_when_eager(
        D.divergence,
        f,
        argnums,
        skip=_randomness(method),
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import value_and_divergence
        >>> y, div = value_and_divergence(lambda x: 2.0 * x)(jnp.ones((2, 3)))
        >>> y.shape, div.tolist()
        ((2, 3), [6.0, 6.0])
    """
    return _compiled_when_eager(
        D.value_and_divergence,
        f,
        argnums,
        skip=_randomness(method),
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import divergence_from_pattern, sparsity
        >>> f = lambda x: jnp.cumsum(x, axis=1) ** 2
        >>> pattern = sparsity(f)(jnp.ones((8, 5)))
        >>> divergence_from_pattern(f, pattern)(jnp.ones((2, 5))).tolist()
        [30.0, 30.0]
    """
    options: dict[str, Any] = dict(batch_axis=batch_axis, chunk_size=chunk_size, has_aux=has_aux)
    return _compiled_when_eager(D.divergence_from_pattern, f, pattern, argnums, **options)


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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import grad_divergence
        >>> grad_divergence(lambda x: x**3)(jnp.ones((2, 3))).tolist()
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """
    return _compiled_when_eager(
        D.grad_divergence,
        f,
        argnums,
        skip=_randomness(method),
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import laplacian
        >>> laplacian(lambda x: jnp.sum(x**2, axis=1))(jnp.ones((2, 3))).tolist()
        [6.0, 6.0]
    """
    return _compiled_when_eager(
        S.laplacian,
        u,
        argnums,
        skip=_randomness(method),
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import bilaplacian
        >>> bilaplacian(lambda x: jnp.sum(x**4, axis=1))(jnp.ones((2, 3))).tolist()
        [72.0, 72.0]
    """
    return _compiled_when_eager(
        S.bilaplacian,
        u,
        argnums,
        skip=_randomness(method),
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
    A: jax.Array | None = None,
    /,
    argnums: int = 0,
    *,
    factor: jax.Array | None = None,
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import weighted_laplacian
        >>> A = jnp.array([[2.0, 1.0], [1.0, 3.0]])
        >>> u = lambda x: x[:, 0] * x[:, 1]  # H = [[0, 1], [1, 0]]: tr(A H) = 2
        >>> weighted_laplacian(u, A)(jnp.ones((2, 2))).tolist()
        [2.0, 2.0]
        >>> weighted_laplacian(u, factor=jnp.eye(2))(jnp.ones((2, 2))).tolist()
        [0.0, 0.0]
    """
    coefficient, is_factor = S.coefficient_of(A, factor)
    inner = _compiled_when_eager(
        S.weighted_laplacian,
        u,
        argnums,
        skip=1 + _randomness(method),
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import hessian
        >>> hessian(lambda x: x[:, 0] ** 2 * x[:, 1])(jnp.ones((3, 2)))[0].tolist()
        [[2.0, 2.0], [2.0, 0.0]]
    """
    return _compiled_when_eager(
        S.hessian,
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import hessian_diagonal
        >>> hessian_diagonal(lambda x: jnp.sum(x**3, axis=1))(jnp.ones((2, 3))).tolist()
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """
    return _compiled_when_eager(
        S.hessian_diagonal,
        u,
        argnums,
        skip=_randomness(method),
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import squared_frobenius_norm
        >>> W = jnp.array([[1.0, 2.0], [3.0, 4.0]])
        >>> squared_frobenius_norm(lambda x: x @ W.T)(jnp.ones((2, 2))).tolist()
        [30.0, 30.0]
    """
    return _compiled_when_eager(
        F.squared_frobenius_norm,
        f,
        argnums,
        skip=_randomness(method),
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import value_divergence_and_frobenius
        >>> y, div, sq_fro = value_divergence_and_frobenius(lambda x: 2.0 * x)(jnp.ones((2, 3)))
        >>> y.shape, div.tolist(), sq_fro.tolist()
        ((2, 3), [6.0, 6.0], [12.0, 12.0])
    """
    return _compiled_when_eager(
        F.value_divergence_and_frobenius,
        f,
        argnums,
        skip=_randomness(method),
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import log_abs_det
        >>> W = jnp.array([[2.0, 1.0], [0.0, 3.0]])  # det 6
        >>> [round(v, 4) for v in log_abs_det(lambda x: x @ W.T)(jnp.ones((2, 2))).tolist()]
        [1.7918, 1.7918]
    """
    return _compiled_when_eager(
        F.log_abs_det,
        f,
        argnums,
        skip=_randomness(method),
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import sparsity
        >>> p = sparsity(lambda x: jnp.cumsum(x, axis=1))(jnp.ones((8, 5)))
        >>> p.nnz, p.n_diagonal_colors
        (15, 5)
    """
    return T.sparsity(BACKEND, f, argnums, batch_axis=batch_axis, has_aux=has_aux)


@documented()
def sparse_jacobian(
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

    Example:
        >>> import jax.numpy as jnp
        >>> from divjac.jax import sparse_jacobian
        >>> J = sparse_jacobian(lambda x: jnp.sin(x))(jnp.zeros((2, 3)))
        >>> J.shape, J.nse
        ((2, 3, 3), 3)
    """
    return _compiled_when_eager(
        T.sparse_jacobian,
        f,
        argnums,
        batch_axis=batch_axis,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
        layout=None,
    )


def clear_caches() -> None:
    """Drop every trace, detection and compiled eager call that ``divjac.jax`` has cached.

    Never needed for correct results: a cached detection is reused only when the traced
    program and everything it read are unchanged (see ``docs/how-it-works.md``, "Caching").
    Use it to free memory, or to time a first call.
    """
    _detect.CACHE.clear()
    _eager.CACHE.clear()
    _eager.VARYING.clear()
    stochastic.clear_plans()
