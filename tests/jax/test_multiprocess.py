"""divjac under ``jax.distributed``: two processes of two CPU devices each (gloo collectives), the
batch sharded over the global mesh of four devices.

Each process runs this file as a script (its process id and the coordinator's port on the
command line) and reports, per method, the collectives in the compiled program and the largest
difference between its own shards of the result and the one-process call on the whole batch.
Process 1 used to crash in the chunk planner, which asked every device of the mesh for its
memory statistics (only a process's own devices can answer).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

PROCESSES, LOCAL_DEVICES = 2, 2
METHODS = ("exact", "sparse", "hutchinson", "laplacian-exact", "laplacian-hutchinson")
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def _cases(process_id: int, port: int) -> dict[str, Any]:  # runs in each process
    import re

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_x64", True)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=PROCESSES,
        process_id=process_id,
        initialization_timeout=120,
    )
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import divjac.jax as dj
    from divjac.models import jax as models

    assert jax.device_count() == PROCESSES * LOCAL_DEVICES
    assert jax.local_device_count() == LOCAL_DEVICES
    params = models.init_cnn(
        jax.random.key(0), channels=3, layers=2, in_channels=2, out_channels=2, dtype=jnp.float64
    )

    def cnn(x: Any) -> Any:
        return models.cnn(params, x)

    def u(x: Any) -> Any:  # a scalar per sample
        return jnp.sum(jnp.tanh(cnn(x)) ** 2, axis=(1, 2, 3))

    key = jax.random.key(3)
    transforms = {
        "exact": dj.divergence(cnn, method="exact"),
        "sparse": dj.divergence(cnn, method="sparse"),
        "hutchinson": lambda x: dj.divergence(cnn, method="hutchinson", num_probes=4)(key, x),
        "laplacian-exact": dj.laplacian(u, method="exact"),
        "laplacian-hutchinson": lambda x: dj.laplacian(u, method="hutchinson", num_probes=4)(
            key, x
        ),
    }
    batch = 2 * PROCESSES * LOCAL_DEVICES
    x = np.random.default_rng(0).normal(size=(batch, 4, 4, 2))
    mesh = jax.make_mesh((PROCESSES * LOCAL_DEVICES,), ("batch",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("batch"))
    per_process = batch // PROCESSES
    mine = slice(process_id * per_process, (process_id + 1) * per_process)
    xs = jax.make_array_from_process_local_data(sharding, x[mine], x.shape)

    report: dict[str, Any] = {}
    for name in METHODS:
        fn = jax.jit(transforms[name])
        compiled = fn.lower(xs).compile()
        text = compiled.as_text()
        out = compiled(xs)
        alone = np.asarray(fn(jnp.asarray(x)))  # one process, the whole batch, local device
        gaps = [
            float(np.max(np.abs(np.asarray(shard.data) - alone[shard.index])))
            for shard in out.addressable_shards
        ]
        report[name] = {
            "collectives": [c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", text)],
            "shards": len(out.addressable_shards),
            "vs_one_process": max(gaps),
        }
    jax.distributed.shutdown()
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run() -> list[dict[str, Any]]:
    env = os.environ.copy()
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={LOCAL_DEVICES}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    reports = []
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                subprocess.Popen(
                    [sys.executable, __file__, str(i), str(port)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
            for i in range(PROCESSES)
        ]
        stack.callback(lambda: [proc.kill() for proc in procs])  # before the pipes close
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"process {i}:\n{err[-4000:]}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.conftest import once_per_session  # here: this file also runs as a script

    return once_per_session(tmp_path_factory, "jax-2-processes", _run)  # type: ignore[no-any-return]


@pytest.mark.parametrize("process", range(PROCESSES))
@pytest.mark.parametrize("name", METHODS)
def test_every_process_computes_its_shards_without_collectives(reports, process, name):
    entry = reports[process][name]
    assert entry["collectives"] == []
    assert entry["shards"] == LOCAL_DEVICES
    # Stochastic methods too: the probes do not depend on how the batch is laid out.
    assert entry["vs_one_process"] < 1e-12


if __name__ == "__main__":
    print(json.dumps(_cases(int(sys.argv[1]), int(sys.argv[2]))))
