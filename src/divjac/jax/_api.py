"""The public transforms of :mod:`divjac.jax`: :mod:`divjac._transforms` bound to JAX.

Each function is the backend-neutral transform with :class:`~divjac.jax._backend.JaxBackend`
filled in; its docstring carries a JAX example (doctested).
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
    >>> import jax.numpy as jnp
    >>> from divjac.jax import jacobian
    >>> W = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    >>> jacobian(lambda x: x @ W.T)(jnp.ones((5, 2))).shape
    (5, 2, 2)
    """,
)

divergence = _bind(
    T.divergence,
    """
    >>> import jax.numpy as jnp
    >>> from divjac.jax import divergence
    >>> divergence(lambda x: jnp.sin(x))(jnp.zeros((3, 4))).tolist()
    [4.0, 4.0, 4.0]
    """,
)

value_and_divergence = _bind(
    T.value_and_divergence,
    """
    >>> import jax.numpy as jnp
    >>> from divjac.jax import value_and_divergence
    >>> y, div = value_and_divergence(lambda x: 2.0 * x)(jnp.ones((2, 3)))
    >>> y.shape, div.tolist()
    ((2, 3), [6.0, 6.0])
    """,
)

grad_divergence = _bind(
    T.grad_divergence,
    """
    >>> import jax.numpy as jnp
    >>> from divjac.jax import grad_divergence
    >>> grad_divergence(lambda x: x**3)(jnp.ones((2, 3))).tolist()
    [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """,
)

laplacian = _bind(
    T.laplacian,
    """
    >>> import jax.numpy as jnp
    >>> from divjac.jax import laplacian
    >>> laplacian(lambda x: jnp.sum(x**2, axis=1))(jnp.ones((2, 3))).tolist()
    [6.0, 6.0]
    """,
)

sparsity = _bind(
    T.sparsity,
    """
    >>> import jax.numpy as jnp
    >>> from divjac.jax import sparsity
    >>> p = sparsity(lambda x: jnp.cumsum(x, axis=1), jnp.ones((8, 5)))
    >>> p.nnz, p.n_diagonal_colors
    (15, 5)
    """,
)

sparse_jacobian = _bind(
    T.sparse_jacobian,
    """
    >>> import jax.numpy as jnp
    >>> from divjac.jax import sparse_jacobian
    >>> J = sparse_jacobian(lambda x: jnp.sin(x))(jnp.zeros((2, 3)))
    >>> J.shape, J.nse
    ((2, 3, 3), 3)
    """,
    options=BACKEND.sparse_format,
)


def clear_caches() -> None:
    """Drop every trace and detection that ``divjac.jax`` has cached.

    Never needed for correct results: a cached detection is reused only when the traced
    program and everything it read are unchanged (see ``docs/how-it-works.md``, "Caching").
    Use it to free memory, or to time a first call.
    """
    _detect.CACHE.clear()
    stochastic.clear_plans()
