"""Per-sample Jacobians and divergences of batched PyTorch functions, on ``torch.func``.

Every transform takes a *batched* function ``f`` (a function or an ``nn.Module``): its
differentiated argument and its output carry the batch on ``batch_axis``; other arguments
(``t``, parameters, ...) pass through untouched. Because the samples of a batch-independent
``f`` do not interact, the batched Jacobian is block diagonal and one JVP (or VJP) with the same
tangent in every sample yields that column (or row) of every sample's Jacobian: ``n`` batched
passes, run together under ``torch.func.vmap``, give all per-sample Jacobians, with no
cross-sample work and no ``(B, ..., B, ...)`` array. Independence is checked on the traced ATen
graph, never assumed.

Module parameters are ordinary captured tensors: results stay on the autograd graph, so a loss
built on a divergence backpropagates to them (``loss.backward()``), and everything composes with
``torch.func`` transforms. Device and dtype follow the differentiated input.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from torch.utils import _pytree as pytree

import torch
from torch import nn

from .._core import checks, estimators as est, plan, stochastic
from .._core.detection import AUTO_DETECTION_ENTRIES, LRU, Detection
from .._core.pattern import SparsityPattern
from .._errors import ArgnumsError, OutputError
from ._detect import TensorSpec, Traced, find_modules, quiet_batch_norm, trace

__all__ = [
    "divergence",
    "grad_divergence",
    "jacobian",
    "laplacian",
    "sparse_jacobian",
    "sparsity",
    "value_and_divergence",
]

# Exact methods push rows (VJPs) rather than columns when both cost the same number of passes:
# PyTorch's reverse mode is the faster one (one forward pass, then batched backward passes).
_PREFER_REVERSE = True


# Seed matrices (passes x elements) up to this size are built once and sliced by vmap.
_SEED_MATRIX_ELEMENTS = 1 << 22
# The seeds of recent plans (keyed by the coloring's identity, which the cached pattern keeps).
_SEEDS: LRU[tuple[Any, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = LRU(16)


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
    prefer_reverse: bool = _PREFER_REVERSE


@dataclass
class _Call:
    """One call of a transform: the batch-first function and what detection found."""

    spec: _Spec
    g: Callable[[torch.Tensor], Any]
    xb: torch.Tensor
    traced: Traced
    argnum: int
    modules: list[nn.Module]

    @property
    def batch_size(self) -> int:
        return int(self.xb.shape[0])

    @property
    def in_sample(self) -> tuple[int, ...]:
        return tuple(self.xb.shape[1:])

    @property
    def out_sample(self) -> tuple[int, ...]:
        return self.traced.out.shape[1:]

    @property
    def n_in(self) -> int:
        return math.prod(self.in_sample)

    @property
    def n_out(self) -> int:
        return math.prod(self.out_sample)

    def unbatch(self, yb: torch.Tensor) -> torch.Tensor:
        """A batch-first result back to the caller's layout."""
        return _to_axis(yb, self.spec.batch_axis)

    def bytes_per_pass(self) -> int:
        per_pass = (
            self.xb.numel() + math.prod(self.traced.out.shape) + 2 * self.traced.max_intermediate
        )
        return self.xb.element_size() * per_pass

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


def _prepare(spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
    fname = spec.fname
    argnum = checks.normalize_argnum(spec.argnums, len(args), fname=fname)
    x = args[argnum]
    if not isinstance(x, torch.Tensor):
        raise ArgnumsError(
            f"{fname}: argnums={spec.argnums} selects an argument of type {type(x).__name__}; "
            "divjac differentiates with respect to one tensor. Pass the tensor there (to "
            "differentiate w.r.t. parameters, call .backward() on a loss built on the result)."
        )
    if not x.is_floating_point():
        raise checks.not_floating(x.dtype, argnum=argnum, fname=fname, cast_hint="x.float()")
    axis = checks.normalize_batch_axis(
        spec.batch_axis, tuple(x.shape), what="differentiated input", fname=fname
    )
    leaves, treedef = pytree.tree_flatten((args, kwargs))
    modules = find_modules(spec.fun, leaves)
    traced = trace(
        spec.fun,
        leaves,
        treedef,
        x_leaf=len(pytree.tree_leaves(args[:argnum])),
        batch_axis=axis,
        has_aux=spec.has_aux,
        modules=modules,
    )
    _check_output(spec, traced, tuple(x.shape), axis)
    if axis != spec.batch_axis:
        spec = _Spec(
            spec.fun,
            spec.argnums,
            axis,
            spec.has_aux,
            spec.coupling,
            spec.fname,
            spec.prefer_reverse,
        )
    fun, has_aux = spec.fun, spec.has_aux

    def g(xb: torch.Tensor) -> Any:
        out = fun(*args[:argnum], _to_axis(xb, axis), *args[argnum + 1 :], **kwargs)
        y, aux = out if has_aux else (out, None)
        yb = _from_axis(y, axis)
        return (yb, aux) if has_aux else yb

    xb = _from_axis(x, axis)
    return _Call(spec, g, xb, traced, argnum, modules)


def _from_axis(t: torch.Tensor, axis: int | None) -> torch.Tensor:
    """Batch axis ``axis`` (``None``: no batch) moved first."""
    if axis is None:
        return t[None]
    return t if axis == 0 else torch.movedim(t, axis, 0)


def _to_axis(t: torch.Tensor, axis: int | None) -> torch.Tensor:
    """The leading batch axis moved to ``axis`` (``None``: removed)."""
    if axis is None:
        return t[0]
    return t if axis == 0 else torch.movedim(t, 0, axis)


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
    if not isinstance(out, TensorSpec):
        raise checks.not_an_array(out, what="function's output", fname=fname)
    if not (out.dtype.is_floating_point or out.dtype.is_complex):
        raise OutputError(
            f"{fname}: the function's output has dtype {out.dtype}; derivatives need a real "
            "floating output. Return floats (cast integer or boolean results with .float())."
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

Seed = Callable[[torch.Tensor], torch.Tensor]
Finish = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _passes(
    call: _Call, reverse: bool, inputs: torch.Tensor, seed: Seed, finish: Finish, chunk: int
) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Run one batched JVP (or VJP) per entry of ``inputs``, ``chunk`` at a time under ``vmap``.

    Pass ``c`` (an entry of ``inputs``) pushes ``t = seed(c)`` (shape ``(B, *seed_sample)``)
    through the linearized batched function and keeps ``finish(c, t, pushed)``. Returns the
    batch-first value of the function, its aux and the stacked results of the passes.
    """
    xb = call.xb
    g, aux_of = _split_aux(call.g) if call.spec.has_aux else (call.g, None)
    n_passes = int(inputs.shape[0])
    with quiet_batch_norm(call.modules):
        if reverse:
            pulled: Any = torch.func.vjp(g, xb, has_aux=aux_of is not None)
            y, vjp_fn, aux = pulled if aux_of is not None else (*pulled, None)

            def pull(c: torch.Tensor) -> torch.Tensor:
                ct = seed(c)
                return finish(c, ct, vjp_fn(ct)[0])

            chunk_size = None if chunk >= n_passes else chunk
            stacked = torch.func.vmap(pull, chunk_size=chunk_size)(inputs)
            return y, (aux_of(aux) if aux_of is not None else None), stacked
        auxes: list[Any] = []

        def push(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            t = seed(c)
            result: Any = torch.func.jvp(g, (xb,), (t,), has_aux=aux_of is not None)
            if aux_of is not None:
                auxes.append(result[2])
            return result[0], finish(c, t, result[1])

        # The value is the same in every pass (out_dims None); chunks are run one by one,
        # as vmap's own chunk_size cannot return an unbatched output. Random operations
        # (dropout in training mode) draw once per chunk, shared by its passes.
        pushes = torch.func.vmap(push, out_dims=cast(Any, (None, 0)), randomness="same")
        parts = []
        for lo in range(0, n_passes, chunk):
            y, part = pushes(inputs[lo : lo + chunk])
            parts.append(part)
        aux = aux_of(auxes[0]) if aux_of is not None else None
        return y, aux, torch.cat(parts) if len(parts) > 1 else parts[0]


def _split_aux(
    g: Callable[[torch.Tensor], Any],
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], Any]]:
    """``g`` returning ``(y, tensor leaves of aux)`` (what ``torch.func`` passes through) and
    the function that puts the aux back together with its other leaves (strings, numbers)."""
    box: list[Any] = []

    def tensors_only(xb: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        y, aux = g(xb)
        leaves, treedef = pytree.tree_flatten(aux)
        box[:] = [(leaves, treedef)]
        return y, [a for a in leaves if isinstance(a, torch.Tensor)]

    def rebuild(tensors: list[torch.Tensor]) -> Any:
        leaves, treedef = box[0]
        it = iter(tensors)
        return pytree.tree_unflatten(
            [next(it) if isinstance(a, torch.Tensor) else a for a in leaves], treedef
        )

    return tensors_only, rebuild


def _indicators(
    colors: np.ndarray | None, n: int, n_passes: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The passes' inputs and the flat indicator (length ``n``) of the elements of each one.

    Pass ``c`` takes the elements of color ``c`` (element ``c`` for the dense method,
    ``colors=None``). Small seed matrices are built once and sliced by ``vmap``; larger ones
    are built one row per pass, from the pass index.
    """
    key = (None if colors is None else id(colors), n, n_passes, device, dtype)
    cached = _SEEDS.get(key)
    if cached is not None and cached[0] is colors:
        return cached[1], cached[2]
    labels = np.arange(n) if colors is None else np.asarray(colors, np.int64)
    labels_t = torch.as_tensor(labels, device=device)
    passes = torch.arange(n_passes, device=device)
    if n_passes * n <= _SEED_MATRIX_ELEMENTS:
        inputs = (labels_t[None, :] == passes[:, None]).to(dtype)
        indicator: Callable[[torch.Tensor], torch.Tensor] = _identity
    else:
        inputs, indicator = passes, lambda c: (labels_t == c).to(dtype)
    _SEEDS.put(key, (colors, inputs, indicator))
    return inputs, indicator


def _identity(row: torch.Tensor) -> torch.Tensor:
    return row


def _chunk(call: _Call, n_passes: int, chunk_size: int | None) -> int:
    return plan.choose_chunk_size(n_passes, call.bytes_per_pass(), chunk_size)


# --- jacobian -----------------------------------------------------------------------------------


def _jacobian_values(call: _Call, mode: str, chunk_size: int | None) -> tuple[torch.Tensor, Any]:
    """Per-sample Jacobians ``(B, n_out, n_in)`` and aux."""
    found = call.detect(per_sample=mode in ("sparse", "auto"), auto=mode == "auto")
    if found.coupling is not None:
        n_in, n_out = call.n_in, call.n_out
        cheaper_rev = n_out < n_in or (n_out == n_in and call.spec.prefer_reverse)
        return _coupled_jacobian(call, mode == "rev" or (mode != "fwd" and cheaper_rev), chunk_size)
    the_plan = plan.jacobian_plan(
        mode, call.n_in, call.n_out, found.pattern, prefer_reverse=call.spec.prefer_reverse
    )
    compressed, aux = _compressed(call, the_plan, chunk_size)  # (k, B, n_other)
    if not the_plan.is_sparse:
        order = (1, 0, 2) if the_plan.reverse else (1, 2, 0)
        return compressed.permute(order), aux
    assert found.pattern is not None
    rows, cols, values = _decompress(found.pattern, the_plan, compressed)
    B = call.batch_size
    flat = torch.as_tensor(rows * call.n_in + cols, device=values.device)
    dense = values.new_zeros(B, call.n_out * call.n_in).index_copy(1, flat, values)
    return dense.reshape(B, call.n_out, call.n_in), aux


def _compressed(
    call: _Call, the_plan: plan.Plan, chunk_size: int | None
) -> tuple[torch.Tensor, Any]:
    """The passes of a plan, each ``J_b S_c`` (or ``S_c^T J_b``) flattened to ``(B, n)``."""
    B = call.batch_size
    seed_shape = call.out_sample if the_plan.reverse else call.in_sample
    inputs, indicator = _indicators(
        the_plan.colors, math.prod(seed_shape), the_plan.n_passes, call.xb.device, call.xb.dtype
    )

    def seed(c: torch.Tensor) -> torch.Tensor:
        return indicator(c).reshape(seed_shape).expand(B, *seed_shape)

    def finish(c: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.reshape(B, -1)

    chunk = _chunk(call, the_plan.n_passes, chunk_size)
    _, aux, stacked = _passes(call, the_plan.reverse, inputs, seed, finish, chunk)
    return stacked, aux


def _decompress(
    pattern: SparsityPattern, the_plan: plan.Plan, compressed: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """Rows, columns (row-major order) and per-sample values ``(B, nnz)`` of the nonzeros."""
    coo = pattern.csr.tocoo()
    rows, cols = np.asarray(coo.row, np.int64), np.asarray(coo.col, np.int64)
    order = np.lexsort((cols, rows))
    rows, cols = rows[order], cols[order]
    assert the_plan.colors is not None
    device = compressed.device
    if the_plan.reverse:
        which, within = the_plan.colors[rows], cols
    else:
        which, within = the_plan.colors[cols], rows
    values = compressed[
        torch.as_tensor(which, device=device), :, torch.as_tensor(within, device=device)
    ]
    return rows, cols, values.T


def _coupled_jacobian(
    call: _Call, reverse: bool, chunk_size: int | None
) -> tuple[torch.Tensor, Any]:
    """Exact diagonal blocks of a coupled function: one pass per (sample, element)."""
    B = call.batch_size
    seed_shape, n_seed = (call.out_sample, call.n_out) if reverse else (call.in_sample, call.n_in)
    device, dtype = call.xb.device, call.xb.dtype
    every = torch.arange(B * n_seed, device=device)
    samples = torch.arange(B, device=device)

    def seed(p: torch.Tensor) -> torch.Tensor:
        return (every == p).to(dtype).reshape(B, *seed_shape)

    def finish(p: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        own = (samples == torch.div(p, n_seed, rounding_mode="floor")).to(out.dtype)
        return (out.reshape(B, -1) * own[:, None]).sum(0)

    n_passes = B * n_seed
    chunk = _chunk(call, n_passes, chunk_size)
    _, aux, blocks = _passes(call, reverse, every, seed, finish, chunk)
    blocks = blocks.reshape(B, n_seed, -1)
    return (blocks if reverse else blocks.transpose(1, 2)), aux


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
        f: batched function or ``nn.Module``; argument ``argnums`` and the output carry the
            batch on ``batch_axis``. Other arguments pass through untouched.
        argnums: position of the differentiated tensor argument (a tuple gives a tuple of
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
        >>> import torch
        >>> from divjac.torch import jacobian
        >>> W = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> jacobian(lambda x: x @ W.T)(torch.ones(5, 2)).shape
        torch.Size([5, 2, 2])
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
    checks.check_choice("mode", mode, plan.JACOBIAN_MODES, fname="jacobian")
    checks.check_coupling_option(coupling, fname="jacobian")
    spec = _Spec(f, argnums, batch_axis, has_aux, coupling, "jacobian")

    def jac_fn(*args: Any, **kwargs: Any) -> Any:
        call = _prepare(spec, args, kwargs)
        flat, aux = _jacobian_values(call, mode, chunk_size)
        jac = flat.reshape(call.batch_size, *call.out_sample, *call.in_sample)
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


def _exact_divergence(call: _Call, ds: _DivSpec) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Exact per-sample divergence: (batch-first value, divergence (B,), aux)."""
    checks.check_square(call.in_sample, call.out_sample, fname=call.spec.fname)
    per_sample = ds.method in ("sparse", "auto")
    found = call.detect(per_sample=per_sample, auto=ds.method == "auto")
    reverse = call.spec.prefer_reverse
    B, n = call.batch_size, call.n_in
    if found.coupling is None:
        the_plan = plan.divergence_plan(ds.method, n, found.pattern, prefer_reverse=reverse)
        n_seed, batched = n, True
    else:
        whole = call.traced.detect(per_sample=True, whole_batch=True) if per_sample else None
        pattern = whole.pattern if whole is not None else None
        the_plan = plan.divergence_plan(
            "exact" if pattern is None else ds.method, B * n, pattern, prefer_reverse=reverse
        )
        n_seed, batched = B * n, False
    inputs, indicator = _indicators(
        the_plan.colors, n_seed, the_plan.n_passes, call.xb.device, call.xb.dtype
    )
    shape = (B, *call.in_sample)

    def seed(c: torch.Tensor) -> torch.Tensor:
        t = indicator(c)
        return t.reshape(call.in_sample).expand(shape) if batched else t.reshape(shape)

    def finish(c: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return (out * t).reshape(B, -1).sum(1)

    chunk = _chunk(call, the_plan.n_passes, ds.chunk_size)
    y, aux, contributions = _passes(call, the_plan.reverse, inputs, seed, finish, chunk)
    return y, contributions.sum(0), aux


def _stochastic_divergence(
    call: _Call, ds: _DivSpec, generator: torch.Generator | None, probes: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """(batch-first value, estimate (B,), stderr (B,), aux) of a stochastic method."""
    fname = call.spec.fname
    checks.check_square(call.in_sample, call.out_sample, fname=fname)
    found = call.detect(per_sample=ds.method == "probing", auto=True)
    if found.coupling is not None and ds.method in ("hutch++", "xtrace"):
        raise checks.coupling_error(found.coupling, fname=fname, fallbacks=found.fallbacks)
    B, n = call.batch_size, call.n_in
    results: dict[str, Any] = {}
    matvec = _batched_matvec(call, ds, results)
    if ds.method == "probing":
        pattern = found.pattern if found.coupling is None else None
        colors, exact, reps = stochastic.probing_plan(
            pattern,
            call.in_sample,
            num_probes=ds.num_probes,
            probing_distance=ds.probing_distance,
            need_stderr=ds.return_stderr,
        )
        signs = _draw(generator, probes, (B, n, reps), "rademacher", call, fname)
        estimate, stderr = est.probing(
            matvec, colors, signs, exact=exact, num_colors=int(colors.max()) + 1
        )
    else:
        num = ds.num_probes or stochastic.default_num_probes(ds.method, n)
        k = est.num_random_vectors(ds.method, num, n)
        V = _draw(generator, probes, (B, n, k), ds.distribution, call, fname)
        estimate, stderr = est.estimate_trace(ds.method, matvec, V)
    return results["y"], estimate, stderr, results.get("aux")


def _batched_matvec(
    call: _Call, ds: _DivSpec, results: dict[str, Any]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``V (B, n, k) -> W (B, n, k)`` with ``W[b] = J_b V[b]``: one batched JVP per column.

    The function's value and aux of the first call are kept in ``results``.
    """
    B, n, shape = call.batch_size, call.n_in, call.in_sample

    def matvec(V: torch.Tensor) -> torch.Tensor:
        k = V.shape[-1]
        columns = torch.movedim(V, -1, 0).reshape(k, B, *shape)

        def seed(column: torch.Tensor) -> torch.Tensor:
            return column

        def finish(column: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return out

        chunk = _chunk(call, k, ds.chunk_size)
        y, aux, out = _passes(call, False, columns, seed, finish, chunk)
        results.setdefault("y", y)
        results.setdefault("aux", aux)
        return torch.movedim(out.reshape(k, B, n), 0, -1)

    return matvec


def _draw(
    generator: torch.Generator | None,
    probes: Any,
    shape: tuple[int, int, int],
    distribution: str,
    call: _Call,
    fname: str,
) -> torch.Tensor:
    """Probes ``(B, n, k)``: the caller's (reusable noise) or drawn from ``generator``."""
    B, n, k = shape
    device, dtype = call.xb.device, call.xb.dtype
    if probes is not None:
        probes = torch.as_tensor(probes, dtype=dtype, device=device)
        axis = call.spec.batch_axis
        x_shape = stochastic.caller_shape(call.in_sample, B, axis)
        if stochastic.check_probes_shape(tuple(probes.shape), x_shape, k, fname=fname):
            probes = probes[None]
        moved = probes[:, None] if axis is None else torch.movedim(probes, axis + 1, 1)
        return torch.movedim(moved.reshape(k, B, n), 0, -1)
    if generator is None:
        raise stochastic.missing_randomness(fname, "generator=torch.Generator().manual_seed(0)")
    if distribution == "rademacher":
        bits = torch.randint(0, 2, shape, generator=generator, device=generator.device)
        raw = (2 * bits - 1).to(device=device, dtype=dtype)
    else:
        raw = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype)
        raw = raw.to(device)
    return est.normalize_probes(raw, distribution)


def _divergence_transform(
    f: Callable[..., Any],
    argnums: int,
    batch_axis: int | None,
    has_aux: bool,
    coupling: str,
    ds: _DivSpec,
    fname: str,
    prefer_reverse: bool = _PREFER_REVERSE,
) -> Callable[..., Any]:
    """The shared body of :func:`divergence` and :func:`value_and_divergence`."""
    checks.check_choice("method", ds.method, plan.DIVERGENCE_METHODS, fname=fname)
    checks.check_choice("distribution", ds.distribution, est.DISTRIBUTIONS, fname=fname)
    checks.check_coupling_option(coupling, fname=fname)
    spec = _Spec(f, argnums, batch_axis, has_aux, coupling, fname, prefer_reverse)

    def value_and_div(
        *args: Any, generator: torch.Generator | None = None, probes: Any = None, **kwargs: Any
    ) -> tuple[torch.Tensor, Any, Any]:
        call = _prepare(spec, args, kwargs)
        if ds.method in plan.STOCHASTIC_METHODS:
            y, div, stderr, aux = _stochastic_divergence(call, ds, generator, probes)
        else:
            if probes is not None:
                raise ValueError(
                    f"{fname}: probes= is only used by the stochastic methods "
                    f"{plan.STOCHASTIC_METHODS}; method={ds.method!r} is exact."
                )
            y, div, aux = _exact_divergence(call, ds)
            stderr = torch.zeros_like(div)
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
        f: batched function or ``nn.Module``, ``[B, *shape] -> [B, *shape]`` in argument
            ``argnums``.
        argnums: position of the differentiated tensor argument.
        batch_axis: batch axis of that argument and of the output (``None``: single sample).
        method: ``"exact"`` (one batched pass per input element), ``"sparse"`` (exact, one pass
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
        A function with ``f``'s signature (plus keywords ``generator=`` and ``probes=`` for
        stochastic methods) returning the per-sample divergence, shape ``(B,)``.

    Raises:
        NonSquareJacobianError: output and input samples differ in shape.
        BatchCouplingError: ``f`` mixes samples (with ``coupling="raise"``).
        MissingKeyError: a stochastic method was called without ``generator`` or ``probes``.
        NumProbesError: ``num_probes`` or ``probes`` do not fit the method.

    Example:
        >>> import torch
        >>> from divjac.torch import divergence
        >>> divergence(torch.sin)(torch.zeros(3, 4)).tolist()
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
    (``((value, aux), div)`` with ``has_aux``), as ``torch.func.grad_and_value`` pairs them.

    Example:
        >>> import torch
        >>> from divjac.torch import value_and_divergence
        >>> y, div = value_and_divergence(lambda x: 2.0 * x)(torch.ones(2, 3))
        >>> tuple(y.shape), div.tolist()
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
    diagonal-block trace w.r.t. the whole batch, summed over samples.) Computed with
    ``torch.func.grad``, so it stays differentiable w.r.t. module parameters.

    Example:
        >>> import torch
        >>> from divjac.torch import grad_divergence
        >>> grad_divergence(lambda x: x**3)(torch.ones(2, 3)).tolist()
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

    def grad_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        argnum = checks.normalize_argnum(argnums, len(args), fname="grad_divergence")

        def total(x: torch.Tensor) -> torch.Tensor:
            return torch.sum(div(*args[:argnum], x, *args[argnum + 1 :], **kwargs))

        result: torch.Tensor = torch.func.grad(total)(args[argnum])
        return result

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
        >>> import torch
        >>> from divjac.torch import laplacian
        >>> laplacian(lambda x: torch.sum(x**2, dim=1))(torch.ones(2, 3)).tolist()
        [6.0, 6.0]
    """

    def gradient(*args: Any, **kwargs: Any) -> torch.Tensor:
        argnum = checks.normalize_argnum(argnums, len(args), fname="laplacian")
        x = args[argnum]

        def total(x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = u(*args[:argnum], x, *args[argnum + 1 :], **kwargs)
            return out

        out, pull = cast(Any, torch.func.vjp(total, x))
        _check_scalar_per_sample(out, tuple(x.shape), batch_axis)
        grad: torch.Tensor = pull(torch.ones_like(out))[0]
        return grad

    ds = _DivSpec(method, num_probes, distribution, return_stderr, chunk_size, None)
    inner = _divergence_transform(
        gradient, argnums, batch_axis, False, coupling, ds, "laplacian", prefer_reverse=False
    )

    def lap_fn(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)[1]

    return lap_fn


def _check_scalar_per_sample(out: Any, x_shape: tuple[int, ...], batch_axis: int | None) -> None:
    if not isinstance(out, torch.Tensor):
        raise checks.not_an_array(out, what="function's output", fname="laplacian")
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
    f: Callable[..., Any],
    /,
    *args: Any,
    argnums: int = 0,
    batch_axis: int | None = 0,
    has_aux: bool = False,
    **kwargs: Any,
) -> SparsityPattern:
    """Detect the per-sample Jacobian sparsity of ``f`` at arguments of these shapes.

    Detection interprets the ATen graph traced on fake tensors (values are never used, except
    constants baked into the function), so the pattern holds for every input of these shapes.
    It never misses a true nonzero; operations without a rule are assumed dense (with a
    warning).

    Returns:
        A :class:`~divjac.SparsityPattern` with the per-sample CSR pattern, colorings and
        ``is_batch_independent`` (a coupled function is reported, not refused).

    Example:
        >>> import torch
        >>> from divjac.torch import sparsity
        >>> p = sparsity(lambda x: torch.cumsum(x, dim=1), torch.ones(8, 5))
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
    layout: torch.layout = torch.sparse_coo,
) -> Callable[..., Any]:
    """Per-sample Jacobian as a sparse tensor of shape ``(B, n_out, n_in)``.

    Only the detected nonzeros are stored, and they are computed with one pass per color of the
    column (or row) coloring: a 64x64 blur with an 11x11 kernel needs about 121 passes instead of
    4096, and no ``H*W x H*W`` dense array is formed.

    Args:
        layout: ``torch.sparse_coo`` (default; a 3-d COO tensor) or ``torch.sparse_csr`` (a
            batched CSR tensor: every sample shares the pattern).

    Example:
        >>> import torch
        >>> from divjac.torch import sparse_jacobian
        >>> J = sparse_jacobian(torch.sin)(torch.zeros(2, 3))
        >>> tuple(J.shape), J._nnz()
        ((2, 3, 3), 6)
    """
    if layout not in (torch.sparse_coo, torch.sparse_csr):
        raise ValueError(
            f"sparse_jacobian: layout must be torch.sparse_coo or torch.sparse_csr; got {layout}."
        )
    spec = _Spec(f, argnums, batch_axis, has_aux, "raise", "sparse_jacobian")

    def sparse_fn(*args: Any, **kwargs: Any) -> Any:
        call = _prepare(spec, args, kwargs)
        found = call.detect(per_sample=True)
        assert found is not None and found.pattern is not None
        the_plan = plan.jacobian_plan(
            "sparse", call.n_in, call.n_out, found.pattern, prefer_reverse=spec.prefer_reverse
        )
        compressed, aux = _compressed(call, the_plan, chunk_size)
        rows, cols, values = _decompress(found.pattern, the_plan, compressed)
        matrix = _sparse(call, rows, cols, values, layout)
        return (matrix, aux) if has_aux else matrix

    return sparse_fn


def _sparse(
    call: _Call, rows: np.ndarray, cols: np.ndarray, values: torch.Tensor, layout: torch.layout
) -> torch.Tensor:
    """The sparse tensor of per-sample values ``(B, nnz)`` at (row-major sorted) ``rows, cols``."""
    B, n_out, n_in = call.batch_size, call.n_out, call.n_in
    device = values.device
    single = call.spec.batch_axis is None
    if layout == torch.sparse_csr:
        with warnings.catch_warnings():  # "sparse CSR support is in beta": we only build it
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            return _csr(rows, cols, values, (B, n_out, n_in), single)
    pair = torch.as_tensor(np.stack([rows, cols]), device=device)
    if single:
        return torch.sparse_coo_tensor(
            pair, values[0], (n_out, n_in), is_coalesced=True, check_invariants=False
        )
    nnz = pair.shape[1]
    batch = torch.arange(B, device=device).repeat_interleave(nnz)
    indices = torch.cat([batch[None], pair.repeat(1, B)])
    return torch.sparse_coo_tensor(
        indices, values.reshape(-1), (B, n_out, n_in), is_coalesced=True, check_invariants=False
    )


def _csr(
    rows: np.ndarray,
    cols: np.ndarray,
    values: torch.Tensor,
    shape: tuple[int, int, int],
    single: bool,
) -> torch.Tensor:
    """A batched CSR tensor (every sample shares the pattern) of values ``(B, nnz)``."""
    B, n_out, n_in = shape
    device = values.device
    crow = np.zeros(n_out + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=n_out), out=crow[1:])
    crow_t = torch.as_tensor(crow, device=device)
    col_t = torch.as_tensor(cols, device=device)
    if single:
        return torch.sparse_csr_tensor(
            crow_t, col_t, values[0], (n_out, n_in), check_invariants=False
        )
    return torch.sparse_csr_tensor(
        crow_t.expand(B, -1),
        col_t.expand(B, -1),
        values,
        (B, n_out, n_in),
        check_invariants=False,
    )
