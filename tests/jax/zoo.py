"""A small model zoo for the context matrix (tests/jax/test_contexts.py).

Every model is a batched function ``f(params, x, scale)`` whose output has the shape of ``x``
(so that its per-sample Jacobian is square), ``scale`` a Python float that the contexts pass
as an argument; ``init(dtype)`` gives its parameters and an input batch of 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclass(frozen=True)
class Model:
    name: str
    f: Callable[..., jax.Array]
    shapes: dict[str, tuple[int, ...]]  # parameter shapes
    x_shape: tuple[int, ...]  # one batch: (B, *sample)

    def init(self, dtype: Any, seed: int = 0) -> tuple[Any, jax.Array]:
        rng = np.random.default_rng(seed)
        params = {
            k: jnp.asarray(rng.normal(size=s) / np.sqrt(max(1, np.prod(s[:-1]))), dtype)
            for k, s in self.shapes.items()
        }
        return params, jnp.asarray(rng.normal(size=self.x_shape), dtype)


def _conv(x: jax.Array, w: jax.Array) -> jax.Array:
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _layer_norm(x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, -1, keepdims=True)
    return (x - mean) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + 1e-5)


def _attention(x: jax.Array, p: Any, prefix: str) -> jax.Array:
    q, k, v = (x @ p[prefix + name] for name in "qkv")
    # a Python float (weakly typed): a NumPy float64 scale made float32 models float64
    weights = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) * q.shape[-1] ** -0.5, axis=-1)
    return weights @ v


def mlp(p: Any, x: jax.Array, scale: float = 1.0) -> jax.Array:
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return scale * jnp.sin(h @ p["w2"]) + 0.1 * x**2


def cnn(p: Any, x: jax.Array, scale: float = 1.0) -> jax.Array:
    h = jnp.tanh(_conv(x, p["k1"]))
    return scale * _conv(jax.nn.softplus(h), p["k2"])


def unet(p: Any, x: jax.Array, scale: float = 1.0) -> jax.Array:
    """conv -> GroupNorm (2 groups) -> SiLU, 2x2 average pool, self-attention over the pooled
    pixels, nearest upsampling, a skip connection and a conv back to the input's channels."""
    B, H, W, _ = x.shape
    h = _conv(x, p["k1"])  # (B, H, W, 4)
    g = h.reshape(B, H, W, 2, 2)
    mean = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
    var = jnp.var(g, axis=(1, 2, 4), keepdims=True)
    h = jax.nn.silu(((g - mean) / jnp.sqrt(var + 1e-5)).reshape(h.shape) * p["gamma"])
    d = h.reshape(B, H // 2, 2, W // 2, 2, 4).mean(axis=(2, 4)).reshape(B, -1, 4)
    d = (d + _attention(d, p, "a")).reshape(B, H // 2, W // 2, 4)
    up = jnp.repeat(jnp.repeat(d, 2, axis=1), 2, axis=2)
    return scale * _conv(jnp.concatenate([up, h], axis=-1), p["k2"])


def transformer(p: Any, x: jax.Array, scale: float = 1.0) -> jax.Array:
    h = x + _attention(_layer_norm(x), p, "a")
    return h + scale * jax.nn.gelu(_layer_norm(h) @ p["w1"]) @ p["w2"]


def lstm(p: Any, x: jax.Array, scale: float = 1.0) -> jax.Array:
    """An LSTM over the time axis (``lax.scan``), its hidden states as the output."""
    B, _, H = x.shape

    def step(carry: Any, xt: jax.Array) -> Any:
        h, c = carry
        i, f, o, u = jnp.split(xt @ p["wx"] + h @ p["wh"] + p["b"], 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(u)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    zeros = jnp.zeros((B, H), x.dtype)
    _, hs = lax.scan(step, (zeros, zeros), jnp.swapaxes(x, 0, 1))
    return scale * jnp.swapaxes(hs, 0, 1)


def solve(p: Any, x: jax.Array, scale: float = 1.0) -> jax.Array:
    """``(2 I + M M^T + 0.1 x x^T)^{-1} x`` per sample."""
    n = x.shape[-1]
    m = 2 * jnp.eye(n, dtype=x.dtype) + p["m"] @ p["m"].T
    a = m + 0.1 * x[:, :, None] * x[:, None, :]
    return scale * jnp.linalg.solve(a, x[..., None])[..., 0]


def _equinox() -> Model | None:
    try:
        import equinox as eqx
    except ImportError:  # pragma: no cover - a dev dependency
        return None
    module = eqx.nn.MLP(3, 3, 6, 2, activation=jnp.tanh, key=jax.random.key(0))
    arrays, static = eqx.partition(module, eqx.is_array)
    shapes = {"leaves": ()}  # parameters come from the module (see init below)

    def f(p: Any, x: jax.Array, scale: float = 1.0) -> jax.Array:
        return scale * jax.vmap(eqx.combine(p, static))(x)

    class EquinoxModel(Model):
        def init(self, dtype: Any, seed: int = 0) -> tuple[Any, jax.Array]:
            params = jax.tree_util.tree_map(lambda a: a.astype(dtype), arrays)
            rng = np.random.default_rng(seed)
            return params, jnp.asarray(rng.normal(size=self.x_shape), dtype)

    return EquinoxModel("equinox_mlp", f, shapes, (2, 3))


def _zoo() -> dict[str, Model]:
    models = [
        Model("mlp", mlp, {"w1": (3, 6), "b1": (6,), "w2": (6, 3)}, (2, 3)),
        Model("cnn", cnn, {"k1": (3, 3, 2, 3), "k2": (3, 3, 3, 2)}, (2, 4, 4, 2)),
        Model(
            "unet",
            unet,
            {
                "k1": (3, 3, 2, 4),
                "gamma": (4,),
                "aq": (4, 4),
                "ak": (4, 4),
                "av": (4, 4),
                "k2": (3, 3, 8, 2),
            },
            (2, 4, 4, 2),
        ),
        Model(
            "transformer",
            transformer,
            {"aq": (4, 4), "ak": (4, 4), "av": (4, 4), "w1": (4, 8), "w2": (8, 4)},
            (2, 3, 4),
        ),
        Model("lstm", lstm, {"wx": (2, 8), "wh": (2, 8), "b": (8,)}, (2, 3, 2)),
        Model("solve", solve, {"m": (3, 3)}, (2, 3)),
    ]
    eqx_model = _equinox()
    if eqx_model is not None:
        models.append(eqx_model)
    return {m.name: m for m in models}


ZOO = _zoo()
