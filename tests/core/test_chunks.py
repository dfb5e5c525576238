"""How many passes run at once when the caller does not say: the memory budget, and on the
host the CPU's cache (under a gradient only in torch, where all passes fit the budget at once)."""

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
def test_large_passes_whose_batching_saves_only_overhead_run_one_at_a_time():
    """Rows that share one forward pass (a convolution network's on PyTorch's tape): where 8
    of them would fill more than half the cache, one at a time, as a loop of backward passes;
    small ones keep their chunks of at least 8, in the cache."""
    # a 10-class ResNet's rows at B = 8 (3 MB each) and B = 128 (49 MB): one at a time
    assert plan.choose_chunk_size(10, 3 * MIB, None, in_cache=True, overhead_only=True) == 1
    assert plan.choose_chunk_size(10, 49 * MIB, None, in_cache=True, overhead_only=True) == 1
    # small rows (an MLP's, a small image's): batched as before
    assert plan.choose_chunk_size(10, MIB, None, in_cache=True, overhead_only=True) == 10
    assert plan.choose_chunk_size(147, MIB, None, in_cache=True, overhead_only=True) == 30
    # passes that batching saves more than overhead (columns, each evaluating the function)
    assert plan.choose_chunk_size(10, 3 * MIB, None, in_cache=True) == 10
    assert plan.choose_chunk_size(10, 49 * MIB, None, in_cache=True) == 5  # at least 8
    # the caller's chunk, a device's memory, a set budget: as they say
    assert plan.choose_chunk_size(10, 49 * MIB, 10, in_cache=True, overhead_only=True) == 10
    assert plan.choose_chunk_size(10, 49 * MIB, None, overhead_only=True) == 10


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


@pytest.mark.usefixtures("host")
def test_torch_rows_of_a_convolution_network_are_pulled_one_at_a_time(monkeypatch):
    """A 10-class convolution network's Jacobian pulls its 10 rows one at a time where they
    are large (here: every pass, the cache made tiny); an MLP's rows stay batched (chunks of
    at least 8); the values are those of a loop of backward passes. On the autograd graph
    (the parameters require grad) the same chunks keep their graphs, not checkpointed: the
    gradients through the Jacobian are those of the loop's, with ``create_graph``."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from divjac.torch import jacobian

    monkeypatch.setattr(plan, "host_cache_bytes", lambda: 1)
    chunks = []
    original = plan.choose_chunk_size

    def spy(*args, **kwargs):
        chunks.append(original(*args, **kwargs))
        return chunks[-1]

    monkeypatch.setattr(plan, "choose_chunk_size", spy)
    from divjac.torch import _passes

    checkpoints = []
    checkpoint = _passes.checkpoint
    monkeypatch.setattr(
        _passes, "checkpoint", lambda *a, **k: checkpoints.append(1) or checkpoint(*a, **k)
    )
    torch.manual_seed(0)
    d = torch.float64
    conv = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10),
    ).to(d).eval()  # fmt: skip
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.Tanh(), nn.Linear(16, 10)).to(d)
    x = torch.randn(2, 3, 4, 4, dtype=d)
    for net, chunk in ((conv, 1), (mlp, 5)):
        chunks.clear()
        with torch.no_grad():
            jac = jacobian(net)(x)
        assert chunks == [chunk]
        xg = x.clone().requires_grad_()
        out = net(xg)
        rows = [torch.autograd.grad(out[:, k].sum(), xg, retain_graph=True)[0] for k in range(10)]
        torch.testing.assert_close(jac, torch.stack(rows, 1))
        chunks.clear()
        ours = jacobian(net)(x)
        assert chunks == [chunk]
        assert not checkpoints
        unused = {"allow_unused": True, "materialize_grads": True}  # the last bias
        grads = torch.autograd.grad(ours.square().sum(), list(net.parameters()), **unused)
        out = net(xg)
        rows = [
            torch.autograd.grad(out[:, k].sum(), xg, retain_graph=True, create_graph=True)[0]
            for k in range(10)
        ]
        loss = torch.stack(rows, 1).square().sum()
        expected = torch.autograd.grad(loss, list(net.parameters()), **unused)
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_a_setting_that_is_not_a_positive_size_is_named(monkeypatch, value):
    """A ``DIVJAC_*_MB`` setting that is not a positive number of megabytes is refused with
    its name and a value that works; an empty one counts as unset."""
    from divjac._core import settings
    from divjac._errors import OptionError

    monkeypatch.setenv("DIVJAC_MEMORY_BUDGET_MB", value)
    with pytest.raises(OptionError, match=r"DIVJAC_MEMORY_BUDGET_MB=.*e\.g\. DIVJAC_MEMORY"):
        settings.read()
    monkeypatch.setenv("DIVJAC_MEMORY_BUDGET_MB", "")
    assert settings.read().memory_budget is None
    monkeypatch.setenv("DIVJAC_MEMORY_BUDGET_MB", "2.5")
    assert settings.read().memory_budget == int(2.5 * MIB)
