"""The linear differential operators of :mod:`divjac.jax` (:mod:`divjac._operators` with
:class:`~divjac.jax._backend.JaxBackend`), as :mod:`divjac.jax._api`'s transforms are written."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

from .. import _operators as O
from .._call import Coupling, OperatorMethod
from .._docs import documented
from ._api import _compiled_when_eager, _randomness
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import derivative
        >>> u = lambda x: x[:, 0] ** 3 * x[:, 1]  # d^3u/dx0^2 dx1 = 6 x0
        >>> derivative(u, (0, 0, 1))(jnp.array([[1.0, 2.0], [3.0, 4.0]])).round().tolist()
        [6.0, 18.0]
    """
    return _compiled_when_eager(
        O.derivative,
        u,
        argnums,
        alpha=tuple(alpha) if isinstance(alpha, list) else alpha,  # hashable: a cache key
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
        >>> import jax.numpy as jnp
        >>> from divjac.jax import differential_operator
        >>> u = lambda x: x[:, 0] ** 4 + x[:, 0] * x[:, 1]  # u_xxxx + 2 u_xy = 24 + 2
        >>> op = differential_operator(u, [(1.0, (0, 0, 0, 0)), (2.0, (0, 1))])
        >>> op(jnp.ones((2, 2))).round().tolist()
        [26.0, 26.0]
    """
    options: dict[str, Any] = dict(
        batch_axis=batch_axis,
        method=method,
        num_probes=num_probes,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        has_aux=has_aux,
        coupling=coupling,
    )
    if _numbers_only(terms):
        # Hashable: part of the key of the compiled program of an eager call.
        static = tuple((c, tuple(alpha)) for c, alpha in terms)
        return _compiled_when_eager(
            O.differential_operator, u, argnums, skip=_randomness(method), terms=static, **options
        )
    # Per-sample arrays and functions of the input are the caller's values, not constants of
    # a cached program: traced where the call is (inside the caller's jax.jit).
    return O.differential_operator(BACKEND, u, argnums, terms=terms, **options)


def _numbers_only(terms: Any) -> bool:
    """Whether ``terms`` are pairs of a real number and a sequence of indices."""
    try:
        return all(
            isinstance(c, numbers.Real) and isinstance(alpha, Sequence) for c, alpha in terms
        )
    except (TypeError, ValueError):
        return False  # not pairs: the transform says what they should be
