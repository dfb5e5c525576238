"""Shapes of arrays whose mesh axes are ``Explicit`` (JAX's sharding in types).

Under explicit sharding JAX infers the sharding of a reshape's result only in simple cases and
refuses the others (splitting a batch-sharded axis back into the batch and the sample's shape).
divjac's results keep the batch where it was, so it states their sharding: the operand's, axis
for axis where the axes are the same. Arrays of ``Auto`` meshes and unsharded ones are reshaped
as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

__all__ = ["reshape", "sharded_like"]


def sharded_like(x: Any, axes: slice) -> NamedSharding | None:
    """The sharding of a result whose axes are ``x``'s ``axes`` (then others, replicated),
    where ``x`` is sharded over an ``Explicit`` mesh axis; ``None`` otherwise."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if not spec or mesh is None:
        return None
    explicit = {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == AxisType.Explicit
    }
    named = {
        n for entry in spec if entry for n in (entry if isinstance(entry, tuple) else (entry,))
    }
    if not named & explicit:
        return None
    full = tuple(spec) + (None,) * (jax.numpy.ndim(x) - len(spec))
    return NamedSharding(mesh, PartitionSpec(*full[axes]))


def reshape(x: jax.Array, shape: Sequence[int], sharding: NamedSharding | None) -> jax.Array:
    """``x.reshape(shape)``, sharded as ``sharding`` (from :func:`sharded_like`) if given."""
    if sharding is None:
        return x.reshape(tuple(shape))
    return jax.lax.reshape(x, tuple(shape), out_sharding=sharding)
