"""Training with a divergence loss under ``DistributedDataParallel``: 2 CPU processes, gloo.

Score matching (Hyvarinen, 2005) fits a score model ``s(x) ~ grad log p(x)`` by minimizing
``E[ tr(ds/dx) + |s(x)|^2 / 2 ]``; the trace is the per-sample divergence of ``s``. Here every
step's batch is split over two processes, and each one computes the loss of its half with
``value_and_divergence(ddp)``: a transform of the DDP wrapper. divjac traces and differentiates
the wrapped module, and runs each call inside the wrapper's forward machinery, so the backward of
the loss all-reduces every gradient exactly once, as after ``ddp(x)`` (and buffers are
broadcast from rank 0 first). The per-sample work needs no communication.

The script checks what it claims: both ranks hold the same parameters at the end, equal (to
rounding) to one process trained on the whole batches; and the fitted score approaches the true
one, ``-Sigma^{-1} (x - mu)`` for the Gaussian data.

Two patterns would train each rank on its own gradients: ``divergence(ddp.module)`` (divjac
raises ``DDPError`` there) and a loss that does not reach every parameter while DDP waits for
them all (a pure divergence never reaches the output bias: construct DDP with
``find_unused_parameters=True``; divjac raises otherwise).

Run: ``python examples/ddp_divergence.py`` (it starts its two processes), or one process per
rank with ``torchrun --nproc-per-node 2 examples/ddp_divergence.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import distributed as dist, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from divjac.torch import value_and_divergence

WORLD = 2
D = torch.float64
MU = torch.tensor([1.0, -2.0], dtype=D)
CHOL = torch.tensor([[1.0, 0.0], [0.6, 0.5]], dtype=D)  # Sigma = CHOL @ CHOL.T


def score_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every process (whatever its default dtype)
    return nn.Sequential(nn.Linear(2, 32, dtype=D), nn.Softplus(), nn.Linear(32, 2, dtype=D))


def batches(steps: int, batch: int) -> list[torch.Tensor]:
    """The global batches, the same in every process: ``x ~ N(MU, CHOL CHOL^T)``."""
    g = torch.Generator().manual_seed(1)
    return [MU + torch.randn(batch, 2, generator=g, dtype=D) @ CHOL.T for _ in range(steps)]


def loss_fn(model: Any, x: torch.Tensor) -> torch.Tensor:
    """The score matching loss of ``x``; ``model`` a module or its DDP wrapper."""
    s, div = value_and_divergence(model, method="exact")(x)
    return (div + 0.5 * s.square().sum(1)).mean()


def train(model: Any, params: list[nn.Parameter], xs: list[torch.Tensor]) -> list[float]:
    opt = torch.optim.Adam(params, lr=2e-2)
    losses = []
    for x in xs:
        opt.zero_grad()
        loss = loss_fn(model, x)
        loss.backward()  # through DDP: gradients averaged over the ranks, once
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def worker(steps: int, batch: int, out: str | None) -> None:
    """One process of the job (its rank and the rendezvous from the environment, as
    ``torchrun`` sets them); rank 0 saves its parameters and losses to ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        rank = dist.get_rank()
        net = score_model()
        ddp = DDP(net)  # value_and_divergence reaches every parameter: the defaults do
        local = [x.chunk(WORLD)[rank] for x in batches(steps, batch)]
        losses = train(ddp, list(net.parameters()), local)
        mine = torch.cat([p.detach().flatten() for p in net.parameters()])
        everyone = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(everyone, mine)
        if rank == 0 and out is not None:
            gap = max(float((t - mine).abs().max()) for t in everyone)
            torch.save({"params": mine, "losses": losses, "rank_gap": gap}, out)
        # no rank tears gloo down while another still talks to it (that aborted a worker with
        # "terminate called without an active exception", rarely, on a loaded machine)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_distributed(steps: int, batch: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run this script as ``WORLD`` worker processes on 127.0.0.1 (what ``torchrun
    --nproc-per-node 2`` would start); rank 0's parameters, losses and the gap between ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        rendezvous |= {"WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, __file__, str(steps), str(batch), out]
        processes = [
            subprocess.Popen(
                command,
                env=os.environ | rendezvous | {"RANK": str(r), "LOCAL_RANK": str(r)},
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(WORLD)
        ]
        try:
            errors = [p.communicate(timeout=timeout_s)[1] for p in processes]
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [
            (r, e) for r, (p, e) in enumerate(zip(processes, errors, strict=True)) if p.returncode
        ]
        if failed:
            rank, err = failed[0]
            raise RuntimeError(f"worker {rank} of {WORLD} failed:\n{err[-3000:]}")
        result: dict[str, Any] = torch.load(out)
    return result


def main(small: bool = False) -> dict[str, Any]:
    steps, batch = (6, 16) if small else (300, 256)
    distributed = run_distributed(steps, batch)

    net = score_model()  # one process, the whole batches
    losses = train(net, list(net.parameters()), batches(steps, batch))
    params = torch.cat([p.detach().flatten() for p in net.parameters()])
    gap = float((params - distributed["params"]).abs().max())

    x = batches(1, 512)[0]
    true_score = -torch.linalg.solve(CHOL @ CHOL.T, (x - MU).T).T
    with torch.no_grad():
        score_error = float(
            (net(x) - true_score).square().sum(1).mean() / true_score.square().sum(1).mean()
        )

    print(f"{WORLD} processes, {steps} steps of {batch} samples ({batch // WORLD} per process)")
    print(f"loss: {distributed['losses'][0]:.4f} -> {distributed['losses'][-1]:.4f}")
    print(f"parameters: between ranks {distributed['rank_gap']:.1e}, vs one process {gap:.1e}")
    print(f"relative error of the fitted score: {score_error:.3f}")
    return {
        "losses": distributed["losses"],
        "one_process_losses": losses,
        "rank_gap": distributed["rank_gap"],
        "one_process_gap": gap,
        "score_error": score_error,
    }


if __name__ == "__main__":
    if "RANK" in os.environ:  # a worker: started by run_distributed, or by torchrun
        steps, batch = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (300, 256)
        worker(steps, batch, sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        main()
