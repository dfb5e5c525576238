"""How many passes run at once when the caller does not say: the memory budget, and on the
host the CPU's cache (where the backward does not recompute each chunk)."""

from __future__ import annotations

import pytest

from divjac._core import plan

MIB = 1 << 20


@pytest.fixture
def host(monkeypatch):
    monkeypatch.delenv("DIVJAC_MEMORY_BUDGET_MB", raising=False)
    monkeypatch.setattr(plan, "host_cache_bytes", lambda: 32 * MIB)


@pytest.mark.usefixtures("host")
def test_on_the_host_a_chunk_of_first_order_passes_fits_the_cache():
    # 32 fit: 5 chunks, made even (30, not 4 of 32 and one of 19)
    assert plan.choose_chunk_size(147, MIB, None, in_cache=True) == 30
    assert plan.choose_chunk_size(64, 32 * MIB // 56, None, in_cache=True) == 32  # 56 fit
    # 40 passes fit, or 80 where a pass holds half its bytes in the cache at once (a fused sweep)
    assert plan.choose_chunk_size(64, 32 * MIB // 40, None, in_cache=True) == 32
    assert plan.choose_chunk_size(64, 32 * MIB // 40, None, in_cache=True, cache_share=2) == 64
    assert plan.choose_chunk_size(147, MIB, None) == 147  # by the memory budget alone
    assert plan.choose_chunk_size(20, MIB, None, in_cache=True) == 20  # all fit
    assert plan.choose_chunk_size(147, 16 * MIB, None, in_cache=True) == 8  # at least 8
    assert plan.choose_chunk_size(147, 200 * MIB, None, in_cache=True) == 5  # the budget's
    assert plan.choose_chunk_size(147, MIB, 100, in_cache=True) == 100  # the caller's


@pytest.mark.usefixtures("host")
def test_a_device_or_a_set_budget_is_not_cut_to_the_cache(monkeypatch):
    assert plan.choose_chunk_size(147, MIB, None, available=8 << 30, in_cache=True) == 147
    monkeypatch.setenv("DIVJAC_MEMORY_BUDGET_MB", "100")
    assert plan.choose_chunk_size(147, MIB, None, in_cache=True) == 74  # 100 fit: 2 chunks


def test_the_host_cache_is_read_or_defaults():
    cache = plan.host_cache_bytes()
    assert MIB // 4 <= cache <= 4096 * MIB


@pytest.mark.usefixtures("host")
def test_jax_passes_under_a_gradient_are_not_cut_to_the_cache(monkeypatch):
    """Under ``jax.grad`` each chunk is checkpointed (recomputed by the backward): the memory
    budget alone chunks the passes there; without a gradient they fit the cache."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from divjac.jax import divergence

    monkeypatch.setattr(plan, "host_cache_bytes", lambda: 1)  # every chunk at its floor
    chunks = []
    original = plan.choose_chunk_size

    def spy(*args, **kwargs):
        chunks.append(original(*args, **kwargs))
        return chunks[-1]

    monkeypatch.setattr(plan, "choose_chunk_size", spy)
    div = divergence(lambda x: jnp.tanh(x @ jnp.ones((20, 20))), method="exact")
    x = jnp.ones((2, 20)) / 20
    div(x)
    jax.grad(lambda x: div(x).sum())(x)
    assert chunks == [7, 20]  # the floor of 8 passes: 3 chunks, made even
