"""P11: the first call of ``"auto"`` against the best explicit mode, and first / second calls.

(a) The first call (caches cleared before every call: divjac's, and JAX's compiled programs) of
``mode="auto"`` / ``method="auto"`` against the fastest first call of the explicit modes, on
four models in each framework, float32:

* a 10-class CNN classifier (three 3x3 convolutions, batch normalization in eval mode, a global
  average pool, a dense layer) on 32x32x3 images: ``jacobian``, explicit ``"rev"`` (10 passes)
  and ``"sparse"`` (``"fwd"``, 3072 passes, is never the fastest and is not run);
* a dense MLP ``d -> 256 -> 256 -> d``: ``divergence``, explicit ``"exact"`` and ``"sparse"``;
* a U-Net with attention (two resolutions, group normalization, self-attention over the
  positions of the coarse one; PyTorch: diffusers' ``UNet2DModel`` where it is installed):
  ``divergence``, ``"exact"`` and ``"sparse"``;
* the 3-layer 3x3 CNN (16 channels) on 32x32x3, where the sparse plan wins and ``"auto"`` must
  keep it: ``divergence``, ``"exact"`` and ``"sparse"``.

``"auto"`` skips the per-sample detection where it cannot pay off (:mod:`divjac._core.detection_gate`);
the target is ``auto <= 1.2x`` the best explicit first call. Each mode is run once untimed first
(the framework's one-time costs: imports, kernel registration), then the medians of repeats in
rotated order. ``--quick``: small sizes (``B = 2``, 8x8 images, ``d = 16``), one repeat.

(b) For each built-in model (:mod:`divjac.models.jax`, :mod:`divjac.models.torch`) the first
call of ``divergence(method="auto")`` against its second call, with the first call's stages
(trace, coupling check, screening, detection, coloring; passes: the rest) in ``extra``.
Reported, no target.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._core import timing
from ._harness import Result, block

_TARGET = 1.2


@dataclass
class _Framework:
    """What the measurements need of one framework."""

    name: str
    api: Any
    clear: Callable[[], None]
    array: Callable[[np.ndarray], Any]


def run(quick: bool) -> list[Result]:
    repeat = 1 if quick else 5
    results: list[Result] = []
    for name, cases in (("jax", _jax_cases), ("torch", _torch_cases)):
        if importlib.util.find_spec(name) is None:
            continue
        fw, models, builtin = cases(quick)
        for case, (transform, f, shape, modes) in models.items():
            results.append(_versus_explicit(fw, case, transform, f, shape, modes, repeat))
        results += [_first_and_second(fw, case, f, shape) for case, (f, shape) in builtin.items()]
    return results


def _first_call(fw: _Framework, make: Callable[[], Callable[[Any], Any]], x: Any) -> float:
    fw.clear()
    fn = make()
    start = time.perf_counter()
    block(fn(x))
    return time.perf_counter() - start


def _versus_explicit(
    fw: _Framework,
    case: str,
    transform: str,
    f: Callable[[Any], Any],
    shape: tuple[int, ...],
    modes: tuple[str, ...],
    repeat: int,
) -> Result:
    x = fw.array(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    option = "mode" if transform == "jacobian" else "method"
    makers = {
        mode: (lambda mode=mode: getattr(fw.api, transform)(f, **{option: mode}))
        for mode in ("auto", *modes)
    }
    for make in makers.values():  # the framework's own one-time costs, not a first call's
        _first_call(fw, make, x)
    times: dict[str, list[float]] = {mode: [] for mode in makers}
    order = list(makers)
    for r in range(repeat):
        for mode in order[r % len(order) :] + order[: r % len(order)]:  # rotated
            times[mode].append(_first_call(fw, makers[mode], x))
    median = {mode: statistics.median(t) for mode, t in times.items()}
    best = min(modes, key=median.__getitem__)
    return Result(
        "P11",
        f"{fw.name}: {case} {list(shape)}, {transform}, first call",
        f"{option}='auto'",
        f"best explicit ({option}={best!r})",
        median["auto"],
        median[best],
        target=_TARGET,
        extra={"median_seconds": median, "repeats": repeat},
    )


def _first_and_second(
    fw: _Framework, case: str, f: Callable[[Any], Any], shape: tuple[int, ...]
) -> Result:
    x = fw.array(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
    fw.clear()
    div = fw.api.divergence(f)
    with timing.recording() as stages:
        start = time.perf_counter()
        block(div(x))
        first = time.perf_counter() - start
    start = time.perf_counter()
    block(div(x))
    second = time.perf_counter() - start
    breakdown = {stage: stages.get(stage, 0.0) for stage in timing.STAGES}
    breakdown["passes"] = max(first - sum(breakdown.values()), 0.0)
    return Result(
        "-",
        f"{fw.name}: built-in {case} {list(shape)}, divergence(method='auto')",
        "first call",
        "second call",
        first,
        second,
        extra={"stages": breakdown},
    )


# --- JAX --------------------------------------------------------------------------------------


def _jax_cases(quick: bool) -> tuple[_Framework, dict[str, Any], dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from ... import jax as dj
    from ...models import jax as models

    def clear() -> None:
        dj.clear_caches()
        jax.clear_caches()

    fw = _Framework("JAX", dj, clear, jnp.asarray)
    key = iter(jax.random.split(jax.random.key(0), 32))
    b, image, d = (2, 8, 16) if quick else (8, 32, 64)

    def w(*shape: int) -> jax.Array:
        fan_in = math.prod(shape[:-1])
        return jax.random.normal(next(key), shape) / math.sqrt(fan_in)

    def conv(h: jax.Array, kernel: jax.Array, stride: int = 1) -> jax.Array:
        return jax.lax.conv_general_dilated(
            h, kernel, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def batch_norm(h: jax.Array) -> jax.Array:  # eval mode: a per-channel affine map
        c = h.shape[-1]
        return h * (1.0 + 0.1 * jnp.arange(c) / c) + 0.01 * jnp.arange(c)

    k1, k2, k3, dense = w(3, 3, 3, 16), w(3, 3, 16, 32), w(3, 3, 32, 64), w(64, 10)

    def classifier(x: jax.Array) -> jax.Array:
        h = jax.nn.relu(batch_norm(conv(x, k1)))
        h = jax.nn.relu(batch_norm(conv(h, k2, 2)))
        h = jax.nn.relu(batch_norm(conv(h, k3, 2)))
        return h.mean(axis=(1, 2)) @ dense

    mlp_params = models.init_mlp(next(key), (d, 256, 256, d))
    u1, u2, u3, u4 = w(3, 3, 3, 16), w(3, 3, 16, 32), w(3, 3, 48, 16), w(3, 3, 16, 3)
    wq, wk, wv = w(32, 32), w(32, 32), w(32, 32)

    def group_norm(h: jax.Array, groups: int = 4) -> jax.Array:
        k, H, W, C = h.shape
        g = h.reshape(k, H, W, groups, C // groups)
        mean = g.mean(axis=(1, 2, 4), keepdims=True)
        var = g.var(axis=(1, 2, 4), keepdims=True)
        return ((g - mean) / jnp.sqrt(var + 1e-5)).reshape(h.shape)

    def attention_unet(x: jax.Array) -> jax.Array:
        e1 = jax.nn.silu(group_norm(conv(x, u1)))
        k, H, W, _ = e1.shape
        e2 = jax.nn.silu(group_norm(conv(e1.reshape(k, H // 2, 2, W // 2, 2, 16).mean((2, 4)), u2)))
        t = e2.reshape(k, -1, 32)
        scores = (t @ wq) @ jnp.swapaxes(t @ wk, 1, 2) / math.sqrt(32)
        t = t + jax.nn.softmax(scores, axis=-1) @ (t @ wv)
        up = jnp.repeat(jnp.repeat(t.reshape(e2.shape), 2, axis=1), 2, axis=2)
        h = jax.nn.silu(group_norm(conv(jnp.concatenate([up, e1], axis=-1), u3)))
        return conv(h, u4)

    cnn_params = models.init_cnn(next(key), channels=16, layers=3)
    cases = {
        "10-class CNN classifier": (
            "jacobian",
            classifier,
            (b, image, image, 3),
            ("rev", "sparse"),
        ),
        f"dense MLP {d}-256-256-{d}": (
            "divergence",
            lambda x: models.mlp(mlp_params, x),
            (b, d),
            ("exact", "sparse"),
        ),
        "U-Net with attention": (
            "divergence",
            attention_unet,
            (b, image // 2, image // 2, 3),
            ("exact", "sparse"),
        ),
        "3-layer CNN": (
            "divergence",
            lambda x: models.cnn(cnn_params, x),
            (b, image, image, 3),
            ("exact", "sparse"),
        ),
    }
    unet_params = models.init_unet(next(key))
    t = jnp.full((b, 1), 0.5)
    xt_params = models.init_mlp_xt(next(key), d)
    squash_params = models.init_concat_squash(next(key), d)
    builtin = {
        "mlp": (lambda x: models.mlp(mlp_params, x), (b, d)),
        "mlp_xt": (lambda x: models.mlp_xt(xt_params, x, t), (b, d)),
        "concat_squash": (
            lambda x: models.concat_squash(squash_params, jnp.asarray(0.5), x),
            (b, d),
        ),
        "cnn": (lambda x: models.cnn(cnn_params, x), (b, image, image, 3)),
        "unet": (lambda x: models.unet(unet_params, x), (b, image, image, 3)),
        "blur": (models.blur, (b, image, image)),
    }
    return fw, cases, builtin


# --- PyTorch ----------------------------------------------------------------------------------


def _torch_cases(quick: bool) -> tuple[_Framework, dict[str, Any], dict[str, Any]]:
    import torch
    from torch import nn

    from ... import torch as dt
    from ...models import torch as models

    fw = _Framework("PyTorch", dt, dt.clear_caches, torch.as_tensor)
    torch.manual_seed(0)
    b, image, d = (2, 8, 16) if quick else (8, 32, 64)
    classifier = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).eval()
    mlp_params = models.init_mlp(0, (d, 256, 256, d))
    unet = (None if quick else _diffusers_unet(image // 2)) or _attention_unet()
    cnn_params = models.init_cnn(1, channels=16, layers=3)
    cases = {
        "10-class CNN classifier (BatchNorm eval)": (
            "jacobian",
            classifier,
            (b, 3, image, image),
            ("rev", "sparse"),
        ),
        f"dense MLP {d}-256-256-{d}": (
            "divergence",
            lambda x: models.mlp(mlp_params, x),
            (b, d),
            ("exact", "sparse"),
        ),
        "U-Net with attention": (
            "divergence",
            unet,
            (b, 3, image // 2, image // 2),
            ("exact", "sparse"),
        ),
        "3-layer CNN": (
            "divergence",
            lambda x: models.cnn(cnn_params, x),
            (b, 3, image, image),
            ("exact", "sparse"),
        ),
    }
    unet_params = models.init_unet(2)
    t = torch.full((b, 1), 0.5)
    xt_params = models.init_mlp_xt(3, d)
    builtin = {
        "mlp": (lambda x: models.mlp(mlp_params, x), (b, d)),
        "mlp_xt": (lambda x: models.mlp_xt(xt_params, x, t), (b, d)),
        "cnn": (lambda x: models.cnn(cnn_params, x), (b, 3, image, image)),
        "unet": (lambda x: models.unet(unet_params, x), (b, 3, image, image)),
        "blur": (models.blur, (b, image, image)),
    }
    return fw, cases, builtin


def _diffusers_unet(size: int) -> Callable[[Any], Any] | None:
    """A small diffusers ``UNet2DModel`` (group norms, attention at the coarse resolution) at
    timestep 0, or ``None`` where diffusers is not installed."""
    if importlib.util.find_spec("diffusers") is None:
        return None
    import torch
    from diffusers import UNet2DModel

    model: Any = UNet2DModel(
        sample_size=size,
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        norm_num_groups=8,
        attention_head_dim=8,
    )
    model.eval()
    step = torch.zeros(())

    def unet(x: Any) -> Any:
        return model(x, step).sample

    return unet


def _attention_unet() -> Any:
    """A small U-Net with attention: two resolutions, group norms, self-attention over the
    positions of the coarse one."""
    import torch
    from torch import nn

    def block(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(4, c_out), nn.SiLU()
        )

    class AttentionUNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc1, self.enc2, self.dec = block(3, 16), block(16, 32), block(48, 16)
            self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
            self.out = nn.Conv2d(16, 3, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e1 = self.enc1(x)
            e2 = self.enc2(nn.functional.avg_pool2d(e1, 2))
            t = e2.flatten(2).transpose(1, 2)
            t = t + self.attention(t, t, t, need_weights=False)[0]
            up = t.transpose(1, 2).reshape(e2.shape)
            up = up.repeat_interleave(2, 2).repeat_interleave(2, 3)
            return self.out(self.dec(torch.cat([up, e1], dim=1)))

    return AttentionUNet().eval()
