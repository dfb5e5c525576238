"""Example models in PyTorch, the same architectures as :mod:`divjac.models.jax`.

The functional forms (``mlp(params, x)``, ``cnn(params, x)``, ...) take the same parameter
layouts as the JAX models (dense weights ``(n_in, n_out)``); the CNN works on ``NCHW`` images
with ``OIHW`` kernels. :func:`from_jax` converts JAX parameters (the same weights give the same
functions in both frameworks), and :class:`MLP` / :class:`CNN` wrap the same computations as
``nn.Module`` s. Importing this module never imports JAX.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._errors import InternalError
from . import unet_layers

__all__ = [
    "CNN",
    "MLP",
    "ConcatSquashLinear",
    "ConcatSquashODE",
    "blur",
    "cnn",
    "cnn_params_from_jax",
    "from_jax",
    "gaussian_kernel",
    "init_cnn",
    "init_mlp",
    "init_mlp_xt",
    "init_unet",
    "mlp",
    "mlp_xt",
    "unet",
]

Params = list[tuple[torch.Tensor, torch.Tensor]]


def _generator(seed: int | torch.Generator) -> torch.Generator:
    return seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)


def init_mlp(
    seed: int | torch.Generator, sizes: Sequence[int], dtype: torch.dtype = torch.float32
) -> Params:
    """Weights ``(n_in, n_out)`` and biases of an MLP with layer sizes ``sizes``."""
    gen = _generator(seed)
    params = []
    for a, b in itertools.pairwise(sizes):
        w = torch.randn(a, b, generator=gen, dtype=dtype) / math.sqrt(a)
        params.append((w, 0.1 * torch.randn(b, generator=gen, dtype=dtype)))
    return params


def mlp(params: Params, x: torch.Tensor) -> torch.Tensor:
    """``tanh`` MLP on the last axis: ``[..., d_in] -> [..., d_out]`` (per sample)."""
    for w, b in params[:-1]:
        x = torch.tanh(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def init_mlp_xt(
    seed: int | torch.Generator, d: int, hidden: int = 100, dtype: torch.dtype = torch.float32
) -> Params:
    """Weights of ``net(x, t)``: ``cat(x, t) -> hidden tanh -> hidden tanh -> d``."""
    return init_mlp(seed, (d + 1, hidden, hidden, d), dtype)


def mlp_xt(params: Params, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The time-dependent vector field ``net(params, x, t)``: ``x (b, d)``, ``t (b, 1)``."""
    return mlp(params, torch.cat([x, t], dim=-1))


def init_cnn(
    seed: int | torch.Generator,
    *,
    channels: int = 16,
    layers: int = 3,
    in_channels: int = 3,
    out_channels: int = 3,
    kernel: int = 3,
    dtype: torch.dtype = torch.float32,
) -> Params:
    """Weights (``OIHW`` kernels, biases) of a ``'same'`` conv stack with ``tanh`` in between."""
    gen = _generator(seed)
    sizes = [in_channels] + [channels] * (layers - 1) + [out_channels]
    params = []
    for c_in, c_out in itertools.pairwise(sizes):
        fan_in = kernel * kernel * c_in
        w = torch.randn(c_out, c_in, kernel, kernel, generator=gen, dtype=dtype)
        params.append((w / math.sqrt(fan_in), 0.1 * torch.randn(c_out, generator=gen, dtype=dtype)))
    return params


def cnn(params: Params, x: torch.Tensor) -> torch.Tensor:
    """Conv stack on images ``[k, C, H, W]`` (NCHW), ``'same'`` padding, ``tanh`` in between."""
    for i, (w, b) in enumerate(params):
        x = F.conv2d(x, w, b, padding="same")
        if i < len(params) - 1:
            x = torch.tanh(x)
    return x


def init_unet(
    seed: int | torch.Generator,
    *,
    channels: int = 8,
    in_channels: int = 3,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Weights of :func:`unet` (3x3 ``OIHW`` kernels and biases, the global dense layer)."""
    gen = _generator(seed)
    c = channels
    shapes = unet_layers(channels, in_channels)
    params: dict[str, Any] = {}
    for name, (c_in, c_out) in shapes.items():
        w = torch.randn(c_out, c_in, 3, 3, generator=gen, dtype=dtype) / math.sqrt(9 * c_in)
        params[name] = (w, 0.1 * torch.randn(c_out, generator=gen, dtype=dtype))
    params["global"] = (
        0.1 * torch.randn(2 * c, 2 * c, generator=gen, dtype=dtype) / math.sqrt(2 * c)
    )
    return params


def unet(params: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    """The U-Net of :func:`divjac.models.jax.unet` on ``[k, C, H, W]`` (H, W divisible by 4):
    two average-pool downsamplings, a global-context branch, nearest upsampling with skips."""

    def conv(name: str, h: torch.Tensor) -> torch.Tensor:
        w, b = params[name]
        return F.conv2d(h, w, b, padding=1)

    def up(h: torch.Tensor) -> torch.Tensor:
        return h.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)

    e1 = torch.tanh(conv("enc1", x))
    e2 = torch.tanh(conv("enc2", F.avg_pool2d(e1, 2)))
    m = torch.tanh(conv("mid", F.avg_pool2d(e2, 2)))
    context = torch.tanh(m.mean(dim=(2, 3)) @ params["global"])
    m = m + context[:, :, None, None]
    d2 = torch.tanh(conv("dec2", torch.cat([up(m), e2], dim=1)))
    return conv("dec1", torch.cat([up(d2), e1], dim=1))


def gaussian_kernel(
    size: int = 11, sigma: float = 2.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Normalized ``size x size`` Gaussian kernel."""
    r = np.arange(size) - (size - 1) / 2
    k = np.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * sigma**2))
    return torch.as_tensor(k / k.sum(), dtype=dtype)


def blur(x: torch.Tensor, kernel: torch.Tensor | None = None) -> torch.Tensor:
    """Gaussian blur of a batch of images ``[k, H, W]`` (``'same'``, zero padding).

    A true convolution (the kernel is flipped), like ``jax.scipy.signal.convolve2d``.
    """
    kernel = gaussian_kernel(dtype=x.dtype) if kernel is None else kernel.to(x.dtype)
    weight = torch.flip(kernel, (0, 1))[None, None].to(x.device)
    return F.conv2d(x[:, None], weight, padding="same")[:, 0]


# --- weights from JAX -------------------------------------------------------------------------


def from_jax(params: Any, dtype: torch.dtype | None = None) -> Params:
    """Dense-layer parameters of :mod:`divjac.models.jax` (``mlp``, ``mlp_xt``) as tensors.

    Works on JAX arrays without importing JAX (through ``numpy.asarray``).
    """
    return [(_tensor(w, dtype), _tensor(b, dtype)) for w, b in params]


def cnn_params_from_jax(params: Any, dtype: torch.dtype | None = None) -> Params:
    """CNN parameters of :mod:`divjac.models.jax`: ``HWIO`` kernels become ``OIHW``."""
    return [
        (_tensor(np.transpose(np.asarray(w), (3, 2, 0, 1)), dtype), _tensor(b, dtype))
        for w, b in params
    ]


def _tensor(value: Any, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.as_tensor(np.array(value), dtype=dtype)


# --- the same models as nn.Modules --------------------------------------------------------------


class MLP(nn.Module):
    """The ``tanh`` MLP of :func:`mlp` as an ``nn.Module`` (``nn.Linear`` layers).

    Args:
        params: weights ``(n_in, n_out)`` and biases, e.g. from :func:`init_mlp` or
            :func:`from_jax`.
    """

    def __init__(self, params: Params) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for w, b in params:
            layer = nn.Linear(w.shape[0], w.shape[1], dtype=w.dtype)
            with torch.no_grad():
                layer.weight.copy_(w.T)
                layer.bias.copy_(b)
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


class CNN(nn.Module):
    """The conv stack of :func:`cnn` as an ``nn.Module`` (``nn.Conv2d`` layers, NCHW).

    Args:
        params: ``OIHW`` kernels and biases, e.g. from :func:`init_cnn` or
            :func:`cnn_params_from_jax`.
    """

    def __init__(self, params: Params) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for w, b in params:
            c_out, c_in, kh, kw = w.shape
            conv = nn.Conv2d(c_in, c_out, (kh, kw), padding="same", dtype=w.dtype)
            if conv.bias is None:
                raise InternalError("nn.Conv2d was built without the bias it was asked for")
            with torch.no_grad():
                conv.weight.copy_(w)
                conv.bias.copy_(b)
            self.layers.append(conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


class ConcatSquashLinear(nn.Module):
    """FFJORD's concat-squash layer: ``W x`` gated and shifted by the time,
    ``(W x + b) * sigmoid(G t + g) + H t``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.layer = nn.Linear(n_in, n_out)
        self.gate = nn.Linear(1, n_out)
        self.shift = nn.Linear(1, n_out, bias=False)

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = t.reshape(1, 1).to(x.dtype)
        return self.layer(x) * torch.sigmoid(self.gate(t)) + self.shift(t)


class ConcatSquashODE(nn.Module):
    """FFJORD's ODE function ``f(t, x)``: concat-squash layers with softplus between them,
    ``x (B, d)`` and a scalar time ``t`` -> ``(B, d)`` (the CNF vector field of its tabular
    and toy experiments)."""

    def __init__(self, d: int, hidden: Sequence[int] = (64, 64, 64), seed: int = 0) -> None:
        super().__init__()
        sizes = (d, *hidden, d)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(
                ConcatSquashLinear(a, b) for a, b in itertools.pairwise(sizes)
            )
        self.activation = nn.Softplus()

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(t, x)
            if i < len(self.layers) - 1:
                x = self.activation(x)
        return x
