"""P7: divjac.torch against the torch.func equivalents, side by side in one run.

(a) Per-sample Jacobian of the MLP ``d -> 256 -> 256 -> d`` (tanh), ``B = 64``, ``d`` in
{16, 128}, float32: ``divjac.torch.jacobian`` vs hand-written ``vmap(jacrev)`` / ``vmap(jacfwd)``
(best of, with and without ``chunk_size``) and vs ``torch.autograd.functional.jacobian`` with
``vectorize=True`` on the full batch followed by diagonal-block extraction (``B^2`` work).
(b) Exact divergence of the same MLP vs the best hand-written ``vmap(jac*)`` + trace.
(c) Exact divergence of the 3-layer 3x3 CNN (16 channels) on ``[8, 3, 32, 32]`` from its
sparsity (48 passes) vs the dense hand-written ``vmap(jacrev)`` + trace (3072 passes).
(d) Exact dense divergence of an 11x11 Gaussian blur on ``[4, 24, 24]`` (576 passes) vs the best
hand-written ``vmap(jacrev)`` / ``vmap(jacfwd)`` + trace (a convolution graph: divjac pushes
columns, as PyTorch's batched convolution backward is the slower direction there).
(e) ``mode="auto"`` against both explicit modes, exact divergence of a small U-Net with
GroupNorm and self-attention on ``[2, 3, 16, 16]`` (768 passes), where rows are the faster
direction (the convolution heuristic took columns, 1.5-1.7x slower): auto times a few passes of
each and must be within 1.1x of the better mode.
(f) Per-sample Jacobian of a 10-class ResNet-like CNN (three residual blocks, BatchNorm in eval
mode, a global average pool, a dense layer) on ``[B, 3, 32, 32]``, ``B`` in {8, 32, 128} (quick:
{8, 32}), at torch's thread count: ``jacobian`` at its defaults (10 rows) against the best of
``vmap(jacrev)`` (unchunked, ``chunk_size`` 1, 2, 5) and a loop of 10 backward passes
(``torch.autograd.grad`` of ``out[:, k].sum()``): within 1.0x the best.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import jacfwd, jacrev, vmap

from ...models import torch as models
from ...torch import divergence, jacobian, sparsity
from ._harness import ESTIMATOR_BUDGET, Result, best_time, cost_rows, interleaved_best_times


def run(quick: bool) -> list[Result]:
    results: list[Result] = []
    with torch.no_grad():
        for d in (16, 128):
            results += _mlp_case(d, repeat=3 if quick else 7)
        results += _cnn_case(quick)
        results += _blur_case(repeat=2 if quick else 5)
        results += _direction_case(repeat=2 if quick else 4)
        for batch in (8, 32) if quick else (8, 32, 128):
            results += _few_outputs_case(batch, repeat=2 if quick else 3)
        results += cost_rows("torch", _estimator_costs(quick))
    for batch in (8, 32) if quick else (8, 32, 128):  # on the autograd graph, as in training
        results += _few_outputs_case(batch, repeat=2 if quick else 3)
    return results


def _estimator_costs(quick: bool) -> dict[str, dict[str, float]]:
    """Hutch++ and XTrace against Hutchinson at the same matvecs (see bench_estimators)."""
    cases: dict[str, tuple[Callable[..., Any], Any]] = {
        "CNN 3x3 16ch [8,3,32,32], n=3072": (models.cnn, models.init_cnn(11, channels=16)),
        "U-Net 8ch [8,3,32,32], n=3072": (models.unet, models.init_unet(12)),
    }
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(13))
    times = {}
    for case, (f, params) in cases.items():
        fns = {}
        for method in ("hutchinson", "hutch++", "xtrace"):
            div = divergence(f, 1, method=method, num_probes=ESTIMATOR_BUDGET)
            fns[method] = lambda div=div, params=params: div(
                torch.Generator().manual_seed(0), params, x
            )
        times[case] = interleaved_best_times(fns, repeat=3 if quick else 7, min_time=0.0)
    return times


def _mlp_case(d: int, repeat: int) -> list[Result]:
    params = models.init_mlp(0, (d, 256, 256, d))
    x = torch.randn(64, d, generator=torch.Generator().manual_seed(1))
    f = models.mlp

    def per_sample(p, xi):
        return f(p, xi)

    hand = {
        "vmap(jacrev)": vmap(jacrev(per_sample, 1), (None, 0)),
        "vmap(jacfwd)": vmap(jacfwd(per_sample, 1), (None, 0)),
        "vmap(jacrev, chunk_size=d/4)": vmap(
            jacrev(per_sample, 1, chunk_size=max(d // 4, 1)), (None, 0)
        ),
    }

    def full(p, x):
        J = torch.autograd.functional.jacobian(lambda v: f(p, v), x, vectorize=True)
        return torch.diagonal(J, dim1=0, dim2=2).permute(2, 0, 1)  # (B, d, B, d) -> blocks

    ours = jacobian(f, 1)
    div = divergence(f, 1, method="exact")

    def traced(fn: Callable[..., Any]) -> Callable[..., Any]:
        return lambda p, x: torch.diagonal(fn(p, x), 0, 1, 2).sum(1)

    fns: dict[str, Callable[[], Any]] = {}
    for name, fn in hand.items():
        fns[name] = functools.partial(fn, params, x)
        fns[name + "+trace"] = functools.partial(traced(fn), params, x)
    fns["ours"] = lambda: ours(params, x)
    fns["div"] = lambda: div(params, x)
    reference = hand["vmap(jacrev)"](params, x)
    max_err = float((ours(params, x) - reference).abs().max())
    t = interleaved_best_times(fns, repeat=repeat)
    # The full-batch Jacobian is 100x slower and allocates B^2 blocks: timed on its own, so
    # that its memory traffic does not disturb the interleaved measurements above.
    t["full"] = best_time(lambda: full(params, x), repeat=2)
    best_jac = min(hand, key=lambda k: t[k])
    best_div = min((k + "+trace" for k in hand), key=lambda k: t[k])
    case = f"MLP d={d}, B=64 (torch)"
    return [
        Result(
            "P7", case, "jacobian", best_jac, t["ours"], t[best_jac], target=1.10,
            extra={"max_abs_diff": max_err, "all": {k: t[k] for k in hand}},
        ),
        Result(
            "P7", case, "jacobian", "autograd.functional.jacobian(vectorize)+diag",
            t["ours"], t["full"], kind="gain", target=None,
        ),
        Result(
            "P7", case, "divergence exact", best_div, t["div"], t[best_div], target=1.10,
            extra={"all": {k: t[k + "+trace"] for k in hand}},
        ),
    ]  # fmt: skip


def _cnn_case(quick: bool) -> list[Result]:
    params = models.init_cnn(0, channels=16, layers=3)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    f = models.cnn
    pattern = sparsity(f, argnums=1)(params, x)
    sparse = divergence(f, 1, method="sparse")
    dense_ours = divergence(f, 1, method="exact")

    def per_sample(xi):
        return f(params, xi[None])[0]

    def dense(x):
        J = vmap(jacrev(per_sample))(x).reshape(x.shape[0], 3072, 3072)
        return torch.diagonal(J, dim1=1, dim2=2).sum(1)

    ours_value, dense_value = sparse(params, x), dense(x)
    rel = float(((ours_value - dense_value).abs() / dense_value.abs()).max())
    t_sparse = best_time(lambda: sparse(params, x), repeat=2 if quick else 5)
    t_dense = best_time(lambda: dense(x), repeat=1, warmup=0)
    case = "CNN 3x3x3 16ch [8,3,32,32] (torch)"
    results = [
        Result(
            "P7", case, f"sparse ({pattern.n_diagonal_colors} passes)",
            "vmap(jacrev)+trace (3072 passes)", t_sparse, t_dense, kind="gain", target=30.0,
            extra={"max_rel_error": rel, "colors": pattern.n_diagonal_colors},
        )
    ]  # fmt: skip
    if not quick:
        t_exact = best_time(lambda: dense_ours(params, x), repeat=1, warmup=0)
        results.append(
            Result(
                "-", case, f"sparse ({pattern.n_diagonal_colors} passes)",
                "divjac exact (3072 passes)", t_sparse, t_exact, kind="gain",
            )
        )  # fmt: skip
    return results


def _blur_case(repeat: int) -> list[Result]:
    x = torch.randn(4, 24, 24, generator=torch.Generator().manual_seed(3))
    f = models.blur
    n = x[0].numel()

    def hand(jac):
        def div():
            J = vmap(jac(f))(x[:, None]).reshape(x.shape[0], n, n)
            return torch.diagonal(J, dim1=1, dim2=2).sum(1)

        return div

    exact = divergence(f, method="exact")
    fns = {"vmap(jacrev)+trace": hand(jacrev), "vmap(jacfwd)+trace": hand(jacfwd)}
    fns["ours"] = lambda: exact(x)
    max_err = float((exact(x) - fns["vmap(jacfwd)+trace"]()).abs().max())
    t = interleaved_best_times(fns, repeat=repeat)
    best = min((k for k in fns if k != "ours"), key=lambda k: t[k])
    return [
        Result(
            "P7", "blur 11x11 [4,24,24] (torch)", "divergence exact (576 passes)", best,
            t["ours"], t[best], target=1.10,
            extra={"max_abs_diff": max_err, "all": {k: t[k] for k in fns if k != "ours"}},
        )
    ]  # fmt: skip


class _AttentionUNet(nn.Module):
    """A small U-Net: GroupNorm + SiLU convolutions, one downsampling, self-attention over the
    pixels at the bottom, nearest upsampling with a skip."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        c = channels

        def block(c_in: int, c_out: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(4, c_out), nn.SiLU()
            )

        self.enc, self.mid = block(3, c), block(c, 2 * c)
        self.attention = nn.MultiheadAttention(2 * c, 2, batch_first=True)
        self.dec, self.out = block(3 * c, c), nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        m = self.mid(nn.functional.avg_pool2d(e, 2))
        b, c, h, w = m.shape
        tokens = m.flatten(2).transpose(1, 2)
        m = m + self.attention(tokens, tokens, tokens)[0].transpose(1, 2).reshape(b, c, h, w)
        up = nn.functional.interpolate(m, scale_factor=2.0, mode="nearest")
        return self.out(self.dec(torch.cat([up, e], dim=1)))


def _direction_case(repeat: int) -> list[Result]:
    torch.manual_seed(4)
    net = _AttentionUNet().eval()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    fns = {
        mode: functools.partial(divergence(net, method="exact", mode=mode), x)
        for mode in ("auto", "fwd", "rev")
    }
    t = interleaved_best_times(fns, repeat=repeat)
    best = min(("fwd", "rev"), key=lambda k: t[k])
    return [
        Result(
            "P7", "U-Net GroupNorm+attention [2,3,16,16] (torch)", "divergence exact, mode='auto' (768 passes)",
            f"mode='{best}' (the better explicit mode)", t["auto"], t[best], target=1.10,
            extra={"fwd": t["fwd"], "rev": t["rev"]},
        )
    ]  # fmt: skip


class _Residual(nn.Module):
    """Two 3x3 convolutions with BatchNorm and ReLU, plus the input (a 1x1 convolution where the
    shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out),
        )  # fmt: skip
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.skip = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def _resnet() -> nn.Module:
    """A ResNet-like 10-class classifier of 32x32 RGB images, in eval mode."""
    torch.manual_seed(6)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        _Residual(16, 16, 1), _Residual(16, 32, 2), _Residual(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    ).eval()  # fmt: skip


def _few_outputs_case(batch: int, repeat: int) -> list[Result]:
    """A 10-class ResNet's per-sample Jacobian, in the grad mode the caller set: with it on,
    the parameters require grad and every result stays on the autograd graph (the loop
    passes ``create_graph``: the same differentiable result)."""
    net = _resnet()
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    graph = torch.is_grad_enabled()

    def per_sample(xi: torch.Tensor) -> torch.Tensor:
        return net(xi[None])[0]

    def loop() -> torch.Tensor:
        xg = x.clone().requires_grad_()
        with torch.enable_grad():
            out = net(xg)
            rows = [
                torch.autograd.grad(out[:, k].sum(), xg, retain_graph=k < 9, create_graph=graph)[0]
                for k in range(10)
            ]
        return torch.stack(rows, 1)

    hand: dict[str, Callable[[], Any]] = {
        "vmap(jacrev)": functools.partial(vmap(jacrev(per_sample)), x),
        **{
            f"vmap(jacrev, chunk_size={c})": functools.partial(
                vmap(jacrev(per_sample, chunk_size=c)), x
            )
            for c in (1, 2, 5)
        },
        "loop of 10 backward passes": loop,
    }
    ours = jacobian(net)
    fns = {**hand, "ours": lambda: ours(x)}
    max_err = float((ours(x) - loop()).abs().max())
    t = interleaved_best_times(fns, repeat=repeat, min_time=0.0)
    best = min(hand, key=lambda k: t[k])
    context = "on the autograd graph" if graph else "torch.no_grad()"
    return [
        Result(
            "P7", f"ResNet 10 classes [{batch},3,32,32], {context}, {torch.get_num_threads()} threads (torch)",
            "jacobian (10 rows)", best, t["ours"], t[best], target=1.0,
            extra={"max_abs_diff": max_err, "all": {k: t[k] for k in hand}},
        )
    ]  # fmt: skip
