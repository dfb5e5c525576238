"""Example models in plain JAX (no Flax needed): the ``net(params, x, t)`` MLP, a CNN, a blur."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.signal import convolve2d

from . import unet_layers

__all__ = [
    "blur",
    "cnn",
    "concat_squash",
    "gaussian_kernel",
    "init_cnn",
    "init_concat_squash",
    "init_mlp",
    "init_mlp_xt",
    "init_unet",
    "mlp",
    "mlp_xt",
    "unet",
]

Params = Any


def _dense(key: jax.Array, n_in: int, n_out: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    wkey, bkey = jax.random.split(key)
    w = jax.random.normal(wkey, (n_in, n_out), dtype) / math.sqrt(n_in)
    b = 0.1 * jax.random.normal(bkey, (n_out,), dtype)
    return w, b


def init_mlp(
    key: jax.Array, sizes: tuple[int, ...], dtype: Any = jnp.float32
) -> list[tuple[jax.Array, jax.Array]]:
    """Weights of an MLP with layer sizes ``sizes`` (e.g. ``(d, 256, 256, d)``)."""
    keys = jax.random.split(key, len(sizes) - 1)
    return [_dense(k, a, b, dtype) for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def mlp(params: Params, x: jax.Array) -> jax.Array:
    """``tanh`` MLP on the last axis: ``[..., d_in] -> [..., d_out]`` (per sample)."""
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def init_mlp_xt(
    key: jax.Array, d: int, hidden: int = 100, dtype: Any = jnp.float32
) -> list[tuple[jax.Array, jax.Array]]:
    """Weights of ``net(x, t)``: ``hstack(x, t) -> Dense(hidden) tanh -> Dense(hidden) tanh -> Dense(d)``."""
    return init_mlp(key, (d + 1, hidden, hidden, d), dtype)


def mlp_xt(params: Params, x: jax.Array, t: jax.Array) -> jax.Array:
    """The time-dependent vector field ``net(params, x, t)``: ``x (b, d)``, ``t (b, 1)`` -> ``(b, d)``."""
    return mlp(params, jnp.concatenate([x, t], axis=-1))


def init_cnn(
    key: jax.Array,
    *,
    channels: int = 16,
    layers: int = 3,
    in_channels: int = 3,
    out_channels: int = 3,
    kernel: int = 3,
    dtype: Any = jnp.float32,
) -> list[tuple[jax.Array, jax.Array]]:
    """Weights (HWIO kernels, biases) of a ``'same'`` conv stack with ``tanh`` in between."""
    sizes = [in_channels] + [channels] * (layers - 1) + [out_channels]
    keys = jax.random.split(key, layers)
    params = []
    for k, c_in, c_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        wkey, bkey = jax.random.split(k)
        fan_in = kernel * kernel * c_in
        w = jax.random.normal(wkey, (kernel, kernel, c_in, c_out), dtype) / math.sqrt(fan_in)
        params.append((w, 0.1 * jax.random.normal(bkey, (c_out,), dtype)))
    return params


def cnn(params: Params, x: jax.Array) -> jax.Array:
    """Conv stack on images ``[k, H, W, C]`` (NHWC), ``'same'`` padding, ``tanh`` between layers."""
    for i, (w, b) in enumerate(params):
        x = jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        x = x + b
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return x


def init_unet(
    key: jax.Array, *, channels: int = 8, in_channels: int = 3, dtype: Any = jnp.float32
) -> dict[str, Any]:
    """Weights of :func:`unet` (3x3 HWIO kernels and biases)."""
    c = channels
    shapes = unet_layers(channels, in_channels)
    keys = jax.random.split(key, len(shapes) + 1)
    params: dict[str, Any] = {}
    for k, (name, (c_in, c_out)) in zip(keys, shapes.items(), strict=False):
        wkey, bkey = jax.random.split(k)
        w = jax.random.normal(wkey, (3, 3, c_in, c_out), dtype) / math.sqrt(9 * c_in)
        params[name] = (w, 0.1 * jax.random.normal(bkey, (c_out,), dtype))
    params["global"] = 0.1 * jax.random.normal(keys[-1], (2 * c, 2 * c), dtype) / math.sqrt(2 * c)
    return params


def unet(params: Params, x: jax.Array) -> jax.Array:
    """A small U-Net on ``[k, H, W, C]`` (H, W divisible by 4) whose receptive field is the image.

    Two 2x average-pool downsamplings, a global-context branch (spatial mean, dense layer,
    broadcast back), nearest upsampling with skip connections. The per-sample Jacobian is
    structurally dense but numerically concentrated near the diagonal, as in score networks.
    """

    def conv(name: str, h: jax.Array) -> jax.Array:
        w, b = params[name]
        return (
            jax.lax.conv_general_dilated(
                h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            + b
        )

    def down(h: jax.Array) -> jax.Array:
        k, H, W, C = h.shape
        return h.reshape(k, H // 2, 2, W // 2, 2, C).mean(axis=(2, 4))

    def up(h: jax.Array) -> jax.Array:
        return jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2)

    e1 = jnp.tanh(conv("enc1", x))
    e2 = jnp.tanh(conv("enc2", down(e1)))
    m = jnp.tanh(conv("mid", down(e2)))
    context = jnp.tanh(m.mean(axis=(1, 2)) @ params["global"])
    m = m + context[:, None, None, :]
    d2 = jnp.tanh(conv("dec2", jnp.concatenate([up(m), e2], axis=-1)))
    return conv("dec1", jnp.concatenate([up(d2), e1], axis=-1))


def gaussian_kernel(size: int = 11, sigma: float = 2.0, dtype: Any = jnp.float32) -> jax.Array:
    """Normalized ``size x size`` Gaussian kernel."""
    r = np.arange(size) - (size - 1) / 2
    k = np.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * sigma**2))
    return jnp.asarray(k / k.sum(), dtype)


def blur(x: jax.Array, kernel: jax.Array | None = None) -> jax.Array:
    """Gaussian blur of a batch of images ``[k, H, W]`` (``'same'``, zero padding)."""
    kernel = gaussian_kernel(dtype=x.dtype) if kernel is None else kernel
    return jax.vmap(lambda img: convolve2d(img, kernel, mode="same"))(x)


def init_concat_squash(
    key: jax.Array, d: int, hidden: tuple[int, ...] = (64, 64, 64), dtype: Any = jnp.float32
) -> list[dict[str, jax.Array]]:
    """Weights of FFJORD's ODE function (:func:`concat_squash`): per layer, the dense weight
    and bias, the gate's and the shift's."""
    sizes = (d, *hidden, d)
    layers = []
    for k, a, b in zip(jax.random.split(key, len(sizes) - 1), sizes[:-1], sizes[1:], strict=True):
        k1, k2, k3 = jax.random.split(k, 3)
        w, bias = _dense(k1, a, b, dtype)
        gate_w, gate_b = _dense(k2, 1, b, dtype)
        shift_w, _ = _dense(k3, 1, b, dtype)
        layers.append({"w": w, "b": bias, "gate_w": gate_w, "gate_b": gate_b, "shift_w": shift_w})
    return layers


def concat_squash(params: Params, t: jax.Array, x: jax.Array) -> jax.Array:
    """FFJORD's ODE function ``f(t, x)``: concat-squash layers
    ``(x W + b) * sigmoid(t G + g) + t H`` with softplus between them; ``x (B, d)``, scalar
    ``t``."""
    t = jnp.reshape(t, (1, 1)).astype(x.dtype)
    for i, layer in enumerate(params):
        gate = jax.nn.sigmoid(t @ layer["gate_w"] + layer["gate_b"])
        x = (x @ layer["w"] + layer["b"]) * gate + t @ layer["shift_w"]
        if i < len(params) - 1:
            x = jax.nn.softplus(x)
    return x
