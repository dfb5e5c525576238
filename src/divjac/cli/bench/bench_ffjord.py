"""The CNF hot path: divjac against FFJORD's own divergence code, side by side in one run.

FFJORD's ODE function (:class:`divjac.models.torch.ConcatSquashODE`: concat-squash layers,
softplus, hidden 64-64-64), ``B = 256``, ``d`` in {2, 64, 784}, float32, parameters requiring
grad (training). At every evaluation FFJORD computes ``f(t, x)`` and Hutchinson's
``e^T (df/dx) e`` from one VJP (``autograd.grad(f, x, e, create_graph=True)``), or, for small
``d``, the exact trace from a loop of ``d`` such gradients. Measured with the same probes (the
estimates agree to rounding):

- one evaluation, forward only and forward + backward to the parameters, 1 and 16 probes (the
  baseline for 16 is the faster of a loop of 16 VJPs and ``is_grads_batched``); best-of times,
  and for one probe forward + backward also the ratio of the medians (P17, target 1.05);
- the exact divergence (``d = 2``, ``d = 64``) against FFJORD's loop;
- a whole training step: ``torchdiffeq.odeint`` (rk4, 8 steps) of the CNF with Hutchinson,
  then the backward pass of the negative log-likelihood;
- divjac's overhead per call: the same passes on a tiny function (``sin`` on ``[4, 3]``)
  against hand-written ``autograd.grad`` code, which should stay below 0.2 ms.

The JAX rows are in :mod:`.bench_ffjord_jax` (they run where torch is not installed).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from ...models import torch as models
from ...torch import value_and_divergence
from ._harness import Result, interleaved_best_times, interleaved_times

B = 256


def run(quick: bool) -> list[Result]:
    repeat = 5 if quick else 15
    results: list[Result] = []
    for d in (2, 64) if quick else (2, 64, 784):
        results += _evaluation(d, 1, repeat)
        results += _evaluation(d, 16, repeat)
    for d in (2,) if quick else (2, 64):
        results += _exact(d, repeat)
    for d in (2,) if quick else (2, 64):
        results.append(_training_step(d, 3 if quick else 7))
    results += _overhead(repeat)
    return results


def _setup(d: int) -> tuple[models.ConcatSquashODE, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(d)
    return models.ConcatSquashODE(d), torch.tensor(0.5), torch.randn(B, d, generator=gen)


def _timed(
    fns: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]], repeat: int
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Forward-only and forward + backward best times of each ``fn() -> (y, div)``, and the
    median forward + backward times."""

    def backward(fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        def step() -> None:
            y, div = fn()
            (y.square().mean() + div.mean()).backward()

        return step

    both = {**fns, **{k + "+bwd": backward(fn) for k, fn in fns.items()}}
    times = interleaved_times(both, repeat=repeat, min_time=0.02)
    best = {k: min(ts) for k, ts in times.items()}
    median = {k: statistics.median(times[k + "+bwd"]) for k in fns}
    return {k: best[k] for k in fns}, {k: best[k + "+bwd"] for k in fns}, median


def _evaluation(d: int, k: int, repeat: int) -> list[Result]:
    f, t, x0 = _setup(d)
    x = x0.clone().requires_grad_()
    probes = torch.randn(k, B, d, generator=torch.Generator().manual_seed(1))
    ours = value_and_divergence(lambda x: f(t, x), method="hutchinson", num_probes=k)

    def loop() -> tuple[torch.Tensor, torch.Tensor]:
        y = f(t, x)
        terms = [(torch.autograd.grad(y, x, e, create_graph=True)[0] * e).sum(1) for e in probes]
        return y, torch.stack(terms).mean(0)

    def batched() -> tuple[torch.Tensor, torch.Tensor]:
        y = f(t, x)
        pulled = torch.autograd.grad(y, x, probes, create_graph=True, is_grads_batched=True)[0]
        return y, (pulled * probes).sum(2).mean(0)

    fns: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
        "ours": lambda: ours(probes, x),
        "loop": loop,
    }
    if k > 1:
        fns["is_grads_batched"] = batched
    err = float((ours(probes, x)[1] - loop()[1]).abs().max() / loop()[1].abs().max())
    fwd, bwd, median = _timed(fns, repeat)
    results = []
    for label, times in (("forward", fwd), ("forward+backward", bwd)):
        base = min((n for n in times if n != "ours"), key=times.__getitem__)
        results.append(
            Result(
                "F1",
                f"FFJORD ODEfunc d={d}, B={B}, {k} probe{'s' * (k > 1)}, {label} (torch)",
                "value_and_divergence(hutchinson)",
                f"FFJORD's VJP code ({base})",
                times["ours"],
                times[base],
                target=1.10,
                extra={"max_rel_diff": err},
            )
        )
    if k == 1:
        results.append(
            Result(
                "P17",
                f"FFJORD ODEfunc d={d}, B={B}, 1 probe, forward+backward, median (torch)",
                "value_and_divergence(hutchinson)",
                "FFJORD's VJP code (loop)",
                median["ours"],
                median["loop"],
                target=1.05,
            )
        )
    return results


def _exact(d: int, repeat: int) -> list[Result]:
    f, t, x0 = _setup(d)
    x = x0.clone().requires_grad_()
    ours = value_and_divergence(lambda x: f(t, x), method="exact")

    def loop() -> tuple[torch.Tensor, torch.Tensor]:
        y = f(t, x)
        div = sum(
            torch.autograd.grad(y[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(d)
        )
        return y, torch.as_tensor(div)

    err = float((ours(x)[1] - loop()[1]).abs().max() / loop()[1].abs().max())
    _, bwd, _ = _timed({"ours": lambda: ours(x), "loop": loop}, repeat)
    return [
        Result(
            "F2",
            f"FFJORD ODEfunc d={d}, B={B}, exact, forward+backward (torch)",
            "value_and_divergence(exact)",
            f"FFJORD's loop of {d} gradients",
            bwd["ours"],
            bwd["loop"],
            target=1.10 if d < 16 else 1.0,
            extra={"max_rel_diff": err},
        )
    ]


def _training_step(d: int, repeat: int) -> Result:
    from torchdiffeq import odeint

    f, _, x0 = _setup(d)
    probes = torch.randn(B, d, generator=torch.Generator().manual_seed(2))
    ours = value_and_divergence(f, 1, method="hutchinson", num_probes=1)

    def ffjord_field(t: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = state[0]
        with torch.enable_grad():
            x = x if x.requires_grad else x.requires_grad_()
            y = f(t, x)
            g = torch.autograd.grad(y, x, probes, create_graph=True)[0]
        return y, -(g * probes).sum(1)

    def ours_field(t: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        y, div = ours(probes, t, state[0])
        return y, -div

    def step(field: Callable[..., Any]) -> Callable[[], float]:
        def run() -> float:
            f.zero_grad()
            times = torch.tensor([0.0, 1.0])
            z, dlogp = odeint(
                field, (x0, torch.zeros(B)), times, method="rk4", options={"step_size": 0.125}
            )
            nll = (0.5 * z[-1].square().sum(1) - dlogp[-1]).mean()
            nll.backward()
            return float(nll)

        return run

    runs = {"ours": step(ours_field), "ffjord": step(ffjord_field)}
    err = abs(runs["ours"]() - runs["ffjord"]())
    t = interleaved_best_times(runs, repeat=repeat, min_time=0.0)
    return Result(
        "F3",
        f"CNF training step d={d}, B={B}: odeint rk4 (8 steps) + backward (torch)",
        "value_and_divergence(hutchinson)",
        "FFJORD's VJP code",
        t["ours"],
        t["ffjord"],
        target=1.10,
        extra={"abs_diff_loss": err},
    )


def _overhead(repeat: int) -> list[Result]:
    """divjac's own cost per call: the same passes on a tiny function, against hand-written
    ``autograd.grad`` code (one VJP for a probe; a loop of 3 for the exact divergence)."""
    x = torch.randn(4, 3).requires_grad_()
    probe = torch.randn(1, 4, 3)
    hutchinson = value_and_divergence(torch.sin, method="hutchinson", num_probes=1)
    exact = value_and_divergence(torch.sin, method="exact")
    eye = torch.eye(3)

    def hand_hutchinson() -> torch.Tensor:
        y = torch.sin(x)
        return (torch.autograd.grad(y, x, probe[0], create_graph=True)[0] * probe[0]).sum(1)

    def hand_exact() -> torch.Tensor:
        y = torch.sin(x)
        rows = [torch.autograd.grad(y, x, e.expand(4, 3), create_graph=True)[0] for e in eye]
        return torch.stack([r[:, i] for i, r in enumerate(rows)]).sum(0)

    t = interleaved_best_times(
        {
            "hutchinson": lambda: hutchinson(probe, x),
            "hand_hutchinson": hand_hutchinson,
            "exact": lambda: exact(x),
            "hand_exact": hand_exact,
        },
        repeat=repeat,
    )
    return [
        Result(
            "F4",
            f"per-call overhead, sin on [4, 3], {name} (torch)",
            f"value_and_divergence({name}) - hand-written",
            "0.2 ms budget",
            t[name] - t["hand_" + name],
            2e-4,
            target=1.0,
            extra={"divjac_s": t[name], "hand_s": t["hand_" + name]},
        )
        for name in ("hutchinson", "exact")
    ]
