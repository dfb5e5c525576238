"""What the second-order operators (:mod:`divjac._second`, :mod:`divjac._hessian`) share:
their options, the per-sample gradient, the plan of a call's directions (coupling checked, the
colors of a diagonal coloring of the Hessian pattern), and the directions themselves (the unit
basis, color indicators, random coordinates), pushed through the backend's second-order Taylor
sweep in chunks. Imports neither JAX nor PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._backend import Array, Backend
from ._call import Call, Coupling, Distribution, Spec, check_num_probes, check_option, prepare
from ._core import checks, estimators as est
from ._core.plan import Chunks
from ._divergence import is_probes, probe_count
from ._errors import NumProbesError, OptionError, OutputError
from ._transforms import auto_detects

__all__: list[str] = []


@dataclass(frozen=True)
class Options:
    """The options of a second-order transform."""

    method: str
    num_probes: int | None
    distribution: Distribution
    return_stderr: bool
    chunk_size: int | None


@dataclass(frozen=True)
class _Plan:
    """How a call's directions are chosen, planned ahead of the sweep.

    Attributes:
        coupled: the function mixes samples (``coupling="exact"``): each direction is placed
            in one sample at a time.
        colors: the colors of the Hessian pattern whose indicators are the directions;
            ``None``: dense (the unit basis).
    """

    coupled: bool
    colors: np.ndarray | None


# --- the functions and their calls --------------------------------------------------------------


def _gradient(
    backend: Backend[Any], u: Callable[..., Any], argnum: int, has_aux: bool, fname: str
) -> Any:
    """The per-sample gradient of ``u`` (of the sum of its output components) w.r.t. argument
    ``argnum``: a batched function with ``u``'s signature (``(gradient, aux)`` with ``has_aux``)."""

    def gradient(*args: Any, **kwargs: Any) -> Any:
        at = checks.normalize_argnum(argnum, len(args), fname=fname)

        def values(x: Array) -> Any:
            return u(*args[:at], x, *args[at + 1 :], **kwargs)

        return backend.grad_of_sum(values, args[at], has_aux=has_aux)

    return gradient


def _values(call: Call) -> Callable[[Array], Array]:
    """The call's batch-first function without its aux."""
    if call.has_aux:
        return lambda xb: call.g(xb)[0]
    return call.g


def _aux(call: Call) -> Any:
    """The call's aux (one more forward evaluation), ``None`` without ``has_aux``."""
    return call.g(call.xb)[1] if call.has_aux else None


def require_scalar(call: Call) -> None:
    if math.prod(call.out_sample) != 1:
        raise OutputError(
            f"{call.spec.fname}: u must return one scalar per sample (output shape (B,) or "
            f"(B, 1)); its per-sample output has shape {call.out_sample}. Use laplacian or "
            "weighted_laplacian (per output component), or jacobian, for vector outputs."
        )


def unbatch(call: Call, result: Array, batch_axis: int | None) -> Array:
    """A batch-first result with the layout of ``u``'s output."""
    if batch_axis is None:
        return result[0]
    return call.backend.moveaxis(result, 0, batch_axis % result.ndim)


def _plan(call: Call, method: str, stochastic_method: bool) -> _Plan:
    """Check coupling (raising as ``coupling`` says) and choose the directions: the colors of
    a diagonal coloring of the detected Hessian pattern (same-colored ``i != j`` have
    ``H_ij = H_ji = 0``) for ``"sparse"``, and for ``"auto"`` when they are at most half the
    unit basis."""
    found = call.detect(per_sample=False)
    if found.coupling is not None:
        if stochastic_method:
            raise checks.coupling_error(
                found.coupling, fname=call.spec.fname, method=method, second_order=True
            )
        return _Plan(coupled=True, colors=None)
    if method not in ("sparse", "auto"):
        return _Plan(coupled=False, colors=None)
    missing = call.backend.reverse_less(call)
    if missing and method == "auto":
        return _Plan(
            coupled=False, colors=None
        )  # no per-sample gradient, no Hessian pattern: the unit basis
    if missing:
        raise OptionError(
            f"{call.spec.fname}: method='sparse' colors the Hessian's pattern, found through the "
            f"per-sample gradient, but the function runs {', '.join(sorted(missing))}, which "
            "has no reverse derivative. Use method='exact' (forward Taylor mode), or write the "
            "loop with lax.scan (or lax.fori_loop with static bounds)."
        )
    # The gradient's spec made here: under torch.compile this runs ahead of dynamo's trace,
    # which cannot take the gradient's closure as an argument.
    grad_call = prepare(_grad_spec(call.spec), call.args, call.kwargs)
    if method == "auto" and not auto_detects(grad_call, call.n_in):
        return _Plan(coupled=False, colors=None)  # the colours could not pay for the detection
    hess = grad_call.detect(per_sample=True, auto=method == "auto", dense_passes=call.n_in)
    if hess.coupling is not None or hess.pattern is None:  # too dense to finish (auto)
        return _Plan(coupled=False, colors=None)
    pattern = hess.pattern
    if method == "auto" and 2 * pattern.n_diagonal_colors > call.n_in:
        return _Plan(coupled=False, colors=None)
    return _Plan(coupled=False, colors=np.asarray(pattern.diagonal_colors, np.int64))


def _grad_spec(spec: Spec) -> Spec:
    """The spec of the per-sample gradient of ``spec``'s function (its Hessian's pattern)."""
    backend = spec.backend
    return Spec(
        backend,
        _gradient(backend, spec.fun, spec.argnums, spec.has_aux, spec.fname),
        spec.argnums,
        spec.batch_axis,
        spec.has_aux,
        "exact",  # u's coupling is checked on u itself
        spec.fname,
    )


# --- directions ---------------------------------------------------------------------------------


def _basis(call: Call, colors: np.ndarray | None) -> Array:
    """Shared directions ``[K, 1, *in]``: the unit basis, or the indicators of ``colors``,
    made on the device of the input (from the plan's colors kept there: no host data)."""
    backend, xb = call.backend, call.xb
    if colors is None:
        labels, n_colors = backend.arange(call.n_in, xb), call.n_in
    else:
        labels = backend.on_device(colors, xb)
        n_colors = int(colors.max()) + 1 if colors.size else 0
    matrix = labels[None, :] == backend.arange(n_colors, xb)[:, None]
    return backend.asarray(matrix, like=xb).reshape(n_colors, 1, *call.in_sample)


def _eye(call: Call, n: int) -> Array:
    """The ``(n, n)`` identity, made on the device of the input (no host data)."""
    i = call.backend.arange(n, call.xb)
    return call.backend.asarray(i[:, None] == i[None, :], like=call.xb)


def one_sample_at_a_time(
    call: Call, directions: Array, weights: Array | None
) -> tuple[Array, Array]:
    """Directions ``[B*K, B, *in]`` placing each of ``[K, B or 1, *in]`` in one sample only, and
    the weights ``[B*K, B]`` that keep, in each sample, its own directions' terms (times their
    ``weights``, ``[K]`` or per sample ``[K, B]``): the exact per-sample sums of a function
    that mixes samples."""
    backend, B = call.backend, call.batch_size
    K, n = int(directions.shape[0]), call.n_in
    flat = directions.reshape(K, -1, n)
    eye = _eye(call, B)
    spread = (eye[:, None, :, None] * flat[None]).reshape(B * K, B, *call.in_sample)
    ones = backend.asarray(backend.arange(K, call.xb) >= 0, like=call.xb)
    w = ones if weights is None else weights
    w = w[:, None] if w.ndim == 1 else w  # (K, 1) shared, (K, B) per sample
    return spread, (eye[:, None, :] * w[None]).reshape(B * K, B)


def own_terms(call: Call, terms: Array) -> Array:
    """``[K, B, *out]`` from the per-direction terms ``[B*K, B, *out]`` of
    :func:`one_sample_at_a_time`: each sample's terms of its own directions."""
    B = call.batch_size
    m = math.prod(call.out_sample)
    eye = _eye(call, B)
    own = (terms.reshape(B, -1, B, m) * eye[:, None, :, None]).sum(2)  # (B, K, m)
    return call.backend.moveaxis(own, 0, 1).reshape(-1, B, *call.out_sample)


def _sweep(
    call: Call,
    directions: Array,
    weights: Array | None,
    *,
    collapse: bool,
    chunk_size: int | None,
) -> Array:
    """The second-order terms of the sweep of ``directions`` (summed with ``weights`` when
    ``collapse``), ``chunk_size`` directions at a time."""
    backend = call.backend
    K = int(directions.shape[0])
    # On the host, chunks of directions that stay in the CPU's cache, as first-order passes
    # (Call.chunk): the exact Laplacian of a tanh MLP d = 256 -> 256 -> 256 -> 1 at B = 256,
    # against all 256 directions in one chunk, torch 198-210 -> 153 ms, JAX 119 -> 99 ms.
    chunks = sweep_chunk(call, K, chunk_size)
    chunk = chunks.size
    if K == 0:  # an empty sample: no direction, every second-order term is zero
        passes = () if collapse else (0,)
        zeros = np.zeros((*passes, call.batch_size, *call.out_sample))
        return backend.asarray(zeros, like=call.xb)
    f = _values(call)

    def run(xb: Array, v: Array, w: Array | None) -> Array:
        return backend.second_order_sweep(f, xb, v, weights=w, collapse=collapse, point=call)[2]

    swept = backend.checkpointed(chunks)(run)
    parts = []
    for start in range(0, K, chunk):
        w = None if weights is None else weights[start : start + chunk]
        parts.append(swept(call.xb, directions[start : start + chunk], w))
    if collapse:
        return sum(parts[1:], parts[0])
    return parts[0] if len(parts) == 1 else backend.concatenate(parts)


def sweep_chunk(call: Call, k: int, chunk_size: int | None) -> Chunks:
    """Directions of a second-order sweep run at once (:meth:`Call.chunk`, a pass holding
    the backend's :attr:`~divjac._backend.Backend.sweep_cache_share` of its bytes in cache)."""
    backend = call.backend
    return backend.ahead(Call.chunk, call, k, chunk_size, True, backend.sweep_cache_share)


def mean_and_stderr(call: Call, terms: Array, stderr: bool) -> tuple[Array, Array | None]:
    """Mean over ``k`` of independent terms ``[k, B, *shape]`` and its standard error."""
    k = int(terms.shape[0])
    if stderr and k < 2:
        raise NumProbesError(
            f"{call.spec.fname}: return_stderr=True needs at least 2 probes (the spread of "
            "their terms is the error bar); pass num_probes=2 or more."
        )
    shape = tuple(terms.shape[1:])
    mean, err = est.hutchinson_from_terms(terms.reshape(k, -1), stderr=stderr)
    return mean.reshape(shape), None if err is None else err.reshape(shape)


def _num_probes(call: Call, opts: Options, randomness: Any) -> int:
    return probe_count(call, opts.num_probes, randomness)


def sampled(call: Call, opts: Options, randomness: Any, exact_directions: int) -> int | None:
    """Hutchinson's probes per sample, ``None`` where a budget of ``exact_directions`` or
    more pays for the exact sum (no error), as the divergence's: the budget is the caller's
    probes' count when ``num_probes`` is not given."""
    k = _num_probes(call, opts, randomness)
    return None if k >= exact_directions else k


def coordinates(call: Call, randomness: Any, k: int) -> Array:
    """``k`` distinct random unit directions per sample, ``[k, B, *in]`` (STDE's jets)."""
    backend, B, n = call.backend, call.batch_size, call.n_in
    if is_probes(backend, randomness):
        raise NumProbesError(
            f"{call.spec.fname}: method='stde' samples coordinates itself; pass a source of "
            f"randomness ({backend.randomness_example}) rather than probes."
        )
    order = backend.draw(randomness, (B, n), "gaussian", like=call.xb).argsort(-1)[:, :k]
    chosen = order[..., None] == backend.arange(n, call.xb)  # (B, k, n)
    unit = backend.asarray(chosen, like=call.xb)
    return backend.moveaxis(unit, 1, 0).reshape(k, B, *call.in_sample)


def checked_stderr_budget(call: Call, k: int, least: int = 2) -> None:
    if k < least:
        raise NumProbesError(
            f"{call.spec.fname}: return_stderr=True needs at least {least} probes below n "
            f"(the error bar is estimated from them); pass num_probes={least} or more."
        )


def check_options(opts: Options, coupling: Coupling, methods: Any, fname: str) -> None:
    check_option("method", opts.method, methods, fname=fname)
    check_option("distribution", opts.distribution, Distribution, fname=fname)
    check_option("coupling", coupling, Coupling, fname=fname)
    check_num_probes(opts.num_probes, fname=fname)


def weighted_sum(weights: Array, terms: Array) -> Array:
    """``sum_k weights[k] terms[k]``: weights ``[K]`` or ``[K, B]``, terms ``[K, B, *out]``."""
    w = weights if weights.ndim == 2 else weights[:, None]
    return (w.reshape(*w.shape, *(1,) * (terms.ndim - 2)) * terms).sum(0)


def powers(
    call: Call, order: int, directions: Array, weights: Array | None, chunk_size: int | None
) -> Array:
    """``(v . grad)^order u`` for ``order`` 3 or 4 (the operators' higher orders, the
    Hutchinson bi-Laplacian's terms): each term ``[K, B, *out]`` with
    ``weights=None``, else ``sum_k w_k (v_k . grad)^order u`` ``[B, *out]``. One collapsed
    Taylor sweep of that order where the backend has one, else the first- or second-order
    term of the second-order sweep, along ``v``, of the second-order sweep along ``v``."""
    backend, f, traced = call.backend, _values(call), call.traced
    chunk = sweep_chunk(call, int(directions.shape[0]), chunk_size).size
    swept = backend.taylor_sweep(f, call.xb, directions, order, weights=weights, chunk=chunk)
    if swept is not None:
        return swept

    def power(v: Array) -> Array:
        def second(xb: Array) -> Array:
            return backend.second_order_sweep(
                f, xb, v[None], weights=None, collapse=True, traced=traced
            )[2]

        swept = backend.second_order_sweep(second, call.xb, v[None], weights=None, collapse=False)
        return swept[order - 2][0]

    terms = backend.map_stacked(power, directions, chunk)
    return terms if weights is None else weighted_sum(weights, terms)
