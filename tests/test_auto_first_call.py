"""``"auto"`` decides before it detects (:mod:`divjac._core.detection_gate`), in both frameworks.

It skips the per-sample detection where it cannot pay off (few dense passes: a 10-class
classifier; a pattern dense on a few probed inputs: an MLP, a U-Net with attention), still
refuses functions that mix samples (the coupling check always runs), still detects and takes
the sparse plan of a convolutional network, and its results equal brute force (float64).

What ran is read from the stages a call records (:mod:`divjac._core.timing`), the traced
program's cached detections and the passes the backend was asked to seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from divjac import BatchCouplingError
from divjac._core import detection_gate, timing

from .reference import jax_diagonal_blocks, torch_diagonal_blocks, traces

B = 2


@dataclass
class Framework:
    """One framework's API, backend, models and brute-force reference."""

    api: Any
    backend: Any
    models: dict[str, tuple[Callable[..., Any], tuple[int, ...]]]
    blocks: Callable[[Callable[..., Any], Any], np.ndarray]
    laplacian: Callable[[Callable[..., Any], Any], np.ndarray]
    array: Callable[[np.ndarray], Any]
    numpy: Callable[[Any], np.ndarray]


def _jax() -> Framework:
    import jax
    import jax.numpy as jnp

    import divjac.jax as dj
    from divjac.jax._backend import BACKEND
    from divjac.models import jax as models

    rng = np.random.default_rng(0)

    def w(*shape: int) -> Any:
        return jnp.asarray(rng.standard_normal(shape) / math.sqrt(shape[-2] * 3))

    def conv(h: Any, kernel: Any, stride: int = 1) -> Any:
        return jax.lax.conv_general_dilated(
            h, kernel, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    k1, k2, dense = w(3, 3, 3, 4), w(3, 3, 4, 8), w(8, 10)
    scale, shift = jnp.asarray(rng.uniform(0.5, 1.5, 4)), jnp.asarray(rng.normal(size=4))

    def classifier(x: Any) -> Any:  # conv, batch norm (eval: per-channel affine), pool, dense
        h = jax.nn.relu(conv(x, k1) * scale + shift)
        h = jnp.tanh(conv(h, k2, stride=2))
        return h.mean(axis=(1, 2)) @ dense

    mlp_params = models.init_mlp(jax.random.key(0), (24, 32, 24), jnp.float64)
    a1, a2 = w(3, 3, 2, 4), w(3, 3, 4, 2)
    wq, wk, wv = w(4, 4), w(4, 4), w(4, 4)

    def attention_unet(x: Any) -> Any:  # conv, self-attention over all positions, conv
        h = jnp.tanh(conv(x, a1))
        tokens = h.reshape(h.shape[0], -1, 4)
        scores = (tokens @ wq) @ jnp.swapaxes(tokens @ wk, 1, 2) / 2.0
        tokens = tokens + jax.nn.softmax(scores, axis=-1) @ (tokens @ wv)
        return conv(tokens.reshape(h.shape), a2)

    cnn_params = models.init_cnn(jax.random.key(1), channels=4, layers=3, dtype=jnp.float64)

    def laplacian(u: Callable[..., Any], x: Any) -> np.ndarray:
        def one(xb: Any) -> Any:
            return u(xb[None])[0]

        return np.array([np.trace(np.asarray(jax.hessian(one)(xb))) for xb in x])

    return Framework(
        api=dj,
        backend=BACKEND,
        models={
            "classifier": (classifier, (8, 8, 3)),
            "mlp": (lambda x: models.mlp(mlp_params, x), (24,)),
            "attention_unet": (attention_unet, (4, 4, 2)),
            "cnn": (lambda x: models.cnn(cnn_params, x), (8, 8, 3)),
        },
        blocks=lambda f, x: jax_diagonal_blocks(f, (x,)),
        laplacian=laplacian,
        array=jnp.asarray,
        numpy=np.asarray,
    )


def _torch() -> Framework:
    import torch
    from torch import nn

    import divjac.torch as dt
    from divjac.models import torch as models
    from divjac.torch._backend import BACKEND

    torch.manual_seed(0)
    classifier = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3, padding=1, stride=2),
        nn.BatchNorm2d(8),
        nn.Tanh(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    ).double()
    with torch.no_grad():  # running statistics that are not the identity
        for m in classifier:
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    classifier.eval()
    mlp_params = models.init_mlp(0, (24, 32, 24), torch.float64)

    class AttentionUNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Conv2d(2, 4, 3, padding=1)
            self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
            self.outer = nn.Conv2d(4, 2, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inner(x))
            tokens = h.flatten(2).transpose(1, 2)
            tokens = tokens + self.attention(tokens, tokens, tokens, need_weights=False)[0]
            return self.outer(tokens.transpose(1, 2).reshape(h.shape))

    cnn_params = models.init_cnn(1, channels=4, layers=3, dtype=torch.float64)

    def laplacian(u: Callable[..., Any], x: Any) -> np.ndarray:
        def one(xb: Any) -> Any:
            return u(xb[None])[0]

        return np.array(
            [torch.trace(torch.autograd.functional.hessian(one, xb)).item() for xb in x]
        )

    return Framework(
        api=dt,
        backend=BACKEND,
        models={
            "classifier": (classifier, (3, 8, 8)),
            "mlp": (lambda x: models.mlp(mlp_params, x), (24,)),
            "attention_unet": (AttentionUNet().double().eval(), (2, 4, 4)),
            "cnn": (lambda x: models.cnn(cnn_params, x), (3, 8, 8)),
        },
        blocks=lambda f, x: torch_diagonal_blocks(f, (x,)),
        laplacian=laplacian,
        array=lambda a: torch.as_tensor(a, dtype=torch.float64),
        numpy=lambda t: t.detach().numpy(),
    )


@pytest.fixture(params=["jax", "torch"])
def fw(request: pytest.FixtureRequest) -> Framework:
    pytest.importorskip(request.param)
    framework = _jax() if request.param == "jax" else _torch()
    framework.api.clear_caches()  # every call below is a first call
    return framework


def _input(fw: Framework, shape: tuple[int, ...], seed: int = 0) -> Any:
    return fw.array(np.random.default_rng(seed).standard_normal((B, *shape)))


def _per_sample(fw: Framework, f: Callable[..., Any], x: Any) -> dict[int | None, Any]:
    """The per-sample detections cached for ``f`` at ``x``, by their entry limit."""
    traced = fw.backend.trace(f, (x,), {}, argnum=0, batch_axis=0, has_aux=False)
    return {
        limit: found
        for (_, per_sample, whole_batch, limit), found in traced.detections.items()
        if per_sample and not whole_batch
    }


@pytest.fixture
def seeded(fw: Framework, monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int]]:
    """``(sparse, n_passes)`` of every plan whose seeds the backend made."""
    made: list[tuple[bool, int]] = []
    indicators = type(fw.backend).indicators

    def spy(self: Any, colors: Any, n: int, n_passes: int, like: Any, **options: Any) -> Any:
        made.append((colors is not None, n_passes))
        return indicators(self, colors, n, n_passes, like, **options)

    monkeypatch.setattr(type(fw.backend), "indicators", spy)
    return made


def test_few_dense_passes_skip_detection(fw: Framework, seeded: list[tuple[bool, int]]) -> None:
    """A 10-class classifier: its 10 reverse passes are the dense plan, no detection runs."""
    f, shape = fw.models["classifier"]
    x = _input(fw, shape)
    with timing.recording() as stages:
        jac = fw.api.jacobian(f)(x)
    assert "coupling check" in stages and "detection" not in stages
    assert not _per_sample(fw, f, x)
    assert seeded == [(False, 10)]
    np.testing.assert_allclose(fw.numpy(jac), fw.blocks(f, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("model", ["mlp", "attention_unet"])
def test_dense_on_the_probes_skips_detection(
    fw: Framework, seeded: list[tuple[bool, int]], model: str
) -> None:
    f, shape = fw.models[model]
    n = math.prod(shape)
    assert n > detection_gate.FEW_PASSES  # the probe decides, not the pass count
    x = _input(fw, shape)
    with timing.recording() as stages:
        div = fw.api.divergence(f)(x)
    assert "screening" in stages and "coupling check" in stages and "detection" not in stages
    assert _per_sample(fw, f, x) == {0: None}  # the verdict "dense", cached
    assert seeded == [(False, n)]
    np.testing.assert_allclose(
        fw.numpy(div), traces(fw.blocks(f, x), shape), rtol=1e-10, atol=1e-12
    )


def test_the_verdict_is_cached(fw: Framework, monkeypatch: pytest.MonkeyPatch) -> None:
    probes = []
    probe = detection_gate._dense_on_probes
    monkeypatch.setattr(detection_gate, "_dense_on_probes", lambda t: probes.append(t) or probe(t))
    for model in ("mlp", "cnn"):
        f, shape = fw.models[model]
        x = _input(fw, shape)
        first = fw.api.divergence(f)(x)
        second = fw.api.divergence(f)(x)
        np.testing.assert_array_equal(fw.numpy(first), fw.numpy(second))
    assert len(probes) == 2  # one probe per program, none on the second calls


def test_the_cnn_is_still_detected_and_sparse(
    fw: Framework, seeded: list[tuple[bool, int]]
) -> None:
    f, shape = fw.models["cnn"]
    n = math.prod(shape)
    x = _input(fw, shape)
    with timing.recording() as stages:
        div = fw.api.divergence(f)(x)
        jac = fw.api.jacobian(f)(x)
    assert "detection" in stages and "coupling check" not in stages
    found = _per_sample(fw, f, x)
    pattern = next(d.pattern for d in found.values() if d is not None)
    assert seeded == [
        (True, pattern.n_diagonal_colors),
        (True, min(pattern.n_colors, pattern.n_row_colors)),
    ]
    assert pattern.n_diagonal_colors < n // 2  # 48 of 192 (an 8x8 image is small)
    blocks = fw.blocks(f, x)
    np.testing.assert_allclose(fw.numpy(div), traces(blocks, shape), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(fw.numpy(jac), blocks, rtol=1e-10, atol=1e-12)


def test_explicit_sparse_still_detects_few_passes(fw: Framework) -> None:
    def f(x: Any) -> Any:
        return x * x * x + x

    x = _input(fw, (4,))
    with timing.recording() as stages:
        div = fw.api.divergence(f, method="sparse")(x)
    assert "detection" in stages
    np.testing.assert_allclose(fw.numpy(div), traces(fw.blocks(f, x), (4,)), rtol=1e-12)


def _mixes(x: Any) -> Any:
    return x - x.mean(0)


@pytest.mark.parametrize("width", [4, 32])  # few passes; the probe (not dense here)
def test_a_function_that_mixes_samples_still_raises(fw: Framework, width: int) -> None:
    x = _input(fw, (width,))
    with pytest.raises(BatchCouplingError):
        fw.api.divergence(_mixes)(x)
    with pytest.raises(BatchCouplingError):
        fw.api.jacobian(_mixes)(x)


def test_a_dense_function_that_mixes_samples_still_raises(fw: Framework) -> None:
    f, shape = fw.models["mlp"]
    x = _input(fw, shape)
    with timing.recording() as stages, pytest.raises(BatchCouplingError):
        fw.api.divergence(lambda v: f(_mixes(v)))(x)
    assert "detection" not in stages  # dense on the probes: the coupling check refused it


def test_batch_norm_in_training_mode_still_raises() -> None:
    pytest.importorskip("torch")
    from torch import nn

    fw = _torch()
    classifier, shape = fw.models["classifier"]
    square = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Tanh())
    x = _input(fw, shape)
    with pytest.raises(BatchCouplingError):
        fw.api.jacobian(classifier.train())(x)  # 10 outputs: the coupling check alone
    with pytest.raises(BatchCouplingError):
        fw.api.divergence(square.double().train())(x)  # dense on the probes: the check alone


@pytest.mark.slow
def test_other_auto_transforms_equal_brute_force(fw: Framework) -> None:
    f, shape = fw.models["mlp"]
    x = _input(fw, shape)
    expected = traces(fw.blocks(f, x), shape)
    value, div = fw.api.value_and_divergence(f)(x)
    np.testing.assert_allclose(fw.numpy(div), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(fw.numpy(value), fw.numpy(f(x)), rtol=1e-12)
    exact = fw.api.grad_divergence(f, method="exact")(x)
    np.testing.assert_allclose(
        fw.numpy(fw.api.grad_divergence(f)(x)), fw.numpy(exact), rtol=1e-10, atol=1e-12
    )

    def u(v: Any) -> Any:
        return (f(v) ** 2).sum(-1)

    with timing.recording() as stages:
        lap = fw.api.laplacian(u)(x)
    assert "detection" not in stages
    np.testing.assert_allclose(fw.numpy(lap), fw.laplacian(u, x), rtol=1e-10, atol=1e-12)
