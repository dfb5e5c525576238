"""Per-sample Jacobians and divergences of batched JAX functions.

Every transform takes a *batched* function ``f``: its differentiated argument and its output carry
the batch on ``batch_axis``; other arguments (params, ``t``, ...) pass through untouched. Because
the samples of a batch-independent ``f`` do not interact, the batched Jacobian is block diagonal
and one JVP with the same tangent in every sample yields that column of every sample's Jacobian:
``n`` batched passes give all per-sample Jacobians, with no cross-sample work and no
``(B, ..., B, ...)`` array. Independence is checked on the traced program, never assumed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse

import jax
from jax import lax

from .._core import checks, estimators as est, plan, stochastic
from .._core.pattern import SparsityPattern
from .._errors import ArgnumsError, OutputError
from ._detect import Detection, Traced, is_array, trace
from ._sink import shared_push

__all__ = [
    "divergence",
    "grad_divergence",
    "jacobian",
    "laplacian",
    "sparse_jacobian",
    "sparsity",
    "value_and_divergence",
]

# Sparse detection in mode/method "auto" is abandoned once an intermediate holds more entries.
_AUTO_DETECTION_ENTRIES = 20_000_000


# --- one prepared call --------------------------------------------------------------------------


@dataclass
class _Spec:
    """What a transform was built with (shared by all its calls)."""

    fun: Callable[..., Any]
    argnums: int
    batch_axis: int | None
    has_aux: bool
    coupling: str
    fname: str


@dataclass
class _Call:
    """One call of a transform: the batch-first function and what detection found."""

    spec: _Spec
    g: Callable[[jax.Array], Any]
    xb: jax.Array
    traced: Traced
    argnum: int

    @property
    def batch_size(self) -> int:
        return self.xb.shape[0]

    @property
    def in_sample(self) -> tuple[int, ...]:
        return tuple(self.xb.shape[1:])

    @property
    def out_sample(self) -> tuple[int, ...]:
        return tuple(self.traced.out.shape[1:])

    @property
    def n_in(self) -> int:
        return math.prod(self.in_sample)

    @property
    def n_out(self) -> int:
        return math.prod(self.out_sample)

    def unbatch(self, yb: jax.Array) -> jax.Array:
        """A batch-first result back to the caller's layout."""
        axis = self.spec.batch_axis
        return yb[0] if axis is None else jnp.moveaxis(yb, 0, axis)

    def bytes_per_pass(self) -> int:
        itemsize = jnp.dtype(self.xb.dtype).itemsize
        per_pass = self.xb.size + math.prod(self.traced.out.shape) + self.traced.pass_elements
        return itemsize * per_pass

    def detect(self, *, per_sample: bool, auto: bool = False) -> Detection:
        """Detect the pattern (abandoned in ``auto`` mode when too dense); checks coupling."""
        limit = _AUTO_DETECTION_ENTRIES if auto else None
        found = self.traced.detect(per_sample=per_sample, max_entries=limit)
        if found is None:
            found = self.traced.detect(per_sample=False)
        assert found is not None
        if found.coupling is not None and self.spec.coupling == "raise":
            raise checks.coupling_error(
                found.coupling, fname=self.spec.fname, fallbacks=found.fallbacks
            )
        return found


def _prepare(spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
    fname = spec.fname
    argnum = checks.normalize_argnum(spec.argnums, len(args), fname=fname)
    x = args[argnum]
    if not is_array(x):
        raise ArgnumsError(
            f"{fname}: argnums={spec.argnums} selects an argument of type {type(x).__name__}; "
            "divjac differentiates with respect to one array. Pass the array there (to "
            "differentiate w.r.t. parameters, take jax.grad of a loss built on the result)."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise checks.not_floating(
            x.dtype, argnum=argnum, fname=fname, cast_hint="x.astype(jnp.float32)"
        )
    axis = checks.normalize_batch_axis(
        spec.batch_axis, np.shape(x), what="differentiated input", fname=fname
    )
    traced = trace(
        spec.fun,
        args,
        kwargs,
        argnum=argnum,
        batch_axis=axis,
        has_aux=spec.has_aux,
    )
    _check_output(spec, traced, np.shape(x), axis)
    spec = spec if axis == spec.batch_axis else _replace_axis(spec, axis)

    def g(xb: jax.Array) -> Any:
        xs = xb[0] if axis is None else jnp.moveaxis(xb, 0, axis)
        out = spec.fun(*args[:argnum], xs, *args[argnum + 1 :], **kwargs)
        y, aux = out if spec.has_aux else (out, None)
        yb = y[None] if axis is None else jnp.moveaxis(y, axis, 0)
        return (yb, aux) if spec.has_aux else yb

    xb = x[None] if axis is None else jnp.moveaxis(x, axis, 0)
    return _Call(spec, g, xb, traced, argnum)


def _replace_axis(spec: _Spec, axis: int | None) -> _Spec:
    return _Spec(spec.fun, spec.argnums, axis, spec.has_aux, spec.coupling, spec.fname)


def _check_output(spec: _Spec, traced: Traced, x_shape: tuple[int, ...], axis: int | None) -> None:
    fname = spec.fname
    out = traced.out_tree
    if spec.has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise OutputError(
                f"{fname}: has_aux=True needs the function to return a pair (output, aux); "
                f"got {type(out).__name__}."
            )
        out = out[0]
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise checks.not_an_array(out, what="function's output", fname=fname)
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise OutputError(
            f"{fname}: the function's output has dtype {out.dtype}; derivatives need a real "
            "floating output. Return floats (cast integer or boolean results)."
        )
    if axis is None:
        return
    out_axis = checks.normalize_batch_axis(
        spec.batch_axis, out.shape, what="function's output", fname=fname
    )
    assert out_axis is not None
    if out.shape[out_axis] != x_shape[axis]:
        raise checks.batch_size_mismatch(x_shape, axis, out.shape, out_axis, fname=fname)


# --- passes -------------------------------------------------------------------------------------


def _linear_map(
    call: _Call, reverse: bool
) -> tuple[jax.Array, Any, Callable[[jax.Array], jax.Array]]:
    """(batch-first output, aux, push): ``push`` is the JVP (or VJP) of the batched function."""
    aux = None
    if reverse:
        if call.spec.has_aux:
            y, vjp_fn, aux = jax.vjp(call.g, call.xb, has_aux=True)
        else:
            y, vjp_fn = jax.vjp(call.g, call.xb)
        return y, aux, lambda ct: vjp_fn(ct)[0]
    if call.spec.has_aux:
        y, jvp_fn, aux = jax.linearize(call.g, call.xb, has_aux=True)
    else:
        y, jvp_fn = jax.linearize(call.g, call.xb)
    return y, aux, jvp_fn


def _run_passes(
    pass_fn: Callable[[jax.Array], jax.Array], n_passes: int, chunk: int, out_axis: int = 0
) -> jax.Array:
    """``stack([pass_fn(c) for c in range(n_passes)], axis=out_axis)``, ``chunk`` at a time."""
    ids = jnp.arange(n_passes)
    if chunk >= n_passes:
        return jax.vmap(pass_fn, out_axes=out_axis)(ids)
    stacked = lax.map(pass_fn, ids, batch_size=chunk)
    return jnp.moveaxis(stacked, 0, out_axis)


def _indicator(colors: np.ndarray | None, c: jax.Array, n: int, dtype: Any) -> jax.Array:
    """Elements of color ``c`` (one-hot ``c`` for the dense method), flat, of length ``n``."""
    if colors is None:
        return jax.nn.one_hot(c, n, dtype=dtype)
    return (jnp.asarray(colors) == c).astype(dtype)


def _chunk(call: _Call, n_passes: int, chunk_size: int | None) -> int:
    return plan.choose_chunk_size(n_passes, call.bytes_per_pass(), chunk_size)


# --- jacobian -----------------------------------------------------------------------------------


def _jacobian_values(call: _Call, mode: str, chunk_size: int | None) -> tuple[jax.Array, Any]:
    """Per-sample Jacobians ``(B, n_out, n_in)`` and aux."""
    found = call.detect(per_sample=mode in ("sparse", "auto"), auto=mode == "auto")
    if found.coupling is not None:
        return _coupled_jacobian(call, mode == "rev", chunk_size)
    the_plan = plan.jacobian_plan(
        mode, call.n_in, call.n_out, found.pattern, prefer_reverse=found.has_custom_vjp
    )
    if not the_plan.is_sparse:
        return _compressed(call, the_plan, chunk_size, out_axis=1 if the_plan.reverse else 2)
    compressed, aux = _compressed(call, the_plan, chunk_size)  # (k, B, n_other)
    assert found.pattern is not None
    rows, cols, values = _decompress(found.pattern, the_plan, compressed)
    dense = jnp.zeros((call.batch_size, call.n_out, call.n_in), compressed.dtype)
    return dense.at[:, rows, cols].set(values), aux


def _compressed(
    call: _Call, the_plan: plan.Plan, chunk_size: int | None, out_axis: int = 0
) -> tuple[jax.Array, Any]:
    """The passes of a plan, each ``J_b S_c`` (or ``S_c^T J_b``) flattened to ``(B, n)``.

    Stacked on ``out_axis``; returns (stacked passes, aux).
    """
    _, aux, push = _linear_map(call, the_plan.reverse)
    B = call.batch_size
    seed_shape = call.out_sample if the_plan.reverse else call.in_sample
    n_seed = math.prod(seed_shape)
    dtype = call.xb.dtype
    push_shared = shared_push(push, B, seed_shape, dtype)

    def pass_fn(c: jax.Array) -> jax.Array:
        t = _indicator(the_plan.colors, c, n_seed, dtype).reshape(seed_shape)
        return push_shared(t).reshape(B, -1)

    chunk = _chunk(call, the_plan.n_passes, chunk_size)
    return _run_passes(pass_fn, the_plan.n_passes, chunk, out_axis), aux


def _decompress(
    pattern: SparsityPattern, the_plan: plan.Plan, compressed: jax.Array
) -> tuple[np.ndarray, np.ndarray, jax.Array]:
    """Rows, columns and per-sample values ``(B, nnz)`` of the pattern's nonzeros."""
    coo = pattern.csr.tocoo()
    rows, cols = np.asarray(coo.row, np.int64), np.asarray(coo.col, np.int64)
    order = np.lexsort((cols, rows))
    rows, cols = rows[order], cols[order]
    assert the_plan.colors is not None
    if the_plan.reverse:
        values = compressed[the_plan.colors[rows], :, cols]
    else:
        values = compressed[the_plan.colors[cols], :, rows]
    return rows, cols, values.T


def _coupled_jacobian(call: _Call, reverse: bool, chunk_size: int | None) -> tuple[jax.Array, Any]:
    """Exact diagonal blocks of a coupled function: one pass per (sample, element)."""
    _, aux, push = _linear_map(call, reverse)
    B = call.batch_size
    seed_shape, n_seed = (call.out_sample, call.n_out) if reverse else (call.in_sample, call.n_in)
    dtype = call.xb.dtype

    def pass_fn(p: jax.Array) -> jax.Array:
        t = jax.nn.one_hot(p, B * n_seed, dtype=dtype).reshape(B, *seed_shape)
        return push(t).reshape(B, -1)[p // n_seed]

    blocks = _run_passes(pass_fn, B * n_seed, _chunk(call, B * n_seed, chunk_size))
    blocks = blocks.reshape(B, n_seed, -1)
    return (blocks if reverse else jnp.swapaxes(blocks, 1, 2)), aux


def jacobian(
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
        f: batched function; argument ``argnums`` and the output carry the batch on
            ``batch_axis``. Other arguments pass through untouched.
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

    Example:
        >>> import jax.numpy as jnp
        >>> from divjac.jax import jacobian
        >>> W = jnp.array([[1.0, 2.0], [3.0, 4.0]])
        >>> jacobian(lambda x: x @ W.T)(jnp.ones((5, 2))).shape
        (5, 2, 2)
    """
    if not isinstance(argnums, int):
        parts = [
            jacobian(
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
    _check_choice("mode", mode, plan.JACOBIAN_MODES, "jacobian")
    checks.check_coupling_option(coupling, fname="jacobian")
    spec = _Spec(f, argnums, batch_axis, has_aux, coupling, "jacobian")

    def jac_fn(*args: Any, **kwargs: Any) -> Any:
        call = _prepare(spec, args, kwargs)
        flat, aux = _jacobian_values(call, mode, chunk_size)
        shape = call.out_sample + call.in_sample
        jac = flat.reshape((call.batch_size, *shape))
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


def _exact_divergence(call: _Call, ds: _DivSpec) -> tuple[jax.Array, jax.Array, Any]:
    """Exact per-sample divergence: (batch-first value, divergence (B,), aux)."""
    checks.check_square(call.in_sample, call.out_sample, fname=call.spec.fname)
    per_sample = ds.method in ("sparse", "auto")
    found = call.detect(per_sample=per_sample, auto=ds.method == "auto")
    reverse = found.has_custom_vjp
    B, n = call.batch_size, call.n_in
    if found.coupling is None:
        the_plan = plan.divergence_plan(ds.method, n, found.pattern, prefer_reverse=reverse)
        colors, n_seed, batched = the_plan.colors, n, True
    else:
        whole = call.traced.detect(per_sample=True, whole_batch=True) if per_sample else None
        pattern = whole.pattern if whole is not None else None
        the_plan = plan.divergence_plan(
            "exact" if pattern is None else ds.method, B * n, pattern, prefer_reverse=reverse
        )
        colors, n_seed, batched = the_plan.colors, B * n, False
    y, aux, push = _linear_map(call, the_plan.reverse)
    dtype = call.xb.dtype
    if batched:
        push_shared = shared_push(push, B, call.in_sample, dtype)

    members = jnp.asarray(plan.color_classes(colors, n_seed))

    def pass_fn(c: jax.Array) -> jax.Array:
        t = _indicator(colors, c, n_seed, dtype)
        idx = members[c]
        valid = idx >= 0
        idx = jnp.maximum(idx, 0)
        if batched:
            out = push_shared(t.reshape(call.in_sample)).reshape(B, -1)
            return jnp.sum(jnp.where(valid, jnp.take(out, idx, axis=1), 0), axis=1)
        out = push(t.reshape(B, *call.in_sample)).reshape(-1)
        vals = jnp.where(valid, out[idx], 0)
        return jnp.zeros(B, vals.dtype).at[idx // n].add(vals)

    contributions = _run_passes(
        pass_fn, the_plan.n_passes, _chunk(call, the_plan.n_passes, ds.chunk_size)
    )
    return y, jnp.sum(contributions, axis=0), aux


def _stochastic_divergence(
    call: _Call, ds: _DivSpec, key: jax.Array | None, probes: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """(batch-first value, estimate (B,), stderr (B,), aux) of a stochastic method."""
    fname = call.spec.fname
    checks.check_square(call.in_sample, call.out_sample, fname=fname)
    found = call.detect(per_sample=ds.method == "probing", auto=True)
    if found.coupling is not None and ds.method in ("hutch++", "xtrace"):
        raise checks.coupling_error(found.coupling, fname=fname, fallbacks=found.fallbacks)
    B, n = call.batch_size, call.n_in
    y, aux, push = _linear_map(call, found.has_custom_vjp)
    matvec = _batched_matvec(call, push, ds)
    if ds.method == "probing":
        pattern = found.pattern if found.coupling is None else None
        colors, exact, reps = stochastic.probing_plan(
            pattern,
            call.in_sample,
            num_probes=ds.num_probes,
            probing_distance=ds.probing_distance,
            need_stderr=ds.return_stderr,
        )
        signs = _draw(key, probes, (B, n, reps), "rademacher", call, fname)
        estimate, stderr = est.probing(
            matvec, colors, signs, exact=exact, num_colors=int(colors.max()) + 1
        )
        return y, estimate, stderr, aux
    num = ds.num_probes or stochastic.default_num_probes(ds.method, n)
    k = est.num_random_vectors(ds.method, num, n)
    V = _draw(key, probes, (B, n, k), ds.distribution, call, fname)
    estimate, stderr = est.estimate_trace(ds.method, matvec, V)
    return y, estimate, stderr, aux


def _batched_matvec(
    call: _Call, push: Callable[[jax.Array], jax.Array], ds: _DivSpec
) -> Callable[[jax.Array], jax.Array]:
    """``V (B, n, k) -> W (B, n, k)`` with ``W[b] = J_b V[b]``: one batched pass per column."""
    B, n, shape = call.batch_size, call.n_in, call.in_sample

    def matvec(V: jax.Array) -> jax.Array:
        k = V.shape[-1]
        columns = jnp.moveaxis(V, -1, 0).reshape(k, B, *shape)
        chunk = _chunk(call, k, ds.chunk_size)
        out = _run_passes(lambda i: push(columns[i]), k, chunk)
        return jnp.moveaxis(out.reshape(k, B, n), 0, -1)

    return matvec


def _draw(
    key: jax.Array | None,
    probes: jax.Array | None,
    shape: tuple[int, int, int],
    distribution: str,
    call: _Call,
    fname: str,
) -> jax.Array:
    """Probes ``(B, n, k)``: the caller's (reusable noise) or drawn from ``key``."""
    B, n, k = shape
    if probes is not None:
        probes = jnp.asarray(probes, call.xb.dtype)
        axis = call.spec.batch_axis
        x_shape = stochastic.caller_shape(call.in_sample, B, axis)
        if stochastic.check_probes_shape(probes.shape, x_shape, k, fname=fname):
            probes = probes[None]
        moved = probes[:, None] if axis is None else jnp.moveaxis(probes, axis + 1, 1)
        return jnp.moveaxis(moved.reshape(k, B, n), 0, -1)
    if key is None:
        raise stochastic.missing_randomness(fname, "key=jax.random.key(0)")
    dtype = call.xb.dtype
    if distribution == "rademacher":
        raw = jax.random.rademacher(key, shape, dtype)
    else:
        raw = jax.random.normal(key, shape, dtype)
    return est.normalize_probes(raw, distribution)


def _check_choice(name: str, value: str, options: Sequence[str], fname: str) -> None:
    if value not in options:
        raise ValueError(f"{fname}: {name} must be one of {tuple(options)}; got {value!r}.")


def _divergence_transform(
    f: Callable[..., Any],
    argnums: int,
    batch_axis: int | None,
    has_aux: bool,
    coupling: str,
    ds: _DivSpec,
    fname: str,
) -> Callable[..., Any]:
    """The shared body of :func:`divergence` and :func:`value_and_divergence`."""
    _check_choice("method", ds.method, plan.DIVERGENCE_METHODS, fname)
    _check_choice("distribution", ds.distribution, est.DISTRIBUTIONS, fname)
    checks.check_coupling_option(coupling, fname=fname)
    spec = _Spec(f, argnums, batch_axis, has_aux, coupling, fname)

    def value_and_div(*args: Any, key: jax.Array | None = None, probes: Any = None, **kwargs: Any):
        call = _prepare(spec, args, kwargs)
        if ds.method in plan.STOCHASTIC_METHODS:
            y, div, stderr, aux = _stochastic_divergence(call, ds, key, probes)
        else:
            if probes is not None:
                raise ValueError(
                    f"{fname}: probes= is only used by the stochastic methods "
                    f"{plan.STOCHASTIC_METHODS}; method={ds.method!r} is exact."
                )
            y, div, aux = _exact_divergence(call, ds)
            stderr = jnp.zeros_like(div)
        if call.spec.batch_axis is None:
            div, stderr = div[0], stderr[0]
        result = (div, stderr) if ds.return_stderr else div
        return call.unbatch(y), result, aux

    return value_and_div


def divergence(
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
    """Per-sample divergence (trace of the per-sample Jacobian) of a batched function.

    Args:
        f: batched function ``[B, *shape] -> [B, *shape]`` in argument ``argnums``.
        argnums: position of the differentiated array argument.
        batch_axis: batch axis of that argument and of the output (``None``: single sample).
        method: ``"exact"`` (one batched JVP per input element), ``"sparse"`` (exact, one pass
            per color of a diagonal coloring of the detected pattern), ``"auto"`` (exact: sparse
            when it saves passes, never stochastic), or a stochastic estimate: ``"hutchinson"``,
            ``"hutch++"``, ``"xtrace"``, ``"probing"``.
        num_probes: matvec budget per sample of a stochastic method (default 16; Hutch++ needs
            a multiple of 3, XTrace an even number).
        distribution: probe distribution: ``"rademacher"``, ``"gaussian"`` or ``"sphere"``.
        return_stderr: return ``(divergence, stderr)``; the standard error is 0 for exact
            methods.
        chunk_size: passes computed at once (bounds memory); ``None`` picks from the sizes.
        has_aux: ``f`` returns ``(output, aux)``; the transform returns ``(div, aux)``.
        coupling: ``"raise"`` refuses functions that mix samples; ``"exact"`` computes the
            traces of the true per-sample diagonal blocks (more passes).
        probing_distance: for ``"probing"``, color a distance-limited pattern (Chebyshev
            distance on the per-sample grid) instead of choosing the distance from the budget.

    Returns:
        A function with ``f``'s signature (plus keywords ``key=`` and ``probes=`` for stochastic
        methods) returning the per-sample divergence, shape ``(B,)``.

    Raises:
        NonSquareJacobianError: output and input samples differ in shape.
        BatchCouplingError: ``f`` mixes samples (with ``coupling="raise"``).
        MissingKeyError: a stochastic method was called without ``key`` or ``probes``.
        NumProbesError: ``num_probes`` or ``probes`` do not fit the method.

    Example:
        >>> import jax.numpy as jnp
        >>> from divjac.jax import divergence
        >>> divergence(lambda x: jnp.sin(x))(jnp.zeros((3, 4))).tolist()
        [4.0, 4.0, 4.0]
    """
    ds = _DivSpec(method, num_probes, distribution, return_stderr, chunk_size, probing_distance)
    inner = _divergence_transform(f, argnums, batch_axis, has_aux, coupling, ds, "divergence")

    def div_fn(*args: Any, **kwargs: Any) -> Any:
        _, div, aux = inner(*args, **kwargs)
        return (div, aux) if has_aux else div

    return div_fn


def value_and_divergence(
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
    """``f``'s output and its per-sample divergence from one shared forward computation.

    Takes the arguments of :func:`divergence`. The returned function gives ``(value, div)``
    (``((value, aux), div)`` with ``has_aux``), as ``jax.value_and_grad`` does.

    Example:
        >>> import jax.numpy as jnp
        >>> from divjac.jax import value_and_divergence
        >>> y, div = value_and_divergence(lambda x: 2.0 * x)(jnp.ones((2, 3)))
        >>> y.shape, div.tolist()
        ((2, 3), [6.0, 6.0])
    """
    ds = _DivSpec(method, num_probes, distribution, return_stderr, chunk_size, probing_distance)
    inner = _divergence_transform(
        f, argnums, batch_axis, has_aux, coupling, ds, "value_and_divergence"
    )

    def vd_fn(*args: Any, **kwargs: Any) -> Any:
        y, div, aux = inner(*args, **kwargs)
        return ((y, aux), div) if has_aux else (y, div)

    return vd_fn


def grad_divergence(
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
    diagonal-block trace w.r.t. the whole batch, summed over samples.)

    Example:
        >>> import jax.numpy as jnp
        >>> from divjac.jax import grad_divergence
        >>> grad_divergence(lambda x: x**3)(jnp.ones((2, 3))).tolist()
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """
    div = divergence(
        f,
        argnums,
        batch_axis=batch_axis,
        method=method,
        num_probes=num_probes,
        distribution=distribution,
        chunk_size=chunk_size,
        coupling=coupling,
    )

    def grad_fn(*args: Any, **kwargs: Any) -> jax.Array:
        argnum = checks.normalize_argnum(argnums, len(args), fname="grad_divergence")

        def total(x: jax.Array) -> jax.Array:
            return jnp.sum(div(*args[:argnum], x, *args[argnum + 1 :], **kwargs))

        return jax.grad(total)(args[argnum])

    return grad_fn


def laplacian(
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

    Example:
        >>> import jax.numpy as jnp
        >>> from divjac.jax import laplacian
        >>> laplacian(lambda x: jnp.sum(x**2, axis=1))(jnp.ones((2, 3))).tolist()
        [6.0, 6.0]
    """
    spec = _Spec(u, argnums, batch_axis, False, coupling, "laplacian")

    def gradient(*args: Any, **kwargs: Any) -> jax.Array:
        argnum = checks.normalize_argnum(argnums, len(args), fname="laplacian")
        call = _prepare(spec, args, kwargs)
        if call.n_out != 1:
            raise OutputError(
                f"laplacian: u must return one scalar per sample (output shape (B,) or "
                f"(B, 1)); its per-sample output has shape {call.out_sample}. Use "
                "divergence/jacobian for vector outputs."
            )

        def total(x: jax.Array) -> jax.Array:
            return jnp.sum(u(*args[:argnum], x, *args[argnum + 1 :], **kwargs))

        return jax.grad(total)(args[argnum])

    return divergence(
        gradient,
        argnums,
        batch_axis=batch_axis,
        method=method,
        num_probes=num_probes,
        distribution=distribution,
        return_stderr=return_stderr,
        chunk_size=chunk_size,
        coupling=coupling,
    )


# --- sparsity -----------------------------------------------------------------------------------


def sparsity(
    f: Callable[..., Any],
    /,
    *args: Any,
    argnums: int = 0,
    batch_axis: int | None = 0,
    has_aux: bool = False,
    **kwargs: Any,
) -> SparsityPattern:
    """Detect the per-sample Jacobian sparsity of ``f`` at arguments of these shapes.

    Detection interprets the traced program (values are never used, except constants baked
    into the function), so the pattern holds for every input of these shapes. It never misses a
    true nonzero; operations without a rule are assumed dense (with a warning).

    Returns:
        A :class:`~divjac.SparsityPattern` with the per-sample CSR pattern, colorings and
        ``is_batch_independent`` (a coupled function is reported, not refused).

    Example:
        >>> import jax.numpy as jnp
        >>> from divjac.jax import sparsity
        >>> p = sparsity(lambda x: jnp.cumsum(x, axis=1), jnp.ones((8, 5)))
        >>> p.nnz, p.n_diagonal_colors
        (15, 5)
    """
    spec = _Spec(f, argnums, batch_axis, has_aux, "exact", "sparsity")
    call = _prepare(spec, args, kwargs)
    found = call.detect(per_sample=True)
    assert found is not None and found.pattern is not None
    return found.pattern


def sparse_jacobian(
    f: Callable[..., Any],
    /,
    argnums: int = 0,
    *,
    batch_axis: int | None = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """Per-sample Jacobian as a sparse ``BCOO`` matrix batch of shape ``(B, n_out, n_in)``.

    Only the detected nonzeros are stored, and they are computed with one pass per color of the
    column (or row) coloring: a 64x64 blur with an 11x11 kernel needs about 121 passes instead of
    4096, and no ``H*W x H*W`` dense array is formed.

    Example:
        >>> import jax.numpy as jnp
        >>> from divjac.jax import sparse_jacobian
        >>> J = sparse_jacobian(lambda x: jnp.sin(x))(jnp.zeros((2, 3)))
        >>> J.shape, J.nse
        ((2, 3, 3), 3)
    """
    spec = _Spec(f, argnums, batch_axis, has_aux, "raise", "sparse_jacobian")

    def sparse_fn(*args: Any, **kwargs: Any) -> Any:
        call = _prepare(spec, args, kwargs)
        found = call.detect(per_sample=True)
        assert found is not None and found.pattern is not None
        the_plan = plan.jacobian_plan(
            "sparse", call.n_in, call.n_out, found.pattern, prefer_reverse=found.has_custom_vjp
        )
        compressed, aux = _compressed(call, the_plan, chunk_size)
        rows, cols, values = _decompress(found.pattern, the_plan, compressed)
        indices = jnp.asarray(np.stack([rows, cols], axis=1)[None], dtype=jnp.int32)
        shape = (call.batch_size, call.n_out, call.n_in)
        matrix = jsparse.BCOO((values, indices), shape=shape)
        if call.spec.batch_axis is None:
            matrix = jsparse.BCOO((values[0], indices[0]), shape=(call.n_out, call.n_in))
        return (matrix, aux) if has_aux else matrix

    return sparse_fn
