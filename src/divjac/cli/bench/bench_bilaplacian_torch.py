"""The bi-Laplacian in PyTorch: divjac's exact ``bilaplacian`` against nested Hessians.

The MLP ``16 -> W -> W -> 1`` (tanh), float32, without autograd: ``bilaplacian(u)`` (the
collapsed sweep of the unit basis through the collapsed sweep of the unit basis) against what
a user writes by hand, ``vmap`` over the samples of the trace of ``torch.func.hessian`` of the
Laplacian ``trace(hessian(u))``. Target: at least 3x faster.
"""

from __future__ import annotations

import torch
from torch.func import hessian, vmap

from ...models import torch as models
from ...torch import bilaplacian
from ._harness import Result, bilaplacian_row


def run(quick: bool) -> list[Result]:
    d, width, batch = (16, 64, 64) if quick else (16, 128, 128)
    params = models.init_mlp(0, (d, width, width, 1))
    x = torch.randn(batch, d, generator=torch.Generator().manual_seed(1))

    def u(z: torch.Tensor) -> torch.Tensor:
        return models.mlp(params, z)[:, 0]

    def laplacian(z: torch.Tensor) -> torch.Tensor:
        return torch.trace(hessian(lambda s: models.mlp(params, s[None])[0, 0])(z))

    ours = bilaplacian(u)

    def nested() -> torch.Tensor:
        return torch.diagonal(vmap(hessian(laplacian))(x), 0, 1, 2).sum(1)

    case = f"bi-Laplacian, MLP {d}-{width}-{width}-1 tanh, B={batch}, float32"
    with torch.no_grad():
        want = nested()
        rel_err = float((ours(x) - want).abs().max() / want.abs().max())
        row = bilaplacian_row(
            "torch",
            case,
            lambda: ours(x),
            nested,
            rel_err=rel_err,
            repeat=3 if quick else 7,
            min_time=0.0,
        )
    return [row]
