"""Linear differential operators up to fourth order in PyTorch: divjac's
``differential_operator`` against nested ``torch.func.jacfwd``.

The rows of ``bench_operators`` (P21, P23, P24) in torch, float32, without autograd; the
baseline is the cheapest nested ``jacfwd`` a user writes: the ``k``-th ``jacfwd`` of
``s -> u(x + s @ basis)`` over the coordinates the partial involves, ``vmap`` over them and
the samples. ``--quick`` runs P21 at ``d = 8`` and P24 up to ``d = 32`` only, once each.
(jet-for-pytorch, which needs Python 3.12 or newer, is compared in ``bench_operators_jet``.)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.func import jacfwd, vmap

from ...models import torch as models
from ...torch import differential_operator
from ._harness import Result, operator_row, particles_row, rel_err

Fn = Callable[[torch.Tensor], torch.Tensor]


def nested_jacfwd(u1: Fn, x: torch.Tensor, basis: torch.Tensor, alpha: tuple[int, ...]) -> Any:
    """``d^|alpha| / ds_alpha u1(x + s @ basis)`` at ``s = 0`` by nested ``jacfwd``."""
    g: Fn = lambda s: u1(x + s @ basis)  # noqa: E731
    for _ in alpha:
        g = jacfwd(g)
    return g(x.new_zeros(basis.shape[0]))[alpha]


def _single(u: Fn) -> Fn:
    return lambda z: u(z[None])[0]


def fourth_diagonal(u: Fn) -> Fn:
    """``sum_i d^4u/dx_i^4`` per sample by nested ``jacfwd`` along each coordinate."""

    def per_sample(x: torch.Tensor) -> torch.Tensor:
        rows = torch.eye(x.shape[0], dtype=x.dtype)[:, None, :]
        return vmap(lambda e: nested_jacfwd(_single(u), x, e, (0, 0, 0, 0)))(rows).sum()

    return vmap(per_sample)


def _mlp(d: int) -> tuple[Fn, torch.Tensor]:
    params = models.init_mlp(0, (d, 64, 64, 1))
    x = torch.randn(128, d, generator=torch.Generator().manual_seed(1))
    return lambda z: models.mlp(params, z)[..., 0], x


@torch.no_grad()
def run(quick: bool) -> list[Result]:
    if quick:  # d = 32 (P21) and 128 (P24) take seconds a call on torch: the full run only
        return [_fourth(8, 1), _mixed(1), _particles(1, (8, 32))]
    return [_fourth(8, 7), _fourth(32, 7), _mixed(7), _particles(7, (8, 32, 128))]


def _fourth(d: int, repeat: int) -> Result:
    u, x = _mlp(d)
    ours = differential_operator(u, [(1.0, (i, i, i, i)) for i in range(d)], method="exact")
    return operator_row(
        "P21",
        f"sum_i d4u/dx_i^4, MLP {d}-64-64-1 tanh, B=128, float32 (torch)",
        partial(ours, x),
        ("torch.func: vmap of nested jacfwd along each x_i", partial(fourth_diagonal(u), x)),
        repeat=repeat,
        min_time=0.0,
    )


def _mixed(repeat: int) -> Result:
    u, x = _mlp(16)
    ours = differential_operator(u, [(1.0, (0, 0, 15))], method="exact")
    basis = torch.eye(16)[[0, 15]]
    nested = vmap(lambda z: nested_jacfwd(_single(u), z, basis, (0, 0, 1)))
    return operator_row(
        "P23",
        "u_xxt = d3u/dx_0^2 dx_15, MLP 16-64-64-1 tanh, B=128, float32 (torch)",
        partial(ours, x),
        ("torch.func: vmap of nested jacfwd in (x_0, x_15)", partial(nested, x)),
        repeat=repeat,
        min_time=0.0,
    )


def _particles(repeat: int, sizes: tuple[int, ...]) -> Result:
    phi = models.init_mlp(2, (2, 16, 16, 1))

    def u(z: torch.Tensor) -> torch.Tensor:  # (B, d) -> (B,): a sum over the pairs of z
        return models.mlp(phi, z.reshape(*z.shape[:-1], -1, 2))[..., 0].sum(-1)

    def x(d: int) -> torch.Tensor:
        return torch.randn(32, d, generator=torch.Generator().manual_seed(3))

    def operator(d: int) -> Fn:
        return differential_operator(u, [(1.0, (i, i, i, i)) for i in range(d)])

    extra = {
        f"max_rel_err_vs_nested_jacfwd_d{d}": rel_err(operator(d)(x(d)), fourth_diagonal(u)(x(d)))
        for d in (8, 32)
    }
    return particles_row(
        "torch",
        "sum_i d4u/dx_i^4 of a sum over pairs, phi 2-16-16-1 tanh, B=32, float32",
        {d: (partial(operator(d), x(d)), partial(u, x(d))) for d in sizes},
        repeat=repeat,
        extra=extra,
    )
