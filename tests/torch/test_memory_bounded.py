"""Training through chunked passes within a memory budget (torch): with gradients, every chunk
of passes (exact and sparse divergences, Jacobians, the second-order sweeps) is checkpointed, so
its graph is dropped once its result is computed and the backward recomputes it. The gradients
are those of the unchunked call, to 1e-12 in float64; nothing is checkpointed where no gradient
can flow or where one chunk holds every pass. Memory is measured by ``divjac bench``
(``bench_memory``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import divjac.torch as dj
from divjac.torch import _passes
from tests.torch.conftest import count_calls

D = torch.float64


def _cnn(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.Tanh(),
        nn.Dropout(dropout),
        nn.Conv2d(4, 2, 3, padding=1),
    ).to(D)


@pytest.fixture
def checkpoints(monkeypatch):
    """The number of chunks run under ``torch.utils.checkpoint``."""
    return count_calls(monkeypatch, _passes, "checkpoint")


def _grads(net: nn.Module, x: torch.Tensor, transform, *, input_grad: bool = True) -> list:
    net.zero_grad()
    x = x.detach().clone().requires_grad_(input_grad)
    value = transform(x)
    (value.square().sum() + value.sum()).backward()
    return [value.detach(), x.grad, *(p.grad for p in net.parameters())]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["exact", "sparse"])
@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_chunked_training_gradients_equal_unchunked(method, mode, checkpoints):
    net = _cnn().eval()
    x = torch.randn(3, 2, 5, 5, dtype=D)
    whole = _grads(net, x, dj.divergence(net, method=method, mode=mode))
    assert checkpoints[0] == 0  # one chunk: nothing to recompute
    chunked = _grads(net, x, dj.divergence(net, method=method, mode=mode, chunk_size=4))
    _assert_same(chunked, whole)
    assert checkpoints[0] >= 2


def test_jacobian_and_parameter_only_gradients(checkpoints):
    """A Jacobian's passes, and gradients that reach the parameters only (an input that does
    not require grad: the passes are on the graph through the weights)."""
    net = _cnn().eval()
    x = torch.randn(2, 2, 4, 4, dtype=D)
    for mode in ("fwd", "rev"):
        whole = _grads(net, x, dj.jacobian(net, mode=mode))
        chunked = _grads(net, x, dj.jacobian(net, mode=mode, chunk_size=5))
        _assert_same(chunked, whole)
    assert checkpoints[0] > 0
    before = checkpoints[0]
    transform = dj.divergence(net, method="exact")
    whole = _grads(net, x, transform, input_grad=False)
    chunked = _grads(net, x, dj.divergence(net, method="exact", chunk_size=4), input_grad=False)
    _assert_same(chunked, whole)
    assert checkpoints[0] > before
    assert net[0].weight.grad is not None


def test_random_function_recomputes_its_draws(checkpoints):
    """Dropout in training mode: the recomputed chunks draw what their first run drew."""
    net = _cnn(dropout=0.3)
    net[1].eval()  # the batch norm per sample (its running statistics)
    x = torch.randn(2, 2, 4, 4, dtype=D)
    results = []
    for chunk in (None, 5):
        torch.manual_seed(7)
        results.append(_grads(net, x, dj.divergence(net, method="exact", chunk_size=chunk)))
    _assert_same(results[1], results[0])
    assert checkpoints[0] > 0


@pytest.mark.parametrize("method", ["exact", "sparse"])
def test_second_order_sweep_chunked_training(method, checkpoints):
    torch.manual_seed(0)
    w = torch.randn(6, 8, dtype=D)
    v = torch.randn(8, dtype=D, requires_grad=True)

    def u(x):
        return torch.tanh(x @ w).pow(2) @ v

    x = torch.randn(3, 6, dtype=D)
    results = []
    for chunk in (None, 2):
        v.grad = None
        xx = x.clone().requires_grad_()
        lap = dj.laplacian(u, method=method, chunk_size=chunk)(xx)
        lap.square().sum().backward()
        results.append([lap.detach(), xx.grad, v.grad])
    _assert_same(results[1], results[0])
    assert checkpoints[0] >= 2


def test_nothing_checkpointed_without_gradients(checkpoints):
    net = _cnn().eval()
    x = torch.randn(2, 2, 4, 4, dtype=D)
    with torch.no_grad():
        dj.divergence(net, method="exact", chunk_size=4)(x)
    with torch.inference_mode():
        dj.divergence(net, method="exact", chunk_size=4)(x)
    for p in net.parameters():
        p.requires_grad_(False)
    dj.divergence(net, method="exact", chunk_size=4)(x)
    assert checkpoints[0] == 0


def test_budget_counts_what_a_pass_keeps_for_the_backward(monkeypatch):
    """With gradients a pass keeps its intermediates for the backward: the planner's bytes per
    pass are larger there, so the memory budget cuts the passes into more chunks."""
    from divjac._core import plan

    planned = []
    original = plan.choose_chunk_size

    def spy(n_passes, bytes_per_pass, chunk_size, **kwargs):
        planned.append(bytes_per_pass)
        return original(n_passes, bytes_per_pass, chunk_size, **kwargs)

    monkeypatch.setattr(plan, "choose_chunk_size", spy)
    net = _cnn().eval()
    x = torch.randn(2, 2, 4, 4, dtype=D)
    transform = dj.divergence(net, method="exact")
    with torch.no_grad():
        transform(x)
    transform(x)
    assert len(planned) == 2
    assert planned[1] > 1.5 * planned[0]


@pytest.fixture
def chunks(monkeypatch) -> list[int]:
    """The chunk sizes the planner chooses, on a host whose cache holds no pass (every chunk
    it cuts for the cache is at its floor of 8)."""
    from divjac._core import plan

    monkeypatch.delenv("DIVJAC_MEMORY_BUDGET_MB", raising=False)
    monkeypatch.setattr(plan, "host_cache_bytes", lambda: 1)
    chosen: list[int] = []
    original = plan.choose_chunk_size

    def spy(*args, **kwargs):
        chosen.append(original(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(plan, "choose_chunk_size", spy)
    return chosen


def test_cache_sized_chunks_keep_their_graphs_where_all_passes_fit(chunks, checkpoints):
    """On the host, passes run in chunks that fit the CPU's cache, on the autograd graph too
    where all of them fit the memory budget at once: those chunks keep their graphs (no
    checkpoint, nothing recomputed). The gradients are those of one chunk."""
    net = _cnn().eval()
    x = torch.randn(2, 2, 4, 4, dtype=D)
    transform = dj.divergence(net, method="exact")
    with torch.no_grad():
        off = transform(x)
    on = _grads(net, x, transform)
    assert chunks == [8, 8]  # 32 passes: at the floor of 8, off the graph and on it
    assert checkpoints[0] == 0
    torch.testing.assert_close(on[0], off)
    _assert_same(on, _grads(net, x, dj.divergence(net, method="exact", chunk_size=32)))


def test_chunks_past_the_budget_are_checkpointed(chunks, checkpoints, monkeypatch):
    """Where the passes on the graph do not all fit the memory budget, the budget alone chunks
    them (not the cache), and each chunk is checkpointed: the gradients are those of one
    chunk."""
    from divjac._core import plan

    net = _cnn().eval()
    x = torch.randn(2, 2, 4, 4, dtype=D)
    whole = _grads(net, x, dj.divergence(net, method="exact", chunk_size=32))
    monkeypatch.setattr(plan, "memory_budget", lambda *args, **kwargs: 1)  # no pass fits
    chunks.clear()
    chunked = _grads(net, x, dj.divergence(net, method="exact"))
    assert chunks == [1]
    assert checkpoints[0] == 32
    _assert_same(chunked, whole)


def test_second_order_sweeps_fit_the_cache(chunks, checkpoints):
    """The directions of a Laplacian's and a Hessian diagonal's sweeps are chunked for the CPU's
    cache as first-order passes are (torch, tanh MLP d = 64 at B = 256: 1.3x faster), on the
    autograd graph too where they all fit the memory budget (not checkpointed), with the same
    values."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 1)).to(D)
    x = torch.randn(3, 20, dtype=D)

    def u(z: torch.Tensor) -> torch.Tensor:
        return net(z)[..., 0]

    hessians = torch.stack([torch.autograd.functional.hessian(u, xi) for xi in x])
    for transform, expected in (
        (dj.laplacian(u, method="exact"), hessians.diagonal(dim1=1, dim2=2).sum(1)),
        (dj.hessian_diagonal(u, method="exact"), hessians.diagonal(dim1=1, dim2=2)),
    ):
        chunks.clear()
        with torch.no_grad():
            off = transform(x)
        assert chunks[-1] == 7  # 20 directions, 8 fit: 3 even chunks
        on = transform(x)
        assert chunks[-1] == 7  # the same chunks, which keep their graphs
        on.sum().backward()
        torch.testing.assert_close(off, expected)
        torch.testing.assert_close(on.detach(), off)
    assert checkpoints[0] == 0


def test_compiled_chunks_past_the_budget_are_not_checkpointed(chunks, checkpoints, monkeypatch):
    """Under ``torch.compile`` the plan is made ahead of dynamo's trace, outside it: chunks the
    budget cuts on the graph are still not checkpointed there (dynamo's partitioner chooses
    what to recompute, and ``torch.utils.checkpoint`` with a context cannot be traced). The
    values and gradients are those of one eager chunk."""
    from divjac._core import plan

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 2, 3, padding=1))
    net = net.to(D)
    x = torch.randn(2, 2, 4, 4, dtype=D)
    whole = _grads(net, x, dj.divergence(net, method="exact", chunk_size=32))
    monkeypatch.setattr(plan, "memory_budget", lambda *args, **kwargs: 1)  # no pass fits
    chunks.clear()
    transform = torch.compile(dj.divergence(net, method="exact"), backend="aot_eager")
    compiled = _grads(net, x, transform)
    assert chunks and chunks[-1] == 1
    assert checkpoints[0] == 0
    _assert_same(compiled, whole)
