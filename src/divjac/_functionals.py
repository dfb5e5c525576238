"""Jacobian functionals beyond the trace: squared Frobenius norms and log-determinants.

Written once over a backend, with the passes of the divergence (:mod:`divjac._divergence`) and
the Jacobian (:mod:`divjac._transforms`); only what a pass keeps (its finish) differs:

* ``||J_b||_F^2`` exactly: the columns of one color of a column coloring share no nonzero row,
  so ``sum_c ||J s_c||^2 = ||J||_F^2`` (rows likewise): one pass per color (``"sparse"``) or
  per element (``"exact"``). Coloring ``P + I`` instead of ``P`` makes each pass also read the
  diagonal entries of its own elements, so the same passes give the divergence.
* ``||J_b||_F^2`` by Hutchinson: ``E ||v^T J||^2 = ||J||_F^2`` for ``E[v v^T] = I`` (VJPs,
  ``mode="rev"`` and ``"auto"``), or ``E ||J v||^2`` (JVPs, ``mode="fwd"``): one definition per
  mode, never chosen by sizes, so that the same probes give the same value in every framework;
  the same pass gives ``v^T J v`` (RNODE's regularizer: Finlay et al. 2020, "How to train your
  neural ODE", one VJP per probe).
* ``log|det J_b|``: the LU of the per-sample Jacobians (``"exact"``), or stochastic Lanczos
  quadrature on ``J^T J`` (``"slq"``, :mod:`divjac._core.estimators.ubaru2017slq`), one JVP
  and one VJP per Lanczos step.

Imports neither JAX nor PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import _transforms as T
from ._backend import Array, Backend
from ._call import (
    Call,
    Direction,
    Distribution,
    FrobeniusMethod,
    LogDetMethod,
    Spec,
    check_num_probes,
    check_option,
    prepare,
)
from ._core import checks, estimators as est, plan, timing
from ._core.estimators._common import device, namespace
from ._divergence import _pushed, draw, itself, probe_count, split_randomness
from ._errors import ArgnumsError, NumProbesError, OptionError

__all__ = [
    "STOCHASTIC_METHODS",
    "log_abs_det",
    "squared_frobenius_norm",
    "value_divergence_and_frobenius",
]

STOCHASTIC_METHODS = ("hutchinson", "slq")
"""The stochastic methods of the functionals (their functions take randomness first)."""


@dataclass(frozen=True)
class _Options:
    """The options of a functional's transform.

    Attributes:
        with_divergence: the passes also give the divergence (of a square Jacobian).
    """

    method: str
    num_probes: int | None
    distribution: Distribution
    return_stderr: bool
    chunk_size: int | None
    with_divergence: bool = False
    lanczos_steps: int | None = None


# --- squared Frobenius norm (and the divergence) ------------------------------------------------


def _norm_finish(
    batch_size: int, with_divergence: bool, backend: Backend[Any]
) -> Callable[[Array, Array, Array], Array]:
    """The finish of a norm pass: per sample ``(||pushed||^2,)``, or ``(t . pushed,
    ||pushed||^2)`` with the divergence: ``(r, B)``. ``t`` is one sample's seed (shared
    passes) or the whole batch's (probes)."""

    def finish(c: Array, t: Array, pushed: Array) -> Array:
        flat = pushed.reshape(batch_size, -1)
        squares = (flat * flat).sum(-1)
        if not with_divergence:
            return squares[None]
        diagonal = (flat * t.reshape(-1, flat.shape[-1])).sum(-1)  # t: (1, n) or (B, n)
        return backend.stack([diagonal, squares])

    return finish


def _exact_norms(call: Call, options: _Options) -> tuple[Array, Array, Any]:
    """``(value, (r, B) exact results, aux)``: ``[||J_b||_F^2]`` or ``[div_b, ||J_b||_F^2]``."""
    backend = call.backend
    planned = backend.ahead(_exact_plan, call, options)
    seed = T.shaped(planned.indicator, call.out_sample if planned.reverse else call.in_sample)
    linear = backend.linearize(call, reverse=planned.reverse)
    finish = _norm_finish(call.batch_size, options.with_divergence, backend)
    stacked = linear.passes(planned.inputs, seed, finish, planned.chunk, shared=True)
    return linear.value, stacked.sum(0), linear.aux


def _exact_plan(call: Call, options: _Options) -> T.Seeds:
    n_in, n_out = call.n_in, call.n_out
    method = options.method
    per_sample = method == "sparse" or (method == "auto" and T.auto_detects(call, min(n_in, n_out)))
    found = call.detect(per_sample=per_sample, auto=method == "auto", dense_passes=min(n_in, n_out))
    with timing.stage("coloring"):
        the_plan = plan.frobenius_plan(
            method,
            call.spec.direction,
            n_in,
            n_out,
            found.pattern,
            prefer_reverse=call.prefer_reverse(found),
            with_diagonal=options.with_divergence,
        )
    n_seed = n_out if the_plan.reverse else n_in
    return T.seeds(call, the_plan, n_seed, options.chunk_size, indexed=False)


def _stochastic_norms(
    call: Call, options: _Options, randomness: Any
) -> tuple[Array, Array, Array | None, Any]:
    """``(value, (r, B) estimates, (r, B) stderrs or None, aux)`` from Hutchinson probes."""
    backend = call.backend
    reverse = backend.ahead(_hutchinson_rows, call)
    sample = call.out_sample if reverse else call.in_sample
    linear = backend.linearize(call, reverse=reverse)
    k = probe_count(call, options.num_probes, randomness, output=reverse)
    if options.return_stderr and k < 2:
        raise NumProbesError(
            f"{call.spec.fname}: return_stderr=True with method='hutchinson' needs num_probes "
            f">= 2; got {k} probe, and one term has no trustworthy error bar (a probe can miss "
            "the dominant direction of J). Pass more probes, or return_stderr=False."
        )
    n = math.prod(sample)
    exact = k >= n  # the budget pays for the exact answer, as divergence's does
    if exact:
        k, probes = n, _coordinates(call, sample)
    else:
        probes = draw(call, randomness, k, options.distribution, output=reverse)
    chunk = backend.ahead(Call.chunk, call, k, options.chunk_size)
    if exact or not options.return_stderr:
        finish = _norm_finish(call.batch_size, options.with_divergence, backend)
        terms = linear.passes(probes, itself, finish, chunk, shared=False)  # (k, r, B)
        estimates, _ = est.hutchinson_from_terms(terms, stderr=False)
        stderrs = backend.zeros_like(estimates) if options.return_stderr else None
        return linear.value, estimates, stderrs, linear.aux
    # The standard errors need the images of all probes (their cross products).
    B = call.batch_size
    pushed = linear.passes(probes, itself, _pushed, chunk, shared=False)  # (k, B, *image)
    images = backend.moveaxis(pushed.reshape(k, B, -1), 0, -1)  # (B, m, k)
    norm, norm_se = est.squared_norm_mean_and_stderr(images, namespace(images))
    if not options.with_divergence:
        return linear.value, norm[None], norm_se[None], linear.aux
    V = backend.moveaxis(probes.reshape(k, B, -1), 0, -1)
    xp = namespace(images)
    div, div_se = est.mean_and_stderr(est.column_dots(V, images), xp, images, V)
    return linear.value, backend.stack([div, norm]), backend.stack([div_se, norm_se]), linear.aux


def _coordinates(call: Call, sample: tuple[int, ...]) -> Array:
    """The ``n`` coordinate directions scaled to ``sqrt(n)`` (``E[v v^T] = I`` over them, so the
    mean of their terms is the exact trace or squared norm), as probes ``(n, B, *sample)``."""
    xp = namespace(call.xb)
    n = math.prod(sample)
    eye = xp.eye(n, dtype=call.xb.dtype, device=device(call.xb)) * math.sqrt(n)
    return xp.broadcast_to(xp.reshape(eye, (n, 1, *sample)), (n, call.batch_size, *sample))


def _unmixed(call: Call) -> None:
    """Check that samples do not mix (the functionals have no ``coupling`` option)."""
    call.detect(per_sample=False)


def _hutchinson_rows(call: Call) -> bool:
    """Whether Hutchinson's passes of the norms pull rows: ``||v^T J||^2`` from VJPs for
    ``mode="rev"`` and ``"auto"`` (the same definition whatever the sizes, program or
    framework, so that the same probes give the same regularizer), ``||J v||^2`` from JVPs for
    ``mode="fwd"``; checks that samples do not mix."""
    _unmixed(call)
    if call.spec.direction == "fwd":
        call.columns_possible("fwd")  # raises where forward passes cannot go
        return False
    missing = call.backend.reverse_less(call)
    if missing:
        raise OptionError(
            f"{call.spec.fname}: method='hutchinson' estimates ||J||_F^2 by ||v^T J||^2 from "
            f"VJPs (mode={call.spec.direction!r}), but the function runs "
            f"{', '.join(sorted(missing))}, which has no reverse derivative. Pass mode='fwd' "
            "for the estimate ||J v||^2 from JVPs (also unbiased; the same probes give a "
            "different value), or method='exact'."
        )
    return True


def _norms_transform(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnum: int,
    batch_axis: int | None,
    has_aux: bool,
    mode: Direction,
    options: _Options,
    fname: str,
) -> Callable[..., tuple[Array, tuple[Any, ...], Any]]:
    """``(*args) -> (value, results, aux)``, ``results``: per functional the value (or
    ``(value, stderr)`` with ``return_stderr``), unbatched."""
    spec = Spec(backend, f, argnum, batch_axis, has_aux, "raise", fname, None, mode)
    stochastic_method = options.method in STOCHASTIC_METHODS

    def norms(*args: Any, **kwargs: Any) -> tuple[Array, tuple[Any, ...], Any]:
        randomness, args = split_randomness(
            backend, args, fname, stochastic_method=stochastic_method
        )
        call = prepare(spec, args, kwargs)
        if options.with_divergence:
            checks.check_square(call.in_sample, call.out_sample, fname=fname)
        if randomness:
            y, values, stderrs, aux = _stochastic_norms(call, options, randomness[0])
        else:
            y, values, aux = _exact_norms(call, options)
            stderrs = backend.zeros_like(values) if options.return_stderr else None

        def row(a: Array) -> Array:
            return a[0] if call.spec.batch_axis is None else a

        # Rows by iteration (in torch one unbind, not an indexing per row).
        if stderrs is None:
            return call.unbatch(y), tuple(row(v) for v in values), aux
        pairs = zip(values, stderrs, strict=True)
        return call.unbatch(y), tuple((row(v), row(s)) for v, s in pairs), aux

    return norms


def _check(options: _Options, mode: Direction, methods: Any, fname: str) -> None:
    check_option("method", options.method, methods, fname=fname)
    check_option("mode", mode, Direction, fname=fname)
    check_option("distribution", options.distribution, Distribution, fname=fname)
    check_num_probes(options.num_probes, fname=fname)
    steps = options.lanczos_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise NumProbesError(
            f"{fname}: lanczos_steps must be a positive integer (Lanczos steps per probe, at "
            f"most the input sample's size), or None for min(n, 30); got {steps!r}."
        )


def squared_frobenius_norm(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    method: FrobeniusMethod,
    mode: Direction,
    num_probes: int | None,
    distribution: Distribution,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
) -> Callable[..., Any]:
    """Per-sample ``||J_b||_F^2`` (see ``divjac.jax.squared_frobenius_norm``)."""
    fname = "squared_frobenius_norm"
    options = _Options(method, num_probes, distribution, return_stderr, chunk_size)
    _check(options, mode, FrobeniusMethod, fname)

    def one(argnum: int) -> Callable[..., Any]:
        inner = _norms_transform(backend, f, argnum, batch_axis, has_aux, mode, options, fname)

        def norm_fn(*args: Any, **kwargs: Any) -> Any:
            _, (norm,), aux = inner(*args, **kwargs)
            return (norm, aux) if has_aux else norm

        return norm_fn

    return T.per_argnum(argnums, one, T.tuple_of(has_aux), fname=fname)


def value_divergence_and_frobenius(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int,
    *,
    batch_axis: int | None,
    method: FrobeniusMethod,
    mode: Direction,
    num_probes: int | None,
    distribution: Distribution,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
) -> Callable[..., Any]:
    """``f``'s output, its per-sample divergence and ``||J_b||_F^2`` from the same passes (see
    ``divjac.jax.value_divergence_and_frobenius``)."""
    fname = "value_divergence_and_frobenius"
    if not isinstance(argnums, int) or isinstance(argnums, bool):
        raise ArgnumsError(
            f"{fname}: argnums must be one int (the passes are those of one argument); got "
            f"{argnums!r}. Call it once per argument."
        )
    options = _Options(
        method, num_probes, distribution, return_stderr, chunk_size, with_divergence=True
    )
    _check(options, mode, FrobeniusMethod, fname)
    inner = _norms_transform(backend, f, argnums, batch_axis, has_aux, mode, options, fname)

    def all_fn(*args: Any, **kwargs: Any) -> Any:
        value, (div, norm), aux = inner(*args, **kwargs)
        return ((value, aux) if has_aux else value), div, norm

    return all_fn


# --- log|det J| ---------------------------------------------------------------------------------


def _exact_log_abs_det(call: Call, mode: Direction, chunk_size: int | None) -> tuple[Array, Any]:
    """``log|det J_b|`` ``(B,)`` from the per-sample Jacobians, and the aux."""
    flat, aux = T.jacobian_values(call, mode, chunk_size)
    xp = namespace(flat)
    if xp.finfo(flat.dtype).bits < 32:  # (no LU in half precision): in float32, cast back
        return xp.astype(xp.linalg.slogdet(xp.astype(flat, xp.float32))[1], flat.dtype), aux
    return xp.linalg.slogdet(flat)[1], aux


def _forward_less(call: Call) -> tuple[str, ...]:
    """The operations of the call's program without a forward derivative, sorted: a plain
    function and a tuple, which the setup ahead of ``torch.compile``'s trace can take and give
    (not a bound method, nor a set)."""
    return tuple(sorted(call.backend.forward_less(call)))


def _slq_log_abs_det(
    call: Call, options: _Options, randomness: Any
) -> tuple[Array, Array | None, Any]:
    """SLQ's ``(estimate, stderr or None, aux)`` with ``J^T J v`` as one JVP and one VJP."""
    backend, B, n, shape = call.backend, call.batch_size, call.n_in, call.in_sample
    backend.ahead(_unmixed, call)  # samples must not mix
    missing = backend.ahead(_forward_less, call)
    if missing:
        raise OptionError(
            f"{call.spec.fname}: method='slq' multiplies by J^T J, one forward and one reverse "
            f"pass, but the function runs {', '.join(sorted(missing))}, which has no forward "
            "derivative in this framework. Use method='exact' (the per-sample Jacobians by "
            "reverse passes)."
        )
    columns, rows = backend.linearize(call, reverse=False), backend.linearize(call, reverse=True)
    k = probe_count(call, options.num_probes, randomness)
    steps = options.lanczos_steps or est.default_lanczos_steps(n)
    if steps > n:
        raise NumProbesError(
            f"{call.spec.fname}: lanczos_steps={steps} exceeds the input sample's size n = {n} "
            f"(at most n Lanczos steps per probe, where the quadrature is exact); pass "
            f"lanczos_steps <= {n}, or None."
        )
    probes = draw(call, randomness, k, options.distribution)  # (k, B, *in)
    chunk = backend.ahead(Call.chunk, call, k, options.chunk_size)

    def gram(V: Array) -> Array:
        pushed = columns.passes(
            backend.moveaxis(V, -1, 0).reshape(k, B, *shape), itself, _pushed, chunk, shared=False
        )
        pulled = rows.passes(pushed, itself, _pushed, chunk, shared=False)
        return backend.moveaxis(pulled.reshape(k, B, n), 0, -1)

    V = backend.moveaxis(probes.reshape(k, B, n), 0, -1)
    estimate, stderr = est.slq_log_abs_det(
        gram, V, steps, stderr=options.return_stderr, loop=backend.fori_loop
    )
    return estimate, stderr, rows.aux


def log_abs_det(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    method: LogDetMethod,
    mode: Direction,
    num_probes: int | None,
    lanczos_steps: int | None,
    distribution: Distribution,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
) -> Callable[..., Any]:
    """Per-sample ``log|det J_b|`` (see ``divjac.jax.log_abs_det``)."""
    fname = "log_abs_det"
    options = _Options(
        method, num_probes, distribution, return_stderr, chunk_size, lanczos_steps=lanczos_steps
    )
    _check(options, mode, LogDetMethod, fname)
    stochastic_method = method in STOCHASTIC_METHODS

    def one(argnum: int) -> Callable[..., Any]:
        spec = Spec(backend, f, argnum, batch_axis, has_aux, "raise", fname, None, mode)

        def logdet_fn(*args: Any, **kwargs: Any) -> Any:
            randomness, args = split_randomness(
                backend, args, fname, stochastic_method=stochastic_method
            )
            call = prepare(spec, args, kwargs)
            checks.check_square(call.in_sample, call.out_sample, fname=fname)
            if randomness:
                value, stderr, aux = _slq_log_abs_det(call, options, randomness[0])
            else:
                value, aux = _exact_log_abs_det(call, mode, chunk_size)
                stderr = backend.zeros_like(value) if return_stderr else None
            if call.spec.batch_axis is None:
                value = value[0]
                stderr = None if stderr is None else stderr[0]
            result = (value, stderr) if return_stderr else value
            return (result, aux) if has_aux else result

        return logdet_fn

    return T.per_argnum(argnums, one, T.tuple_of(has_aux), fname=fname)
