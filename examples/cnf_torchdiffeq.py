"""Continuous normalizing flow log-likelihood with torchdiffeq (FFJORD; Grathwohl et al., 2019).

The PyTorch twin of ``cnf_diffrax.py``: ``dz/dt = f(z, t)`` from data (``t = 0``) to the base
distribution (``t = 1``), and

    log p(x) = log N(z(1); 0, I) + integral_0^1 div f(z(t), t) dt.

``torchdiffeq.odeint`` integrates the augmented state ``(z, -integral div f)``; divjac's
``value_and_divergence`` gives ``f`` and its per-sample divergence from one forward pass, exactly
or by Hutchinson's estimator with noise fixed across the solve: the probes are drawn once and
passed first at every step (a ``torch.Generator().manual_seed(s)`` created inside the dynamics
and passed first would do the same).

Run: ``python examples/cnf_torchdiffeq.py``
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torchdiffeq import odeint

from divjac.models import torch as models
from divjac.torch import value_and_divergence


def velocity(params: Any, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The vector field ``f(z, t)``: the built-in ``net(x, t)`` MLP, ``z (B, d)``, scalar ``t``."""
    return models.mlp_xt(params, z, t.to(z.dtype).expand(z.shape[0], 1))


def log_likelihood(
    params: Any,
    x: torch.Tensor,
    *,
    method: str = "auto",
    num_probes: int | None = None,
    probes: torch.Tensor | None = None,
    steps: int = 20,
) -> torch.Tensor:
    """Per-sample ``log p(x)`` of the CNF, shape ``(B,)`` (fixed-step RK4 over ``[0, 1]``)."""
    field = value_and_divergence(velocity, argnums=1, method=method, num_probes=num_probes)
    noise = () if probes is None else (probes,)  # the same probes at every step

    def dynamics(t: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> Any:
        z, _ = state
        dz, div = field(*noise, params, z, t)  # a stochastic method takes its probes first
        return dz, -div

    times = torch.tensor([0.0, 1.0], dtype=x.dtype)
    y0 = (x, torch.zeros(x.shape[0], dtype=x.dtype))
    zs, minus_integral = odeint(dynamics, y0, times, method="rk4", options={"step_size": 1 / steps})
    z1 = zs[-1]
    d = x.shape[1]
    log_base = -0.5 * (z1**2).sum(1) - 0.5 * d * math.log(2 * math.pi)
    return log_base - minus_integral[-1]


def main(small: bool = False) -> dict[str, Any]:
    """Exact and Hutchinson log-likelihoods, their agreement, and a gradient w.r.t. the params."""
    d, batch, steps, n_draws = (3, 8, 8, 16) if small else (16, 256, 20, 32)
    dtype = torch.get_default_dtype()
    params = models.init_mlp_xt(0, d, hidden=32 if small else 64, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x = 0.5 * torch.randn(batch, d, generator=gen, dtype=dtype)

    with torch.no_grad():
        exact = log_likelihood(params, x, steps=steps)

    def rademacher(seed: int, rows: int) -> torch.Tensor:  # one probe per sample: (1, rows, d)
        bits = torch.randint(0, 2, (1, rows, d), generator=torch.Generator().manual_seed(seed))
        return (2 * bits - 1).to(dtype)

    def hutchinson(x: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return log_likelihood(
                params, x, method="hutchinson", num_probes=1, probes=probes, steps=steps
            )

    probes = rademacher(2, batch)
    estimate, again = hutchinson(x, probes), hutchinson(x, probes)
    # n_draws independent estimates in one solve: the batch repeated, a fresh probe per row
    many = hutchinson(x.repeat(n_draws, 1), rademacher(3, n_draws * batch)).reshape(n_draws, -1)
    mean, stderr = many.mean(0), many.std(0) / math.sqrt(n_draws)

    leaves = [t.requires_grad_() for pair in params for t in pair]
    loss = -log_likelihood(params, x, steps=steps).mean()  # training loss: mean NLL
    loss.backward()
    grad_norm = math.sqrt(sum(float((t.grad**2).sum()) for t in leaves if t.grad is not None))

    print(f"CNF on d = {d}, {batch} samples, {steps} RK4 steps")
    print(f"  exact log p(x), first samples:       {exact[:4]}")
    print(f"  Hutchinson (1 probe, fixed noise):    {estimate[:4]}")
    print(f"  mean of {n_draws} draws +- stderr:         {mean[:4]} +- {stderr[:4]}")
    print(f"  same probes twice, same result:       {bool(torch.equal(estimate, again))}")
    print(f"  NLL {float(loss.detach()):.4f}, |d NLL / d params| = {grad_norm:.4f}")
    return {
        "params": params,
        "x": x,
        "steps": steps,
        "exact": exact,
        "hutchinson": estimate,
        "hutchinson_again": again,
        "hutchinson_mean": mean,
        "hutchinson_stderr": stderr,
        "loss": loss.detach(),
        "grads": [t.grad for t in leaves],
    }


if __name__ == "__main__":
    main()
