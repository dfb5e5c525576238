"""A small model zoo for the torch context matrix (:mod:`tests.torch.test_contexts`): each model
is a batched function of a small float64 input, in eval mode where it has one (no dropout)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 3, padding=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UNet(nn.Module):
    """A two-level U-Net: convolutions, GroupNorm, SiLU, spatial self-attention at the bottom,
    nearest upsampling and a skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.attn_norm = nn.GroupNorm(2, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.up = nn.Conv2d(8, 4, 3, padding=1)
        self.out = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm(self.inp(x)))
        d = F.silu(self.down(h))
        B, C, H, W = d.shape
        seq = self.attn_norm(d).flatten(2).transpose(1, 2)
        a, _ = self.attn(seq, seq, seq, need_weights=False)
        d = d + a.transpose(1, 2).reshape(B, C, H, W)
        u = F.interpolate(d, scale_factor=2.0, mode="nearest")
        return self.out(F.silu(self.up(torch.cat([u, h], dim=1))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(
            4, 2, dim_feedforward=8, dropout=0.0, batch_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class RunningScale(nn.Module):
    """Scales by a running statistic that its forward updates, then reads (the update must
    not be applied more than once by a call, nor differentiate a moved state)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.mul_(0.9).add_(0.1 * x.abs().mean(0))
        return torch.tanh(self.lin(x) * self.scale)


def solve(x: torch.Tensor) -> torch.Tensor:
    """``(I + x x^T)^{-1} x`` per sample (a batched linear solve)."""
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(eye + x[:, :, None] * x[:, None, :], x)


@dataclass(frozen=True)
class Model:
    """A zoo entry: how to build it and the shape of its batched input."""

    name: str
    build: Callable[[], Callable[[torch.Tensor], torch.Tensor]]
    shape: tuple[int, ...]
    singular: bool = False
    """Whether its per-sample Jacobians are singular (``log|det J|`` is minus infinity, what
    any computation of it returns is rounding noise: not compared)."""

    def make(self, dtype: torch.dtype = torch.float64) -> Callable[[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        f = self.build()
        if isinstance(f, nn.Module):
            f = f.to(dtype).eval()
        return f

    def input(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        return torch.randn(self.shape, generator=g, dtype=torch.float64).to(dtype)


ZOO = {
    m.name: m
    for m in (
        Model("mlp", MLP, (3, 4)),
        Model("cnn", CNN, (2, 2, 4, 4)),
        Model("unet", UNet, (2, 2, 4, 4)),
        # Its final LayerNorm centres each token's features: J maps onto the zero-mean
        # subspace (condition number ~1e17 in float64).
        Model("transformer", Transformer, (2, 3, 4), singular=True),
        Model("lstm", LSTM, (2, 4, 3)),
        Model("solve", lambda: solve, (3, 4)),
    )
}
"""The differentiable models of the matrix (:class:`RunningScale` is refused, separately)."""


class Timed(nn.Module):
    """A zoo model ``f`` as ``gain * f(x * (1 + t / 2))``, per sample ``t``: ``t`` defaults to
    the buffer ``t0`` (default times, which the function can reach whatever ``t`` is passed),
    and ``gain`` is a parameter of its own (so that every model, a plain function too, has
    parameters to update or pass functionally)."""

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor], batch: int) -> None:
        super().__init__()
        self.inner = inner
        self.gain = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        self.register_buffer("t0", torch.linspace(0.2, 0.6, batch, dtype=torch.float64))

    def forward(self, x: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        t = self.t0 if t is None else t
        return self.gain * self.inner(x * (1 + t / 2).reshape(-1, *[1] * (x.ndim - 1)))


def new_times(batch: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Times other than :class:`Timed`'s default ``t0``."""
    return torch.linspace(-0.3, 0.5, batch, dtype=torch.float64).to(dtype)


def timed(model: Model, dtype: torch.dtype = torch.float64) -> Timed:
    """The zoo model wrapped in :class:`Timed`, in ``dtype``, in eval mode."""
    return Timed(model.make(dtype), model.shape[0]).to(dtype).eval()
