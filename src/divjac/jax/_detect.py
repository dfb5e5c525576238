"""Tracing a batched function and detecting its per-sample pattern and batch coupling (cached)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

import jax

from .._core import deps as D, detection
from .._core.detection import LRU, EntryLimit, Propagated
from ._interpret import Interpreter

__all__ = ["CACHE", "Traced", "is_array", "trace"]


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array JAX would trace (not a Python scalar or other object)."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.core.Tracer)


@dataclass(eq=False)
class Traced(detection.Traced):
    """The jaxpr of a batched function, batch-first in and out, with its detections cached.

    ``pass_elements`` counts every intermediate of the program plus the workspace of its
    convolutions (see :func:`_pass_elements`).

    Attributes:
        closed: jaxpr whose inputs are the array leaves of ``(args, kwargs)``, the differentiated
            one with its batch axis moved first (or a leading batch of one added).
        x_pos: position of the differentiated leaf among the jaxpr inputs.
    """

    closed: Any
    x_pos: int

    def _propagate(self, seeded: D.Deps, limit: EntryLimit | None) -> Propagated:
        interp = Interpreter(seeded.n_labels, limit=limit)
        in_deps = [
            seeded if i == self.x_pos else D.empty(tuple(aval.shape), seeded.n_labels)
            for i, aval in enumerate(self.closed.in_avals)
        ]
        out = interp.run(self.closed, in_deps)[0]
        interp.warn_fallbacks()
        return Propagated(out, frozenset(interp.fallbacks), interp.has_custom_vjp)


CACHE: LRU[Traced] = LRU(128)
"""Traced functions, shared by all transforms. Keys hold the function itself (compared with
``==``, so ``net.apply`` bound again to the same module hits)."""


def _key(
    fun: Any, static: tuple[Any, ...], leaves: list[Any], dynamic: list[bool], treedef: Any
) -> Hashable | None:
    try:
        key = (
            fun,
            static,
            treedef,
            tuple(
                (np.shape(leaf), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)))
                if dyn
                else leaf
                for leaf, dyn in zip(leaves, dynamic, strict=True)
            ),
        )
        hash(key)
    except TypeError:
        return None
    return key


def trace(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    argnum: int,
    batch_axis: int | None,
    has_aux: bool,
) -> Traced:
    """Trace ``fun`` batch-first in its argument ``argnum``.

    Non-array arguments are static (as in ``jax.jacfwd``). Results are cached (:data:`CACHE`)
    by the function, the structure, shapes and dtypes of the array arguments and the static
    values, like ``jax.jit``'s cache.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [is_array(leaf) for leaf in leaves]
    x_leaf = len(jax.tree_util.tree_leaves(tuple(args[:argnum])))
    key = _key(fun, (argnum, batch_axis, has_aux), leaves, dynamic, treedef)
    cached = CACHE.get(key) if key is not None else None
    if cached is not None:
        return cached
    x_pos = sum(dynamic[:x_leaf])
    dyn = [leaf for leaf, d in zip(leaves, dynamic, strict=True) if d]
    x = leaves[x_leaf]
    xb_aval = jax.ShapeDtypeStruct(detection.batch_first_shape(np.shape(x), batch_axis), x.dtype)
    out_tree: list[Any] = []

    def batch_first(*dyn_leaves: Any) -> Any:
        it = iter(dyn_leaves)
        full = [next(it) if d else leaf for leaf, d in zip(leaves, dynamic, strict=True)]
        xb = full[x_leaf]
        full[x_leaf] = xb[0] if batch_axis is None else jnp.moveaxis(xb, 0, batch_axis)
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
        out = fun(*call_args, **call_kwargs)
        out_tree.append(
            jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), out)
        )
        y = out[0] if has_aux else out
        if not isinstance(y, jax.Array):
            return jnp.zeros((0,))  # reported by the caller from out_tree
        return y[None] if batch_axis is None else _move_first(y, batch_axis)

    avals = [jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype) for leaf in dyn]
    avals[x_pos] = xb_aval
    closed = jax.make_jaxpr(batch_first)(*avals)
    traced = Traced(
        x_shape=tuple(xb_aval.shape),
        out_shape=tuple(closed.out_avals[0].shape),
        out_tree=out_tree[0],
        pass_elements=_pass_elements(closed.jaxpr),
        closed=closed,
        x_pos=x_pos,
    )
    if key is not None:
        CACHE.put(key, traced)
    return traced


def _pass_elements(jaxpr: Any) -> int:
    """Elements of all intermediates (nested programs included), plus convolution workspaces.

    XLA frees buffers as it goes, so this over-estimates what one pass holds; that is the safe
    side for choosing how many passes to run at once. A convolution is counted with its
    im2col-like workspace (output size times kernel taps), which XLA's CPU backend can allocate.
    """
    total = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            total += math.prod(getattr(var.aval, "shape", ()))
        if eqn.primitive.name == "conv_general_dilated":
            taps = math.prod(
                eqn.invars[1].aval.shape[a] for a in eqn.params["dimension_numbers"].rhs_spec[2:]
            )
            total += math.prod(eqn.outvars[0].aval.shape) * taps
        for sub in jcore.jaxprs_in_params(eqn.params):
            total += _pass_elements(sub)
    return total


def _move_first(y: jax.Array, axis: int) -> jax.Array:
    if y.ndim <= axis:
        return y  # the caller reports the bad batch axis from the output shapes
    return jnp.moveaxis(y, axis, 0)
