"""The table from JAX primitive names to (shared rule, parameter extractor).

The element-wise primitives come from the op-fact table :data:`divjac.jax._ops.ELEMENTWISE`.

Every rule is one of :mod:`divjac._core.rules` (a few that only JAX has are written here with the
same signature); an extractor turns an equation's parameters (and, for gathers and scatters, its
constant indices; for nested programs, functions that run them) into the rule's parameters.
Users add (or replace) entries with :func:`register_rule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from .._core import rules as D
from .._core.rules import Deps, Op, Rule
from .._errors import InternalError
from . import _compat
from ._derive import via_jvp, via_vjp
from ._jaxpr import Runner, Scope, shape
from ._ops import ELEMENTWISE, Elementwise

__all__ = ["REGISTRY", "TABLE", "register_elementwise", "register_rule"]

Extract = Callable[[Runner, Scope, Any], Mapping[str, Any]]


def _none(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    return {}


def _params(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    """The equation's parameters as JAX holds them (for the rules users register)."""
    return eqn.params


def _p(**names: str) -> Extract:
    """An extractor renaming the equation's parameters: ``rule name=jax name``."""

    def extract(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
        return {ours: eqn.params[theirs] for ours, theirs in names.items()}

    return extract


TABLE: dict[str, tuple[Rule, Extract]] = {}


def _add(names: Sequence[str], rule: Rule, extract: Extract = _none) -> None:
    for name in names:
        TABLE[name] = (rule, extract)


for _name, _fact in ELEMENTWISE.items():
    _add([_name], D.nothing_rule if _fact.constant else D.elementwise_rule)
_add(  # outputs whose derivative is zero everywhere it exists
    ["iota", "eq", "ne", "lt", "le", "gt",
     "ge", "and", "or", "not", "xor", "is_finite", "shift_left", "shift_right_logical",
     "shift_right_arithmetic", "population_count", "clz", "argmax", "argmin", "random_bits",
     "random_seed", "random_wrap", "random_unwrap", "random_fold_in", "random_split",
     "threefry2x32", "rng_bit_generator", "rng_uniform", "lu_pivots_to_permutation",
     "reduce_and", "reduce_or", "reduce_xor"],
    D.nothing_rule,
)  # fmt: skip
_add(
    ["optimization_barrier", "sharding_constraint", "device_put", "mesh_cast", "reshard"],
    D.identity_rule,
)


# --- data movement ---------------------------------------------------------------------------


def _reshape(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    return {"permutation": eqn.params.get("dimensions")}


_add(["reshape"], D.reshape_rule, _reshape)
_add(["squeeze", "expand_dims"], D.reshape_rule)
_add(["transpose"], D.transpose_rule, _p(permutation="permutation"))
_add(["broadcast_in_dim"], D.broadcast_in_dim_rule, _p(dimensions="broadcast_dimensions"))
_add(["rev"], D.rev_rule, _p(axes="dimensions"))
_add(["slice"], D.slice_rule, _p(start="start_indices", limit="limit_indices", strides="strides"))
_add(["pad"], D.pad_rule, _p(config="padding_config"))
_add(["concatenate"], D.concatenate_rule, _p(axis="dimension"))
_add(["stack"], D.stack_rule, _p(axis="axis"))
_add(["tile"], D.tile_rule, _p(reps="reps"))
_add(["split"], D.split_rule, _p(axis="axis", sizes="sizes"))
_add(["unstack"], D.unstack_rule, _p(axis="axis"))


def _select_n(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    """Case ``which[e]`` is read at ``e`` (the inputs, predicate first, broadcast to the output
    are stacked in order); an unknown predicate: any case."""
    which = scope.value(eqn.invars[0])
    if which is None:
        return {"src": None}
    out = shape(eqn.outvars[0].aval)
    n = math.prod(out)
    cases = [np.arange(n).reshape(out) + n * (k + 1) for k in range(len(eqn.invars) - 1)]
    return {"src": [np.choose(np.broadcast_to(which.astype(np.int64), out), cases)]}


_add(["select_n"], D.select_rule, _select_n)


# --- reductions, scans, sorts -----------------------------------------------------------------

_add(["reduce_sum", "reduce_max", "reduce_min", "reduce_prod"], D.reduce_rule, _p(axes="axes"))
_add(
    ["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"],
    D.cumulative_rule,
    _p(axis="axis", reverse="reverse"),
)
_add(["sort"], D.sort_rule, _p(axis="dimension"))


def _top_k(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    return {"axis": eqn.params.get("axis", len(shape(eqn.invars[0].aval)) - 1)}


_add(["top_k"], D.sort_rule, _top_k)
_add(["approx_top_k"], D.sort_rule, _p(axis="reduction_dimension"))


def _collective(op: Op) -> list[Deps]:
    """A reduction over the positional axes ``vmap(..., axis_name=...)`` gives a named axis.

    A named axis left over (inside ``shard_map`` or ``pmap``) mixes the values of other
    instances, which are not tracked: dense.
    """
    axes = op.params["axes"]
    if all(isinstance(a, int | np.integer) for a in axes):
        return [D.reduce(d, axes) for d in op.ins]
    return op.dense()


_add(["psum", "pmax", "pmin"], _collective, _p(axes="axes"))


# --- contractions, convolutions, windows ---------------------------------------------------------


def _dot_general(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    contracting, batch = eqn.params["dimension_numbers"]
    return {"contracting": contracting, "batch": batch}


_add(["dot_general"], D.dot_rule, _dot_general)


def _conv(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    p = eqn.params
    dn = p["dimension_numbers"]
    return {
        "lhs_spec": dn.lhs_spec,
        "rhs_spec": dn.rhs_spec,
        "out_spec": dn.out_spec,
        "window_strides": p["window_strides"],
        "padding": p["padding"],
        "lhs_dilation": p["lhs_dilation"],
        "rhs_dilation": p["rhs_dilation"],
        "feature_group_count": p["feature_group_count"],
        "batch_group_count": p["batch_group_count"],
    }


_add(["conv_general_dilated"], D.conv_rule, _conv)


def _window(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    p = eqn.params
    return {
        "window_dimensions": p["window_dimensions"],
        "window_strides": p["window_strides"],
        "padding": p["padding"],
        "base_dilation": p.get("base_dilation"),
        "window_dilation": p.get("window_dilation"),
    }


_add(
    ["reduce_window_sum", "reduce_window_max", "reduce_window_min", "select_and_gather_add"],
    D.window_rule,
    _window,
)
_add(
    ["select_and_scatter_add"],
    D.window_transposed_rule,
    _p(window_dimensions="window_dimensions", window_strides="window_strides", padding="padding"),
)


def _reduce_window(op: Op) -> list[Deps]:
    """The generic ``reduce_window`` (operands, then their initial values)."""
    n = len(op.out_shapes)
    windowed = D.window(D.union(*op.ins[:n]), **op.params)
    inits = op.ins[n:]
    init = D.union(*(D.reshape(i, ()) for i in inits)) if inits else None
    return [
        D.union(windowed, *([D.broadcast_to(init, s)] if init is not None else []))
        for s in op.out_shapes
    ]


_add(["reduce_window"], _reduce_window, _window)


# --- linear algebra, FFT -------------------------------------------------------------------------


def _fft(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    ndim = len(shape(eqn.invars[0].aval))
    return {"axes": list(range(ndim - len(eqn.params["fft_lengths"]), ndim))}


_add(["fft"], D.fft_rule, _fft)


def _linalg(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    core = 1 if eqn.primitive.name == "tridiagonal_solve" else 2
    return {"lead": len(shape(eqn.invars[0].aval)) - core}


_add(
    ["cholesky", "lu", "qr", "geqrf", "geqp3", "householder_product", "eigh", "eig", "svd",
     "schur", "hessenberg", "tridiagonal", "tridiagonal_solve", "cholesky_update"],
    D.batched_rule,
    _linalg,
)  # fmt: skip


def _triangular_solve(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    p = eqn.params
    return {"lower": p["lower"] != p["transpose_a"], "left": p["left_side"]}


_add(["triangular_solve"], D.triangular_solve_rule, _triangular_solve)


def _custom_linear_solve(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    lengths, jaxprs = _compat.linear_solve_parts(eqn)
    ins = [scope.read(v) for v in eqn.invars]
    matvec_consts = ins[: lengths.matvec]
    offset = lengths.matvec + lengths.vecmat
    solve_consts = ins[offset : offset + lengths.solve]
    return {
        "n_consts": sum(lengths),
        "solve": lambda rhs: it.run(jaxprs.solve, [*solve_consts, *rhs]),
        "matvec": lambda x: it.run(jaxprs.matvec, [*matvec_consts, *x]),
        "matrix_moves": any(not c.is_empty for c in matvec_consts),
    }


_add(["custom_linear_solve"], D.linear_solve_rule, _custom_linear_solve)


# --- gathers and scatters --------------------------------------------------------------------


def _start(scope: Scope, eqn: Any, first: int, sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """The (clipped) start of a dynamic slice or update, zeros where unknown, and the axes
    partially covered whose start is unknown."""
    operand = shape(eqn.invars[0].aval)
    begin, unknown = [], []
    for a, (v, dim, size) in enumerate(zip(eqn.invars[first:], operand, sizes, strict=True)):
        value = scope.value(v)
        if value is None and size < dim:
            unknown.append(a)
        begin.append(0 if value is None else int(np.clip(int(value), 0, dim - size)))
    return begin, unknown


def _window_of(operand: tuple[int, ...], begin: Sequence[int], sizes: Sequence[int]) -> Any:
    return tuple(slice(b, b + s) for b, s in zip(begin, sizes, strict=True))


def _dynamic_slice(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    operand = shape(eqn.invars[0].aval)
    sizes = eqn.params["slice_sizes"]
    begin, unknown = _start(scope, eqn, 1, sizes)
    src = np.arange(math.prod(operand)).reshape(operand)[_window_of(operand, begin, sizes)]
    return {"src": [src], "unknown": {0: unknown}, "n_sources": 1}


_add(["dynamic_slice"], D.gather_rule, _dynamic_slice)


def _dynamic_update_slice(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    operand = shape(eqn.invars[0].aval)
    update = shape(eqn.invars[1].aval)
    begin, unknown = _start(scope, eqn, 2, update)
    target = np.arange(math.prod(operand)).reshape(operand)[_window_of(operand, begin, update)]
    return {"target": target, "overwrite": True, "unknown_axes": unknown or None}


_add(["dynamic_update_slice"], D.scatter_rule, _dynamic_update_slice)


def _index_columns(scope: Scope, var: Any) -> list[np.ndarray | None]:
    """Values of the components of a gather's or scatter's index vectors (``None``: unknown).

    The index vectors lie along the last axis. An index array concatenated from columns keeps
    its known ones: in ``x[jnp.arange(B), labels]`` the batch column is known even when the
    labels are computed (``argmax``) or traced.
    """
    dims = shape(var.aval)
    value = scope.value(var)
    if value is not None:
        return list(np.moveaxis(np.broadcast_to(value, dims), -1, 0))
    eqn = None if isinstance(var, _compat.Literal) else scope.producers.get(var)
    last = len(dims) - 1
    if eqn is not None and eqn.primitive.name == "concatenate" and eqn.params["dimension"] == last:
        return [c for v in eqn.invars for c in _index_columns(scope, v)]
    return [None] * dims[-1]


def _index_array(var: Any, columns: list[np.ndarray | None]) -> np.ndarray:
    """The index array of ``var`` with its unknown components replaced by zeros."""
    indices = np.zeros(shape(var.aval), np.dtype(var.aval.dtype))
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


def _gather(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    """Unknown index components: any position along their operand axes (the other axes stay
    exact)."""
    columns = _index_columns(scope, eqn.invars[1])
    start_index_map = eqn.params["dimension_numbers"].start_index_map
    params = dict(eqn.params)
    params["fill_value"] = 0 if "FILL" in str(params.get("mode")) else params.get("fill_value")
    operand = shape(eqn.invars[0].aval)
    src = _index_gather(operand, _index_array(eqn.invars[1], columns), params)
    unknown = [start_index_map[k] for k, c in enumerate(columns) if c is None]
    return {"src": [src], "unknown": {0: unknown}, "n_sources": 1}


_add(["gather"], D.gather_rule, _gather)


def _scatter_as_gather(eqn: Any) -> tuple[Any, tuple[int, ...]]:
    """Gather dimension numbers and slice sizes that read what a scatter writes."""
    dn = eqn.params["dimension_numbers"]
    operand_shape = shape(eqn.invars[0].aval)
    update_shape = shape(eqn.invars[2].aval)
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


def _scatter(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    """Unknown index components: routed as if they were zero, then each update may land
    anywhere along their operand axes (the other axes, batching axes included, stay exact)."""
    columns = _index_columns(scope, eqn.invars[1])
    scattered = eqn.params["dimension_numbers"].scatter_dims_to_operand_dims
    unknown = [scattered[k] for k, c in enumerate(columns) if c is None]
    gdn, sizes = _scatter_as_gather(eqn)
    params = dict(
        dimension_numbers=gdn,
        slice_sizes=sizes,
        mode=lax.GatherScatterMode.from_any(eqn.params.get("mode")),
        fill_value=0,
        indices_are_sorted=False,
        unique_indices=False,
    )
    operand = shape(eqn.invars[0].aval)
    target = _index_gather(operand, _index_array(eqn.invars[1], columns), params)
    return {
        "target": target,
        "source_input": 2,
        "overwrite": eqn.primitive.name == "scatter",
        "unknown_axes": unknown or None,
    }


_add(
    ["scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
     "scatter_min", "scatter-max", "scatter_max", "scatter-sub", "scatter_sub"],
    D.scatter_rule,
    _scatter,
)  # fmt: skip


# --- nested programs ---------------------------------------------------------------------------


def _values(scope: Scope, eqn: Any, lo: int = 0, hi: int | None = None) -> list[Any]:
    return [scope.value(v) for v in eqn.invars[lo:hi]]


def _call(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    sub = _compat.called(eqn)
    values = _values(scope, eqn)
    return {"program": lambda ins: it.run(sub, ins, in_values=values)}


_add(
    ["jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_lin",
     "named_call", "custom_vmap_call", "shard_map"],
    D.call_rule,
    _call,
)  # fmt: skip


def _cond(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    values = _values(scope, eqn, 1)

    def branch(jaxpr: Any) -> Callable[[Sequence[Deps]], list[Deps]]:
        return lambda ins: it.run(jaxpr, ins, in_values=values)

    return {"branches": [branch(b) for b in _compat.branches(eqn)]}


_add(["cond"], D.cond_rule, _cond)


def _loop_body(
    it: Runner, jaxpr: Any, values: Sequence[Any]
) -> Callable[[Sequence[Deps]], list[Deps]]:
    """A loop body as the loop rules run it: with the labels of its inputs, which may be other
    than the interpreter's (the rules find the body's local pattern with a label per element)."""

    def body(ins: Sequence[Deps]) -> list[Deps]:
        n_labels = ins[0].n_labels if ins else it.n_labels
        if n_labels == it.n_labels:
            return it.run(jaxpr, ins, in_values=values)
        local = it.local(n_labels)
        outs = local.run(jaxpr, ins, in_values=values)
        it.fallbacks |= local.fallbacks
        it.has_custom_vjp |= local.has_custom_vjp
        return outs

    return body


def _while(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    program, n_cond, n_body = _compat.while_parts(eqn)
    values = _values(scope, eqn, n_cond, n_cond + n_body)
    n_carry = len(eqn.invars) - n_cond - n_body
    body = _loop_body(it, program, [*values, *[None] * n_carry])
    return {"body": body, "n_cond": n_cond, "n_body": n_body}


_add(["while"], D.while_rule, _while)


def _scan(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    loop = _compat.scan_parts(eqn)
    n_consts = loop.n_consts
    values = [*_values(scope, eqn, 0, n_consts), *[None] * (len(eqn.invars) - n_consts)]
    return {
        "body": _loop_body(it, loop.body, values),
        "n_consts": n_consts,
        "n_carry": loop.n_carry,
        "length": loop.length,
        "reverse": loop.reverse,
    }


_add(["scan"], D.scan_rule, _scan)


def _custom_jvp(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    """The primal program and the custom JVP rule (a straight-through estimator's rule too)."""
    values = _values(scope, eqn)
    program = _compat.called(eqn)
    return {
        "primal": lambda ins: it.run(program, ins, in_values=values),
        "derive": lambda: via_jvp(it, scope, eqn),
    }


def _custom_vjp(it: Runner, scope: Scope, eqn: Any) -> Mapping[str, Any]:
    """The primal program and the custom VJP rule (forward mode cannot use this function)."""
    it.has_custom_vjp = True
    values = _values(scope, eqn)
    program = _compat.called(eqn)
    return {
        "primal": lambda ins: it.run(program, ins, in_values=values),
        "derive": lambda: via_vjp(it, scope, eqn),
    }


_add(["custom_jvp_call"], D.custom_rule, _custom_jvp)
_add(["custom_vjp_call", "custom_vjp_call_jaxpr"], D.custom_rule, _custom_vjp)


# --- rules of the user's own primitives -------------------------------------------------------

REGISTRY = D.Registry("JAX primitive")


def register_rule(op: _compat.Primitive | str, rule: Rule, /) -> None:
    """Give the JAX primitive ``op`` (or its name) a sparsity rule.

    The rule receives an :class:`divjac.rules.Op`: the dependency sets of the equation's inputs
    (``op.ins``), the shapes of its outputs (``op.out_shapes``), its parameters as JAX holds
    them (``op.params``) and the constant values of its inputs (``op.value(i)``); it returns
    the dependency sets of every output, built with the functions of :mod:`divjac.rules`. It
    replaces any built-in rule of that primitive; detections cached before are not reused.

    Args:
        op: the primitive (``jax.extend.core.Primitive``) or its name.
        rule: ``Op -> list[Deps]``; it may over-approximate, it must never miss a dependency.

    Returns:
        Nothing; every later detection uses the rule.

    Raises:
        RuleError: ``rule`` is not callable (later: it returned what does not fit).

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.extend.core import Primitive
        >>> import divjac.jax as dj
        >>> from divjac import rules
        >>> flip_p = Primitive("example_flip")  # reverses the last axis
        >>> _ = flip_p.def_impl(lambda x: jnp.flip(x, -1))
        >>> _ = flip_p.def_abstract_eval(lambda x: x)
        >>> dj.register_rule(flip_p, lambda op: [rules.rev(op.ins[0], [len(op.ins[0].shape) - 1])])
        >>> pattern = dj.sparsity(lambda x: jnp.sin(flip_p.bind(x)))(jnp.ones((2, 3)))
        >>> pattern.csr.toarray().astype(int)
        array([[0, 0, 1],
               [0, 1, 0],
               [1, 0, 0]])
    """
    name = op if isinstance(op, str) else op.name
    REGISTRY.register(name, rule)
    checked = REGISTRY.get(name)
    if checked is None:
        raise InternalError(f"the rule registered for {name} is not found")
    TABLE[name] = (checked, _params)


def register_elementwise(op: _compat.Primitive | str, fact: Elementwise, /) -> None:
    """Make the JAX primitive ``op`` (or its name) an element-wise one: one entry of
    :data:`~divjac.jax._ops.ELEMENTWISE`, read by detection, the Taylor sweeps and the sparse
    sweep alike (cached detections are not reused)."""
    name = op if isinstance(op, str) else op.name
    ELEMENTWISE[name] = fact
    register_rule(name, D.nothing_rule if fact.constant else D.elementwise_rule)
