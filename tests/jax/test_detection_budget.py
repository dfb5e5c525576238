"""Sparsity detection past its memory budget: an estimate near the real peak, no silent
fallback of "auto" to the dense method, and errors whose advice works."""

from __future__ import annotations

import re
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import divjac
from divjac._core import detection, plan
from divjac.jax import clear_caches, divergence, jacobian, sparsity
from divjac.models import jax as models

jax.config.update("jax_enable_x64", True)


def _estimate_and_peak(monkeypatch: pytest.MonkeyPatch, f, *args) -> tuple[int, int]:
    """The detection's own estimate of its memory and the peak tracemalloc measured."""
    estimates = []
    check = detection.EntryLimit.check

    def spy(self, dep, where):
        check(self, dep, where)
        estimates.append(self.estimate)

    monkeypatch.setattr(detection.EntryLimit, "check", spy)
    sparsity(f, argnums=len(args) - 1)(*args[:-1], jnp.zeros_like(args[-1])[:1, :8, :8])
    clear_caches()
    estimates.clear()
    tracemalloc.start()
    try:
        sparsity(f, argnums=len(args) - 1)(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return max(estimates), peak


def test_the_memory_estimate_is_within_2x_of_the_measured_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params = models.init_cnn(jax.random.key(0), channels=16, layers=4, dtype=jnp.float32)
    x = jnp.ones((2, 48, 48, 3), jnp.float32)
    estimate, peak = _estimate_and_peak(monkeypatch, models.cnn, params, x)
    assert peak / 2 <= estimate <= 2 * peak


def test_sets_shared_by_elementwise_operations_count_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every elementwise operation shares its input's sets: counting each output anew (as
    the estimate once did) overstates the memory many times over."""
    params = models.init_cnn(jax.random.key(1), channels=16, layers=2, dtype=jnp.float32)

    def deep(params, x):
        y = models.cnn(params, x)
        for _ in range(24):
            y = jnp.tanh(y) * 1.5 + 0.25
        return y

    x = jnp.ones((2, 48, 48, 3), jnp.float32)
    estimate, peak = _estimate_and_peak(monkeypatch, deep, params, x)
    assert peak / 2 <= estimate <= 2 * peak


def _cnn(seed: int = 2, size: int = 8):
    clear_caches()  # no detection of an earlier test
    params = models.init_cnn(jax.random.key(seed), channels=4, layers=2, dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(seed + 1), (2, size, size, 3), jnp.float64)
    return params, x


def test_auto_past_the_budget_warns_with_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    params, x = _cnn()
    exact = divergence(models.cnn, 1, method="exact")(params, x)
    clear_caches()
    monkeypatch.setenv("DIVJAC_DETECTION_MEMORY_MB", "0.01")
    with pytest.warns(divjac.DenseFallbackWarning, match=r"192 passes per sample") as caught:
        got = divergence(models.cnn, 1)(params, x)
    assert re.search(r"needed about \d+ MB .* budget of 0 MB", str(caught[0].message))
    np.testing.assert_allclose(got, exact, rtol=1e-10)
    clear_caches()
    with pytest.warns(divjac.DenseFallbackWarning, match=r"192 passes per sample"):
        jacobian(models.cnn, 1)(params, x)


def test_auto_refuses_an_absurd_dense_fallback_and_its_advice_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params, x = _cnn()
    monkeypatch.setattr(plan, "AUTO_DENSE_MAX_PASSES", 100)  # 192 dense passes: "absurd"
    monkeypatch.setenv("DIVJAC_DETECTION_MEMORY_MB", "0.01")
    with pytest.raises(divjac.DetectionMemoryError, match="192 passes per sample") as info:
        divergence(models.cnn, 1)(params, x)
    message = str(info.value)
    for way in ("DIVJAC_DETECTION_MEMORY_MB", "method='hutchinson'", "method='exact'"):
        assert way in message
    # every way out works: a stochastic method, the dense passes, a larger budget
    divergence(models.cnn, 1, method="hutchinson")(jax.random.key(0), params, x)
    exact = divergence(models.cnn, 1, method="exact")(params, x)
    needed = float(re.search(r"needed about (\d+) MB", message).group(1))
    monkeypatch.setenv("DIVJAC_DETECTION_MEMORY_MB", str(max(4 * needed, 1.0)))
    clear_caches()
    np.testing.assert_allclose(divergence(models.cnn, 1)(params, x), exact, rtol=1e-10)


def test_an_explicit_detection_past_the_budget_names_the_ways_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params, x = _cnn()
    monkeypatch.setenv("DIVJAC_DETECTION_MEMORY_MB", "0.01")
    with pytest.raises(divjac.DetectionMemoryError) as info:
        sparsity(models.cnn, argnums=1)(params, x)
    message = str(info.value)
    assert "budget of 0 MB" in message and "192" in message
    assert "'auto'" not in message  # "auto" cannot detect either: not a way out
    with pytest.raises(divjac.DetectionMemoryError, match="DIVJAC_DETECTION_MEMORY_MB"):
        divergence(models.cnn, 1, method="sparse")(params, x)
