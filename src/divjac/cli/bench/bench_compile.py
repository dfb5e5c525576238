"""divjac.torch under ``torch.compile(fullgraph=True)`` against the same step run eagerly.

A training step (the divergence loss and its ``backward``) of a small MLP (``16 -> 64 -> 64 ->
16``, tanh, ``B = 64``) and a small CNN (two 3x3 convolutions, 8 channels, ``[8, 3, 8, 8]``),
float32, for ``method`` in exact, sparse and hutchinson (8 probes given as a tensor, the
compile-friendly randomness). The loss is compiled (inductor); its ``backward`` runs the
compiled backward graph. Median times after warm-up (the first call compiles); the ratio is
compiled / eager, measured in alternation (goal: <= 1). Quick mode: the MLP only, with the ``aot_eager`` backend (what
dynamo and the ahead-of-trace setup cost, without inductor's minutes of compilation).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from ..._call import Method
from ...torch import divergence
from ._harness import Result

_METHODS: tuple[Method, ...] = ("exact", "sparse", "hutchinson")


def run(quick: bool) -> list[Result]:
    cases = [_mlp()] if quick else [_mlp(), _cnn()]
    backend = "aot_eager" if quick else "inductor"
    return [
        _compare(case, net, x, method, backend, repeat=5 if quick else 30)
        for case, net, x in cases
        for method in _METHODS
    ]


def _mlp() -> tuple[str, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16)
    )
    return "MLP 16-64-64-16, B=64", net, torch.randn(64, 16)


def _cnn() -> tuple[str, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 3, 3, padding=1))
    return "CNN 3x3 8ch [8,3,8,8]", net, torch.randn(8, 3, 8, 8)


def _compare(
    case: str, net: nn.Module, x: torch.Tensor, method: Method, backend: str, repeat: int
) -> Result:
    probes = torch.randn(8, *x.shape)

    def loss(x: torch.Tensor) -> torch.Tensor:
        if method == "hutchinson":
            div = divergence(net, method=method, num_probes=8)(probes, x)
        else:
            div = divergence(net, method=method)(x)
        return (div**2).mean()

    torch.compiler.reset()
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    start = time.perf_counter()
    step(compiled, x)
    compile_s = time.perf_counter() - start
    eager_value, compiled_value = loss(x), compiled(x)
    t_eager, t_compiled = _median_times([lambda: step(loss, x), lambda: step(compiled, x)], repeat)
    net.zero_grad()
    return Result(
        "-",
        f"{case}, loss + backward (torch.compile {backend})",
        f"compiled {method}",
        f"eager {method}",
        t_compiled,
        t_eager,
        target=None,
        extra={
            "compile_s": compile_s,
            "max_abs_diff": float((compiled_value - eager_value).detach().abs().max()),
        },
    )


def step(loss: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    loss(x).backward()


def _median_times(fns: list[Callable[[], None]], repeat: int) -> list[float]:
    """Median times of ``fns``, measured in alternation (fair under machine noise)."""
    for fn in fns:
        for _ in range(3):  # warm-up
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, kept in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return [statistics.median(kept) for kept in times]
