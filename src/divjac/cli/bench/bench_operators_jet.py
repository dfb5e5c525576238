"""Third- and fourth-order operators in PyTorch: divjac's ``differential_operator`` against
jet-for-pytorch's collapsed Taylor mode (issue 45's comparison).

The cases of ``bench_operators_torch`` (P21 at ``d = 8`` and 32, P23), float32, without autograd,
with jet-for-pytorch 1.0 written as its own ``bilaplacian`` uses it: one collapsed jet of the
batched function (``jet(u, (x,), collapsed=True)``), the first coefficients the directions
``[R, B, d]`` (shared by the samples), the middle ones zero, the top one summed. P21's directions
are the coordinates; P23's ``d^3u/dx_0^2 dx_15`` is ``T(a, a, b) = ((a + b)^3 - (a - b)^3 - 2
b^3) / 6`` of the third derivative ``T`` along ``a + b``, ``a - b`` and ``b``, each scaled by the
cube root of its weight (a collapsed jet sums its directions unweighted). jet-for-pytorch needs
Python >= 3.12: elsewhere this module is skipped.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from ...models import torch as models
from ...torch import differential_operator
from ._harness import Result, gain_row, rel_err
from .bench_operators_torch import Fn

JET_TARGET = 1.0
"""divjac's exact operator at least as fast as jet-for-pytorch's collapsed jets."""


def _mlp(d: int) -> tuple[Fn, torch.Tensor]:
    """``bench_operators_torch``'s MLP and points, its output ``[B, 1]`` kept: jet-for-pytorch
    1.0 has no rule for ``aten.select`` (``u(x)[..., 0]``)."""
    params = models.init_mlp(0, (d, 64, 64, 1))
    x = torch.randn(128, d, generator=torch.Generator().manual_seed(1))
    return partial(models.mlp, params), x


def _collapsed(u: Fn, x: torch.Tensor, directions: torch.Tensor, order: int) -> Fn:
    """``sum_r (v_r . grad)^order u`` for the directions ``[R, d]``, by one collapsed jet."""
    from jet import jet  # (not installed: ``divjac bench`` skips the module, naming it)

    jet_u = jet(u, (x,), collapsed=True)
    first = directions[:, None, :].expand(-1, *x.shape).contiguous()
    middle = torch.zeros_like(first)
    top = torch.zeros_like(x)

    def operator(z: torch.Tensor) -> torch.Tensor:
        coefficients = jet_u((z, first, *[middle] * (order - 2), top))
        # jet's coefficients are the derivatives along the curve (no 1/k!)
        return coefficients[order]

    return operator


def _row(id: str, case: str, ours: Fn, theirs: Fn, x: torch.Tensor, repeat: int) -> Result:
    return gain_row(
        id,
        case,
        ("differential_operator (exact)", partial(ours, x)),
        ("jet-for-pytorch: one collapsed jet", partial(theirs, x)),
        target=JET_TARGET,
        extra={"max_rel_err_vs_jet": rel_err(ours(x), theirs(x))},
        repeat=repeat,
        min_time=0.0,
    )


def _fourth(d: int, repeat: int) -> Result:
    u, x = _mlp(d)
    ours = differential_operator(u, [(1.0, (i, i, i, i)) for i in range(d)], method="exact")
    theirs = _collapsed(u, x, torch.eye(d), 4)
    case = f"sum_i d4u/dx_i^4, MLP {d}-64-64-1 tanh, B=128, float32 (torch, vs jet)"
    return _row("P21j", case, ours, theirs, x, repeat)


def _mixed(repeat: int) -> Result:
    u, x = _mlp(16)
    ours = differential_operator(u, [(1.0, (0, 0, 15))], method="exact")
    a, b = torch.eye(16)[0], torch.eye(16)[15]
    weights = (1 / 6, -1 / 6, -2 / 6)
    directions = torch.stack(
        [
            math.copysign(abs(w) ** (1 / 3), w) * v
            for w, v in zip(weights, (a + b, a - b, b), strict=True)
        ]
    )
    theirs = _collapsed(u, x, directions, 3)
    case = "u_xxt = d3u/dx_0^2 dx_15, MLP 16-64-64-1 tanh, B=128, float32 (torch, vs jet)"
    return _row("P23j", case, ours, theirs, x, repeat)


@torch.no_grad()
def run(quick: bool) -> list[Result]:
    if quick:
        return [_fourth(8, 1), _mixed(1)]
    return [_fourth(8, 7), _fourth(32, 7), _mixed(7)]
