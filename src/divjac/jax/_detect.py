"""Tracing a batched function and detecting its per-sample pattern and batch coupling (cached)."""

from __future__ import annotations

import contextvars
import functools
import hashlib
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import detection, rules as D
from .._core.detection import LRU, EntryLimit, Propagated
from .._errors import StateUpdateError
from . import _compat
from ._interpret import Interpreter
from ._ops import ELEMENTWISE

__all__ = [
    "CACHE",
    "GRADIENT",
    "Traced",
    "Variant",
    "digest",
    "fingerprint",
    "is_array",
    "is_differentiated",
    "trace",
]


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array JAX would trace (not a Python scalar or other object).

    Known by ``x``'s type (any tracer is one, whatever its abstract value), remembered per
    type: ``jax.Array``'s own check is a call into jaxlib, and an eager call asks it of every
    leaf of its arguments."""
    kind = type(x)
    known = _ARRAY_TYPES.get(kind)
    if known is None:
        known = _ARRAY_TYPES[kind] = isinstance(x, _ARRAYS)
    return known


_ARRAYS = (jax.Array, np.ndarray, np.generic, _compat.Tracer)
_ARRAY_TYPES: dict[type, bool] = {}


@dataclass(eq=False)
class Variant:
    """The detections of one program, for the values of the captured constants they read.

    Attributes:
        reads: digest (:func:`digest`) of each captured constant that detection read, by its
            position among the program's constants.
        detections: the detections (shared by the traces that match).
    """

    reads: dict[int, Hashable] = field(default_factory=dict)
    detections: dict[Any, Any] = field(default_factory=dict)

    def matches(self, consts: Sequence[Any]) -> bool:
        """Whether every constant that was read has the same value in ``consts``."""
        return all(digest(consts[i]) == d for i, d in self.reads.items())


@dataclass(eq=False)
class Traced(detection.Traced):
    """The jaxpr of a batched function, batch-first in and out, with its detections cached.

    ``pass_elements`` is the most elements the program's intermediates hold at once
    (:func:`_live_peak`); :attr:`graph_elements` what a pass keeps where it is differentiated.

    Attributes:
        closed: jaxpr whose inputs are the array leaves of ``(args, kwargs)``, the differentiated
            one with its batch axis moved first (or a leading batch of one added).
        x_pos: position of the differentiated leaf among the jaxpr inputs.
        variant: where the detections are cached, with what they read.
    """

    closed: Any
    x_pos: int
    variant: Variant

    @functools.cached_property
    def graph_elements(self) -> int:
        """Elements one pass holds where a gradient flows through it (memory planning): its
        intermediates, which the backward of its (checkpointed) chunk keeps
        (:func:`_kept_elements`), and the cotangents alive at once in that backward, which
        runs the program in reverse (its live peak): 0.62-1.62x XLA's temporaries per pass on
        the built-in models, where the live peak alone is 2-6x under."""
        return _kept_elements(self.closed.jaxpr) + self.pass_elements

    def differentiated(self, leaves: Sequence[Any]) -> bool:
        """Whether ``leaves`` (the call's arguments) or the program's captured constants are
        being differentiated (a ``jax.grad``, ``jvp`` or ``linearize`` trace, under ``jit`` or
        not): the passes then keep their intermediates for the backward."""
        return GRADIENT.get() or any(map(is_differentiated, (*leaves, *self.closed.consts)))

    def _propagate(self, seeded: D.Deps, limit: EntryLimit) -> Propagated:
        interp = Interpreter(seeded.n_labels, limit=limit)
        in_deps = [
            seeded if i == self.x_pos else D.empty(tuple(aval.shape), seeded.n_labels)
            for i, aval in enumerate(self.closed.in_avals)
        ]
        out = interp.run(self.closed, in_deps, captured=True)[0]
        consts = self.closed.consts
        self.variant.reads.update((i, digest(consts[i])) for i in interp.read_consts)
        interp.warn_fallbacks()
        return Propagated(out, frozenset(interp.fallbacks), interp.has_custom_vjp)


CACHE: LRU[list[Variant]] = LRU(128)
"""Detections, shared by all transforms, keyed by the traced program (:func:`fingerprint`).

A function is traced anew at every call (under ``jax.jit``, only while jit traces), so the
program is always the one that the caller's function and arguments make now: a new closure
over updated parameters, a module whose flags changed, a dict whose arrays were replaced.
Detection never reads captured floating-point arrays (weights), so their values are not part
of the key and nothing here keeps them alive. Captured integer and boolean arrays (indices,
masks) are read when a rule needs them; each :class:`Variant` of a program records digests of
those it read, and is reused only where they are unchanged (a counter that changes at every
step and is never read, such as an nnx ``Rngs`` count, causes no new detection)."""

# Variants kept per program (values of the constants that detection read).
_VARIANTS = 8


def digest(value: Any) -> Hashable:
    """A digest of a concrete array's values (``None`` for tracers: unknown values)."""
    if isinstance(value, _compat.Tracer) or not getattr(value, "is_fully_addressable", True):
        return None
    if jnp.issubdtype(getattr(value, "dtype", np.float32), jax.dtypes.prng_key):
        with jax.ensure_compile_time_eval():  # a concrete key stays concrete under a trace
            value = jax.random.key_data(value)
    data = np.asarray(value)
    return (str(data.dtype), data.shape, hashlib.blake2b(data.tobytes()).digest())


def fingerprint(closed: Any) -> Hashable:
    """A key equal for two traces when their detections are the same.

    It holds the program's structure (primitives, parameters, how variables connect, shapes and
    dtypes, nested programs), literal values and the digests of the integer and boolean
    constants of nested programs; the values of the program's own constants are left to
    :class:`Variant`. Variables are numbered in order, so traces of the same function at
    different times compare equal.
    """
    memo: dict[int, Hashable] = {}

    def aval(a: Any) -> Hashable:
        if isinstance(a, int | float | complex):  # a literal lifted to a constant by the eager
            return type(a).__name__  # path (divjac.jax._eager), whose key holds its value
        shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
        if shape is None or dtype is None:
            return str(a)
        return (tuple(shape), dtype, bool(getattr(a, "weak_type", False)))

    def literal(v: Any) -> Hashable:
        data = np.asarray(v)
        return (data.dtype, data.shape, data.tobytes())

    def const(c: Any) -> Hashable:
        dtype = getattr(c, "dtype", None)
        if dtype is None:
            return ("object", type(c).__name__, id(c))  # never equal to another trace's
        if jnp.issubdtype(dtype, jnp.inexact):
            return ("array", tuple(np.shape(c)), str(dtype))  # never read by detection
        return digest(c)

    def param(p: Any) -> Hashable:
        if _compat.is_program(p):
            jaxpr, consts = _compat.open_jaxpr(p)
            return ("program", program(jaxpr), tuple(const(c) for c in consts))
        if isinstance(p, tuple | list):
            return (type(p).__name__, tuple(param(q) for q in p))
        if isinstance(p, dict):
            return ("dict", tuple((k, param(q)) for k, q in sorted(p.items())))
        if isinstance(p, np.ndarray | jax.Array):
            return literal(p)
        try:
            hash(p)
        except TypeError:
            return ("unhashable", type(p).__name__, id(p))  # never equal to another trace's
        return p

    def program(jaxpr: Any) -> Hashable:
        found = memo.get(id(jaxpr))
        if found is not None:
            return found
        ids: dict[Any, int] = {}

        def var(v: Any) -> Hashable:
            if isinstance(v, _compat.Literal):
                return ("literal", aval(v.aval), literal(v.val))
            return ids.setdefault(v, len(ids))

        parts: list[Hashable] = [
            tuple((var(v), aval(v.aval)) for v in jaxpr.constvars),
            tuple((var(v), aval(v.aval)) for v in jaxpr.invars),
        ]
        for eqn in jaxpr.eqns:
            parts.append(
                (
                    eqn.primitive.name,
                    tuple(var(v) for v in eqn.invars),
                    tuple(aval(v.aval) for v in eqn.outvars),
                    tuple((k, param(q)) for k, q in sorted(eqn.params.items())),
                )
            )
            for v in eqn.outvars:
                var(v)
        parts.append(tuple(var(v) for v in jaxpr.outvars))
        key = tuple(parts)
        memo[id(jaxpr)] = key
        return key

    return ("closed", program(closed.jaxpr), tuple(aval(c) for c in closed.consts))


def _name_nnx_mutation(err: Exception) -> None:
    """Raise :class:`StateUpdateError` for Flax's refusal of an nnx module's update from inside
    a JAX transform (BatchNorm's statistics, Dropout's RNG counts in training mode), met where
    ``f`` calls the module itself (a closure over it) rather than being the module."""
    if type(err).__name__ != "TraceContextError" or not type(err).__module__.startswith("flax"):
        return
    raise StateUpdateError(
        "divjac (JAX): the function updates the state of a Flax nnx module it calls (BatchNorm's "
        "running statistics or Dropout's RNG counts, in training mode), which nnx refuses "
        "inside JAX transforms. Pass the module itself (or its bound method) as the function "
        "(divergence(model), laplacian(model.energy)): divjac calls it on a copy of its state, "
        "leaving the module unchanged; or put the module in eval mode (model.eval())."
    ) from err


def trace(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    argnum: int,
    batch_axis: int | None,
    has_aux: bool,
) -> Traced:
    """Trace ``fun`` batch-first in its argument ``argnum``; traces of the same program share
    their detections (:data:`CACHE`).

    Non-array arguments are static (as in ``jax.jacfwd``).
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [is_array(leaf) for leaf in leaves]
    x_leaf = len(jax.tree_util.tree_leaves(tuple(args[:argnum])))
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
            jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype) if is_array(a) else a, out
            )
        )
        pair = isinstance(out, tuple | list) and len(out) == 2
        y = out[0] if has_aux and pair else out
        if not isinstance(y, jax.Array) or (has_aux and not pair):
            return jnp.zeros((0,))  # reported by the caller from out_tree
        return y[None] if batch_axis is None else _move_first(y, batch_axis)

    avals = [jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype) for leaf in dyn]
    avals[x_pos] = xb_aval
    try:
        closed = jax.make_jaxpr(batch_first)(*avals)
    except Exception as err:
        _name_nnx_mutation(err)
        raise
    key = (fingerprint(closed), x_pos)
    variants = CACHE.get(key)
    if variants is None:
        variants = []
        CACHE.put(key, variants)
    variant = next((v for v in variants if v.matches(closed.consts)), None)
    if variant is None:
        variant = Variant()
        variants.insert(0, variant)
        del variants[_VARIANTS:]
    return Traced(
        x_shape=tuple(xb_aval.shape),
        out_shape=tuple(closed.out_avals[0].shape),
        out_tree=out_tree[0],
        pass_elements=_live_peak(closed.jaxpr),
        detections=variant.detections,
        closed=closed,
        x_pos=x_pos,
        variant=variant,
    )


def _live_peak(jaxpr: Any) -> int:
    """The most elements the intermediates of ``jaxpr`` hold at once, run in order: each value
    that XLA materializes (:func:`_materialized`) lives from the equation that makes it to its
    last use (the program's outputs to its end), and a nested program (a ``pjit``,
    ``custom_jvp_call``, ``scan`` or ``cond`` body) adds its own peak at its call site to what
    is alive there. What one pass holds of tangents: XLA's temporaries per pass are 0.57-0.84x
    this on the built-in models (``bench_memory_plan``), where the sum of all intermediates
    overestimated them 4-25x (a U-Net's skip connections stay alive across it, which the
    largest intermediate alone misses)."""
    kept = _materialized(jaxpr)
    last: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for var in eqn.invars:
            if not isinstance(var, _compat.Literal):
                last[var] = i
    for var in jaxpr.outvars:
        if not isinstance(var, _compat.Literal):
            last[var] = len(jaxpr.eqns)
    ending: list[int] = [0] * (len(jaxpr.eqns) + 1)
    peak = alive = 0
    for i, eqn in enumerate(jaxpr.eqns):
        made = 0
        for var in filter(kept.__contains__, eqn.outvars):
            size = _elements(var)
            made += size
            ending[max(last.get(var, i), i)] += size
        nested = max((_live_peak(sub) for sub in _compat.sub_jaxprs(eqn)), default=0)
        peak = max(peak, alive + max(made, nested))
        alive += made - ending[i]
    return peak


def _kept_elements(jaxpr: Any) -> int:
    """Elements of the intermediates of ``jaxpr`` that XLA materializes (:func:`_materialized`),
    those of a ``scan`` body once per iteration: what differentiating through a pass may keep
    for the backward."""
    kept = _materialized(jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        total += sum(_elements(var) for var in eqn.outvars if var in kept)
        repeat = _compat.scan_parts(eqn).length if eqn.primitive.name == "scan" else 1
        for sub in _compat.sub_jaxprs(eqn):
            total += repeat * _kept_elements(sub)
    return total


_MOVES = frozenset(
    ["broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev", "slice", "pad",
     "concatenate"]
)  # fmt: skip
_REDUCTIONS = frozenset(["reduce_sum", "reduce_max", "reduce_min", "reduce_prod"])


def _fused(name: str, *, into: bool = False) -> bool:
    """Whether XLA fuses the primitive ``name`` into the loop of the work it feeds: element-wise
    (:data:`~divjac.jax._ops.ELEMENTWISE`) and data-movement work; ``into``: whether its loop
    takes in the fused work that feeds it (reductions too: they read their input in their own
    loop)."""
    return name in ELEMENTWISE or name in _MOVES or (into and name in _REDUCTIONS)


def _materialized(jaxpr: Any) -> set[Any]:
    """The values of ``jaxpr``'s equations that XLA writes to memory: all but the results of
    fusible work (:func:`_fused`) that only fusible work or reductions read, which XLA computes
    inside its readers' loops (a softplus's ten elementwise steps are one loop; a broadcast
    bias is never written out). Without this, chains of elementwise steps made a small CNF's
    estimate 3.3-3.6x its temporaries."""
    readers: dict[Any, list[str]] = {}
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            if not isinstance(var, _compat.Literal):
                readers.setdefault(var, []).append(eqn.primitive.name)
    for var in jaxpr.outvars:
        if not isinstance(var, _compat.Literal):
            readers.setdefault(var, []).append("")  # the program's result is written out
    return {
        var
        for eqn in jaxpr.eqns
        for var in eqn.outvars
        if not _fused(eqn.primitive.name)
        or not all(_fused(name, into=True) for name in readers.get(var, ()))
    }


GRADIENT: contextvars.ContextVar[bool] = contextvars.ContextVar("divjac_gradient", default=False)
"""Set while a program is traced that a differentiation will run through from outside (an
eager call under ``jax.grad``, compiled on its own: :mod:`divjac.jax._eager`), which its own
trace cannot see."""


def is_differentiated(leaf: Any) -> bool:
    """Whether ``leaf`` is a tracer of a differentiation, at any depth of nested traces."""
    while isinstance(leaf, _compat.Tracer):
        if _compat.is_differentiation(leaf):
            return True
        leaf = _compat.unwrap(leaf)  # a vmap's tracer: look through it
    return False


def _elements(var: Any) -> int:
    return math.prod(getattr(var.aval, "shape", ()))


def _move_first(y: jax.Array, axis: int) -> jax.Array:
    if y.ndim <= axis:
        return y  # the caller reports the bad batch axis from the output shapes
    return jnp.moveaxis(y, axis, 0)
