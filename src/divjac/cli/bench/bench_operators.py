"""Linear differential operators up to fourth order in JAX: divjac's ``differential_operator``
against nested ``jax.jacfwd``.

- P21: ``sum_i d^4u/dx_i^4`` of the MLP ``d -> 64 -> 64 -> 1`` (tanh), ``d`` in {8, 32},
  ``B = 128``, float32, jitted. The baseline is the cheapest nested ``jacfwd`` a user writes
  for it: the fourth ``jacfwd`` of ``s -> u(x + s e_i)`` (a scalar ``s``), ``vmap`` over the
  coordinates ``i`` and the samples (the full ``jacfwd`` of ``jacfwd`` ... holds ``d^4``
  entries per sample, 1M at ``d = 32``). Target: at least 5x faster.
- P23: the mixed ``u_xxt = d^3u/dx_0^2 dx_15`` of the same MLP at ``d = 16``: the third
  ``jacfwd`` of ``s -> u(x + s_0 e_0 + s_1 e_15)`` (``s`` in R^2), ``vmap`` over the samples.
- P24: ``sum_i d^4u/dx_i^4`` of a sum over particles ``u(x) = sum_p phi(x_p)`` (``x_p`` in
  R^2, ``phi`` a tanh MLP ``2 -> 16 -> 16 -> 1``), ``d = 2P`` in {8, 32, 128}, ``B = 32``: the
  time of the operator over the time of ``u`` itself, at each ``d`` (the sparse sweep's
  passes follow the colours, 2 here, not ``d``); the row compares the largest ``d`` with the
  smallest.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from ...jax import differential_operator
from ...models import jax as models
from ._harness import Result, operator_row, particles_row, rel_err


def nested_jacfwd(
    u1: Callable[[jax.Array], jax.Array], x: jax.Array, basis: jax.Array, alpha: tuple[int, ...]
) -> jax.Array:
    """``d^|alpha| / ds_alpha u1(x + s @ basis)`` at ``s = 0`` by ``|alpha|`` nested
    ``jax.jacfwd`` (``basis``: the unit vectors of the coordinates the partial involves)."""
    g: Callable[[jax.Array], jax.Array] = lambda s: u1(x + s @ basis)  # noqa: E731
    for _ in alpha:
        g = jax.jacfwd(g)
    return g(jnp.zeros(basis.shape[0], x.dtype))[alpha]


def fourth_diagonal(u1: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``sum_i d^4u/dx_i^4`` per sample by nested ``jacfwd`` along each coordinate."""

    def per_sample(x: jax.Array) -> jax.Array:
        rows = jnp.eye(x.shape[0], dtype=x.dtype)[:, None, :]
        return jax.vmap(lambda e: nested_jacfwd(u1, x, e, (0, 0, 0, 0)))(rows).sum()

    return jax.jit(jax.vmap(per_sample))


def _mlp(d: int) -> tuple[Callable[[jax.Array], jax.Array], Any]:
    params = models.init_mlp(jax.random.key(0), (d, 64, 64, 1))
    return lambda z: models.mlp(params, z)[..., 0], jax.random.normal(jax.random.key(1), (128, d))


def run(quick: bool) -> list[Result]:
    repeat = 3 if quick else 7
    rows = [_fourth(8, repeat), _full(repeat), _fourth(32, repeat)]
    return [*rows, _mixed(repeat), _particles(repeat)]


def _fourth(d: int, repeat: int) -> Result:
    u, x = _mlp(d)
    ours = jax.jit(
        differential_operator(u, [(1.0, (i, i, i, i)) for i in range(d)], method="exact")
    )
    return operator_row(
        "P21",
        f"sum_i d4u/dx_i^4, MLP {d}-64-64-1 tanh, B=128, float32, jit (JAX)",
        partial(ours, x),
        ("vmap of nested jacfwd along each x_i", partial(fourth_diagonal(u), x)),
        repeat=repeat,
        min_time=0.05,
    )


def _full(repeat: int) -> Result:
    """P21 at ``d = 8`` against what a user first writes: the diagonal of the full fourth
    derivative tensor (``d^4`` entries per sample) of four nested ``jacfwd``."""
    u, x = _mlp(8)
    ours = jax.jit(differential_operator(u, [(1.0, (i, i, i, i)) for i in range(8)]))
    single = lambda z: u(z[None])[0]  # noqa: E731
    tensor = jax.jacfwd(jax.jacfwd(jax.jacfwd(jax.jacfwd(single))))
    nested = jax.jit(jax.vmap(lambda z: jnp.einsum("iiii->", tensor(z))))
    return operator_row(
        "P21",
        "sum_i d4u/dx_i^4, MLP 8-64-64-1 tanh, B=128, float32, jit (JAX)",
        partial(ours, x),
        ("vmap of the diagonal of jacfwd(jacfwd(jacfwd(jacfwd(u))))", partial(nested, x)),
        repeat=repeat,
        min_time=0.05,
    )


def _mixed(repeat: int) -> Result:
    u, x = _mlp(16)
    ours = jax.jit(differential_operator(u, [(1.0, (0, 0, 15))], method="exact"))
    basis = jnp.eye(16, dtype=x.dtype)[jnp.array([0, 15])]
    nested = jax.jit(jax.vmap(lambda z: nested_jacfwd(u, z, basis, (0, 0, 1))))
    return operator_row(
        "P23",
        "u_xxt = d3u/dx_0^2 dx_15, MLP 16-64-64-1 tanh, B=128, float32, jit (JAX)",
        partial(ours, x),
        ("vmap of nested jacfwd in (x_0, x_15)", partial(nested, x)),
        repeat=repeat,
        min_time=0.05,
    )


def _particles(repeat: int) -> Result:
    phi = models.init_mlp(jax.random.key(2), (2, 16, 16, 1))

    def u(z: jax.Array) -> jax.Array:  # (B, d) -> (B,): a sum over the pairs of z
        return models.mlp(phi, z.reshape(*z.shape[:-1], -1, 2))[..., 0].sum(-1)

    def x(d: int) -> jax.Array:
        return jax.random.normal(jax.random.key(3), (32, d))

    def operator(d: int) -> Callable[[jax.Array], jax.Array]:
        return jax.jit(differential_operator(u, [(1.0, (i, i, i, i)) for i in range(d)]))

    extra = {
        f"max_rel_err_vs_nested_jacfwd_d{d}": rel_err(operator(d)(x(d)), fourth_diagonal(u)(x(d)))
        for d in (8, 32)
    }
    forward = jax.jit(u)
    return particles_row(
        "JAX",
        "sum_i d4u/dx_i^4 of a sum over pairs, phi 2-16-16-1 tanh, B=32, float32, jit",
        {d: (partial(operator(d), x(d)), partial(forward, x(d))) for d in (8, 32, 128)},
        repeat=repeat,
        extra=extra,
    )
