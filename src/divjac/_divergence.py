"""Per-sample divergences and their gradients, written once over a backend.

The divergence ``tr J_b`` of a batch-independent function is read from batched passes whose
tangents are the indicators of one (diagonal) color in every sample: exact with one pass per
input element (``"exact"``) or per color of a diagonal coloring of the detected pattern
(``"sparse"``), or estimated from random probes (:mod:`divjac._core.estimators`). The gradient of
the divergence is built on it (and the Laplacian's estimators from Hessian-vector products,
:mod:`divjac._second`). Imports neither JAX nor PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._backend import Array, Backend, Finish, Linear
from ._call import (
    Call,
    Coupling,
    Direction,
    Distribution,
    Method,
    Spec,
    check_differentiable,
    check_num_probes,
    check_option,
    prepare,
)
from ._core import checks, estimators as est, plan, stochastic, timing
from ._core.detection import AUTO_DETECTION_ENTRIES
from ._core.pattern import SparsityPattern
from ._errors import NumProbesError
from ._transforms import Seeds, auto_detects, check_pattern, per_argnum, seeds, shaped, tuple_of

__all__ = [
    "divergence",
    "divergence_from_pattern",
    "grad_divergence",
    "value_and_divergence",
]


def _pushed(c: Array, t: Array, pushed: Array) -> Array:
    return pushed


def itself(seed: Array) -> Array:
    """The seed of a pass whose input is its seed (stacked probes)."""
    return seed


@dataclass(frozen=True)
class DivSpec:
    """The options of a divergence transform; ``pattern``: a given one (no detection)."""

    method: Method
    mode: Direction
    num_probes: int | None
    distribution: Distribution
    return_stderr: bool
    chunk_size: int | None
    probing_distance: int | None
    pattern: SparsityPattern | None = None


def _exact_divergence(call: Call, ds: DivSpec) -> tuple[Array, Array, Any]:
    """Exact per-sample divergence: (batch-first value, divergence (B,), aux)."""
    checks.check_square(call.in_sample, call.out_sample, fname=call.spec.fname)
    planned = call.backend.ahead(_exact_plan, call, ds)
    backend, B = call.backend, call.batch_size
    seed = shaped(
        planned.seeds.indicator, call.in_sample if planned.batched else (B, *call.in_sample)
    )
    linear = backend.linearize(call, reverse=planned.seeds.reverse)
    contributions = linear.passes(
        planned.seeds.inputs, seed, planned.finish, planned.seeds.chunk, shared=planned.batched
    )
    return linear.value, contributions.sum(0), linear.aux


@dataclass(frozen=True)
class _Diagonal:
    """The passes of an exact divergence, planned ahead of them.

    Attributes:
        seeds: their seeds.
        finish: what a pass keeps: per sample, the pushed entries of its own elements summed.
        batched: the seeds are one sample's, shared by all; otherwise they span the whole
            batch (the diagonal blocks of a coupled function).
    """

    seeds: Seeds
    finish: Finish
    batched: bool


def _exact_plan(call: Call, ds: DivSpec) -> _Diagonal:
    B, n = call.batch_size, call.n_in
    batched = True
    if ds.pattern is not None:
        check_pattern(call, ds.pattern)
        reverse = call.prefer_reverse(None, measure=True)
        with timing.stage("coloring"):
            the_plan = plan.divergence_plan("sparse", n, ds.pattern, prefer_reverse=reverse)
    else:
        per_sample = ds.method == "sparse" or (ds.method == "auto" and auto_detects(call, n))
        found = call.detect(per_sample=per_sample, auto=ds.method == "auto", dense_passes=n)
        reverse = call.prefer_reverse(found, measure=True)
        if found.coupling is None:
            with timing.stage("coloring"):
                the_plan = plan.divergence_plan(ds.method, n, found.pattern, prefer_reverse=reverse)
        else:
            whole = None  # dense, or past the memory budget (one pass per sample and element)
            if per_sample:
                with timing.stage("detection"):
                    whole = call.traced.detect(
                        per_sample=True, whole_batch=True, max_entries=AUTO_DETECTION_ENTRIES
                    )
            pattern = whole.pattern if whole is not None else None
            with timing.stage("coloring"):
                the_plan = plan.divergence_plan(
                    "exact" if pattern is None else ds.method,
                    B * n,
                    pattern,
                    prefer_reverse=reverse,
                )
            batched = False
    n_seed = n if batched else B * n
    finish = call.backend.diagonal_sums(the_plan.colors, n_seed, B, batched)
    return _Diagonal(seeds(call, the_plan, n_seed, ds.chunk_size), finish, batched)


def _stochastic_divergence(
    call: Call, ds: DivSpec, randomness: Any
) -> tuple[Array, Array, Array | None, Any]:
    """(batch-first value, estimate (B,), stderr (B,) or ``None`` when not asked for, aux) of a
    stochastic method."""
    checks.check_square(call.in_sample, call.out_sample, fname=call.spec.fname)
    backend, B, n = call.backend, call.batch_size, call.n_in
    reverse, probing = backend.ahead(_stochastic_plan, call, ds)
    linear = backend.linearize(call, reverse=reverse)
    if probing is not None:
        matvec = _batched_matvec(call, linear, ds.chunk_size)
        colors, exact, reps = probing
        signs = backend.moveaxis(
            draw(call, randomness, reps, "rademacher").reshape(reps, B, n), 0, -1
        )
        estimate, stderr = est.probing(
            matvec,
            backend.on_device(colors, call.xb),
            signs,
            exact=exact,
            num_colors=int(colors.max()) + 1,
        )
    else:
        num = ds.num_probes or _caller_budget(call, randomness, ds.method)
        num = num or stochastic.default_num_probes(ds.method, n)
        k = est.num_random_vectors(ds.method, num, n)
        if ds.return_stderr:
            est.check_stderr_budget(ds.method, num, n, fname=call.spec.fname)
        columns = draw(call, randomness, k, ds.distribution)
        if ds.method == "hutchinson" and k < n and not ds.return_stderr:
            # Only the terms: the standard error needs the images J v (est.hutchinson).
            terms = _probe_terms(call, linear, columns, ds.chunk_size)
            estimate, stderr = est.hutchinson_from_terms(terms, stderr=ds.return_stderr)
        else:
            V = backend.moveaxis(columns.reshape(k, B, n), 0, -1)
            matvec = _batched_matvec(call, linear, ds.chunk_size)
            estimate, stderr = est.estimate_trace(ds.method, matvec, V)
    return linear.value, estimate, stderr, linear.aux


def _stochastic_plan(call: Call, ds: DivSpec) -> tuple[bool, tuple[np.ndarray, bool, int] | None]:
    """Whether a stochastic method's passes pull rows, and the plan of ``"probing"`` (its
    colors, which of them are exact, and how many probes per color)."""
    found = call.detect(per_sample=ds.method == "probing", auto=True)
    if found.coupling is not None and ds.method in ("hutch++", "xtrace"):  # coupling="exact"
        raise checks.coupling_error(
            found.coupling, fname=call.spec.fname, fallbacks=found.fallbacks, method=ds.method
        )
    # Rows or columns, as the exact method would choose: every estimator estimates the trace
    # of J^T (pushed rows) as well as that of J.
    reverse = call.prefer_reverse(found)
    if ds.method != "probing":
        return reverse, None
    probing = stochastic.probing_plan(
        found.pattern if found.coupling is None else None,
        call.in_sample,
        num_probes=ds.num_probes,
        probing_distance=ds.probing_distance,
        need_stderr=ds.return_stderr,
    )
    colors, exact, reps = probing
    if ds.return_stderr and not exact and reps < 2:
        # One repetition is one term per color: no error bar holds (check_stderr_budget).
        num = int(colors.max()) + 1
        raise NumProbesError(
            f"{call.spec.fname}: return_stderr=True with method='probing' needs two repetitions "
            f"of its {num} colors, num_probes >= {2 * num}; got num_probes="
            f"{ds.num_probes or stochastic.DEFAULT_NUM_PROBES['probing']}, one repetition, too "
            "few for a trustworthy error bar. Pass more probes, a smaller probing_distance, or "
            "return_stderr=False."
        )
    return reverse, probing


def _probe_terms(call: Call, linear: Linear, columns: Array, chunk_size: int | None) -> Array:
    """Hutchinson's terms ``v^T J_b v`` ``(k, B)`` of the probes ``columns`` ``(k, B, *in)``,
    each from one batched pass, in the layout of the passes (as hand-written code does)."""
    k = int(columns.shape[0])
    sample_axes = tuple(range(1, 1 + len(call.in_sample)))

    def dot(c: Array, t: Array, pushed: Array) -> Array:
        return (pushed * t).sum(sample_axes)

    return linear.passes(
        columns, itself, dot, call.backend.ahead(Call.chunk, call, k, chunk_size), shared=False
    )


def _batched_matvec(call: Call, linear: Linear, chunk_size: int | None) -> Callable[[Array], Array]:
    """``V (B, n, k) -> W (B, n, k)`` with ``W[b] = J_b V[b]``: one batched pass per column."""
    backend = call.backend
    B, n, shape = call.batch_size, call.n_in, call.in_sample

    def matvec(V: Array) -> Array:
        k = V.shape[-1]
        columns = backend.moveaxis(V, -1, 0).reshape(k, B, *shape)
        out = linear.passes(
            columns,
            itself,
            _pushed,
            call.backend.ahead(Call.chunk, call, k, chunk_size),
            shared=False,
        )
        return backend.moveaxis(out.reshape(k, B, n), 0, -1)

    return matvec


def is_probes(backend: Backend, randomness: Any) -> bool:
    """Whether the randomness argument is the caller's own probes (a floating array)."""
    return backend.is_array(randomness) and backend.is_floating_input(randomness.dtype)


def _check_probes(call: Call, probes: Array, k: int | None, output: bool) -> bool:
    """The one check of the caller's probes, made by every transform that takes them
    (:func:`caller_count`, :func:`draw`): shaped ``(k, *x.shape)`` or ``x.shape`` (one
    probe; ``True``), ``x`` the differentiated input (or with ``output``, the output: reverse
    passes' probes) as the caller passes it. ``k``: the probes needed (``None``: any number).

    Raises:
        NumProbesError: the probes are shaped otherwise (a transposed array is never read as
            ``k`` probes), or are not ``k`` probes.
    """
    sample = call.out_sample if output else call.in_sample
    return stochastic.check_probes_shape(
        tuple(probes.shape),
        stochastic.caller_shape(sample, call.batch_size, call.spec.batch_axis),
        k,
        fname=call.spec.fname,
        shaped_as="f's output (reverse passes)" if output else "the differentiated input",
    )


def caller_count(
    call: Call, randomness: Any, k: int | None = None, *, output: bool = False
) -> int | None:
    """How many probes per sample the caller's own probes hold (one when shaped as a single
    probe), ``None`` for a key or generator; the probes are checked (:func:`_check_probes`)."""
    if not is_probes(call.backend, randomness):
        return None
    return 1 if _check_probes(call, randomness, k, output) else int(randomness.shape[0])


def probe_count(
    call: Call, num_probes: int | None, randomness: Any, *, output: bool = False
) -> int:
    """Hutchinson probes per sample: ``num_probes``, else as many as the caller's probes hold,
    else the default budget (``output``: the probes are shaped as the output). The caller's
    probes are checked (:func:`caller_count`) even where ``num_probes`` is given, or where the
    budget pays for the exact answer and the probes themselves are not used."""
    given = caller_count(call, randomness, num_probes, output=output)
    if num_probes is not None:
        return num_probes
    sample = call.out_sample if output else call.in_sample
    return given or stochastic.default_num_probes("hutchinson", math.prod(sample))


def _caller_budget(call: Call, randomness: Any, method: str) -> int | None:
    """The budget ``num_probes`` that the caller's probes pay for (``None`` for a key)."""
    k = caller_count(call, randomness)
    if k is None:
        return None
    if method == "hutch++" and k % 2:
        raise NumProbesError(
            f"{call.spec.fname}: method='hutch++' takes an even number of probes per sample "
            f"(the sketch, then as many Hutchinson probes); got {k}."
        )
    return {"hutchinson": k, "hutch++": 3 * k // 2, "xtrace": 2 * k}[method]


def draw(call: Call, randomness: Any, k: int, distribution: str, *, output: bool = False) -> Array:
    """Probes ``(k, B, *sample)`` (``sample``: the input's, or with ``output`` the output's):
    the caller's (reusable noise) or ``k`` per sample drawn from ``randomness``."""
    backend, B = call.backend, call.batch_size
    shape = call.out_sample if output else call.in_sample
    n = math.prod(shape)
    if is_probes(backend, randomness):
        probes = backend.differentiable(backend.asarray(randomness, like=call.xb))
        axis = call.spec.batch_axis
        if _check_probes(call, probes, k, output):
            probes = probes[None]
        return probes[:, None] if axis is None else backend.moveaxis(probes, axis + 1, 1)
    raw = backend.draw(randomness, (B, n, k), distribution, like=call.xb)
    columns = backend.moveaxis(est.normalize_probes(raw, distribution), -1, 0)
    return columns.reshape(k, B, *shape)


def split_randomness(
    backend: Backend, args: tuple[Any, ...], fname: str, *, stochastic_method: bool
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``((randomness,), f's arguments)`` of a stochastic transform's call, ``((), args)``
    of an exact one.

    The randomness of a stochastic method is the first positional argument of the transformed
    function (a key or generator, or the caller's probes), so that it can never collide with
    ``f``'s own arguments and keywords: every keyword of the call reaches ``f``.
    """
    if not stochastic_method:
        return (), args
    if len(args) < 2 or not (is_probes(backend, args[0]) or backend.is_randomness(args[0])):
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


def divergence_transform(spec: Spec, ds: DivSpec) -> Callable[..., tuple[Array, Any, Any]]:
    """The shared body of the divergence transforms: ``(*args) -> (value, div, aux)``."""
    backend, fname = spec.backend, spec.fname
    stochastic_method = ds.method in plan.STOCHASTIC_METHODS

    def value_and_div(*args: Any, **kwargs: Any) -> tuple[Array, Any, Any]:
        randomness, args = split_randomness(
            backend, args, fname, stochastic_method=stochastic_method
        )
        call = prepare(spec, args, kwargs)
        if randomness and call.n_in:  # an empty sample's divergence is exactly 0
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


def _check_options(ds: DivSpec, coupling: Coupling, fname: str) -> None:
    check_option("method", ds.method, Method, fname=fname)
    check_option("mode", ds.mode, Direction, fname=fname)
    check_option("distribution", ds.distribution, Distribution, fname=fname)
    check_option("coupling", coupling, Coupling, fname=fname)
    check_num_probes(ds.num_probes, fname=fname)


def _divergences(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    batch_axis: int | None,
    has_aux: bool,
    coupling: Coupling,
    ds: DivSpec,
    fname: str,
) -> Callable[..., list[tuple[Array, Any, Any]]]:
    """``(*args) -> [(value, div, aux)]``, one per argument of ``argnums``."""
    _check_options(ds, coupling, fname)

    def one(argnum: int) -> Callable[..., tuple[Array, Any, Any]]:
        spec = Spec(backend, f, argnum, batch_axis, has_aux, coupling, fname, None, ds.mode)
        return divergence_transform(spec, ds)

    transform = per_argnum(argnums, one, list, fname=fname)
    if isinstance(argnums, Sequence):
        return transform
    return lambda *args, **kwargs: [transform(*args, **kwargs)]


def divergence(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    method: Method,
    mode: Direction,
    num_probes: int | None,
    distribution: Distribution,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
    probing_distance: int | None,
) -> Callable[..., Any]:
    """Per-sample divergence of a batched function (see ``divjac.jax.divergence``)."""
    ds = DivSpec(
        method, mode, num_probes, distribution, return_stderr, chunk_size, probing_distance
    )
    results = _divergences(backend, f, argnums, batch_axis, has_aux, coupling, ds, "divergence")
    several = isinstance(argnums, Sequence)

    def div_fn(*args: Any, **kwargs: Any) -> Any:
        found = results(*args, **kwargs)
        divs = tuple(div for _, div, _ in found) if several else found[0][1]
        return (divs, found[0][2]) if has_aux else divs

    return div_fn


def value_and_divergence(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    method: Method,
    mode: Direction,
    num_probes: int | None,
    distribution: Distribution,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
    probing_distance: int | None,
) -> Callable[..., Any]:
    """``f``'s output and its per-sample divergence (see ``divjac.jax.value_and_divergence``)."""
    ds = DivSpec(
        method, mode, num_probes, distribution, return_stderr, chunk_size, probing_distance
    )
    fname = "value_and_divergence"
    results = _divergences(backend, f, argnums, batch_axis, has_aux, coupling, ds, fname)
    several = isinstance(argnums, Sequence)

    def value_and_div_fn(*args: Any, **kwargs: Any) -> Any:
        found = results(*args, **kwargs)
        value, _, aux = found[0]
        divs = tuple(div for _, div, _ in found) if several else found[0][1]
        return ((value, aux), divs) if has_aux else (value, divs)

    return value_and_div_fn


def divergence_from_pattern(
    backend: Backend[Any],
    f: Callable[..., Any],
    pattern: SparsityPattern,
    argnums: int,
    *,
    batch_axis: int | None,
    chunk_size: int | None,
    has_aux: bool,
) -> Callable[..., Any]:
    """Exact per-sample divergence from a given pattern: one pass per diagonal color, no
    detection (see ``divjac.jax.divergence_from_pattern``)."""
    ds = DivSpec(
        "sparse",
        "auto",
        None,
        "rademacher",
        return_stderr=False,
        chunk_size=chunk_size,
        probing_distance=None,
        pattern=pattern,
    )
    fname = "divergence_from_pattern"
    spec = Spec(backend, f, argnums, batch_axis, has_aux, "raise", fname, None, ds.mode)
    inner = divergence_transform(spec, ds)

    def div_fn(*args: Any, **kwargs: Any) -> Any:
        _, div, aux = inner(*args, **kwargs)
        return (div, aux) if has_aux else div

    return div_fn


def grad_divergence(
    backend: Backend[Any],
    f: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    method: Method,
    mode: Direction,
    num_probes: int | None,
    distribution: Distribution,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
    probing_distance: int | None,
) -> Callable[..., Any]:
    """Per-sample gradient of the divergence w.r.t. the input (see
    ``divjac.jax.grad_divergence``).

    For a batch-independent ``f``, ``div_b`` depends only on ``x_b``, so the gradient of
    ``sum_b div_b`` holds every per-sample gradient at once: exact, not scaled by ``1/B``, with
    no ``B^2`` work.
    """
    fname = "grad_divergence"
    ds = DivSpec(
        method,
        mode,
        num_probes,
        distribution,
        return_stderr=False,
        chunk_size=chunk_size,
        probing_distance=probing_distance,
    )
    _check_options(ds, coupling, fname)
    stochastic_method = method in plan.STOCHASTIC_METHODS

    def one(argnum: int) -> Callable[..., Any]:
        spec = Spec(backend, f, argnum, batch_axis, has_aux, coupling, fname, None, ds.mode)
        inner = divergence_transform(spec, ds)

        def grad_fn(*args: Any, **kwargs: Any) -> Any:
            randomness, args = split_randomness(
                backend, args, fname, stochastic_method=stochastic_method
            )
            at = checks.normalize_argnum(argnum, len(args), fname=fname)
            check_differentiable(backend, args[at], argnum, at, fname)

            def divergences(x: Array) -> Any:
                _, div, aux = inner(*randomness, *args[:at], x, *args[at + 1 :], **kwargs)
                return (div, aux) if has_aux else div

            return backend.grad_of_sum(divergences, args[at], has_aux=has_aux)

        return grad_fn

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)
