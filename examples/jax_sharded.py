"""Per-sample divergences of a CNN with the batch sharded over devices (jit + NamedSharding, shard_map).

The per-sample work of divjac is embarrassingly parallel over the batch: with the batch axis
sharded over a mesh, every device computes the passes of its own samples, and the compiled
program holds no collective (no all-gather, all-reduce, ...). This script shards a batch of
images over all devices, computes the exact (sparse) divergence and a Hutchinson estimate under
``jax.jit``, checks that the compiled program has no collective and that the results equal the
single-device call, and does the same inside ``shard_map``, where a replicated key gives every
shard its own probes (the key is folded with the shard's index).

Run on one machine with 8 simulated CPU devices: ``python examples/jax_sharded.py`` (the script
sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts, unless JAX was
already imported or ``XLA_FLAGS`` is set); with real accelerators it uses all of them.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

if __name__ == "__main__" and "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from divjac.jax import divergence
from divjac.models import jax as models

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def main(small: bool = False) -> dict[str, Any]:
    """Sharded divergences of a CNN; returns them with the single-device ones, the collectives
    found in the compiled programs, the function and its input."""
    n_devices = jax.device_count()
    size, per_device = (8, 2) if small else (32, 8)
    dtype = jnp.zeros(()).dtype  # float64 where x64 is enabled
    params = models.init_cnn(jax.random.key(0), channels=4 if small else 16, dtype=dtype)

    def f(images: jax.Array) -> jax.Array:  # [B, H, W, 3] -> [B, H, W, 3]
        return models.cnn(params, images)

    shape = (per_device * n_devices, size, size, 3)
    images = jnp.asarray(np.random.default_rng(0).normal(size=shape), dtype)
    mesh = jax.make_mesh((n_devices,), ("batch",))
    sharded = jax.device_put(images, NamedSharding(mesh, P("batch")))
    key = jax.random.key(1)

    exact = jax.jit(divergence(f, method="sparse"))
    hutchinson = jax.jit(divergence(f, method="hutchinson", num_probes=4))
    found = {}
    for name, fn, args in (
        ("sparse", exact, (sharded,)),
        ("hutchinson", hutchinson, (key, sharded)),
    ):
        text = fn.lower(*args).compile().as_text()
        found[name] = [c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", text)]
    div = exact(sharded)
    est = hutchinson(key, sharded)
    print(
        f"{n_devices} devices, batch {shape[0]} of {size}x{size}x3 images sharded as {div.sharding.spec}"
    )
    print(f"  collectives in the compiled programs: {found}")
    div_one, est_one = exact(images), hutchinson(key, images)  # the batch on one device
    print(f"  sparse divergence equals the single-device call: {bool(np.allclose(div, div_one))}")
    print(f"  Hutchinson estimate equals the single-device call: {bool(np.allclose(est, est_one))}")

    in_shard_map = jax.jit(
        jax.shard_map(
            divergence(f, method="hutchinson", num_probes=4),
            mesh=mesh,
            in_specs=(P(), P("batch")),
            out_specs=P("batch"),
        )
    )
    est_mapped = in_shard_map(key, sharded)  # each shard folds its index into the key
    mapped_exact = jax.jit(
        jax.shard_map(
            divergence(f, method="sparse"), mesh=mesh, in_specs=P("batch"), out_specs=P("batch")
        )
    )(sharded)
    print(
        f"  inside shard_map, sparse equals the single-device call: {bool(np.allclose(mapped_exact, div_one))}"
    )
    return {
        "collectives": found,
        "divergence": div,
        "divergence_one_device": div_one,
        "estimate": est,
        "estimate_one_device": est_one,
        "shard_map_divergence": mapped_exact,
        "shard_map_estimate": est_mapped,
        "n_devices": n_devices,
        "f": f,
        "images": images,
    }


if __name__ == "__main__":
    main()
