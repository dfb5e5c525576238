"""Tracing a batched function and detecting its per-sample pattern and batch coupling (cached)."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

import jax

from .._core import deps as D, pattern as P
from .._core.pattern import BatchLayout, Coupling, SparsityPattern
from ._interpret import Interpreter, TooDense

__all__ = ["Detection", "Traced", "is_array", "trace"]


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array JAX would trace (not a Python scalar or other object)."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.core.Tracer)


@dataclass(frozen=True)
class Detection:
    """What one detection found.

    Attributes:
        pattern: the per-sample pattern (``None`` when only coupling was checked, or when the
            pattern was too dense to be worth detecting).
        coupling: ``None`` if the batch is independent, else evidence of coupling.
        has_custom_vjp: a ``custom_vjp`` function is on the path (prefer reverse mode).
        fallbacks: primitives without a sparsity rule, assumed dense.
    """

    pattern: SparsityPattern | None
    coupling: Coupling | None
    has_custom_vjp: bool
    fallbacks: frozenset[str] = frozenset()


@dataclass(eq=False)
class Traced:
    """The jaxpr of a batched function, batch-first in and out, with its detections cached.

    Attributes:
        closed: jaxpr whose inputs are the array leaves of ``(args, kwargs)``, the differentiated
            one with its batch axis moved first (or a leading batch of one added).
        x_pos: position of the differentiated leaf among the jaxpr inputs.
        out: shape/dtype of the (batch-first) output.
        out_tree: shapes/dtypes of what the function returns, in its own layout (for checks).
        pass_elements: elements one pass may hold at once: every intermediate of the program
            plus the workspace of its convolutions (memory planning; an upper bound).
    """

    closed: Any
    x_pos: int
    out: jax.ShapeDtypeStruct
    out_tree: Any
    pass_elements: int
    _detections: dict[tuple[bool, bool, int | None], Detection | None] = field(default_factory=dict)

    @property
    def x_shape(self) -> tuple[int, ...]:
        return tuple(self.closed.in_avals[self.x_pos].shape)

    def detect(
        self, *, per_sample: bool, whole_batch: bool = False, max_entries: int | None = None
    ) -> Detection | None:
        """Detect the pattern and coupling; ``None`` if ``max_entries`` was exceeded.

        With ``whole_batch=True`` the whole batch is one sample: the pattern is the full
        ``(B*n_out, B*n_in)`` one (used to compute exact diagonal blocks of coupled functions).
        """
        key = (per_sample, whole_batch, max_entries)
        if not per_sample:  # a per-sample detection also decided coupling: reuse it
            for (ps, wb, _), found in self._detections.items():
                if ps and wb == whole_batch and found is not None:
                    return found
        if key not in self._detections:
            self._detections[key] = self._detect(per_sample, whole_batch, max_entries)
        return self._detections[key]

    def _detect(
        self, per_sample: bool, whole_batch: bool, max_entries: int | None
    ) -> Detection | None:
        axis = None if whole_batch else 0
        in_layout = BatchLayout(self.x_shape, axis)
        out_layout = BatchLayout(tuple(self.out.shape), axis)
        seeded = P.seed(in_layout, per_sample=per_sample)
        interp = Interpreter(seeded.n_labels, max_entries=max_entries)
        in_deps = [
            seeded if i == self.x_pos else D.empty(tuple(aval.shape), seeded.n_labels)
            for i, aval in enumerate(self.closed.in_avals)
        ]
        try:
            out_deps = interp.run(self.closed, in_deps)[0]
        except TooDense:
            return None
        interp.warn_fallbacks()
        csr, coupling = P.read_out(out_deps, out_layout, in_layout, per_sample=per_sample)
        pattern = None
        if csr is not None:
            pattern = SparsityPattern(
                csr=csr,
                in_shape=in_layout.sample_shape,
                out_shape=out_layout.sample_shape,
                batch_size=in_layout.batch_size,
                coupling=coupling,
                dense_fallbacks=frozenset(interp.fallbacks),
            )
        return Detection(pattern, coupling, interp.has_custom_vjp, frozenset(interp.fallbacks))


class _LRU:
    """A small least-recently-used cache of traced functions, shared by all transforms.

    Keys hold the function itself (compared with ``==``, so ``net.apply`` bound again to the same
    module hits), so creating a transform per call (common in eager loops) still reuses the
    detection. At most ``size`` functions are kept alive.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, Traced] = OrderedDict()

    def get(self, key: Hashable) -> Traced | None:
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: Hashable, value: Traced) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()


CACHE = _LRU(128)


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
    xb_aval = jax.ShapeDtypeStruct(
        (1, *np.shape(x)) if batch_axis is None else _moved(np.shape(x), batch_axis), x.dtype
    )
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
    out_aval = closed.out_avals[0]
    traced = Traced(
        closed,
        x_pos,
        jax.ShapeDtypeStruct(out_aval.shape, out_aval.dtype),
        out_tree[0],
        _pass_elements(closed.jaxpr),
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


def _moved(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return (shape[axis], *shape[:axis], *shape[axis + 1 :])


def _move_first(y: jax.Array, axis: int) -> jax.Array:
    if y.ndim <= axis:
        return y  # the caller reports the bad batch axis from the output shapes
    return jnp.moveaxis(y, axis, 0)
