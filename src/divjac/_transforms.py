"""Per-sample Jacobians and sparsity of batched functions, written once over a backend.

Every transform takes a *batched* function ``f``: its differentiated argument and its output carry
the batch on ``batch_axis``; other arguments (params, ``t``, ...) pass through untouched. Because
the samples of a batch-independent ``f`` do not interact, the batched Jacobian is block diagonal
and one JVP (or VJP) with the same tangent in every sample yields that column (or row) of every
sample's Jacobian: ``n`` batched passes give all per-sample Jacobians, with no cross-sample work
and no ``(B, ..., B, ...)`` array. Independence is checked on the traced program, never assumed.

This module holds the passes shared by every transform, the Jacobian transforms and
:func:`sparsity` (the divergence family is in :mod:`divjac._divergence`); the framework's
primitives come from a :class:`~divjac._backend.Backend`. The public, typed functions of
``divjac.jax`` and ``divjac.torch`` call these with their backend. Imports neither JAX nor
PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ._backend import Array, Backend, Entries, Seed
from ._call import Call, Coupling, Mode, Spec, check_option, prepare
from ._core import detection_gate, plan, timing
from ._core.pattern import SparsityPattern
from ._errors import ArgnumsError, InternalError, PatternError, PatternTypeError

__all__ = [
    "auto_detects",
    "check_pattern",
    "compressed",
    "jacobian",
    "jacobian_from_pattern",
    "jacobian_values",
    "per_argnum",
    "shaped",
    "sparse_jacobian",
    "sparsity",
]

R = TypeVar("R")


# --- tuple argnums ------------------------------------------------------------------------------


def per_argnum(
    argnums: int | Sequence[int],
    make: Callable[[int], Callable[..., R]],
    combine: Callable[[list[R]], Any],
    *,
    fname: str,
) -> Callable[..., Any]:
    """The transform ``make(argnums)``, or for a tuple of ``argnums`` one per argument, whose
    calls return ``combine`` of their results (as ``jax.jacfwd`` does with a tuple)."""
    _check_argnums(argnums, fname)
    if not isinstance(argnums, Sequence):
        return make(argnums)
    if not argnums:
        raise ArgnumsError(
            f"{fname}: argnums=() selects no argument. Pass an int, or a non-empty tuple of ints."
        )
    parts = [make(a) for a in argnums]

    def each(*args: Any, **kwargs: Any) -> Any:
        return combine([part(*args, **kwargs) for part in parts])

    return each


def _check_argnums(argnums: object, fname: str) -> None:
    """Raise :class:`ArgnumsError` unless ``argnums`` is an int or a sequence of ints."""
    items = argnums if isinstance(argnums, Sequence) else (argnums,)
    if isinstance(argnums, str) or not all(
        isinstance(a, int) and not isinstance(a, bool) for a in items
    ):
        hint = ""
        if fname == "sparsity":
            hint = (
                " sparsity is a transform: pass f's arguments to the function it returns, "
                "sparsity(f)(x) (or sparsity(f, argnums=1)(params, x))."
            )
        raise ArgnumsError(
            f"{fname}: argnums must be an int or a tuple of ints; got {type(argnums).__name__}."
            + hint
        )


def tuple_of(has_aux: bool) -> Callable[[list[Any]], Any]:
    """The results of several ``argnums`` as a tuple (``(tuple, aux)`` with ``has_aux``: the aux
    is the same in each, that of the first is kept)."""
    if has_aux:
        return lambda results: (tuple(r[0] for r in results), results[0][1])
    return tuple


# --- passes -------------------------------------------------------------------------------------


def shaped(indicator: Callable[[Array], Array], shape: tuple[int, ...]) -> Seed:
    """The seed of pass ``c``: its (flat) indicator in ``shape``."""
    return lambda c: indicator(c).reshape(shape)


def _rows(batch_size: int) -> Callable[[Array, Array, Array], Array]:
    """The finish keeping each sample's pushed tangent, flat: ``(B, m)``."""
    # Sized, not -1: an empty sample's zero elements leave -1 ambiguous.
    return lambda c, t, pushed: pushed.reshape(batch_size, math.prod(pushed.shape[1:]))


@dataclass(frozen=True)
class Seeds:
    """The seeds of a plan's passes, made ahead of them (:meth:`~divjac._backend.Backend.ahead`).

    Attributes:
        reverse: the passes pull rows (VJPs) rather than push columns (JVPs).
        inputs: the input of every pass (rows of a seed matrix, or pass indices).
        indicator: a pass's flat indicator from its input.
        chunk: how many passes run at once, and whether each chunk is checkpointed.
    """

    reverse: bool
    inputs: Array
    indicator: Callable[[Array], Array]
    chunk: plan.Chunks


def seeds(
    call: Call, the_plan: plan.Plan, n_seed: int, chunk_size: int | None, *, indexed: bool = True
) -> Seeds:
    """The seeds of ``the_plan``'s passes, over ``n_seed`` elements (``indexed=False``: the
    passes' finish never reads the pass's input, see
    :meth:`~divjac._backend.Backend.indicators`)."""
    inputs, indicator = call.backend.indicators(
        the_plan.colors, n_seed, the_plan.n_passes, call.xb, indexed=indexed
    )
    chunk = call.chunk(the_plan.n_passes, chunk_size, reverse=the_plan.reverse)
    return Seeds(the_plan.reverse, inputs, indicator, chunk)


def compressed(call: Call, planned: Seeds) -> tuple[Array, Any]:
    """The passes of a plan, each ``J_b S_c`` (or ``S_c^T J_b``) flattened to ``(B, m)``.

    Returns the stacked passes ``(k, B, m)`` and the aux.
    """
    seed = shaped(planned.indicator, call.out_sample if planned.reverse else call.in_sample)
    linear = call.backend.linearize(call, reverse=planned.reverse)
    stacked = linear.passes(
        planned.inputs, seed, _rows(call.batch_size), planned.chunk, shared=True
    )
    return stacked, linear.aux


def auto_detects(call: Call, dense_passes: int) -> bool:
    """Whether mode/method ``"auto"`` detects the per-sample pattern of this call, whose dense
    plan takes ``dense_passes`` passes (see :mod:`divjac._core.detection_gate`); when not, the caller
    checks coupling alone."""
    with timing.stage("screening"):
        return detection_gate.screen(call.traced, dense_passes).detect


def check_pattern(call: Call, pattern: SparsityPattern) -> None:
    """Raise :class:`PatternError` (:class:`PatternTypeError`) unless a given ``pattern`` is one of this call's function."""
    fname = call.spec.fname
    if not isinstance(pattern, SparsityPattern):
        raise PatternTypeError(
            f"{fname}: pattern must be a SparsityPattern (from divjac's `sparsity`); got "
            f"{type(pattern).__name__}."
        )
    got = (tuple(pattern.in_shape), tuple(pattern.out_shape))
    if got != (call.in_sample, call.out_sample):
        raise PatternError(
            f"{fname}: the pattern is of a function from samples of shape {got[0]} to "
            f"{got[1]}, but this call maps samples of shape {call.in_sample} to "
            f"{call.out_sample}. Detect the pattern again at these shapes (`sparsity`)."
        )
    if not pattern.is_batch_independent:
        raise PatternError(
            f"{fname}: the pattern is of a function that mixes samples, so the batch cannot "
            "share its passes. Use the transform without a pattern, with coupling='exact'."
        )


# --- jacobian -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _JacobianPlan:
    """How the per-sample Jacobians of a call are computed, planned ahead of the passes.

    Attributes:
        reverse: rows (VJPs) rather than columns (JVPs).
        seeds: the compressed passes of a batch-independent call; ``None``: the call couples
            samples (one pass per sample and element).
        entries: the nonzeros and the pass and element of the pass holding each: a sparse
            plan's decompression; ``None``: dense passes. Kept with the plan, the same arrays
            at every call.
        held: the backend's index arrays of ``entries`` (:meth:`Backend.held_entries`).
    """

    reverse: bool
    seeds: Seeds | None
    entries: Entries | None = None
    held: tuple[Any, ...] | None = None


def jacobian_values(call: Call, mode: Mode, chunk_size: int | None) -> tuple[Array, Any]:
    """Per-sample Jacobians ``(B, n_out, n_in)`` and aux."""
    planned = call.backend.ahead(_jacobian_plan, call, mode, chunk_size)
    if planned.seeds is None:
        return _coupled_jacobian(call, planned.reverse, chunk_size)
    return _planned_jacobian(call, planned)


def _jacobian_plan(call: Call, mode: Mode, chunk_size: int | None) -> _JacobianPlan:
    per_sample = mode == "sparse" or (
        mode == "auto" and auto_detects(call, min(call.n_in, call.n_out))
    )
    found = call.detect(
        per_sample=per_sample, auto=mode == "auto", dense_passes=min(call.n_in, call.n_out)
    )
    reverse = call.prefer_reverse(found, measure=mode in ("auto", "sparse"))
    if found.coupling is not None:  # one pass per (sample, element), in the cheaper direction
        dense_mode = mode if mode in ("fwd", "rev") else "auto"
        direction = plan.jacobian_plan(
            dense_mode, call.n_in, call.n_out, None, prefer_reverse=reverse
        )
        if not direction.reverse and not call.columns_possible(dense_mode):
            direction = plan.jacobian_plan(
                dense_mode, call.n_in, call.n_out, None, prefer_reverse=True, rows_only=True
            )
        return _JacobianPlan(direction.reverse, None)
    return _pattern_plan(call, found.pattern, mode, reverse, chunk_size)


def _pattern_plan(
    call: Call, pattern: SparsityPattern | None, mode: Mode, reverse: bool, chunk_size: int | None
) -> _JacobianPlan:
    """The plan of a batch-independent call from ``pattern`` (``None``: dense) and ``mode``."""
    with timing.stage("coloring"):
        the_plan = plan.jacobian_plan(mode, call.n_in, call.n_out, pattern, prefer_reverse=reverse)
        if not the_plan.reverse and not call.columns_possible(mode):
            the_plan = plan.jacobian_plan(
                mode, call.n_in, call.n_out, pattern, prefer_reverse=True, rows_only=True
            )
    n_seed = call.n_out if the_plan.reverse else call.n_in
    planned = seeds(call, the_plan, n_seed, chunk_size, indexed=False)  # finished by _rows
    if not the_plan.is_sparse:
        return _JacobianPlan(the_plan.reverse, planned)
    if pattern is None or the_plan.colors is None:
        raise InternalError("a sparse plan without its pattern")
    entries = _nonzeros(
        pattern, the_plan.colors, reverse=the_plan.reverse, narrow=call.backend.narrow_indices
    )
    held = call.backend.held_entries(entries, call.xb)
    return _JacobianPlan(the_plan.reverse, planned, entries, held)


def _planned_jacobian(call: Call, planned: _JacobianPlan) -> tuple[Array, Any]:
    """Per-sample Jacobians of a batch-independent call: ``(B, n_out, n_in)`` and aux."""
    backend = call.backend
    if planned.seeds is None:
        raise InternalError("compressed passes of a coupled call")
    passes, aux = compressed(call, planned.seeds)  # (k, B, n_other)
    if planned.entries is None:
        return backend.moveaxis(passes, 0, 1 if planned.reverse else 2), aux
    values = backend.take_entries(passes, planned.entries, planned.held)
    shape = (call.batch_size, call.n_out, call.n_in)
    return backend.densify(values, planned.entries, shape, planned.held), aux


def _nonzeros(
    pattern: SparsityPattern, colors: np.ndarray | None, *, reverse: bool, narrow: bool
) -> Entries:
    """The pattern's nonzeros, read off its CSR (no sort, no copy of the columns where their
    dtype is kept), passes coloured by ``colors``; int32 where ``narrow`` and they fit (half
    the memory of int64: 125 M nonzeros at a 1024x1024 blur), else int64."""
    csr = pattern.csr if pattern.csr.has_sorted_indices else pattern.csr.sorted_indices()
    fits = narrow and max(csr.shape) < np.iinfo(np.int32).max
    dtype = np.int32 if fits else np.int64
    grid = pattern.in_shape if pattern.in_shape == pattern.out_shape else None
    cols = csr.indices.astype(dtype, copy=False)
    return Entries(csr.indptr, cols, colors, reverse=reverse, grid=grid)


def _coupled_jacobian(call: Call, reverse: bool, chunk_size: int | None) -> tuple[Array, Any]:
    """Exact diagonal blocks of a coupled function: one pass per (sample, element)."""
    backend = call.backend
    B, xb = call.batch_size, call.xb
    seed_shape, n_seed = (call.out_sample, call.n_out) if reverse else (call.in_sample, call.n_in)
    n_passes = B * n_seed

    def seed(p: Array) -> Array:
        return backend.one_hot(p, n_passes, xb).reshape(B, *seed_shape)

    def finish(p: Array, t: Array, pushed: Array) -> Array:
        return backend.take_sample(pushed.reshape(B, -1), p // n_seed)

    chunk = call.chunk(n_passes, chunk_size, reverse=reverse)
    linear = backend.linearize(call, reverse=reverse)
    blocks = linear.passes(backend.arange(n_passes, xb), seed, finish, chunk, shared=False)
    blocks = blocks.reshape(B, n_seed, -1)
    return (blocks if reverse else backend.moveaxis(blocks, 1, 2)), linear.aux


def _shaped_jacobian(call: Call, flat: Array) -> Array:
    """Flat per-sample Jacobians ``(B, n_out, n_in)`` in the caller's shapes."""
    jac = call.backend.reshape_batch(flat, (call.batch_size, *call.out_sample, *call.in_sample))
    return jac[0] if call.spec.batch_axis is None else jac


def jacobian(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    mode: Mode,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
    fname: str = "jacobian",
) -> Callable[..., Any]:
    """Per-sample Jacobian of a batched function (see ``divjac.jax.jacobian``); ``fname``: the
    public transform built on it (in messages)."""
    check_option("mode", mode, Mode, fname=fname)
    check_option("coupling", coupling, Coupling, fname=fname)

    def one(argnum: int) -> Callable[..., Any]:
        spec = Spec(backend, f, argnum, batch_axis, has_aux, coupling, fname)

        def jac_fn(*args: Any, **kwargs: Any) -> Any:
            call = prepare(spec, args, kwargs)
            flat, aux = jacobian_values(call, mode, chunk_size)
            jac = _shaped_jacobian(call, flat)
            return (jac, aux) if has_aux else jac

        return jac_fn

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)


def jacobian_from_pattern(
    backend: Backend[Any],
    f: Callable[..., Any],
    pattern: SparsityPattern,
    argnums: int,
    *,
    batch_axis: int | None,
    chunk_size: int | None,
    has_aux: bool,
) -> Callable[..., Any]:
    """Per-sample Jacobian from a given pattern: one pass per color, no detection."""
    spec = Spec(backend, f, argnums, batch_axis, has_aux, "raise", "jacobian_from_pattern")

    def jac_fn(*args: Any, **kwargs: Any) -> Any:
        call = prepare(spec, args, kwargs)
        planned = backend.ahead(_given_pattern_plan, call, pattern, chunk_size)
        flat, aux = _planned_jacobian(call, planned)
        jac = _shaped_jacobian(call, flat)
        return (jac, aux) if has_aux else jac

    return jac_fn


def _given_pattern_plan(
    call: Call, pattern: SparsityPattern, chunk_size: int | None
) -> _JacobianPlan:
    check_pattern(call, pattern)
    return _pattern_plan(
        call, pattern, "sparse", call.prefer_reverse(None, measure=True), chunk_size
    )


def _sparse_plan(call: Call, chunk_size: int | None) -> _JacobianPlan:
    """The plan of ``sparse_jacobian``: of a coupled call (``coupling="exact"``), no seeds, and
    its entries read from the diagonal blocks of the samples (pass = row, element = column)."""
    found = call.detect(per_sample=True)
    if found.pattern is None:
        raise InternalError("a per-sample detection without its pattern")
    reverse = call.prefer_reverse(found, measure=True)
    if found.coupling is not None:
        entries = _nonzeros(found.pattern, None, reverse=True, narrow=call.backend.narrow_indices)
        return _JacobianPlan(reverse, None, entries)
    return _pattern_plan(call, found.pattern, "sparse", reverse, chunk_size)


def sparse_jacobian(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
    layout: Any,
) -> Callable[..., Any]:
    """Per-sample Jacobian as a sparse matrix batch (see ``divjac.jax.sparse_jacobian``)."""
    check_option("coupling", coupling, Coupling, fname="sparse_jacobian")
    fmt = backend.sparse_format(layout)

    def one(argnum: int) -> Callable[..., Any]:
        spec = Spec(backend, f, argnum, batch_axis, has_aux, coupling, "sparse_jacobian")

        def sparse_fn(*args: Any, **kwargs: Any) -> Any:
            backend.sparse_format(layout)  # (a compiler may trace this call)
            call = prepare(spec, args, kwargs)
            planned = backend.ahead(_sparse_plan, call, chunk_size)
            if planned.entries is None:
                raise InternalError("a sparse plan without its entries")
            if planned.seeds is None:  # coupling="exact": the detected entries of the blocks
                blocks, aux = _coupled_jacobian(call, planned.reverse, chunk_size)
                passes = backend.moveaxis(blocks, 0, 1)
            else:
                passes, aux = compressed(call, planned.seeds)
            values = backend.take_entries(passes, planned.entries)
            matrix = backend.sparse_matrix(
                planned.entries,
                values,
                (call.batch_size, call.n_out, call.n_in),
                single=call.spec.batch_axis is None,
                sparse_format=fmt,
            )
            return (matrix, aux) if has_aux else matrix

        return sparse_fn

    return per_argnum(argnums, one, tuple_of(has_aux), fname="sparse_jacobian")


# --- sparsity -----------------------------------------------------------------------------------


def sparsity(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    has_aux: bool,
) -> Callable[..., Any]:
    """The per-sample sparsity pattern of ``f`` at its arguments (see ``divjac.jax.sparsity``)."""

    def one(argnum: int) -> Callable[..., SparsityPattern]:
        spec = Spec(backend, f, argnum, batch_axis, has_aux, "exact", "sparsity")

        def detect(*args: Any, **kwargs: Any) -> SparsityPattern:
            found = prepare(spec, args, kwargs).detect(per_sample=True)
            if found.pattern is None:
                raise InternalError("a per-sample detection without its pattern")
            return found.pattern

        return detect

    return per_argnum(argnums, one, tuple, fname="sparsity")
