"""P9 (torch): the exact Laplacian, side by side in one run.

The Laplacian of the MLP ``d -> 256 -> 256 -> 1`` (tanh), ``B = 256``, ``d`` in {16, 64, 256},
float32: ``divjac.torch.laplacian(method="exact")`` (the collapsed second-order Taylor sweep
of the unit basis, in chunks) vs

- the generic reference of the same contract (``vmap`` over the directions of ``jvp`` of
  ``jvp``: ``reference_sweep``),
- the ``torch.func`` Hessian trace (``vmap`` over the samples of ``hessian``, then the trace),
- forward-over-reverse as users write it (``d`` Hessian-vector products, ``jvp`` of
  ``torch.func.grad``, batched with ``vmap``, then the trace),

measured interleaved (best of), without autograd; the exact Laplacian of two networks whose
intermediates depend on few inputs (particles, FermiNet-like: first-order terms stored sparse)
against the dense sweep and the Hessian trace; one training step (a Laplacian loss and its
gradient w.r.t. the weights) by divjac vs by forward-over-reverse; and a PINN's step (an
``nn.Sequential`` 2-64-64-1 tanh MLP, ``u(x)[..., 0]``, B = 1000: per-call costs count)
against the gradient-of-gradient loop of PINN tutorials, on the autograd tape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad, hessian, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...models import torch as models
from ...torch import laplacian
from ...torch._taylor.sweep import reference_sweep, second_order_sweep
from ._harness import Result, interleaved_best_times


def run(quick: bool) -> list[Result]:
    results: list[Result] = []
    for d in (16, 64) if quick else (16, 64, 256):
        results += _mlp_case(d, repeat=1 if quick else 5, quick=quick)
    results += _blocks_cases(repeat=3 if quick else 7)
    results += _pinn_case(repeat=5 if quick else 15)
    results += _psiformer_case(repeat=3 if quick else 9)
    return results


def _pinn_case(repeat: int) -> list[Result]:
    """A PINN's Laplacian, and a step of its loss (``mean(lap^2)`` backpropagated to the
    weights), by divjac and by the loop PINN tutorials write: the gradient with
    ``create_graph``, then one more gradient per input dimension."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(
        torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip
    x = torch.randn(1000, 2, generator=torch.Generator().manual_seed(4))
    lap = laplacian(lambda x: net(x)[..., 0], method="exact")

    def loop() -> torch.Tensor:
        z = x.detach().requires_grad_()
        g = torch.autograd.grad(net(z)[..., 0].sum(), z, create_graph=True)[0]
        return sum(  # type: ignore[return-value]
            torch.autograd.grad(g[:, i].sum(), z, create_graph=True)[0][:, i] for i in range(2)
        )

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            net.zero_grad()
            fn().square().mean().backward()

        return run

    fns = {"ours": lambda: lap(x), "loop": loop}
    fns |= {k + "+bwd": step(fn) for k, fn in list(fns.items())}
    ref = loop().detach()
    error = float((lap(x).detach() - ref).abs().max() / ref.abs().max())
    t = interleaved_best_times(fns, repeat=repeat, min_time=0.02)
    case = "PINN Laplacian, nn.Sequential 2-64-64-1 tanh, B=1000 (torch)"
    label = "laplacian(method='exact')"
    baseline = "gradient-of-gradient loop (autograd.grad, create_graph)"
    extra = {"max_rel_diff": error}
    return [
        Result("-", case, label, baseline, t["ours"], t["loop"], target=None, extra=extra),
        Result("P9", case + ", loss + backward", label, baseline, t["ours+bwd"],
               t["loop+bwd"], target=1.0, extra=extra),
    ]  # fmt: skip


class _Psiformer(torch.nn.Module):
    """A Psiformer-like log-amplitude (von Glehn et al. 2023), small: per-electron features
    ``[r_i, |r_i|]``, a linear embedding, one self-attention block (pre-LayerNorm, multi-head
    attention over the electrons, a GELU MLP, residuals), the mean over electrons, a linear
    read-out, and an exponential envelope ``-sum |r_i|``."""

    def __init__(self, n: int, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.n = n
        self.embed = torch.nn.Linear(4, width)
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)])
        self.attention = torch.nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)
        )
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = x.reshape(x.shape[0], self.n, 3)
        distance = torch.linalg.vector_norm(r, dim=-1, keepdim=True)
        h = self.embed(torch.cat([r, distance], -1))
        a = self.norms[0](h)
        h = h + self.attention(a, a, a, need_weights=False)[0]
        h = h + self.mlp(self.norms[1](h))
        return self.out(h.mean(1))[:, 0] - distance.sum((1, 2))


def _psiformer_case(repeat: int) -> list[Result]:
    """The Laplacian of a Psiformer-like net (8 electrons, d = 24, B = 32: layer norms,
    softmax attention, GELU, concatenation, norms) by divjac and by the gradient-of-gradient
    loop (reverse over reverse: ``vmap(hessian)`` differentiates torch's layer-norm kernel
    forward, wrong at second order in torch 2.13)."""
    net = _Psiformer(8).eval()
    x = torch.randn(32, 24, generator=torch.Generator().manual_seed(6))
    lap = laplacian(net, method="exact")

    def loop() -> torch.Tensor:  # attention in its math form: the others have no 2nd derivative
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            z = x.detach().requires_grad_()
            g = torch.autograd.grad(net(z).sum(), z, create_graph=True)[0]
            return sum(  # type: ignore[return-value]
                torch.autograd.grad(g[:, i].sum(), z, retain_graph=True)[0][:, i]
                for i in range(z.shape[1])
            )

    with torch.no_grad():
        ref = loop()
        error = float((lap(x) - ref).abs().max() / ref.abs().max())
        t = interleaved_best_times({"ours": lambda: lap(x), "loop": loop}, repeat=repeat)
    case = "Laplacian, Psiformer-like (8 electrons, attention, LayerNorm, GELU), B=32 (torch)"
    return [
        Result("P9", case, "laplacian(method='exact')",
               "gradient-of-gradient loop (autograd.grad, d backward passes)", t["ours"],
               t["loop"], kind="gain", target=2.0, extra={"max_rel_diff": error}),
    ]  # fmt: skip


def _blocks_cases(repeat: int) -> list[Result]:
    """The exact Laplacian of networks whose intermediates depend on a few inputs (B = 64,
    float32): a sum over 50 particles in 4-D of a ``4 -> 64 -> 64 -> 1`` tanh MLP, and a
    FermiNet-like net (16 electrons in 3-D, a one-electron layer, then a layer on
    ``[h_i, mean_j h_j]``): ``laplacian(method="exact")`` (first-order terms stored sparse)
    against the dense sweep of the unit basis and the ``vmap(hessian)`` trace."""
    g = torch.Generator().manual_seed(2)

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w1, b1, w2 = normal(4, 64, scale=0.5), normal(64), normal(64, 64, scale=0.125)
    b2, w3 = normal(64), normal(64, scale=0.125)
    v1, v2 = normal(3, 64), normal(128, 64, scale=0.125)

    def particles(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x.reshape(x.shape[0], 50, 4) @ w1 + b1)
        return (torch.tanh(h @ w2 + b2) @ w3).sum(-1)

    def ferminet(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x.reshape(x.shape[0], 16, 3) @ v1)
        mixed = torch.cat([h, h.mean(1, keepdim=True).expand_as(h)], -1)
        return ((torch.tanh(mixed @ v2) + h) @ w3).sum(-1)

    cases: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], int]] = [
        ("sum over 50 particles (4-D) of a 4-64-64-1 tanh MLP", particles, 200),
        ("FermiNet-like (16 electrons, one-electron layer, [h_i, mean h] layer)", ferminet, 48),
    ]
    results = []
    for name, u, d in cases:
        x = normal(64, d)
        fns = _laplacians(u, x)
        with torch.no_grad():
            values = {k: fn() for k, fn in fns.items()}
            t = interleaved_best_times(fns, repeat=repeat, min_time=0.0)
        scale = float(values["hessian"].abs().max())
        error = float((values["ours"] - values["hessian"]).abs().max()) / scale
        case = f"Laplacian, {name}, B=64 (torch)"
        label = "laplacian(method='exact') (sparse first-order terms)"
        results += [
            Result("P9-blocks", case, label, "vmap(hessian) trace", t["ours"], t["hessian"],
                   kind="gain", target=2.0, extra={"max_rel_error_vs_hessian": error}),
            Result("-", case, label, f"second_order_sweep (unit basis, {d})", t["ours"],
                   t["dense"], kind="gain"),
        ]  # fmt: skip
    return results


def _laplacians(u: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> dict[str, Any]:
    """divjac's exact Laplacian, the dense sweep of the unit basis and the Hessian trace."""
    ours = laplacian(u, method="exact")
    basis = torch.eye(x.shape[1])[:, None]

    def trace(z: torch.Tensor) -> torch.Tensor:
        return torch.trace(hessian(lambda q: u(q[None])[0])(z))

    return {
        "ours": lambda: ours(x),
        "dense": lambda: second_order_sweep(u, x, basis)[2],
        "hessian": lambda: vmap(trace)(x),
    }


def _mlp_case(d: int, repeat: int, quick: bool) -> list[Result]:
    B = 256
    params = models.init_mlp(0, (d, 256, 256, 1))
    x = torch.randn(B, d, generator=torch.Generator().manual_seed(1))
    basis = torch.eye(d)[:, None]  # [d, 1, d]: shared by the samples

    def u(x: torch.Tensor) -> torch.Tensor:
        return models.mlp(params, x)

    def per_sample(xi: torch.Tensor) -> torch.Tensor:
        return models.mlp(params, xi[None])[0, 0]

    ours = laplacian(lambda p, x: models.mlp(p, x)[:, 0], 1, method="exact")
    fns: dict[str, Callable[[], Any]] = {
        "ours": lambda: ours(params, x),
        "reference": lambda: reference_sweep(u, x, basis)[2],
        "hessian": lambda: torch.diagonal(vmap(hessian(per_sample))(x), 0, 1, 2).sum(1),
        "fwd-over-rev": lambda: _forward_over_reverse(params, x),
    }
    with torch.no_grad():
        values = {k: fn().reshape(B) for k, fn in fns.items()}
        t = interleaved_best_times(fns, repeat=repeat, min_time=0.0)
    scale = float(values["hessian"].abs().max())
    errors = {k: float((v - values["hessian"]).abs().max()) / scale for k, v in values.items()}
    case = f"Laplacian MLP d={d}->256->256->1 tanh, B={B} (torch)"
    extra = {"max_rel_error_vs_hessian": errors["ours"]}
    label = "laplacian(method='exact')"
    results = [
        Result("-", case, label, "vmap(jvp(jvp)) reference", t["ours"], t["reference"],
               kind="gain", extra=extra),
        Result("P9", case, label, "vmap(hessian) trace", t["ours"], t["hessian"], kind="gain",
               target=2.0, extra=extra),
        Result("P9", case, label, "forward-over-reverse (hand-written, d HVPs)", t["ours"],
               t["fwd-over-rev"], kind="gain", target=2.0, extra=extra),
    ]  # fmt: skip
    if quick:
        return results
    results.append(_training_step(d, B, params, x, repeat))
    return results


def _forward_over_reverse(params: Any, x: torch.Tensor) -> torch.Tensor:
    """The Laplacian as users write it by hand: ``d`` Hessian-vector products (``jvp`` of the
    gradient along each unit direction, batched with ``vmap``), then the trace."""

    def gradient(z: torch.Tensor) -> torch.Tensor:
        return grad(lambda q: models.mlp(params, q).sum())(z)

    basis = torch.eye(x.shape[1], dtype=x.dtype).unsqueeze(1).expand(-1, *x.shape)
    products = vmap(lambda v: jvp(gradient, (x,), (v,))[1])(basis)  # [d, B, d]
    return torch.diagonal(products, 0, 0, 2).sum(-1)


def _training_step(d: int, B: int, params: Any, x: torch.Tensor, repeat: int) -> Result:
    """A Laplacian loss (``mean(lap^2)``) and its gradient w.r.t. the weights."""
    trained = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for w, b in params]
    leaves = [p for pair in trained for p in pair]
    lap = laplacian(lambda p, x: models.mlp(p, x)[:, 0], 1, method="exact")

    def ours() -> Any:
        loss = lap(trained, x).square().mean()
        return torch.autograd.grad(loss, leaves, materialize_grads=True)

    def theirs() -> Any:
        loss = _forward_over_reverse(trained, x).square().mean()
        return torch.autograd.grad(loss, leaves, materialize_grads=True)

    diff = max(float((a - b).abs().max()) for a, b in zip(ours(), theirs(), strict=True))
    t = interleaved_best_times({"ours": ours, "theirs": theirs}, repeat=repeat, min_time=0.0)
    return Result(
        "-", f"Laplacian loss + backward, MLP d={d}, B={B} (torch)", "laplacian(method='exact')",
        "forward-over-reverse (hand-written, d HVPs)", t["ours"], t["theirs"], kind="gain",
        extra={"max_abs_grad_diff": diff},
    )  # fmt: skip
