"""Sparsity detection for JAX: abstract interpretation of a jaxpr over dependency sets.

Every primitive is mapped onto a backend-neutral rule of :mod:`divjac._core.rules`. Nested programs
(``jit``, ``remat``, ``custom_jvp`` / ``custom_vjp``, ``cond``, ``while``, ``scan``) are followed.
A primitive without a rule never raises and never under-approximates: its outputs depend on
everything its inputs depend on, with a :class:`~divjac.DenseFallbackWarning` naming it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

import jax
from jax import lax

from .._core import detection, rules as D
from .._core.detection import EntryLimit
from .._core.rules import Deps

__all__ = ["Interpreter"]

# Constant folding (for static gather indices, masks, ...) is limited to arrays of this size.
_FOLD_LIMIT = 1 << 22
# Loops: a fixpoint on the carried dependency sets, conservative after this many rounds.
_MAX_FIXPOINT_ROUNDS = 64
# Scans of at most this length are unrolled (exact per-iteration patterns).
_UNROLL_SCAN = 16

_ELEMENTWISE = {
    "abs", "acos", "acosh", "add", "add_any", "asin", "asinh", "atan", "atan2", "atanh",
    "bessel_i0e", "bessel_i1e", "cbrt", "clamp", "complex", "conj", "copy", "copy_p", "cos",
    "cosh", "digamma", "div", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "igamma",
    "igamma_grad_a", "igammac", "imag", "integer_pow", "lgamma", "log", "log1p", "logistic",
    "max", "min", "mul", "neg", "nextafter", "polygamma", "pow", "random_gamma_grad", "real",
    "reduce_precision", "regularized_incomplete_beta", "rem", "rsqrt", "sin", "sinh", "sqrt",
    "square", "sub", "tan", "tanh", "zeta", "convert_element_type", "bitcast_convert_type",
    "square_p", "erf_inv_p",
}  # fmt: skip
# Outputs whose derivative is zero everywhere it exists.
_ZERO_DERIVATIVE = {
    "ceil", "floor", "round", "sign", "stop_gradient", "iota", "eq", "ne", "lt", "le", "gt",
    "ge", "and", "or", "not", "xor", "is_finite", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "clz", "argmax", "argmin", "random_bits",
    "random_seed", "random_wrap", "random_unwrap", "random_fold_in", "random_split",
    "threefry2x32", "rng_bit_generator", "rng_uniform", "lu_pivots_to_permutation",
    "reduce_and", "reduce_or", "reduce_xor",
}  # fmt: skip
_IDENTITY = {"optimization_barrier", "sharding_constraint", "device_put", "mesh_cast", "reshard"}
_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"}
# Collective reductions; under ``vmap(..., axis_name=...)`` their axes are positional.
_COLLECTIVES = {"psum", "pmax", "pmin"}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
_WINDOW = {"reduce_window_sum", "reduce_window_max", "reduce_window_min"}
_SCATTER = {"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
            "scatter-min", "scatter_min", "scatter-max", "scatter_max", "scatter-sub",
            "scatter_sub"}  # fmt: skip
# Batched linear algebra: leading axes are a batch, the trailing matrix axes are dense.
_LINALG = {"cholesky", "lu", "qr", "geqrf", "geqp3", "householder_product",
           "eigh", "eig", "svd", "schur", "hessenberg", "tridiagonal", "tridiagonal_solve",
           "cholesky_update"}  # fmt: skip
_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
          "custom_lin", "named_call"}  # fmt: skip


def _is_inexact(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _shape(aval: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(aval, "shape", ()))


def _open(jaxpr: Any) -> tuple[jcore.Jaxpr, list[Any]]:
    """(jaxpr, consts) of a ClosedJaxpr or an open Jaxpr."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def _concrete(value: Any) -> np.ndarray | None:
    """A NumPy copy of a concrete value, ``None`` for tracers and opaque values."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        return np.asarray(value)
    except Exception:
        return None


class _Scope:
    """Dependency sets and known constant values of the variables of one jaxpr."""

    def __init__(self, interp: Interpreter, jaxpr: jcore.Jaxpr) -> None:
        self.interp = interp
        self.deps: dict[Any, Deps] = {}
        self.values: dict[Any, np.ndarray | None] = {}
        self.producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
        # Captured integer/boolean constants of the traced program, by variable: (position
        # among its constants, value); read lazily, and each read is recorded (the cache key).
        self.captured: dict[Any, tuple[int, Any]] = {}

    def read(self, var: Any) -> Deps:
        if isinstance(var, jcore.Literal):
            return D.empty(_shape(var.aval), self.interp.n_labels)
        found = self.deps.get(var)
        return found if found is not None else D.empty(_shape(var.aval), self.interp.n_labels)

    def value(self, var: Any) -> np.ndarray | None:
        """The constant value of ``var`` if it is known at trace time (folded lazily)."""
        if isinstance(var, jcore.Literal):
            return _concrete(var.val)
        if var in self.values:
            return self.values[var]
        if var in self.captured:
            position, const = self.captured[var]
            self.interp.read_consts.add(position)
            self.values[var] = _concrete(const)
            return self.values[var]
        self.values[var] = None  # guards against cycles while folding
        eqn = self.producers.get(var)
        if eqn is not None and self.read(var).is_empty:
            self._fold(eqn)
        return self.values[var]

    def _fold(self, eqn: Any) -> None:
        if any(math.prod(_shape(v.aval)) > _FOLD_LIMIT for v in eqn.outvars) or eqn.effects:
            return
        inputs = []
        for v in eqn.invars:
            val = self.value(v)
            if val is None:
                return
            inputs.append(val)
        outs = _evaluate(eqn, inputs)
        if outs is not None:
            for v, out in zip(eqn.outvars, outs, strict=True):
                self.values[v] = out


def _evaluate(eqn: Any, inputs: Sequence[Any]) -> list[np.ndarray] | None:
    """Evaluate one equation on concrete values (outside any surrounding trace)."""
    fn, _ = _single_eqn_fun(eqn)
    values = [x for v, x in zip(eqn.invars, inputs, strict=True) if isinstance(v, jcore.Var)]
    try:
        with jax.ensure_compile_time_eval():
            return [np.asarray(o) for o in fn(*values)]
    except Exception:
        return None


def _single_eqn_fun(eqn: Any) -> tuple[Callable[..., list[Any]], list[Any]]:
    """The equation as a function of its variable inputs (literals stay inside)."""
    var_in = [v for v in eqn.invars if isinstance(v, jcore.Var)]
    params = eqn.primitive.get_bind_params(eqn.params)

    def fn(*args: Any) -> list[Any]:
        it = iter(args)
        full = [next(it) if isinstance(v, jcore.Var) else v.val for v in eqn.invars]
        out = eqn.primitive.bind(*full, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    return fn, var_in


class Interpreter:
    """Propagates dependency sets through jaxprs.

    Args:
        n_labels: number of labels (columns of every dependency matrix).
        limit: abort with :class:`~divjac._core.detection.TooDense` once an intermediate is
            past it (used to skip sparse detection where it cannot pay off).

    Attributes:
        fallbacks: names of primitives that had no rule (handled as dense).
        has_custom_vjp: whether a ``custom_vjp`` function was met (forward mode cannot
            differentiate it; the caller should prefer reverse mode).
        read_consts: positions of the constants of the outermost program (``run(...,
            captured=True)``) whose values detection read: the result depends on them.
    """

    def __init__(self, n_labels: int, *, limit: EntryLimit | None = None) -> None:
        self.n_labels = n_labels
        self.limit = limit
        self.fallbacks: set[str] = set()
        self.has_custom_vjp = False
        self.read_consts: set[int] = set()
        self.deriving: set[tuple[str, int]] = set()

    def run(
        self,
        jaxpr: Any,
        in_deps: Sequence[Deps],
        consts: Sequence[Any] | None = None,
        in_values: Sequence[np.ndarray | None] | None = None,
        *,
        captured: bool = False,
    ) -> list[Deps]:
        """Dependency sets of the outputs of ``jaxpr`` given those of its inputs.

        With ``captured``, ``jaxpr`` is the traced program and its constants are what the
        function captured: the reads of their values are recorded in :attr:`read_consts`.
        """
        jaxpr, closed_consts = _open(jaxpr)
        consts = closed_consts if consts is None else list(consts)
        scope = _Scope(self, jaxpr)
        for position, (var, const) in enumerate(zip(jaxpr.constvars, consts, strict=True)):
            if isinstance(const, Deps):
                scope.deps[var] = const
            elif _is_inexact(var.aval):
                pass  # captured floating-point arrays are weights: never read
            elif captured:  # indices, masks: read when a rule needs them, and recorded
                scope.captured[var] = (position, const)
            else:
                scope.values[var] = _concrete(const)
        for i, (var, dep) in enumerate(zip(jaxpr.invars, in_deps, strict=True)):
            scope.deps[var] = dep
            if in_values is not None and in_values[i] is not None:
                scope.values[var] = in_values[i]
        for eqn in jaxpr.eqns:
            ins = [scope.read(v) for v in eqn.invars]
            if all(d.is_empty for d in ins) and eqn.primitive.name not in ("while", "scan"):
                continue  # constants and parameters: nothing depends on the labels
            outs = self._eqn(scope, eqn, ins)
            for var, dep in zip(eqn.outvars, outs, strict=True):
                if _is_inexact(var.aval) and not dep.is_empty:
                    if self.limit is not None:
                        self.limit.check(dep, eqn.primitive.name)
                    scope.deps[var] = dep
        return [scope.read(v) for v in jaxpr.outvars]

    def warn_fallbacks(self) -> None:
        """Emit one :class:`DenseFallbackWarning` naming every primitive without a rule."""
        detection.warn_fallbacks(self.fallbacks, kind="JAX primitive", stacklevel=5)

    # --- dispatch -----------------------------------------------------------------------------

    def _eqn(self, scope: _Scope, eqn: Any, ins: list[Deps]) -> list[Deps]:
        name = eqn.primitive.name
        params = eqn.params
        out_shapes = [_shape(v.aval) for v in eqn.outvars]
        if name in _ZERO_DERIVATIVE:
            return [D.empty(s, self.n_labels) for s in out_shapes]
        if name in _ELEMENTWISE:
            return [D.elementwise(out_shapes[0], *ins)]
        if name in _IDENTITY:
            return list(ins[: len(out_shapes)])
        rule = _RULES.get(name)
        if rule is not None:
            return rule(self, scope, eqn, ins, out_shapes)
        sub = params.get("jaxpr", params.get("call_jaxpr"))
        if name in _CALLS or (
            sub is not None
            and len(_open(sub)[0].invars) == len(ins)
            and len(_open(sub)[0].outvars) == len(out_shapes)
        ):
            values = [scope.value(v) for v in eqn.invars]
            return self.run(sub, ins, in_values=values)
        if name in _LINALG:
            return _linalg(self, ins, out_shapes, name)
        # No rule: the primitive's own derivative rules, traced, give a precise pattern.
        derived = _via_jvp(self, scope, eqn)
        if derived is None:
            derived = _via_vjp(self, scope, eqn)
        if derived is not None:
            return derived
        self.fallbacks.add(name)
        sliced = _per_slice(scope, eqn)
        if sliced is not None:
            return sliced
        return [D.dense(s, *ins) for s in out_shapes]


# --- rules: (interpreter, scope, eqn, input deps, output shapes) -> output deps -----------------

Rule = Callable[[Interpreter, _Scope, Any, list[Deps], list[tuple[int, ...]]], list[Deps]]
_RULES: dict[str, Rule] = {}


_rule = detection.rule_registry(_RULES)


@_rule("reshape")
def _reshape(it, scope, eqn, ins, outs):
    if eqn.params.get("dimensions"):
        ins = [D.transpose(ins[0], eqn.params["dimensions"])]
    return [D.reshape(ins[0], outs[0])]


@_rule("squeeze", "expand_dims")
def _squeeze(it, scope, eqn, ins, outs):
    return [D.reshape(ins[0], outs[0])]


@_rule("transpose")
def _transpose(it, scope, eqn, ins, outs):
    return [D.transpose(ins[0], eqn.params["permutation"])]


@_rule("broadcast_in_dim")
def _broadcast_in_dim(it, scope, eqn, ins, outs):
    return [D.broadcast_in_dim(ins[0], outs[0], eqn.params["broadcast_dimensions"])]


@_rule("rev")
def _rev(it, scope, eqn, ins, outs):
    return [D.rev(ins[0], eqn.params["dimensions"])]


@_rule("slice")
def _slice(it, scope, eqn, ins, outs):
    p = eqn.params
    return [D.slice_(ins[0], p["start_indices"], p["limit_indices"], p["strides"])]


@_rule("pad")
def _pad(it, scope, eqn, ins, outs):
    return [D.pad(ins[0], ins[1], eqn.params["padding_config"])]


@_rule("concatenate")
def _concatenate(it, scope, eqn, ins, outs):
    return [D.concatenate(ins, eqn.params["dimension"])]


@_rule("stack")
def _stack(it, scope, eqn, ins, outs):
    return [D.stack(ins, eqn.params["axis"])]


@_rule("tile")
def _tile(it, scope, eqn, ins, outs):
    return [
        D.gather(ins[0], np.tile(np.arange(ins[0].size).reshape(ins[0].shape), eqn.params["reps"]))
    ]


@_rule("split")
def _split(it, scope, eqn, ins, outs):
    axis = eqn.params["axis"]
    bounds = np.cumsum([0, *eqn.params["sizes"]])
    results = []
    for lo, hi in itertools.pairwise(bounds):
        start = [0] * len(ins[0].shape)
        limit = list(ins[0].shape)
        start[axis], limit[axis] = int(lo), int(hi)
        results.append(D.slice_(ins[0], start, limit))
    return results


@_rule(*_REDUCTIONS)
def _reduce(it, scope, eqn, ins, outs):
    return [D.reduce(ins[0], eqn.params["axes"])]


@_rule(*_COLLECTIVES)
def _collective(it, scope, eqn, ins, outs):
    """A reduction over the positional axes ``vmap(..., axis_name=...)`` gives a named axis.

    A named axis left over (inside ``shard_map`` or ``pmap``) mixes the values of other
    instances, which are not tracked: dense.
    """
    axes = eqn.params["axes"]
    if all(isinstance(a, int | np.integer) for a in axes):
        return [D.reduce(d, axes) for d in ins]
    it.fallbacks.add(eqn.primitive.name)
    return [D.dense(s, *ins) for s in outs]


@_rule(*_CUMULATIVE)
def _cumulative(it, scope, eqn, ins, outs):
    return [D.cumulative(ins[0], eqn.params["axis"], reverse=eqn.params["reverse"])]


@_rule("sort")
def _sort(it, scope, eqn, ins, outs):
    return [D.sort_along(d, eqn.params["dimension"]) for d in ins]


@_rule("top_k")
def _top_k(it, scope, eqn, ins, outs):
    axis = eqn.params.get("axis", len(ins[0].shape) - 1)
    line = D.reduce(ins[0], [axis], keepdims=True)
    return [D.broadcast_to(line, outs[0]), D.empty(outs[1], it.n_labels)]


@_rule("select_n")
def _select_n(it, scope, eqn, ins, outs):
    which = scope.value(eqn.invars[0])
    cases = ins[1:]
    if which is None:
        return [D.elementwise(outs[0], *cases)]
    offsets = np.cumsum([0] + [math.prod(outs[0])] * len(cases))
    src = np.choose(np.broadcast_to(which.astype(np.int64), outs[0]), [
        np.arange(math.prod(outs[0])).reshape(outs[0]) + off for off in offsets[:-1]
    ])  # fmt: skip
    full = [D.broadcast_to(c, outs[0]) for c in cases]
    return [D.index_map(outs[0], full, src)]


@_rule("select_if_vmap")
def _select_if_vmap(it, scope, eqn, ins, outs):
    """Equinox's select (``x`` unless mapped with a mapped predicate): element-wise."""
    return [D.elementwise(outs[0], *ins[1:])]


@_rule("dot_general")
def _dot_general(it, scope, eqn, ins, outs):
    contracting, batch = eqn.params["dimension_numbers"]
    values = [scope.value(v) if d.is_empty else None for v, d in zip(eqn.invars, ins, strict=True)]
    return [
        D.dot_general(
            ins[0],
            ins[1],
            contracting=contracting,
            batch=batch,
            lhs_value=values[0],
            rhs_value=values[1],
        )
    ]


@_rule("conv_general_dilated")
def _conv(it, scope, eqn, ins, outs):
    p = eqn.params
    dn = p["dimension_numbers"]
    return [
        D.conv(
            ins[0],
            ins[1],
            out_shape=outs[0],
            lhs_spec=dn.lhs_spec,
            rhs_spec=dn.rhs_spec,
            out_spec=dn.out_spec,
            window_strides=p["window_strides"],
            padding=p["padding"],
            lhs_dilation=p["lhs_dilation"],
            rhs_dilation=p["rhs_dilation"],
            feature_group_count=p["feature_group_count"],
            batch_group_count=p["batch_group_count"],
        )
    ]


def _window_args(p: dict) -> tuple:
    return (
        p["window_dimensions"],
        p["window_strides"],
        p["padding"],
        p.get("base_dilation"),
        p.get("window_dilation"),
    )


@_rule(*_WINDOW)
def _reduce_window(it, scope, eqn, ins, outs):
    return [D.window(ins[0], *_window_args(eqn.params))]


@_rule("reduce_window")
def _reduce_window_generic(it, scope, eqn, ins, outs):
    n = len(outs)
    operands, inits = ins[:n], ins[n:]
    merged = D.union(*operands)
    windowed = D.window(merged, *_window_args(eqn.params))
    init = D.union(*(D.reshape(i, ()) for i in inits)) if inits else None
    results = []
    for s in outs:
        parts = [windowed] + ([D.broadcast_to(init, s)] if init is not None else [])
        results.append(D.union(*parts))
    return results


@_rule("select_and_gather_add")
def _select_and_gather_add(it, scope, eqn, ins, outs):
    return [D.window(ins[0], *_window_args(eqn.params))]


@_rule("select_and_scatter_add")
def _select_and_scatter_add(it, scope, eqn, ins, outs):
    p = eqn.params
    src = D.window_transposed(
        ins[0], outs[0], p["window_dimensions"], p["window_strides"], p["padding"]
    )
    return [src]


@_rule("fft")
def _fft(it, scope, eqn, ins, outs):
    n = len(eqn.params["fft_lengths"])
    return [D.batched_dense(ins[0], n, outs[0], n)]


def _linalg(it: Interpreter, ins: list[Deps], outs: list[tuple[int, ...]], name: str) -> list[Deps]:
    core_in = 1 if name == "tridiagonal_solve" else 2
    lead = len(ins[0].shape) - core_in
    results = []
    for s in outs:
        parts = []
        for d in ins:
            if len(d.shape) < lead or len(s) < lead or d.shape[:lead] != s[:lead]:
                it.fallbacks.add(name)
                return [D.dense(o, *ins) for o in outs]
            parts.append(D.batched_dense(d, len(d.shape) - lead, s, len(s) - lead))
        results.append(D.union(*parts))
    return results


@_rule("triangular_solve")
def _triangular_solve(it, scope, eqn, ins, outs):
    """``op(a) x = b`` (or ``x op(a) = b``) with a triangular ``op(a)``: substitution.

    Solving with a lower triangular matrix from the left, ``x[i, j]`` depends on ``b[k, j]``
    for ``k <= i`` (a prefix along the rows); the other cases are the suffix or the columns.
    Every element depends on its batch entry's whole matrix.
    """
    a, b = ins
    p = eqn.params
    lower = p["lower"] != p["transpose_a"]
    if p["left_side"]:
        solved = D.cumulative(b, -2, reverse=not lower)
    else:
        solved = D.cumulative(b, -1, reverse=lower)
    return [D.union(solved, D.batched_dense(a, 2, outs[0], 2))]


@_rule("custom_linear_solve")
def _custom_linear_solve(it, scope, eqn, ins, outs):
    lengths = eqn.params["const_lengths"]
    jaxprs = eqn.params["jaxprs"]
    matvec_consts = ins[: lengths.matvec]
    offset = lengths.matvec + lengths.vecmat
    solve_consts = ins[offset : offset + lengths.solve]
    rhs = ins[sum(lengths) :]
    solved = it.run(jaxprs.solve, [*solve_consts, *rhs])
    if any(not c.is_empty for c in matvec_consts):
        # x = A^{-1} b gives dx = A^{-1} (db - dA x): route the matrix's dependencies through
        # the matvec (dA x) and the solve, which keeps batched solves per batch entry.
        moved = it.run(jaxprs.matvec, [*matvec_consts, *solved])
        solved = [
            D.union(s, m)
            for s, m in zip(solved, it.run(jaxprs.solve, [*solve_consts, *moved]), strict=True)
        ]
    return solved


@_rule("dynamic_slice")
def _dynamic_slice(it, scope, eqn, ins, outs):
    operand = ins[0]
    sizes = eqn.params["slice_sizes"]
    starts = [scope.value(v) for v in eqn.invars[1:]]
    if all(s is not None for s in starts):
        begin = [
            int(np.clip(int(s), 0, dim - size))
            for s, dim, size in zip(starts, operand.shape, sizes, strict=True)
        ]
        limit = [b + s for b, s in zip(begin, sizes, strict=True)]
        return [D.slice_(operand, begin, limit)]
    # Unknown start: along each partially sliced axis the element may come from anywhere.
    axes = [a for a, (dim, size) in enumerate(zip(operand.shape, sizes, strict=True)) if size < dim]
    return [D.slice_(D.spread(operand, axes), [0] * len(sizes), sizes)]


@_rule("dynamic_update_slice")
def _dynamic_update_slice(it, scope, eqn, ins, outs):
    operand, update = ins[0], ins[1]
    starts = [scope.value(v) for v in eqn.invars[2:]]
    shape = operand.shape
    if all(s is not None for s in starts):
        begin = [
            int(np.clip(int(s), 0, dim - size))
            for s, dim, size in zip(starts, shape, update.shape, strict=True)
        ]
        src = np.arange(math.prod(shape)).reshape(shape)
        window = tuple(slice(b, b + s) for b, s in zip(begin, update.shape, strict=True))
        src[window] = np.arange(update.size).reshape(update.shape) + math.prod(shape)
        return [D.index_map(shape, [operand, update], src)]
    axes = [a for a, (dim, size) in enumerate(zip(shape, update.shape, strict=True)) if size < dim]
    smeared = D.reduce(update, axes, keepdims=True)
    return [D.union(operand, D.broadcast_to(smeared, shape))]


def _index_columns(scope: _Scope, var: Any) -> list[np.ndarray | None]:
    """Values of the components of a gather's or scatter's index vectors (``None``: unknown).

    The index vectors lie along the last axis. An index array concatenated from columns keeps
    its known ones: in ``x[jnp.arange(B), labels]`` the batch column is known even when the
    labels are computed (``argmax``) or traced.
    """
    shape = _shape(var.aval)
    value = scope.value(var)
    if value is not None:
        return list(np.moveaxis(np.broadcast_to(value, shape), -1, 0))
    eqn = None if isinstance(var, jcore.Literal) else scope.producers.get(var)
    last = len(shape) - 1
    if eqn is not None and eqn.primitive.name == "concatenate" and eqn.params["dimension"] == last:
        return [c for v in eqn.invars for c in _index_columns(scope, v)]
    return [None] * shape[-1]


def _index_array(var: Any, columns: list[np.ndarray | None]) -> np.ndarray:
    """The index array of ``var`` with its unknown components replaced by zeros."""
    indices = np.zeros(_shape(var.aval), np.dtype(var.aval.dtype))
    for k, column in enumerate(columns):
        if column is not None:
            indices[..., k] = column
    return indices


def _index_gather(
    operand_shape: tuple[int, ...], indices: np.ndarray, params: dict[str, Any]
) -> np.ndarray:
    """Source index (or -1) of every element a gather reads, by gathering an index array.

    Evaluated on NumPy arrays outside any surrounding trace (under ``jax.jit`` too).
    """
    ids = np.arange(1, math.prod(operand_shape) + 1, dtype=np.int32).reshape(operand_shape)
    with jax.ensure_compile_time_eval():
        out = lax.gather_p.bind(ids, indices, **params)
    return np.asarray(out).astype(np.int64) - 1


@_rule("gather")
def _gather(it, scope, eqn, ins, outs):
    columns = _index_columns(scope, eqn.invars[1])
    start_index_map = eqn.params["dimension_numbers"].start_index_map
    # Unknown components: any position along their operand axes (the other axes stay exact).
    operand = D.spread(ins[0], [start_index_map[k] for k, c in enumerate(columns) if c is None])
    params = dict(eqn.params)
    params["fill_value"] = 0 if "FILL" in str(params.get("mode")) else params.get("fill_value")
    src = _index_gather(operand.shape, _index_array(eqn.invars[1], columns), params)
    return [D.gather(operand, src)]


def _scatter_as_gather(eqn: Any) -> tuple[Any, tuple[int, ...]]:
    """Gather dimension numbers and slice sizes that read what a scatter writes."""
    dn = eqn.params["dimension_numbers"]
    operand_shape = _shape(eqn.invars[0].aval)
    update_shape = _shape(eqn.invars[2].aval)
    window_sizes = iter(update_shape[d] for d in dn.update_window_dims)
    sizes = tuple(
        1 if (a in dn.inserted_window_dims or a in dn.operand_batching_dims) else next(window_sizes)
        for a in range(len(operand_shape))
    )
    gdn = lax.GatherDimensionNumbers(
        offset_dims=dn.update_window_dims,
        collapsed_slice_dims=dn.inserted_window_dims,
        start_index_map=dn.scatter_dims_to_operand_dims,
        operand_batching_dims=dn.operand_batching_dims,
        start_indices_batching_dims=dn.scatter_indices_batching_dims,
    )
    return gdn, sizes


@_rule(*_SCATTER)
def _scatter(it, scope, eqn, ins, outs):
    operand, updates = ins[0], ins[2]
    columns = _index_columns(scope, eqn.invars[1])
    scattered = eqn.params["dimension_numbers"].scatter_dims_to_operand_dims
    # Unknown components: route as if they were zero, then let each update land anywhere
    # along their operand axes (the other axes, batching axes included, stay exact).
    unknown = [scattered[k] for k, c in enumerate(columns) if c is None]
    shape = operand.shape
    gdn, sizes = _scatter_as_gather(eqn)
    params = dict(
        dimension_numbers=gdn,
        slice_sizes=sizes,
        mode=lax.GatherScatterMode.from_any(eqn.params.get("mode")),
        fill_value=0,
        indices_are_sorted=False,
        unique_indices=False,
    )
    target = _index_gather(shape, _index_array(eqn.invars[1], columns), params).ravel()
    landed = target >= 0
    routed = D.compose(shape, target[landed], np.flatnonzero(landed), updates)
    routed = D.spread(routed, unknown)
    if not unknown and eqn.primitive.name == "scatter":
        keep = np.arange(math.prod(shape))
        keep[target[landed]] = -1
        operand = D.gather(operand, keep.reshape(shape))
    return [D.union(operand, routed)]


@_rule("cond")
def _cond(it, scope, eqn, ins, outs):
    operands = ins[1:]
    values = [scope.value(v) for v in eqn.invars[1:]]
    branches = [it.run(b, operands, in_values=values) for b in eqn.params["branches"]]
    return [D.union(*parts) for parts in zip(*branches, strict=True)]


def _same(a: Deps, b: Deps) -> bool:
    if a.is_empty or b.is_empty:
        return a.is_empty == b.is_empty
    ma, mb = a.matrix(), b.matrix()
    return bool(ma.nnz == mb.nnz and (ma != mb).nnz == 0)


def _fixpoint(
    it: Interpreter, body: Callable[[list[Deps]], list[Deps]], init: list[Deps], extra: list[Deps]
) -> list[Deps]:
    """Least fixpoint of ``carry = init | body(carry)``; conservative if it does not settle."""
    carry = list(init)
    for _ in range(_MAX_FIXPOINT_ROUNDS):
        new = [D.union(c, n) for c, n in zip(carry, body(carry), strict=True)]
        if all(_same(a, b) for a, b in zip(carry, new, strict=True)):
            return new
        carry = new
    return [D.dense(c.shape, *carry, *extra) for c in carry]


@_rule("while")
def _while(it, scope, eqn, ins, outs):
    p = eqn.params
    body_consts = ins[p["cond_nconsts"] : p["cond_nconsts"] + p["body_nconsts"]]
    init = ins[p["cond_nconsts"] + p["body_nconsts"] :]
    values = [
        scope.value(v)
        for v in eqn.invars[p["cond_nconsts"] : p["cond_nconsts"] + p["body_nconsts"]]
    ]

    def run_body(carry):
        return it.run(
            p["body_jaxpr"], [*body_consts, *carry], in_values=[*values, *[None] * len(carry)]
        )

    return _fixpoint(it, run_body, init, list(body_consts))


@_rule("scan")
def _scan(it, scope, eqn, ins, outs):
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, init, xs = ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]
    const_values = [scope.value(v) for v in eqn.invars[:n_consts]]
    body = p["jaxpr"]
    n_ys = len(outs) - n_carry

    def x_at(x: Deps, i: int) -> Deps:
        start = [i] + [0] * (len(x.shape) - 1)
        limit = [i + 1, *x.shape[1:]]
        return D.reshape(D.slice_(x, start, limit), x.shape[1:])

    if length <= _UNROLL_SCAN:
        carry, ys = list(init), []
        order = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for i in order:
            out = it.run(body, [*consts, *carry, *(x_at(x, i) for x in xs)], in_values=[
                *const_values, *[None] * (n_carry + len(xs))
            ])  # fmt: skip
            carry, y = out[:n_carry], out[n_carry:]
            ys.append(y)
        if p["reverse"]:
            ys = ys[::-1]
        stacked = [
            D.concatenate([D.reshape(step[k], (1, *step[k].shape)) for step in ys], 0)
            for k in range(n_ys)
        ]
        return [*carry, *stacked]
    x_any = [D.reduce(x, [0]) for x in xs]
    values = [*const_values, *[None] * (n_carry + len(xs))]

    def run_body(carry):
        return it.run(body, [*consts, *carry, *x_any], in_values=values)[:n_carry]

    carry = _fixpoint(it, run_body, init, [*consts, *x_any])
    ys = it.run(body, [*consts, *carry, *x_any], in_values=values)[n_carry:]
    return [*carry, *(D.broadcast_to(y, s) for y, s in zip(ys, outs[n_carry:], strict=True))]


class _Recursive(Exception):
    """A derivative rule applied its own primitive to tangents (abandon that rule)."""

    def __init__(self, key: tuple[str, int]) -> None:
        super().__init__(key)
        self.key = key


def _guarded(derive: Callable[..., list[Deps] | None]) -> Callable[..., list[Deps] | None]:
    """Refuse to derive an equation's pattern from a rule that applies the equation again.

    A linear primitive's JVP rule is often the primitive itself; interpreting it would recurse
    forever. The guard is keyed by the primitive and (for custom functions) by their program.
    """

    def wrapper(it: Interpreter, scope: _Scope, eqn: Any) -> list[Deps] | None:
        key = (eqn.primitive.name, id(eqn.params.get("call_jaxpr")))
        if key in it.deriving:
            raise _Recursive(key)
        it.deriving.add(key)
        try:
            return derive(it, scope, eqn)
        except _Recursive as err:
            if err.key != key:
                raise
            return None
        finally:
            it.deriving.discard(key)

    return wrapper


def _struct(var: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(var.aval.shape, var.aval.dtype)


def _moving(
    scope: _Scope, eqn: Any
) -> tuple[Callable[[Sequence[Any], Sequence[Any]], list[Any]], list[Any], list[bool]]:
    """The equation as a function of its primal inputs and of the differentiated ones.

    Only the floating-point inputs that carry labels are differentiated (the others get
    symbolic-zero tangents), as when JAX differentiates the program with respect to the seeded
    input. A custom rule (``custom_jvp`` / ``custom_vjp``) then sees the perturbation pattern
    it sees in use, so JAX reuses its trace for that pattern: a trace for another pattern
    empties and refills the stores JAX keeps for the user's function, and one that fails
    (an Equinox rule asserting that an argument is not perturbed) leaves them empty, breaking
    every later differentiation of that function ("Store empty").

    Returns ``(call, var_in, moving)``: ``call(primals, moved)`` evaluates the equation on its
    variable inputs ``var_in`` with those flagged in ``moving`` replaced by ``moved``.
    """
    fn, var_in = _single_eqn_fun(eqn)
    moving = [_is_inexact(v.aval) and not scope.read(v).is_empty for v in var_in]

    def call(primals: Sequence[Any], moved: Sequence[Any]) -> list[Any]:
        replaced = iter(moved)
        return fn(*(next(replaced) if m else p for p, m in zip(primals, moving, strict=True)))

    return call, var_in, moving


@_guarded
def _via_jvp(it: Interpreter, scope: _Scope, eqn: Any) -> list[Deps] | None:
    """Dependencies from the equation's JVP rule: tangents in, tangents out.

    The JVP is linear in the tangents, so seeding each tangent input with its primal's
    dependency sets gives the outputs' dependency sets (primal inputs act as constants).
    ``None`` if the rule cannot be traced or refers to the primitive itself.
    """
    call, var_in, moving = _moving(scope, eqn)
    avals = [_struct(v) for v in var_in]

    def tangents_out(primals: list[Any], tangents: list[Any]) -> list[Any]:
        start = [p for p, m in zip(primals, moving, strict=True) if m]
        return jax.jvp(lambda *moved: call(primals, moved), start, tangents)[1]

    try:
        jvp_jaxpr = jax.make_jaxpr(tangents_out)(
            avals, [a for a, m in zip(avals, moving, strict=True) if m]
        )
    except Exception:
        return None
    moved_deps = [scope.read(v) for v, m in zip(var_in, moving, strict=True) if m]
    values = [*(scope.value(v) for v in var_in), *[None] * len(moved_deps)]
    empties = [D.empty(a.shape, it.n_labels) for a in avals]
    return it.run(jvp_jaxpr, [*empties, *moved_deps], in_values=values)


@_guarded
def _via_vjp(it: Interpreter, scope: _Scope, eqn: Any) -> list[Deps] | None:
    """Dependencies from the equation's VJP (transpose) rule, as a local Jacobian pattern.

    Each floating-point output element gets its own label; pulling the labels back through the
    VJP gives the local pattern (inputs x outputs), which is then composed with the inputs'
    dependency sets. ``None`` if the rule cannot be traced or refers to the primitive itself.
    """
    call, var_in, moving = _moving(scope, eqn)
    avals = [_struct(v) for v in var_in]
    kept = [k for k, v in enumerate(eqn.outvars) if _is_inexact(v.aval)]

    def cotangents_in(primals: list[Any], cts: list[Any]) -> Any:
        start = [p for p, m in zip(primals, moving, strict=True) if m]
        outputs = lambda *moved: [call(primals, moved)[k] for k in kept]  # noqa: E731
        return jax.vjp(outputs, *start)[1](cts)

    try:
        vjp_jaxpr = jax.make_jaxpr(cotangents_in)(avals, [_struct(eqn.outvars[k]) for k in kept])
    except Exception:
        return None
    outs = [_shape(eqn.outvars[k].aval) for k in kept]
    sizes = [math.prod(s) for s in outs]
    n_out = sum(sizes)
    offsets = np.cumsum([0, *sizes])
    seeds = [
        D.from_labels(s, np.arange(n) + off, n_out)
        for s, n, off in zip(outs, sizes, offsets[:-1], strict=True)
    ]
    local = Interpreter(n_out)
    local.deriving = it.deriving
    values = [*(scope.value(v) for v in var_in), *[None] * len(seeds)]
    empties = [D.empty(a.shape, n_out) for a in avals]
    pulled = local.run(vjp_jaxpr, [*empties, *seeds], in_values=values)
    it.fallbacks |= local.fallbacks
    moved_deps = [scope.read(v) for v, m in zip(var_in, moving, strict=True) if m]
    stacked_in = D.concatenate([D.reshape(d, (d.size,)) for d in moved_deps], 0)
    pattern = D.concatenate([D.reshape(p, (p.size,)) for p in pulled], 0).matrix().T.tocoo()
    results = [D.empty(_shape(v.aval), it.n_labels) for v in eqn.outvars]
    for k, s, lo, hi in zip(kept, outs, offsets[:-1], offsets[1:], strict=True):
        mask = (pattern.row >= lo) & (pattern.row < hi)
        results[k] = D.compose(s, pattern.row[mask] - lo, pattern.col[mask], stacked_in)
    return results


def _same_params(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    try:
        return all(a[k] is b[k] or bool(a[k] == b[k]) for k in a)
    except Exception:  # values without a truth value (arrays): not provably equal
        return False


def _maps_itself(eqn: Any, axes: list[int | None]) -> bool:
    """Whether mapping the equation over ``axes`` of its inputs gives back the equation itself.

    The primitive is applied, with the same parameters, to one slice of the inputs mapped on
    ``axes`` (``None``: shared by every slice) under ``jax.vmap``; its batching rule must
    return the very same equation on the whole inputs, with the outputs mapped on axis 0.
    """
    fn, var_in = _single_eqn_fun(eqn)
    var_axes = tuple(a for v, a in zip(eqn.invars, axes, strict=True) if isinstance(v, jcore.Var))
    try:
        mapped = jax.make_jaxpr(jax.vmap(fn, in_axes=var_axes))(*map(_struct, var_in)).jaxpr
    except Exception:
        return False
    if len(mapped.eqns) != 1:
        return False
    (again,) = mapped.eqns
    return (
        again.primitive is eqn.primitive
        and _same_params(again.params, eqn.params)
        and [isinstance(v, jcore.Var) for v in again.invars]
        == [isinstance(v, jcore.Var) for v in eqn.invars]
        and [v for v in again.invars if isinstance(v, jcore.Var)] == list(mapped.invars)
        and list(again.outvars) == list(mapped.outvars)
    )


def _random(aval: Any, rng: np.random.Generator) -> np.ndarray:
    shape, dtype = _shape(aval), np.dtype(aval.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 2, shape).astype(dtype)


def _agrees_on_slices(eqn: Any, axes: list[int | None], length: int) -> bool:
    """The batching rule's claim, checked at a random point on the first and last slices.

    Guards against a batching rule that does not hold for these slices (a primitive whose
    abstract evaluation accepts them but which is not defined on them).
    """
    if eqn.effects:
        return False
    rng = np.random.default_rng(0)
    try:
        whole_in = [_random(v.aval, rng) if isinstance(v, jcore.Var) else None for v in eqn.invars]
    except TypeError:  # opaque dtypes (PRNG keys): cannot be drawn
        return False
    whole = _evaluate(eqn, whole_in)
    for b in sorted({0, length - 1}):
        sliced = [
            x if x is None or a is None else x[b] for x, a in zip(whole_in, axes, strict=True)
        ]
        part = _evaluate(eqn, sliced)
        if whole is None or part is None:
            return False
        close = (
            np.allclose(w[b], q, rtol=1e-5, atol=1e-6, equal_nan=True)
            for w, q in zip(whole, part, strict=True)
        )
        if not all(close):
            return False
    return True


def _per_slice(scope: _Scope, eqn: Any) -> list[Deps] | None:
    """A dense fallback that keeps the slices of the leading axis apart, where that is sound.

    When the equation maps itself over the leading axis of its inputs (those of the outputs'
    leading length; the others are shared by every slice), output slice ``b`` depends on the
    input slices ``b`` and the shared inputs only: each slice is dense, samples stay apart.
    ``None`` otherwise.
    """
    lead = {s[:1] for s in (_shape(v.aval) for v in eqn.outvars)}
    if len(lead) != 1 or lead == {()} or lead == {(0,)}:
        return None
    (length,) = lead.pop()
    axes = [
        0 if isinstance(v, jcore.Var) and _shape(v.aval)[:1] == (length,) else None
        for v in eqn.invars
    ]
    if not (_maps_itself(eqn, axes) and _agrees_on_slices(eqn, axes, length)):
        return None
    n_labels = scope.interp.n_labels
    sliced = [scope.read(v) for v, a in zip(eqn.invars, axes, strict=True) if a == 0]
    shared = [scope.read(v) for v, a in zip(eqn.invars, axes, strict=True) if a is None]
    results = []
    for v in eqn.outvars:
        s = _shape(v.aval)
        parts = [D.batched_dense(d, len(d.shape) - 1, s, len(s) - 1) for d in sliced]
        results.append(D.union(D.empty(s, n_labels), *parts, *(D.dense(s, d) for d in shared)))
    return results


def _custom_call(
    it: Interpreter,
    scope: _Scope,
    eqn: Any,
    ins: list[Deps],
    outs: list[tuple[int, ...]],
    program: Any,
    derive: Callable[[Interpreter, _Scope, Any], list[Deps] | None],
) -> list[Deps]:
    """A custom-derivative function: its primal ``program`` and its derivative rule."""
    values = [scope.value(v) for v in eqn.invars]
    primal = it.run(program, ins, in_values=values)
    derived = derive(it, scope, eqn)
    if derived is None:
        it.fallbacks.add(eqn.primitive.name)
        return [D.dense(s, *ins) for s in outs]
    return [D.union(a, b) for a, b in zip(primal, derived, strict=True)]


@_rule("custom_jvp_call")
def _custom_jvp_call(it, scope, eqn, ins, outs):
    """The primal program and the custom JVP rule (a straight-through estimator's rule too)."""
    return _custom_call(it, scope, eqn, ins, outs, eqn.params["call_jaxpr"], _via_jvp)


@_rule("custom_vjp_call", "custom_vjp_call_jaxpr")
def _custom_vjp_call(it, scope, eqn, ins, outs):
    """The primal program and the custom VJP rule (forward mode cannot use this function)."""
    it.has_custom_vjp = True
    program = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
    return _custom_call(it, scope, eqn, ins, outs, program, _via_vjp)
