"""The per-sample Hessian and its diagonal of a scalar-per-sample function, written once over a
backend: Jacobian passes of the per-sample gradient (forward-over-reverse), one per color of
the detected Hessian pattern for ``"sparse"``; the diagonal from Hessian-vector products
(Hutchinson's estimator, Bekas et al. 2007, or the indicators of a diagonal coloring) or from
the second-order sweep of the unit basis. Imports neither JAX nor PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _transforms as T
from ._backend import Array, Backend
from ._call import Call, Coupling, DiagonalMethod, Distribution, Mode, Spec, check_option, prepare
from ._core import estimators as est
from ._core.plan import Chunks
from ._divergence import draw, itself, split_randomness
from ._second_order_sweep import (
    Options,
    _aux,
    _basis,
    _grad_spec,
    _gradient,
    _plan,
    _sweep,
    check_options,
    checked_stderr_budget,
    one_sample_at_a_time,
    own_terms,
    require_scalar,
    sampled,
)
from ._transforms import per_argnum, shaped, tuple_of

__all__ = ["hessian", "hessian_diagonal"]


def hessian(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    mode: Mode,
    chunk_size: int | None,
    has_aux: bool,
) -> Callable[..., Any]:
    """Per-sample Hessians of a scalar-per-sample function (see ``divjac.jax.hessian``): the
    per-sample Jacobian of its per-sample gradient (forward-over-reverse; ``"sparse"``: one
    pass per color of the detected Hessian pattern)."""
    fname = "hessian"
    check_option("mode", mode, Mode, fname=fname)

    def one(argnum: int) -> Callable[..., Any]:
        spec = Spec(backend, u, argnum, batch_axis, has_aux, "raise", fname)
        gradient = _gradient(backend, u, argnum, has_aux, fname)
        jac = T.jacobian(
            backend,
            gradient,
            argnum,
            batch_axis=batch_axis,
            mode=mode,
            chunk_size=chunk_size,
            has_aux=has_aux,
            coupling="exact",  # u's coupling is checked on u itself
            fname=fname,
        )

        def hess_fn(*args: Any, **kwargs: Any) -> Any:
            backend.ahead(_checked_scalar, prepare(spec, args, kwargs))
            return jac(*args, **kwargs)

        return hess_fn

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)


def _checked_scalar(call: Call) -> None:
    """Refuse a function that mixes samples (the per-sample gradient would not see it: a sum
    over samples of terms each in one sample is per-sample again) or has vector outputs."""
    call.detect(per_sample=False)
    require_scalar(call)


def hessian_diagonal(
    backend: Backend[Any],
    u: Callable[..., Any],
    argnums: int | Sequence[int],
    *,
    batch_axis: int | None,
    method: DiagonalMethod,
    num_probes: int | None,
    distribution: Distribution,
    return_stderr: bool,
    chunk_size: int | None,
    has_aux: bool,
    coupling: Coupling,
) -> Callable[..., Any]:
    """The diagonal of the per-sample Hessians of a scalar-per-sample function, shaped as the
    input (see ``divjac.jax.hessian_diagonal``)."""
    fname = "hessian_diagonal"
    opts = Options(method, num_probes, distribution, return_stderr, chunk_size)
    check_options(opts, coupling, DiagonalMethod, fname)

    def one(argnum: int) -> Callable[..., Any]:
        spec = Spec(backend, u, argnum, batch_axis, has_aux, coupling, fname)
        grad_spec = _grad_spec(spec)
        hutchinson = method == "hutchinson"

        def diag_fn(*args: Any, **kwargs: Any) -> Any:
            randomness, args = split_randomness(backend, args, fname, stochastic_method=hutchinson)
            call = prepare(spec, args, kwargs)
            diag, err = _diagonal_values(
                call, opts, randomness[0] if randomness else None, grad_spec
            )
            diag = call.unbatch(diag)
            out = (diag, call.unbatch(err)) if return_stderr else diag
            return (out, _aux(call)) if has_aux else out

        return diag_fn

    return per_argnum(argnums, one, tuple_of(has_aux), fname=fname)


def _diagonal_values(
    call: Call, opts: Options, randomness: Any, grad_spec: Spec
) -> tuple[Array, Array | None]:
    """``(diagonal, stderr or None)``, batch first ``(B, *in)``."""
    backend, B, n = call.backend, call.batch_size, call.n_in
    hutchinson = opts.method == "hutchinson"
    planned = backend.ahead(_plan, call, opts.method, hutchinson)
    backend.ahead(require_scalar, call)
    # Bekas, Kokiopoulou & Saad: E[v * H v] = diag(H) when E[v v^T] = I; a budget of n
    # probes or more pays for the exact diagonal (n directions, no error).
    k = sampled(call, opts, randomness, n) if hutchinson else None
    if k is not None:
        probes = draw(call, randomness, k, opts.distribution)
        how = backend.ahead(gradient_passes, call, k, opts.chunk_size)
        images = own_products(
            call, grad_spec, probes, itself, how, shared=False, times_tangent=False
        )
        v = probes.reshape(k, B, n)
        if not opts.return_stderr:
            return (v * images).mean(0).reshape(B, *call.in_sample), None
        # Two probes leave the bound itself too noisy (coverage 0.93, docs/calibration.md).
        checked_stderr_budget(call, k, least=3)
        v, hv = (backend.moveaxis(a, 0, -1) for a in (v, images))
        mean, err = est.diagonal_mean_and_stderr(v, hv, est.namespace(v))
        return mean.reshape(B, *call.in_sample), _shaped(call, err)
    colored = backend.ahead(_colored, call, opts.method, hutchinson, opts.chunk_size)
    if colored is not None:
        inputs, indicator, how = colored
        seed = shaped(indicator, call.in_sample)
        # Diagonal colors: H_ij = 0 for i != j of one color, so (H v_c)_i = H_ii for i in c.
        passes = own_products(call, grad_spec, inputs, seed, how, shared=True)
        diag = passes.sum(0).reshape(B, *call.in_sample)
        return diag, (backend.zeros_like(diag) if opts.return_stderr else None)
    directions = _basis(call, None)
    if planned.coupled:
        spread, _ = one_sample_at_a_time(call, directions, None)
        terms = own_terms(
            call, _sweep(call, spread, None, collapse=False, chunk_size=opts.chunk_size)
        )
    else:
        terms = _sweep(
            call, directions, None, collapse=False, chunk_size=opts.chunk_size
        )  # (n, B, *out)
    diag = backend.moveaxis(terms.reshape(n, B), 0, 1).reshape(B, *call.in_sample)
    return diag, (backend.zeros_like(diag) if opts.return_stderr else None)


def _colored(
    call: Call, method: str, hutchinson: bool, chunk_size: int | None
) -> tuple[Array, Callable[[Array], Array], tuple[bool, Chunks]] | None:
    """The seeds of the Hessian-vector products of the exact diagonal (the inputs and
    indicator of :meth:`~divjac._backend.Backend.indicators`), one per diagonal colour, or
    one per element where the sweep cannot push forward derivatives, and how they run
    (:func:`gradient_passes`); ``None`` where the diagonal comes from the sweep. A setup
    (under ``torch.compile``, evaluated ahead of dynamo's trace, which cannot key the seeds'
    cache on the colours' ``id``)."""
    planned = call.backend.ahead(_plan, call, method, hutchinson)
    colors, n = planned.colors, call.n_in
    # The sweep pushes forward derivatives: where an operation lacks them, Hessian rows.
    sweep = colors is None and not planned.coupled
    if sweep and n and not call.columns_possible("auto"):
        colors = np.arange(n)
    if colors is None:
        return None
    n_colors = int(colors.max()) + 1
    inputs, indicator = call.backend.indicators(colors, n, n_colors, call.xb)
    return inputs, indicator, gradient_passes(call, n_colors, chunk_size)


def own_products(
    call: Call,
    grad_spec: Spec,
    inputs: Array,
    seed: Callable[[Array], Array],
    how: tuple[bool, Chunks],
    *,
    shared: bool,
    times_tangent: bool = True,
) -> Array:
    """``v * H v`` ``(k, B, n)`` for the tangents ``v`` of the passes (``H v`` without
    ``times_tangent``): Hessian-vector products, JVPs of the per-sample gradient
    (forward-over-reverse), or its VJPs (``v^T H``, the same by symmetry) where the backend
    says so, ``how`` (from :func:`gradient_passes`) with how many at once."""
    backend, B, n = call.backend, call.batch_size, call.n_in
    grad_call = prepare(grad_spec, call.args, call.kwargs)
    pulls_rows, chunk = how
    linear = backend.linearize(grad_call, reverse=pulls_rows)

    def own(c: Array, t: Array, pushed: Array) -> Array:
        return (pushed * t if times_tangent else pushed).reshape(B, n)

    return linear.passes(inputs, seed, own, chunk, shared=shared)


def gradient_passes(call: Call, n_passes: int, chunk_size: int | None) -> tuple[bool, Chunks]:
    """Whether the Hessian-vector products of ``call``'s function are pulled (see
    :meth:`~divjac._backend.Backend.pull_hessian_rows`), and how many run at once (chunked
    in the CPU's cache on the host, as first-order passes). A setup:
    under ``torch.compile`` evaluated ahead of dynamo's trace, which can read neither the
    trace's weak references to what the function captures nor the gradient's closure as an
    argument."""
    grad_call = prepare(_grad_spec(call.spec), call.args, call.kwargs)
    return call.backend.pull_hessian_rows(grad_call), grad_call.chunk(n_passes, chunk_size)


def _shaped(call: Call, err: Array | None) -> Array | None:
    return None if err is None else err.reshape(call.batch_size, *call.in_sample)
