"""Per-sample Jacobians and divergences of batched functions, written once over a backend.

Every transform takes a *batched* function ``f``: its differentiated argument and its output carry
the batch on ``batch_axis``; other arguments (params, ``t``, ...) pass through untouched. Because
the samples of a batch-independent ``f`` do not interact, the batched Jacobian is block diagonal
and one JVP (or VJP) with the same tangent in every sample yields that column (or row) of every
sample's Jacobian: ``n`` batched passes give all per-sample Jacobians, with no cross-sample work
and no ``(B, ..., B, ...)`` array. Independence is checked on the traced program, never assumed.

This module decides what to compute (checks, detection, plans, passes, estimators); the
framework's primitives come from a :class:`~divjac._backend.Backend`, and :func:`bind` makes the
public functions of ``divjac.jax`` and ``divjac.torch`` from the transforms here. It imports
neither JAX nor PyTorch.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._backend import Array, Backend, Linear, Seed
from ._core import checks, estimators as est, plan, stochastic
from ._core.detection import AUTO_DETECTION_ENTRIES, Detection, Traced
from ._core.pattern import SparsityPattern
from ._errors import ArgnumsError, BatchAxisError, OutputError

__all__ = [
    "bind",
    "divergence",
    "grad_divergence",
    "jacobian",
    "laplacian",
    "sparse_jacobian",
    "sparsity",
    "value_and_divergence",
]


# --- one prepared call --------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """What a transform was built with (shared by all its calls)."""

    backend: Backend
    fun: Callable[..., Any]
    argnums: int
    batch_axis: int | None
    has_aux: bool
    coupling: str
    fname: str
    prefer_reverse: bool | None = None  # None: the backend decides from the traced program


@dataclass
class Call:
    """One call of a transform: the batch-first function and what detection found."""

    spec: Spec
    g: Callable[[Array], Any]
    xb: Array
    traced: Traced
    args: tuple[Any, ...]  # the caller's (f's arguments, the differentiated one included)
    kwargs: dict[str, Any]

    @property
    def backend(self) -> Backend:
        return self.spec.backend

    @property
    def batch_size(self) -> int:
        return int(self.xb.shape[0])

    @property
    def in_sample(self) -> tuple[int, ...]:
        return tuple(self.xb.shape[1:])

    @property
    def out_sample(self) -> tuple[int, ...]:
        return tuple(self.traced.out_shape[1:])

    @property
    def n_in(self) -> int:
        return math.prod(self.in_sample)

    @property
    def n_out(self) -> int:
        return math.prod(self.out_sample)

    def unbatch(self, yb: Array) -> Array:
        """A batch-first result back to the caller's layout."""
        return _to_axis(self.backend, yb, self.spec.batch_axis)

    def bytes_per_pass(self) -> int:
        per_pass = (
            math.prod(self.xb.shape) + math.prod(self.traced.out_shape) + self.traced.pass_elements
        )
        return self.backend.itemsize(self.xb) * per_pass

    def chunk(self, n_passes: int, chunk_size: int | None) -> int:
        """Passes run at once: ``chunk_size``, or as many as fit the memory budget."""
        return plan.choose_chunk_size(n_passes, self.bytes_per_pass(), chunk_size)

    def detect(self, *, per_sample: bool, auto: bool = False) -> Detection:
        """Detect the pattern (abandoned in ``auto`` mode when too dense); checks coupling."""
        limit = AUTO_DETECTION_ENTRIES if auto else None
        found = self.traced.detect(per_sample=per_sample, max_entries=limit)
        if found is None:
            found = self.traced.detect(per_sample=False)
        assert found is not None
        if found.coupling is not None and self.spec.coupling == "raise":
            raise checks.coupling_error(
                found.coupling, fname=self.spec.fname, fallbacks=found.fallbacks
            )
        return found

    def prefer_reverse(self, found: Detection) -> bool:
        """Rows rather than columns on a tie (and always where forward mode cannot go)."""
        if found.has_custom_vjp:
            return True
        if self.spec.prefer_reverse is not None:
            return self.spec.prefer_reverse
        return self.backend.prefer_reverse(self.traced)


def _from_axis(backend: Backend, t: Array, axis: int | None) -> Array:
    """Batch axis ``axis`` (``None``: no batch) moved first."""
    return t[None] if axis is None else backend.moveaxis(t, axis, 0)


def _to_axis(backend: Backend, t: Array, axis: int | None) -> Array:
    """The leading batch axis moved to ``axis`` (``None``: removed)."""
    return t[0] if axis is None else backend.moveaxis(t, 0, axis)


def _prepare(spec: Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    backend, fname = spec.backend, spec.fname
    argnum = checks.normalize_argnum(spec.argnums, len(args), fname=fname)
    x = args[argnum]
    if not backend.is_array(x):
        noun = backend.array_noun
        raise ArgnumsError(
            f"{fname}: argnums={spec.argnums} selects an argument of type {type(x).__name__}; "
            f"divjac differentiates with respect to one {noun}. Pass the {noun} there (to "
            f"differentiate w.r.t. parameters, {backend.param_grad_hint})."
        )
    if not backend.is_floating_input(x.dtype):
        raise checks.not_floating(
            x.dtype, argnum=argnum, fname=fname, cast_hint=backend.input_cast_hint
        )
    x_shape = tuple(x.shape)
    axis = checks.normalize_batch_axis(
        spec.batch_axis, x_shape, what="differentiated input", fname=fname
    )
    if axis is not None and x_shape[axis] == 0:
        raise BatchAxisError(
            f"{fname}: the batch is empty (the differentiated input has shape {x_shape}, size "
            f"0 on batch_axis={axis}): there is no sample to differentiate. Skip empty batches "
            "(e.g. drop_last in the data loader), or check batch_axis."
        )
    fun, has_aux = backend.functional(spec.fun), spec.has_aux
    traced = backend.trace(fun, args, kwargs, argnum=argnum, batch_axis=axis, has_aux=has_aux)
    _check_output(spec, traced.out_tree, x_shape, axis)
    if axis != spec.batch_axis:
        spec = dataclasses.replace(spec, batch_axis=axis)

    def g(xb: Array) -> Any:
        out = fun(*args[:argnum], _to_axis(backend, xb, axis), *args[argnum + 1 :], **kwargs)
        y, aux = out if has_aux else (out, None)
        yb = _from_axis(backend, y, axis)
        return (yb, aux) if has_aux else yb

    return Call(spec, g, _from_axis(backend, x, axis), traced, args, kwargs)


def _check_output(spec: Spec, out: Any, x_shape: tuple[int, ...], axis: int | None) -> None:
    """Check what the traced function returned (``out``: its tree of array specs)."""
    backend, fname = spec.backend, spec.fname
    if spec.has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise OutputError(
                f"{fname}: has_aux=True needs the function to return a pair (output, aux); "
                f"got {type(out).__name__}."
            )
        out = out[0]
    if not backend.is_array_spec(out):
        raise checks.not_an_array(out, what="function's output", fname=fname)
    _check_floating_output(backend, out.dtype, fname)
    if axis is None:
        return
    out_axis = checks.normalize_batch_axis(
        spec.batch_axis, out.shape, what="function's output", fname=fname
    )
    assert out_axis is not None
    if out.shape[out_axis] != x_shape[axis]:
        raise checks.batch_size_mismatch(x_shape, axis, out.shape, out_axis, fname=fname)


def _check_floating_output(backend: Backend, dtype: Any, fname: str) -> None:
    if not backend.is_floating_output(dtype):
        raise OutputError(
            f"{fname}: the function's output has dtype {dtype}; derivatives need a real "
            f"floating output. Return floats ({backend.output_cast_hint})."
        )


# --- passes -------------------------------------------------------------------------------------


def _shaped(indicator: Callable[[Array], Array], shape: tuple[int, ...]) -> Seed:
    """The seed of pass ``c``: its (flat) indicator in ``shape``."""
    return lambda c: indicator(c).reshape(shape)


def _rows(batch_size: int) -> Callable[[Array, Array, Array], Array]:
    """The finish keeping each sample's pushed tangent, flat: ``(B, m)``."""
    return lambda c, t, pushed: pushed.reshape(batch_size, -1)


def _pushed(c: Array, t: Array, pushed: Array) -> Array:
    return pushed


def _itself(seed: Array) -> Array:
    """The seed of a pass whose input is its seed (stacked probes)."""
    return seed


def _compressed(call: Call, the_plan: plan.Plan, chunk_size: int | None) -> tuple[Array, Any]:
    """The passes of a plan, each ``J_b S_c`` (or ``S_c^T J_b``) flattened to ``(B, m)``.

    Returns the stacked passes ``(k, B, m)`` and the aux.
    """
    backend = call.backend
    seed_shape = call.out_sample if the_plan.reverse else call.in_sample
    inputs, indicator = backend.indicators(
        the_plan.colors, math.prod(seed_shape), the_plan.n_passes, call.xb
    )
    seed = _shaped(indicator, seed_shape)
    chunk = call.chunk(the_plan.n_passes, chunk_size)
    linear = backend.linearize(call, the_plan.reverse)
    stacked = linear.passes(inputs, seed, _rows(call.batch_size), chunk, shared=True)
    return stacked, linear.aux


# --- jacobian -----------------------------------------------------------------------------------


def _jacobian_values(call: Call, mode: str, chunk_size: int | None) -> tuple[Array, Any]:
    """Per-sample Jacobians ``(B, n_out, n_in)`` and aux."""
    backend = call.backend
    found = call.detect(per_sample=mode in ("sparse", "auto"), auto=mode == "auto")
    reverse = call.prefer_reverse(found)
    if found.coupling is not None:  # one pass per (sample, element), in the cheaper direction
        dense_mode = mode if mode in ("fwd", "rev") else "auto"
        direction = plan.jacobian_plan(
            dense_mode, call.n_in, call.n_out, None, prefer_reverse=reverse
        )
        return _coupled_jacobian(call, direction.reverse, chunk_size)
    the_plan = plan.jacobian_plan(
        mode, call.n_in, call.n_out, found.pattern, prefer_reverse=reverse
    )
    compressed, aux = _compressed(call, the_plan, chunk_size)  # (k, B, n_other)
    if not the_plan.is_sparse:
        return backend.moveaxis(compressed, 0, 1 if the_plan.reverse else 2), aux
    assert found.pattern is not None
    rows, cols, values = _decompress(backend, found.pattern, the_plan, compressed)
    shape = (call.batch_size, call.n_out, call.n_in)
    return backend.densify(values, rows, cols, shape), aux


def _decompress(
    backend: Backend, pattern: SparsityPattern, the_plan: plan.Plan, compressed: Array
) -> tuple[np.ndarray, np.ndarray, Array]:
    """Rows, columns (row-major order) and per-sample values ``(B, nnz)`` of the nonzeros."""
    coo = pattern.csr.tocoo()
    rows, cols = np.asarray(coo.row, np.int64), np.asarray(coo.col, np.int64)
    order = np.lexsort((cols, rows))
    rows, cols = rows[order], cols[order]
    assert the_plan.colors is not None
    if the_plan.reverse:
        which, within = the_plan.colors[rows], cols
    else:
        which, within = the_plan.colors[cols], rows
    return rows, cols, backend.take_entries(compressed, which, within).T


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

    chunk = call.chunk(n_passes, chunk_size)
    linear = backend.linearize(call, reverse)
    blocks = linear.passes(backend.arange(n_passes, xb), seed, finish, chunk, shared=False)
    blocks = blocks.reshape(B, n_seed, -1)
    return (blocks if reverse else backend.moveaxis(blocks, 1, 2)), linear.aux


def jacobian(
    backend: Backend,
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    mode: str = "auto",
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: str = "raise",
) -> Callable[..., Any]:
    """Per-sample Jacobian of a batched function.

    Args:
        f: batched function (in PyTorch also an ``nn.Module``); argument ``argnums`` and the
            output carry the batch on ``batch_axis``. Other arguments pass through untouched.
        argnums: position of the differentiated array argument (a tuple gives a tuple of
            Jacobians, one per argument).
        batch_axis: batch axis of the differentiated argument and of the output; ``None`` for a
            single-sample function.
        mode: ``"fwd"`` (one JVP per input element), ``"rev"`` (one VJP per output element),
            ``"sparse"`` (one pass per color of the detected per-sample pattern) or ``"auto"``
            (sparse when it saves passes, else the cheaper of fwd/rev).
        chunk_size: passes computed at once (bounds memory); ``None`` picks from the sizes.
        has_aux: ``f`` returns ``(output, aux)``; the transform then returns ``(jac, aux)``.
        coupling: ``"raise"`` (default) refuses a function that mixes samples with a
            :class:`~divjac.BatchCouplingError`; ``"exact"`` computes the true per-sample
            diagonal blocks of such a function (one pass per sample and element).

    Returns:
        A function with ``f``'s signature returning the per-sample Jacobians, shape
        ``(B, *out_sample, *in_sample)`` (``(*out, *in)`` with ``batch_axis=None``).

    Raises:
        BatchCouplingError: ``f`` mixes samples (with ``coupling="raise"``).
        ArgnumsError, BatchAxisError, BatchSizeMismatchError, InputDtypeError, OutputError:
            the arguments do not fit (the message says how to fix them).
    """
    if not isinstance(argnums, int):
        parts = [
            jacobian(
                backend,
                f,
                a,
                batch_axis=batch_axis,
                mode=mode,
                chunk_size=chunk_size,
                has_aux=has_aux,
                coupling=coupling,
            )
            for a in argnums
        ]

        def jacobians(*args: Any, **kwargs: Any) -> Any:
            results = [p(*args, **kwargs) for p in parts]
            if has_aux:
                return tuple(r[0] for r in results), results[0][1] if results else None
            return tuple(results)

        return jacobians
    checks.check_choice("mode", mode, plan.JACOBIAN_MODES, fname="jacobian")
    checks.check_coupling_option(coupling, fname="jacobian")
    spec = Spec(backend, f, argnums, batch_axis, has_aux, coupling, "jacobian")

    def jac_fn(*args: Any, **kwargs: Any) -> Any:
        call = _prepare(spec, args, kwargs)
        flat, aux = _jacobian_values(call, mode, chunk_size)
        jac = flat.reshape((call.batch_size, *call.out_sample, *call.in_sample))
        if call.spec.batch_axis is None:
            jac = jac[0]
        return (jac, aux) if has_aux else jac

    return jac_fn


# --- divergence ---------------------------------------------------------------------------------


@dataclass
class _DivSpec:
    method: str
    num_probes: int | None
    distribution: str
    return_stderr: bool
    chunk_size: int | None
    probing_distance: int | None


def _exact_divergence(call: Call, ds: _DivSpec) -> tuple[Array, Array, Any]:
    """Exact per-sample divergence: (batch-first value, divergence (B,), aux)."""
    backend = call.backend
    checks.check_square(call.in_sample, call.out_sample, fname=call.spec.fname)
    per_sample = ds.method in ("sparse", "auto")
    found = call.detect(per_sample=per_sample, auto=ds.method == "auto")
    reverse = call.prefer_reverse(found)
    B, n = call.batch_size, call.n_in
    if found.coupling is None:
        the_plan = plan.divergence_plan(ds.method, n, found.pattern, prefer_reverse=reverse)
        n_seed, batched = n, True
    else:
        whole = (
            call.traced.detect(
                per_sample=True, whole_batch=True, max_entries=AUTO_DETECTION_ENTRIES
            )
            if per_sample
            else None
        )  # None: dense, or past the memory budget (one pass per sample and element then)
        pattern = whole.pattern if whole is not None else None
        the_plan = plan.divergence_plan(
            "exact" if pattern is None else ds.method, B * n, pattern, prefer_reverse=reverse
        )
        n_seed, batched = B * n, False
    inputs, indicator = backend.indicators(the_plan.colors, n_seed, the_plan.n_passes, call.xb)
    seed = _shaped(indicator, call.in_sample if batched else (B, *call.in_sample))
    finish = backend.diagonal_sums(the_plan.colors, n_seed, B, batched)
    chunk = call.chunk(the_plan.n_passes, ds.chunk_size)
    linear = backend.linearize(call, the_plan.reverse)
    contributions = linear.passes(inputs, seed, finish, chunk, shared=batched)
    return linear.value, contributions.sum(0), linear.aux


def _stochastic_divergence(
    call: Call, ds: _DivSpec, randomness: Any
) -> tuple[Array, Array, Array | None, Any]:
    """(batch-first value, estimate (B,), stderr (B,) or ``None`` when not asked for, aux) of a
    stochastic method."""
    fname = call.spec.fname
    checks.check_square(call.in_sample, call.out_sample, fname=fname)
    found = call.detect(per_sample=ds.method == "probing", auto=True)
    if found.coupling is not None and ds.method in ("hutch++", "xtrace"):  # coupling="exact"
        raise checks.coupling_error(
            found.coupling, fname=fname, fallbacks=found.fallbacks, method=ds.method
        )
    backend, B, n = call.backend, call.batch_size, call.n_in
    # Rows or columns, as the exact method would choose: every estimator estimates the trace
    # of J^T (pushed rows) as well as that of J.
    linear = backend.linearize(call, call.prefer_reverse(found))
    if ds.method == "probing":
        matvec = _batched_matvec(call, linear, ds.chunk_size)
        pattern = found.pattern if found.coupling is None else None
        colors, exact, reps = stochastic.probing_plan(
            pattern,
            call.in_sample,
            num_probes=ds.num_probes,
            probing_distance=ds.probing_distance,
            need_stderr=ds.return_stderr,
        )
        signs = backend.moveaxis(
            _draw(call, randomness, reps, "rademacher").reshape(reps, B, n), 0, -1
        )
        estimate, stderr = est.probing(
            matvec, colors, signs, exact=exact, num_colors=int(colors.max()) + 1
        )
    else:
        num = ds.num_probes or stochastic.default_num_probes(ds.method, n)
        k = est.num_random_vectors(ds.method, num, n)
        columns = _draw(call, randomness, k, ds.distribution)
        if ds.method == "hutchinson" and (k > 1 or not ds.return_stderr):
            terms = _probe_terms(call, linear, columns, ds.chunk_size)
            estimate, stderr = est.hutchinson_from_terms(terms, stderr=ds.return_stderr)
        else:
            V = backend.moveaxis(columns.reshape(k, B, n), 0, -1)
            matvec = _batched_matvec(call, linear, ds.chunk_size)
            estimate, stderr = est.estimate_trace(ds.method, matvec, V)
    return linear.value, estimate, stderr, linear.aux


def _probe_terms(call: Call, linear: Linear, columns: Array, chunk_size: int | None) -> Array:
    """Hutchinson's terms ``v^T J_b v`` ``(k, B)`` of the probes ``columns`` ``(k, B, *in)``,
    each from one batched pass, in the layout of the passes (as hand-written code does)."""
    k = int(columns.shape[0])
    sample_axes = tuple(range(1, 1 + len(call.in_sample)))

    def dot(c: Array, t: Array, pushed: Array) -> Array:
        return (pushed * t).sum(sample_axes)

    return linear.passes(columns, _itself, dot, call.chunk(k, chunk_size), shared=False)


def _batched_matvec(call: Call, linear: Linear, chunk_size: int | None) -> Callable[[Array], Array]:
    """``V (B, n, k) -> W (B, n, k)`` with ``W[b] = J_b V[b]``: one batched pass per column."""
    backend = call.backend
    B, n, shape = call.batch_size, call.n_in, call.in_sample

    def matvec(V: Array) -> Array:
        k = V.shape[-1]
        columns = backend.moveaxis(V, -1, 0).reshape(k, B, *shape)
        out = linear.passes(columns, _itself, _pushed, call.chunk(k, chunk_size), shared=False)
        return backend.moveaxis(out.reshape(k, B, n), 0, -1)

    return matvec


def _is_probes(backend: Backend, randomness: Any) -> bool:
    """Whether the randomness argument is the caller's own probes (a floating array)."""
    return backend.is_array(randomness) and backend.is_floating_input(randomness.dtype)


def _draw(call: Call, randomness: Any, k: int, distribution: str) -> Array:
    """Probes ``(k, B, *in)``: the caller's (reusable noise) or ``k`` per sample drawn from
    ``randomness``."""
    backend, fname = call.backend, call.spec.fname
    B, n, shape = call.batch_size, call.n_in, call.in_sample
    if _is_probes(backend, randomness):
        probes = backend.asarray(randomness, like=call.xb)
        axis = call.spec.batch_axis
        x_shape = stochastic.caller_shape(shape, B, axis)
        if stochastic.check_probes_shape(tuple(probes.shape), x_shape, k, fname=fname):
            probes = probes[None]
        return probes[:, None] if axis is None else backend.moveaxis(probes, axis + 1, 1)
    raw = backend.draw(randomness, (B, n, k), distribution, like=call.xb)
    columns = backend.moveaxis(est.normalize_probes(raw, distribution), -1, 0)
    return columns.reshape(k, B, *shape)


def _split_randomness(
    backend: Backend, stochastic_method: bool, args: tuple[Any, ...], fname: str
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``((randomness,), f's arguments)`` of a stochastic transform's call, ``((), args)``
    of an exact one.

    The randomness of a stochastic method is the first positional argument of the transformed
    function (a key or generator, or the caller's probes), so that it can never collide with
    ``f``'s own arguments and keywords: every keyword of the call reaches ``f``.
    """
    if not stochastic_method:
        return (), args
    if len(args) < 2 or not (_is_probes(backend, args[0]) or backend.is_randomness(args[0])):
        if not args:
            got = "no argument"
        elif len(args) == 1:
            got = "one argument only (f's own arguments follow the randomness)"
        else:
            got = f"{type(args[0]).__name__}"
            if backend.is_array(args[0]):
                got += f" of dtype {args[0].dtype}"
        raise stochastic.missing_randomness(fname, backend.randomness_example, got)
    return (args[0],), args[1:]


def _divergence_transform(
    backend: Backend,
    f: Callable[..., Any],
    argnums: int,
    batch_axis: int | None,
    has_aux: bool,
    coupling: str,
    ds: _DivSpec,
    fname: str,
    prefer_reverse: bool | None = None,
) -> Callable[..., tuple[Array, Any, Any]]:
    """The shared body of the divergence transforms: ``(*args) -> (value, div, aux)``."""
    checks.check_choice("method", ds.method, plan.DIVERGENCE_METHODS, fname=fname)
    checks.check_choice("distribution", ds.distribution, est.DISTRIBUTIONS, fname=fname)
    checks.check_coupling_option(coupling, fname=fname)
    spec = Spec(backend, f, argnums, batch_axis, has_aux, coupling, fname, prefer_reverse)
    stochastic_method = ds.method in plan.STOCHASTIC_METHODS

    def value_and_div(*args: Any, **kwargs: Any) -> tuple[Array, Any, Any]:
        randomness, args = _split_randomness(backend, stochastic_method, args, fname)
        call = _prepare(spec, args, kwargs)
        if randomness:
            y, div, stderr, aux = _stochastic_divergence(call, ds, randomness[0])
        else:
            y, div, aux = _exact_divergence(call, ds)
            stderr = backend.zeros_like(div) if ds.return_stderr else None
        if call.spec.batch_axis is None:
            div = div[0]
            stderr = None if stderr is None else stderr[0]
        result = (div, stderr) if ds.return_stderr else div
        return call.unbatch(y), result, aux

    return value_and_div


def _divergence_like(
    name: str, outputs: Callable[[Array, Any, Any, bool], Any], doc: str
) -> Callable[..., Callable[..., Any]]:
    """A divergence transform named ``name``: its calls return ``outputs(value, div, aux,
    has_aux)``. (:func:`divergence` and :func:`value_and_divergence` take the same arguments.)"""

    def transform(
        backend: Backend,
        f: Callable[..., Any],
        /,
        argnums: int = 0,
        *,
        batch_axis: int | None = 0,
        method: str = "auto",
        num_probes: int | None = None,
        distribution: str = "rademacher",
        return_stderr: bool = False,
        chunk_size: int | None = None,
        has_aux: bool = False,
        coupling: str = "raise",
        probing_distance: int | None = None,
    ) -> Callable[..., Any]:
        ds = _DivSpec(method, num_probes, distribution, return_stderr, chunk_size, probing_distance)
        inner = _divergence_transform(backend, f, argnums, batch_axis, has_aux, coupling, ds, name)

        def transformed(*args: Any, **kwargs: Any) -> Any:
            return outputs(*inner(*args, **kwargs), has_aux)

        return transformed

    transform.__name__ = transform.__qualname__ = name
    transform.__doc__ = doc
    return transform


divergence = _divergence_like(
    "divergence",
    lambda value, div, aux, has_aux: (div, aux) if has_aux else div,
    """Per-sample divergence (trace of the per-sample Jacobian) of a batched function.

    Args:
        f: batched function (in PyTorch also an ``nn.Module``), ``[B, *shape] -> [B, *shape]``
            in argument ``argnums``.
        argnums: position of the differentiated array argument.
        batch_axis: batch axis of that argument and of the output (``None``: single sample).
        method: ``"exact"`` (one batched pass per input element), ``"sparse"`` (exact, one pass
            per color of a diagonal coloring of the detected pattern), ``"auto"`` (exact: sparse
            when it saves passes, never stochastic), or a stochastic estimate: ``"hutchinson"``,
            ``"hutch++"``, ``"xtrace"``, ``"probing"``.
        num_probes: matvec budget per sample of a stochastic method (default 16; Hutch++ needs
            a multiple of 3, XTrace an even number).
        distribution: probe distribution: ``"rademacher"``, ``"gaussian"`` or ``"sphere"``.
        return_stderr: return ``(divergence, stderr)``: an error bar (estimate +- 2 stderr
            covers the truth at least 94 % of the time, never NaN); 0 for exact methods.
        chunk_size: passes computed at once (bounds memory); ``None`` picks from the sizes.
        has_aux: ``f`` returns ``(output, aux)``; the transform returns ``(div, aux)``.
        coupling: ``"raise"`` refuses functions that mix samples; ``"exact"`` computes the
            traces of the true per-sample diagonal blocks (more passes).
        probing_distance: for ``"probing"``, color a distance-limited pattern (Chebyshev
            distance on the per-sample grid) instead of choosing the distance from the budget.

    Returns:
        A function with ``f``'s signature returning the per-sample divergence, shape ``(B,)``.
        The function of a stochastic method takes one more argument, **first**: its
        randomness, a JAX PRNG key (``jax.random.key(0)``) or a ``torch.Generator`` (``None``:
        torch's global generator), or the caller's own probes (a floating array of shape
        ``(k, *x.shape)``, or ``x.shape`` for one). Every argument and keyword after it is
        ``f``'s and reaches ``f`` untouched (``key=`` of an Equinox model included).

    Raises:
        NonSquareJacobianError: output and input samples differ in shape.
        BatchCouplingError: ``f`` mixes samples (with ``coupling="raise"``).
        MissingKeyError: a stochastic method's function was called without its randomness
            (a key, generator or probes) as its first argument.
        NumProbesError: ``num_probes`` or ``probes`` do not fit the method.
    """,
)

value_and_divergence = _divergence_like(
    "value_and_divergence",
    lambda value, div, aux, has_aux: ((value, aux), div) if has_aux else (value, div),
    """``f``'s output and its per-sample divergence from one shared forward computation.

    Takes the arguments of :func:`divergence`. The returned function gives ``(value, div)``
    (``((value, aux), div)`` with ``has_aux``), as ``jax.value_and_grad`` and
    ``torch.func.grad_and_value`` pair them.
    """,
)


def grad_divergence(
    backend: Backend,
    f: Callable[..., Any],
    /,
    argnums: int = 0,
    *,
    batch_axis: int | None = 0,
    method: str = "auto",
    num_probes: int | None = None,
    distribution: str = "rademacher",
    chunk_size: int | None = None,
    coupling: str = "raise",
) -> Callable[..., Any]:
    """Per-sample gradient of the divergence w.r.t. the input, shape ``(B, *in_sample)``.

    For a batch-independent ``f``, ``div_b`` depends only on ``x_b``, so the gradient of
    ``sum_b div_b`` holds every per-sample gradient at once: exact, not scaled by ``1/B``, with
    no ``B^2`` work. (For ``coupling="exact"`` it is the gradient of each sample's
    diagonal-block trace w.r.t. the whole batch, summed over samples.) Computed with the
    framework's gradient (``jax.grad``, ``torch.func.grad``), so it stays differentiable
    w.r.t. parameters.
    """
    div = divergence(
        backend,
        f,
        argnums,
        batch_axis=batch_axis,
        method=method,
        num_probes=num_probes,
        distribution=distribution,
        chunk_size=chunk_size,
        coupling=coupling,
    )

    stochastic_method = method in plan.STOCHASTIC_METHODS

    def grad_fn(*args: Any, **kwargs: Any) -> Array:
        randomness, args = _split_randomness(backend, stochastic_method, args, "grad_divergence")
        argnum = checks.normalize_argnum(argnums, len(args), fname="grad_divergence")

        def divergences(x: Array) -> Array:
            return div(*randomness, *args[:argnum], x, *args[argnum + 1 :], **kwargs)

        return backend.grad_of_sum(divergences, args[argnum])

    return grad_fn


def laplacian(
    backend: Backend,
    u: Callable[..., Any],
    /,
    argnums: int = 0,
    *,
    batch_axis: int | None = 0,
    method: str = "auto",
    num_probes: int | None = None,
    distribution: str = "rademacher",
    return_stderr: bool = False,
    chunk_size: int | None = None,
    coupling: str = "raise",
) -> Callable[..., Any]:
    """Per-sample Laplacian of a scalar-per-sample function ``u: [B, *shape] -> [B]``.

    The Laplacian is the divergence of the per-sample gradient, computed forward-over-reverse
    (Hessian-vector products); ``method`` works as in :func:`divergence` (the Hessian pattern
    is symmetric, so ``"sparse"`` uses a diagonal coloring of it).
    """

    def gradient(*args: Any, **kwargs: Any) -> Array:
        argnum = checks.normalize_argnum(argnums, len(args), fname="laplacian")
        x_shape = tuple(args[argnum].shape)

        def values(x: Array) -> Array:
            out = u(*args[:argnum], x, *args[argnum + 1 :], **kwargs)
            _check_scalar_per_sample(backend, out, x_shape, batch_axis)
            return out

        return backend.grad_of_sum(values, args[argnum])

    ds = _DivSpec(method, num_probes, distribution, return_stderr, chunk_size, None)
    inner = _divergence_transform(
        backend, gradient, argnums, batch_axis, False, coupling, ds, "laplacian", False
    )

    def lap_fn(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)[1]

    return lap_fn


def _check_scalar_per_sample(
    backend: Backend, out: Any, x_shape: tuple[int, ...], batch_axis: int | None
) -> None:
    if not backend.is_array(out):
        raise checks.not_an_array(out, what="function's output", fname="laplacian")
    _check_floating_output(backend, out.dtype, "laplacian")
    shape = tuple(out.shape)
    if batch_axis is None:
        sample = shape
    else:
        axis = checks.normalize_batch_axis(
            batch_axis, shape, what="function's output", fname="laplacian"
        )
        assert axis is not None
        x_axis = batch_axis % len(x_shape)
        if shape[axis] != x_shape[x_axis]:
            raise checks.batch_size_mismatch(x_shape, x_axis, shape, axis, fname="laplacian")
        sample = shape[:axis] + shape[axis + 1 :]
    if math.prod(sample) != 1:
        raise OutputError(
            f"laplacian: u must return one scalar per sample (output shape (B,) or "
            f"(B, 1)); its per-sample output has shape {sample}. Use "
            "divergence/jacobian for vector outputs."
        )


# --- sparsity -----------------------------------------------------------------------------------


def sparsity(
    backend: Backend,
    f: Callable[..., Any],
    /,
    *args: Any,
    argnums: int = 0,
    batch_axis: int | None = 0,
    has_aux: bool = False,
    **kwargs: Any,
) -> SparsityPattern:
    """Detect the per-sample Jacobian sparsity of ``f`` at arguments of these shapes.

    Detection interprets the traced program (the jaxpr in JAX, the ATen graph traced on fake
    tensors in PyTorch): values are never used, except constants baked into the function, so
    the pattern holds for every input of these shapes. It never misses a true nonzero;
    operations without a rule are assumed dense (with a warning).

    Returns:
        A :class:`~divjac.SparsityPattern` with the per-sample CSR pattern, colorings and
        ``is_batch_independent`` (a coupled function is reported, not refused).
    """
    spec = Spec(backend, f, argnums, batch_axis, has_aux, "exact", "sparsity")
    call = _prepare(spec, args, kwargs)
    found = call.detect(per_sample=True)
    assert found is not None and found.pattern is not None
    return found.pattern


def sparse_jacobian(
    backend: Backend,
    f: Callable[..., Any],
    /,
    argnums: int = 0,
    *,
    batch_axis: int | None = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
    **sparse_format: Any,
) -> Callable[..., Any]:
    """Per-sample Jacobian as a sparse matrix batch of shape ``(B, n_out, n_in)``.

    A ``BCOO`` array in JAX, a sparse COO or CSR tensor in PyTorch. Only the detected nonzeros
    are stored, and they are computed with one pass per color of the column (or row) coloring:
    a 64x64 blur with an 11x11 kernel needs about 121 passes instead of 4096, and no
    ``H*W x H*W`` dense array is formed.
    """
    fmt = backend.sparse_format(**sparse_format)
    spec = Spec(backend, f, argnums, batch_axis, has_aux, "raise", "sparse_jacobian")

    def sparse_fn(*args: Any, **kwargs: Any) -> Any:
        call = _prepare(spec, args, kwargs)
        found = call.detect(per_sample=True)
        assert found is not None and found.pattern is not None
        the_plan = plan.jacobian_plan(
            "sparse",
            call.n_in,
            call.n_out,
            found.pattern,
            prefer_reverse=call.prefer_reverse(found),
        )
        compressed, aux = _compressed(call, the_plan, chunk_size)
        rows, cols, values = _decompress(backend, found.pattern, the_plan, compressed)
        matrix = backend.sparse_matrix(
            rows,
            cols,
            values,
            (call.batch_size, call.n_out, call.n_in),
            single=call.spec.batch_axis is None,
            sparse_format=fmt,
        )
        return (matrix, aux) if has_aux else matrix

    return sparse_fn


# --- the public functions of a backend ----------------------------------------------------------


def bind(
    transform: Callable[..., Any],
    example: str,
    *,
    backend: Backend,
    module: str,
    notes: str = "",
    options: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """``transform`` with its ``backend`` argument filled in: a public function of ``module``.

    Its signature is the transform's without ``backend`` (``options``' keyword-only parameters
    replace the transform's ``**kwargs``), and its docstring the transform's, followed by
    ``notes`` (framework-specific sections) and ``example`` (doctested ``>>>`` lines).
    """
    signature = inspect.signature(transform)
    params = list(signature.parameters.values())[1:]
    if options is not None:
        assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
        params = params[:-1] + list(inspect.signature(options).parameters.values())
    name = transform.__name__
    keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def public(*args: Any, **kwargs: Any) -> Any:
        if options is not None:  # fail on unknown keywords as Python would on the signature
            for key in kwargs:
                if key not in keywords:
                    raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
        return transform(backend, *args, **kwargs)

    doc = inspect.cleandoc(transform.__doc__ or "")
    sections = [doc, textwrap.dedent(notes).strip(), "Example:\n" + _indented(example)]
    public.__doc__ = "\n\n".join(s for s in sections if s) + "\n"
    public.__name__ = public.__qualname__ = name
    public.__module__ = module
    public.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return public


def _indented(example: str) -> str:
    return textwrap.indent(textwrap.dedent(example).strip(), "    ")
