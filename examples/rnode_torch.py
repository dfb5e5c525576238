"""Training a regularized CNF (FFJORD + RNODE penalties) with torchdiffeq.

RNODE (Finlay et al. 2020, "How to train your neural ODE") adds two penalties to FFJORD's
maximum likelihood: the kinetic energy ``integral ||f||^2 dt`` and the Jacobian penalty
``integral ||J_f||_F^2 dt``, both integrated alongside the log-density. The dynamics need ``f``,
its divergence and the squared Frobenius norm of its Jacobian at every step; divjac's
``value_divergence_and_frobenius`` gives all three from one set of passes: one VJP per probe
(``v^T J v`` and ``||v^T J||^2``), as RNODE's code does by hand, or exactly.

Run: ``python examples/rnode_torch.py``
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torchdiffeq import odeint

from divjac.models import torch as models
from divjac.torch import value_divergence_and_frobenius


def velocity(params: Any, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The vector field ``f(z, t)``: the built-in ``net(x, t)`` MLP, ``z (B, d)``, scalar ``t``."""
    return models.mlp_xt(params, z, t.to(z.dtype).expand(z.shape[0], 1))


def losses(
    params: Any, x: torch.Tensor, probes: torch.Tensor | None, *, steps: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(-log p(x), kinetic energy, Jacobian penalty)`` over ``t in [0, 1]``.

    ``probes``: one Hutchinson probe per sample, fixed across the solve (``None``: exact).
    """
    method = "exact" if probes is None else "hutchinson"
    field = value_divergence_and_frobenius(velocity, argnums=1, method=method)
    noise = () if probes is None else (probes,)

    def dynamics(t: torch.Tensor, state: tuple[torch.Tensor, ...]) -> Any:
        z = state[0]
        dz, div, sq_fro = field(*noise, params, z, t)
        return dz, -div, (dz**2).sum(1), sq_fro

    zero = torch.zeros(x.shape[0], dtype=x.dtype)
    times = torch.tensor([0.0, 1.0], dtype=x.dtype)
    solution = odeint(
        dynamics, (x, zero, zero, zero), times, method="rk4", options={"step_size": 1 / steps}
    )
    z1, minus_integral, kinetic, jacobian = (s[-1] for s in solution)
    log_base = -0.5 * (z1**2).sum(1) - 0.5 * x.shape[1] * math.log(2 * math.pi)
    return -(log_base - minus_integral), kinetic, jacobian


def two_moons(n: int, generator: torch.Generator) -> torch.Tensor:
    """A small 2-d data set: two interleaved half circles with noise."""
    angle = math.pi * torch.rand(n, generator=generator)
    upper = torch.rand(n, generator=generator) < 0.5
    x = torch.stack([torch.cos(angle), torch.sin(angle)], 1)
    x = torch.where(upper[:, None], x, torch.stack([1 - x[:, 0], 0.5 - x[:, 1]], 1))
    return x + 0.05 * torch.randn(n, 2, generator=generator)


def main(small: bool = False) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    batch, iterations, hidden = (16, 3, 16) if small else (256, 200, 64)
    weights = models.init_mlp_xt(0, 2, hidden, torch.get_default_dtype())
    params = [(w.requires_grad_(), b.requires_grad_()) for w, b in weights]
    optimizer = torch.optim.Adam([t for pair in params for t in pair], lr=1e-2)
    history = []
    for it in range(iterations):
        x = two_moons(batch, generator).to(torch.get_default_dtype())
        probes = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        nll, kinetic, jacobian = losses(params, x, probes, steps=2 if small else 8)
        loss = (nll + 0.01 * kinetic + 0.01 * jacobian).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(loss.item())
        if not small and it % 20 == 0:
            print(f"step {it:4d}  loss {loss.item():.4f}  nll {nll.mean().item():.4f}")
    return {"params": params, "history": history, "x": x}


if __name__ == "__main__":
    main()
