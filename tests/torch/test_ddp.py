"""``DistributedDataParallel``: training with a divergence loss on 2 gloo processes equals one
process on the full batch.

One spawn of two processes (127.0.0.1, a free port, a bounded wait) runs every case: each rank
trains its half of the batch through the DDP wrapper and a one-process model of the same weights
trains on the whole batch; rank 0 records the largest differences of the gradients and the
parameters (and between the ranks) after every step, which the tests read. float64 throughout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import distributed as dist, multiprocessing as mp, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import divjac
from divjac.torch import divergence, grad_divergence, jacobian, sparsity, value_and_divergence

D = torch.float64
WORLD = 2
B, K = 8, 3  # the global batch, Hutchinson's probes
STEPS = 2
TOL = 1e-12
WAIT_S = 150.0

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


# --- models and losses (the same in every process) ----------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 3)).to(D)


def _cnn() -> nn.Module:
    """A CNN with batch norm in eval mode (per-sample; its running statistics are random)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh(), nn.Conv2d(4, 1, 3, padding=1)
    ).to(D)
    bn = net[1]
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    return net.eval()


def _data(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(B, *shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def _probes(shape: tuple[int, ...]) -> torch.Tensor:
    bits = torch.randint(0, 2, (K, B, *shape), generator=torch.Generator().manual_seed(7))
    return (2 * bits - 1).to(D)


Loss = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]


def _exact(f: Any, x: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    return divergence(f, method="exact")(x).square().mean()


def _hutchinson(f: Any, x: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    return divergence(f, method="hutchinson", num_probes=K)(probes, x).square().mean()


def _value_and_divergence(f: Any, x: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    y, div = value_and_divergence(f, method="exact")(x)
    return (0.5 * y.square().sum(1) + div).mean()


def _grad_divergence(f: Any, x: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    return grad_divergence(f, method="exact")(x).square().sum(1).mean()


def _jacobian(f: Any, x: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    return jacobian(f)(x).square().flatten(1).sum(1).mean()


UNUSED = {"find_unused_parameters": True}  # a divergence never reaches the output bias

# name: (model, sample shape, loss, DDP's options)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], Loss, dict[str, bool]]] = {
    "mlp-exact": (_mlp, (3,), _exact, UNUSED),
    "mlp-exact-static_graph": (_mlp, (3,), _exact, {"static_graph": True}),
    "mlp-hutchinson": (_mlp, (3,), _hutchinson, UNUSED),
    "mlp-value_and_divergence": (_mlp, (3,), _value_and_divergence, {}),
    "mlp-grad_divergence": (_mlp, (3,), _grad_divergence, UNUSED),
    "mlp-jacobian": (_mlp, (3,), _jacobian, UNUSED),
    "cnn-batchnorm-exact": (_cnn, (1, 5, 5), _exact, UNUSED),
    "cnn-batchnorm-hutchinson": (_cnn, (1, 5, 5), _hutchinson, UNUSED),
}


# --- what each rank runs ------------------------------------------------------------------------


def _local(t: torch.Tensor, rank: int, axis: int = 0) -> torch.Tensor:
    n = t.shape[axis] // WORLD
    return t.narrow(axis, rank * n, n)


def _flat_grads(net: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in net.parameters()]


def _gap(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """The largest difference of two lists of tensors, relative to the largest entry of ``b``
    (inf where one is None and the other not: a gradient that only one has)."""
    if any((u is None) != (v is None) for u, v in zip(a, b, strict=True)):
        return float("inf")
    pairs = [(u, v) for u, v in zip(a, b, strict=True) if u is not None and v is not None]
    scale = max(float(v.abs().max()) for _, v in pairs)
    return max(float((u - v).abs().max()) for u, v in pairs) / max(scale, 1.0)


def _across_ranks(net: nn.Module) -> float:
    """The largest difference of the parameters and gradients between the ranks."""
    mine = torch.cat([p.detach().flatten() for p in net.parameters()])
    mine = torch.cat([mine, *(p.grad.flatten() for p in net.parameters() if p.grad is not None)])
    everyone = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(everyone, mine)
    return max(float((t - everyone[0]).abs().max()) for t in everyone)


def _train(rank: int, name: str) -> dict[str, float]:
    make, shape, loss, options = CASES[name]
    x, probes = _data(shape, seed=1), _probes(shape)
    reference = make()
    net = make()
    ddp = DDP(net, **options)
    if rank == 1:  # rank 0's buffers are broadcast at every forward
        for b in net.buffers():
            if b.is_floating_point():
                b.add_(1.0)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = {"grads": 0.0, "params": 0.0, "ranks": 0.0}
    for _ in range(STEPS):
        for model, o in ((reference, opt_ref), (ddp, opt)):
            o.zero_grad()
            if model is reference:
                loss(model, x, probes).backward()
            else:
                loss(model, _local(x, rank), _local(probes, rank, axis=1)).backward()
        out["grads"] = max(out["grads"], _gap(_flat_grads(net), _flat_grads(reference)))
        out["ranks"] = max(out["ranks"], _across_ranks(net))
        opt_ref.step()
        opt.step()
        gap = _gap(
            [p.detach() for p in net.parameters()], [p.detach() for p in reference.parameters()]
        )
        out["params"] = max(out["params"], gap)
    return out


def _no_sync(rank: int) -> dict[str, float]:
    """One micro-batch under ``no_sync()`` (local), one synchronized: the sum of both."""
    x1, x2 = _data((3,), seed=2), _data((3,), seed=3)
    reference, net = _mlp(), _mlp()
    ddp = DDP(net, find_unused_parameters=True)
    (_exact(reference, x1, x1) + _exact(reference, x2, x2)).backward()
    with ddp.no_sync():
        _exact(ddp, _local(x1, rank), x1).backward()
    _exact(ddp, _local(x2, rank), x2).backward()
    return {"grads": _gap(_flat_grads(net), _flat_grads(reference)), "ranks": _across_ranks(net)}


class _DivergenceLoss(nn.Module):
    """The public pattern: DDP wraps a module whose forward calls divjac on the network."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return divergence(self.net, method="exact")(x).square().mean()


def _wrapped_loss_module(rank: int) -> dict[str, float]:
    x = _data((3,), seed=1)
    reference = _mlp()
    _exact(reference, x, x).backward()
    net = _mlp()
    ddp = DDP(_DivergenceLoss(net), find_unused_parameters=True)
    ddp(_local(x, rank)).backward()
    return {"grads": _gap(_flat_grads(net), _flat_grads(reference)), "ranks": _across_ranks(net)}


def _outcome(attempt: Callable[[], Any]) -> str:
    """``"ran"``, or the message of the divjac error it raised."""
    try:
        attempt()
    except divjac.DivjacError as err:
        return str(err)
    return "ran"


def _refusals(rank: int) -> dict[str, str]:
    """What raises (with its message), and what runs."""
    x = _local(_data((3,), seed=1), rank)
    net = _mlp()
    ddp = DDP(net)  # find_unused_parameters=False: the last bias never reaches a divergence
    seen = {
        "unused-parameter": _outcome(lambda: divergence(ddp)(x)),
        "wrapped-module": _outcome(lambda: divergence(ddp.module)(x)),
        "closure-over-the-module": _outcome(lambda: divergence(lambda x: 2 * ddp.module(x))(x)),
        "jacobian-of-the-module": _outcome(lambda: jacobian(ddp.module)(x)),
        "forward-then-module": _outcome(lambda: (ddp(x), divergence(ddp.module)(x))),
        "sparsity": str(sparsity(ddp)(x).csr.nnz == sparsity(net)(x).csr.nnz),
    }
    with torch.no_grad():  # nothing to synchronize
        divergence(ddp.module)(x)
    with ddp.no_sync():
        divergence(ddp.module)(x).sum().backward()
    late = _mlp()
    divergence(late)(x).sum().backward()  # not wrapped yet: nothing to synchronize
    wrapped_late = DDP(late, find_unused_parameters=True)
    seen["wrapped-after-a-first-call"] = _outcome(lambda: divergence(late)(x))
    divergence(wrapped_late)(x).sum().backward()
    bn = DDP(_cnn().train(), find_unused_parameters=True)
    seen["train-mode-batchnorm"] = _outcome(
        lambda: divergence(bn)(_local(_data((1, 5, 5), seed=1), rank))
    )
    return seen


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results: dict[str, Any] = {name: _train(rank, name) for name in CASES}
        results["no_sync"] = _no_sync(rank)
        results["wrapped-loss-module"] = _wrapped_loss_module(rank)
        results["refusals"] = _refusals(rank)
        if rank == 0:
            Path(out).write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()


# --- the spawn ---------------------------------------------------------------------------------


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _spawned(out: Path) -> Iterator[mp.ProcessContext]:
    context = mp.start_processes(
        _worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn"
    )
    try:
        yield context
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(10)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.conftest import once_per_session  # here: this file also runs as a script

    return once_per_session(tmp_path_factory, "ddp-gloo", lambda: _run(tmp_path_factory))


def _run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ddp") / "rank0.json"
    env = {"OMP_NUM_THREADS": "1"}
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with _spawned(out) as context:
            deadline = time.monotonic() + WAIT_S
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    pytest.fail(f"the 2-process DDP run did not finish in {WAIT_S:.0f} s")
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_training_through_ddp_equals_one_process_on_the_full_batch(results, name):
    got = results[name]
    assert got["grads"] <= TOL, got
    assert got["params"] <= TOL, got
    assert got["ranks"] == 0.0, got


def test_no_sync_accumulates_locally_then_synchronizes_once(results):
    got = results["no_sync"]
    assert got["grads"] <= TOL and got["ranks"] == 0.0, got


def test_a_ddp_wrapped_module_calling_divjac_in_its_forward_is_synchronized(results):
    got = results["wrapped-loss-module"]
    assert got["grads"] <= TOL and got["ranks"] == 0.0, got


def test_what_would_train_unsynchronized_raises_with_the_fix(results):
    seen = results["refusals"]
    assert "find_unused_parameters=True" in seen["unused-parameter"]
    assert "'2.bias'" in seen["unused-parameter"]
    for what in (
        "wrapped-module",
        "closure-over-the-module",
        "jacobian-of-the-module",
        "forward-then-module",
        "wrapped-after-a-first-call",
    ):
        assert "divergence(ddp)(x)" in seen[what], seen[what]
    assert (
        "mixes samples" in seen["train-mode-batchnorm"] or "batch" in seen["train-mode-batchnorm"]
    )
