"""divjac with a batch sharded over 8 (forced host) devices: under ``jit`` with ``NamedSharding``,
and inside ``shard_map``.

The device count is fixed when JAX starts, so every case runs in one subprocess (this file run as
a script, with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``) that reports, per method:
the collectives in the compiled program, the sharding of the outputs, the per-device FLOPs, and
the largest difference from the single-device call and from a brute-force reference (float64).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

import pytest

DEVICES = 8
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
METHODS = (
    "divergence-exact",
    "divergence-sparse",
    "divergence-hutchinson",
    "divergence-hutch++",
    "divergence-xtrace",
    "jacobian-auto",
    "sparse_jacobian",
    "value_and_divergence-sparse",
    "grad_divergence-sparse",
    "mlp-divergence-sparse",
)
STOCHASTIC = ("hutchinson", "hutch++", "xtrace")


def _cases() -> dict[str, Any]:  # runs in the subprocess: 8 host devices
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    jax.config.update("jax_enable_x64", True)
    import divjac.jax as dj
    from divjac.models import jax as models

    assert jax.device_count() == DEVICES
    rng = np.random.default_rng(0)
    B = 2 * DEVICES
    cnn_params = models.init_cnn(
        jax.random.key(0), channels=3, layers=2, in_channels=2, out_channels=2, dtype=jnp.float64
    )
    mlp_params = models.init_mlp(jax.random.key(1), (5, 7, 5), dtype=jnp.float64)
    models_ = {
        "cnn": (lambda x: models.cnn(cnn_params, x), rng.normal(size=(B, 4, 4, 2))),
        "mlp": (lambda x: models.mlp(mlp_params, x), rng.normal(size=(B, 5))),
    }
    key = jax.random.key(3)

    def transform(name: str, f: Any) -> Any:
        """``x -> result`` (``key`` bound for the stochastic methods) for one method."""
        fname, _, method = name.removeprefix("mlp-").partition("-")
        if fname == "divergence" and method in STOCHASTIC:
            div = dj.divergence(f, method=method, num_probes=6)
            return lambda x, k=key: div(k, x)
        if fname == "divergence":
            return dj.divergence(f, method=method)
        if fname == "jacobian":
            return dj.jacobian(f, mode=method)
        if fname == "sparse_jacobian":  # its values (B, nnz): the indices are constants
            return lambda x: dj.sparse_jacobian(f)(x).data
        if fname == "value_and_divergence":
            return dj.value_and_divergence(f, method=method)
        return dj.grad_divergence(f, method=method)

    def brute_force(f: Any, x: Any) -> dict[str, Any]:
        """Per-sample Jacobians, divergences and their gradients by ``vmap(jacfwd)`` of one
        sample's function."""

        def one(xi: Any) -> Any:
            return f(xi[None])[0]

        n = int(np.prod(x.shape[1:]))

        def div(xi: Any) -> Any:
            return jnp.trace(jax.jacfwd(one)(xi).reshape(n, n))

        return {
            "jacobian": jax.jit(jax.vmap(jax.jacfwd(one)))(x),
            "divergence": jax.jit(jax.vmap(div))(x),
            "grad": jax.jit(jax.vmap(jax.grad(div)))(x),
            "value": f(x),
            "n": n,
            "indices": dj.sparse_jacobian(f)(x).indices[0],  # where the values go
        }

    def reference(name: str, brute: dict[str, Any]) -> Any:
        name = name.removeprefix("mlp-")
        if name.startswith("jacobian"):
            return brute["jacobian"]
        if name == "sparse_jacobian":
            rows, cols = np.asarray(brute["indices"]).T
            jac = np.asarray(brute["jacobian"])
            return jac.reshape(len(jac), brute["n"], brute["n"])[:, rows, cols]
        if name.startswith("value_and_divergence"):
            return (brute["value"], brute["divergence"])
        if name.startswith("grad_divergence"):
            return brute["grad"]
        return brute["divergence"]

    def gap(a: Any, b: Any) -> float:
        pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        return max(float(np.max(np.abs(np.ravel(u) - np.ravel(v)))) for u, v in pairs)

    def apply(fn: Any, args: Any) -> Any:
        return fn(*args)

    brute = {name: brute_force(f, x) for name, (f, x) in models_.items()}
    report: dict[str, Any] = {}
    mesh = jax.make_mesh((DEVICES,), ("batch",), axis_types=(AxisType.Auto,))
    sharded = NamedSharding(mesh, P("batch"))
    for name in METHODS:
        model = "mlp" if name.startswith("mlp-") else "cnn"
        f, x = models_[model]
        fn = transform(name, f)
        xs = jax.device_put(x, sharded)
        compiled = jax.jit(fn).lower(xs).compile()
        text = compiled.as_text()
        single = jax.jit(fn).lower(jnp.asarray(x)).compile()
        out, alone = compiled(xs), single(jnp.asarray(x))
        mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("batch"), out_specs=P("batch")))(
            xs
        )
        stochastic = any(m in name for m in STOCHASTIC)
        entry = {
            "collectives": [c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", text)],
            "specs": [str(o.sharding.spec) for o in jax.tree.leaves(out)],
            "flops": [compiled.cost_analysis()["flops"], single.cost_analysis()["flops"]],
            "vs_one_device": gap(out, alone),
            "vs_brute_force": None if stochastic else gap(alone, reference(name, brute[model])),
            "shard_map_vs_one_device": None if stochastic else gap(mapped, alone),
        }
        if stochastic:  # each shard: the one-device call on its samples, with its own key
            shards = jnp.asarray(x).reshape(DEVICES, -1, *x.shape[1:])
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(DEVICES))
            per_shard = jax.jit(functools.partial(jax.lax.map, functools.partial(apply, fn)))
            entry["shard_map_vs_folded_keys"] = gap(mapped, per_shard((shards, keys)))
        report[name] = entry

    # A mesh of Explicit axes (``jax.make_mesh``'s default): the results keep the batch's
    # sharding where JAX would not infer it (reshapes that split the batch-sharded axis).
    f, x = models_["cnn"]

    def u(x: Any) -> Any:
        return jnp.sum(jnp.tanh(f(x)) ** 2, axis=(1, 2, 3))

    explicit_mesh = jax.make_mesh((DEVICES,), ("batch",), axis_types=(AxisType.Explicit,))
    xe = jax.device_put(x, NamedSharding(explicit_mesh, P("batch")))
    for name, fn in {
        "jacobian-auto": dj.jacobian(f),
        "jacobian-sparse": dj.jacobian(f, mode="sparse"),
        "hessian": dj.hessian(u),
        "laplacian-exact": dj.laplacian(u, method="exact"),
        "laplacian-sparse": dj.laplacian(u, method="sparse"),
        "divergence-sparse": dj.divergence(f, method="sparse"),
    }.items():
        compiled = jax.jit(fn).lower(xe).compile()
        text = compiled.as_text()
        out, alone = compiled(xe), jax.jit(fn)(jnp.asarray(x))
        report[f"explicit-{name}"] = {
            "collectives": [c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", text)],
            "spec": str(out.sharding.spec),
            "vs_one_device": gap(out, alone),
            "eager_vs_one_device": gap(fn(xe), alone),
        }

    # Per-shard probes: the same sample on every shard, a replicated key.
    f, x = models_["cnn"]
    same = jnp.asarray(np.broadcast_to(x[:1], x.shape))
    div = dj.divergence(f, method="hutchinson", num_probes=1)
    mapped = jax.jit(
        jax.shard_map(div, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P("batch"))
    )(key, jax.device_put(same, sharded))
    report["replicated_key"] = np.asarray(mapped).reshape(DEVICES, -1)[:, 0].tolist()
    # A key per shard (varying over the mesh axis) is used as it is.
    keys = jax.random.split(key, DEVICES)
    own = jax.jit(
        jax.shard_map(
            lambda k, x: div(k[0], x), mesh=mesh, in_specs=P("batch"), out_specs=P("batch")
        )
    )(keys, jax.device_put(same, sharded))
    per_shard = jax.jit(functools.partial(jax.lax.map, functools.partial(apply, div)))
    expected = per_shard((keys, same.reshape(DEVICES, -1, *same.shape[1:])))
    report["key_per_shard_gap"] = gap(own, expected)

    # Passes planned for the per-device batch where the trace knows the sharding.
    import divjac._call as call_module

    planned: list[int] = []
    bytes_per_pass = call_module.Call.bytes_per_pass

    def spy(self: Any) -> int:
        planned.append(bytes_per_pass(self))
        return planned[-1]

    call_module.Call.bytes_per_pass = spy  # type: ignore[method-assign]
    explicit = jax.make_mesh((DEVICES,), ("batch",), axis_types=(AxisType.Explicit,))
    exact = dj.divergence(f, method="exact")
    exact(jnp.asarray(x))
    jax.jit(exact).lower(jax.device_put(x, NamedSharding(explicit, P("batch"))))
    jax.jit(jax.shard_map(exact, mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))).lower(
        jax.device_put(x, sharded)
    )
    report["bytes_per_pass"] = planned
    call_module.Call.bytes_per_pass = bytes_per_pass  # type: ignore[method-assign]

    # Second order inside shard_map (its inputs vary over the mesh axis) of functions with a
    # custom_jvp: divjac checks the rule differentiates twice at the operands' varying axes.
    W = jnp.asarray(rng.normal(size=(5, 5)))

    def smooth(x: Any) -> Any:
        return jnp.sum(jax.nn.softplus(x @ W) + jnp.logaddexp(x, 0.5 * x), -1)

    xs = jax.device_put(models_["mlp"][1], sharded)
    truth = jax.vmap(jax.hessian(lambda xi: smooth(xi[None])[0]))(jnp.asarray(xs))
    diagonal = jnp.diagonal(truth, axis1=1, axis2=2)
    mapped_second = {
        "laplacian-exact": (dj.laplacian(smooth, method="exact"), diagonal.sum(1)),
        "laplacian-sparse": (dj.laplacian(smooth, method="sparse"), diagonal.sum(1)),
        "laplacian-auto": (dj.laplacian(smooth), diagonal.sum(1)),
        "hessian_diagonal": (dj.hessian_diagonal(smooth), diagonal),
    }
    report["shard_map_second_order"] = {
        name: gap(
            jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("batch"), out_specs=P("batch")))(xs),
            want,
        )
        for name, (fn, want) in mapped_second.items()
    }
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.conftest import once_per_session  # here: this file also runs as a script

    return once_per_session(tmp_path_factory, "jax-8-host-devices", _run)


def _run() -> dict[str, Any]:
    env = os.environ.copy()
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", METHODS)
def test_a_sharded_batch_compiles_without_collectives(report, name):
    entry = report[name]
    assert entry["collectives"] == []
    assert all(spec.startswith("P('batch'") for spec in entry["specs"])  # sharded like x
    per_device, alone = entry["flops"]
    # The per-sample work is split 8 ways; the batch-constant prefix of the shared passes (the
    # first convolution on one sample's tangent) is computed once on every device.
    assert per_device <= 1.5 * alone / DEVICES


@pytest.mark.parametrize("name", METHODS)
def test_sharded_numbers_equal_one_device_and_brute_force(report, name):
    entry = report[name]
    assert entry["vs_one_device"] < 1e-12  # stochastic too: probes do not depend on sharding
    if entry["vs_brute_force"] is not None:
        assert entry["vs_brute_force"] < 1e-10
        assert entry["shard_map_vs_one_device"] < 1e-12
    else:
        assert entry["shard_map_vs_folded_keys"] < 1e-12


EXPLICIT = (
    "jacobian-auto",
    "jacobian-sparse",
    "hessian",
    "laplacian-exact",
    "laplacian-sparse",
    "divergence-sparse",
)


@pytest.mark.parametrize("name", EXPLICIT)
def test_a_batch_sharded_over_explicit_mesh_axes_keeps_its_sharding(report, name):
    entry = report[f"explicit-{name}"]
    assert entry["collectives"] == []
    assert entry["spec"].startswith("P('batch'")
    assert entry["vs_one_device"] < 1e-12
    assert entry["eager_vs_one_device"] < 1e-12


def test_shard_map_draws_independent_probes_per_shard_from_a_replicated_key(report):
    firsts = report["replicated_key"]  # the same sample on each shard
    assert len(set(firsts)) == DEVICES
    assert report["key_per_shard_gap"] < 1e-12


def test_second_order_inside_shard_map_through_custom_jvp_rules(report):
    """softplus and logaddexp (custom_jvp) inside shard_map raised JAX's "requires varying
    manual axes to match": the rule's check traced at operands without the mesh axis."""
    gaps = report["shard_map_second_order"]
    assert len(gaps) == 4
    assert all(gap < 1e-12 for gap in gaps.values()), gaps


def test_passes_are_planned_for_the_per_device_batch(report):
    one_device, explicit_jit, in_shard_map = report["bytes_per_pass"]
    assert explicit_jit == one_device // DEVICES
    assert abs(in_shard_map - explicit_jit) <= 0.02 * explicit_jit


if __name__ == "__main__":
    print(json.dumps(_cases()))
