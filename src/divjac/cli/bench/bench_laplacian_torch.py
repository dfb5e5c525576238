"""P9 (torch): the Laplacian by the collapsed second-order sweep, side by side in one run.

The Laplacian of the MLP ``d -> 256 -> 256 -> 1`` (tanh), ``B = 256``, ``d`` in {16, 64, 256},
float32: ``divjac.torch._taylor.second_order_sweep`` (collapsed Taylor mode over the unit
basis, shared by the samples: directions ``[d, 1, d]``) vs

- the generic reference of the same contract (``vmap`` over the directions of ``jvp`` of
  ``jvp``: ``reference_sweep``),
- the ``torch.func`` Hessian trace (``vmap`` over the samples of ``hessian``, then the trace),
- forward-over-reverse (``divjac.torch.laplacian`` as it is today: ``d`` Hessian-vector
  products, ``jvp`` of the gradient),

measured interleaved (best of), without autograd; and one training step (a Laplacian loss and
its ``backward()`` w.r.t. the weights) by the sweep vs by forward-over-reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import hessian, vmap

from ...models import torch as models
from ...torch import laplacian
from ...torch._taylor import reference_sweep, second_order_sweep
from ._harness import Result, interleaved_best_times


def run(quick: bool) -> list[Result]:
    results: list[Result] = []
    for d in (16, 64) if quick else (16, 64, 256):
        results += _mlp_case(d, repeat=1 if quick else 5, quick=quick)
    return results


def _mlp_case(d: int, repeat: int, quick: bool) -> list[Result]:
    B = 256
    params = models.init_mlp(0, (d, 256, 256, 1))
    x = torch.randn(B, d, generator=torch.Generator().manual_seed(1))
    basis = torch.eye(d)[:, None]  # [d, 1, d]: shared by the samples

    def u(x: torch.Tensor) -> torch.Tensor:
        return models.mlp(params, x)

    def u_params(p: Any, x: torch.Tensor) -> torch.Tensor:
        return models.mlp(p, x)[:, 0]

    def per_sample(xi: torch.Tensor) -> torch.Tensor:
        return models.mlp(params, xi[None])[0, 0]

    fwd_rev = laplacian(u_params, 1, method="exact")
    fns: dict[str, Callable[[], Any]] = {
        "ours": lambda: second_order_sweep(u, x, basis)[2],
        "reference": lambda: reference_sweep(u, x, basis)[2],
        "hessian": lambda: torch.diagonal(vmap(hessian(per_sample))(x), 0, 1, 2).sum(1),
        "fwd-over-rev": lambda: fwd_rev(params, x),
    }
    with torch.no_grad():
        values = {k: fn().reshape(B) for k, fn in fns.items()}
        t = interleaved_best_times(fns, repeat=repeat, min_time=0.0)
    scale = float(values["hessian"].abs().max())
    errors = {k: float((v - values["hessian"]).abs().max()) / scale for k, v in values.items()}
    case = f"Laplacian MLP d={d}->256->256->1 tanh, B={B} (torch)"
    extra = {"max_rel_error_vs_hessian": errors["ours"]}
    results = [
        Result("P9", case, "second_order_sweep", "vmap(jvp(jvp)) reference", t["ours"],
               t["reference"], kind="gain", extra=extra),
        Result("P9", case, "second_order_sweep", "vmap(hessian) trace", t["ours"], t["hessian"],
               kind="gain", target=2.0 if d == 64 else None, extra=extra),
        Result("P9", case, "second_order_sweep", "forward-over-reverse (laplacian today)",
               t["ours"], t["fwd-over-rev"], kind="gain", extra=extra),
    ]  # fmt: skip
    if quick:
        return results
    results.append(_training_step(d, B, params, x, basis, repeat))
    return results


def _training_step(
    d: int, B: int, params: Any, x: torch.Tensor, basis: torch.Tensor, repeat: int
) -> Result:
    """A Laplacian loss (``mean(lap^2)``) and its gradient w.r.t. the weights."""
    trained = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in params]
    leaves = [p for pair in trained for p in pair]
    fwd_rev = laplacian(lambda p, x: models.mlp(p, x)[:, 0], 1, method="exact")

    def u(x: torch.Tensor) -> torch.Tensor:
        return models.mlp(trained, x)

    def ours() -> Any:
        lap = second_order_sweep(u, x, basis)[2]
        return torch.autograd.grad(lap.square().mean(), leaves, materialize_grads=True)

    def theirs() -> Any:
        lap = fwd_rev(trained, x)
        return torch.autograd.grad(lap.square().mean(), leaves, materialize_grads=True)

    diff = max(float((a - b).abs().max()) for a, b in zip(ours(), theirs(), strict=True))
    t = interleaved_best_times({"ours": ours, "theirs": theirs}, repeat=repeat, min_time=0.0)
    return Result(
        "-", f"Laplacian loss + backward, MLP d={d}, B={B} (torch)", "second_order_sweep",
        "forward-over-reverse (laplacian today)", t["ours"], t["theirs"], kind="gain",
        extra={"max_abs_grad_diff": diff},
    )  # fmt: skip
