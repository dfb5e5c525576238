"""Pushing many tangents through a linearized batched function at once, batch-locally.

A divjac pass pushes one tangent through the linearized batched function; ``k`` passes are
pushed at once. :func:`pushes` evaluates the linear program equation by equation with the
passes on an explicit leading axis (a :class:`Passes` value), each primitive batched by JAX's
own rule (``jax.vmap`` of that one equation), with one exception: a convolution folds the pass
axis into its batch axis *behind* the samples (``(B, k) -> B * k``), where JAX's rule folds it
in front (``(k, B) -> k * B``). With the samples sharded over devices, the first layout keeps
each device's share contiguous, so XLA partitions the passes without a collective; the second
gathers the whole batch on every device.

Shared tangents: the batch trick pushes ``broadcast(e)`` (the same ``e`` in every sample). Its
first linear operations (the first ``dot_general`` of an MLP, the first convolution of a CNN)
act on a batch-constant array, so computing them on the broadcast array repeats identical work
``B`` times; XLA does not sink the broadcast through a dot or a convolution. Hand-written
``vmap(jacfwd(f))`` does not pay this: its basis is unbatched. With ``shared``, a value may be a
:class:`Bcast` (a base and the axes broadcast over), and dot products, convolutions,
element-wise operations, transposes, slices, concatenations, sums and reshapes that add or
drop axes of size 1 are computed on the base. A value is materialized (broadcast for real) only
where an operation needs it, typically the first product with a batch-dependent residual.

Inside ``shard_map`` the pushed tangents are cast to vary over the mesh axes the input varies
over (as ``jax.linearize`` requires of them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _compat
from ._ops import CALLS

__all__ = ["pushes", "varying_axes", "varying_like"]

_UNARY = {
    "neg",
    "convert_element_type",
    "copy",
    "copy_p",
    "reduce_precision",
    "real",
    "imag",
}
_BINARY = {"add", "add_any", "sub", "mul", "div", "max", "min"}


@dataclass(frozen=True)
class Passes:
    """A value of every pass: ``value`` holds the passes on its axis ``axis``, the leading one
    (``0``) or, ``behind``, the second (``1``: behind the samples of a batch-first value;
    behind nothing, the leading one, where one pass's value is a scalar)."""

    value: Any
    axis: int = 0

    @staticmethod
    def behind(leading: Any) -> Passes:
        """The passes ``leading`` (passes first) laid out behind the first axis of a pass."""
        if jnp.ndim(leading) < 2:
            return Passes(leading)
        return Passes(jnp.moveaxis(leading, 0, 1), 1)

    def front(self) -> Any:
        """The value with the passes on its leading axis."""
        return self.value if self.axis == 0 else jnp.moveaxis(self.value, self.axis, 0)


def lift(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn`` of per-pass values, batched over the pass axis of the :class:`Passes` arguments
    (a tuple result for a tuple ``fn``), its passes laid out behind where any argument's are."""
    passes = [a for a in args if isinstance(a, Passes)]
    if not passes:
        return fn(*args)
    axes = [a.axis if isinstance(a, Passes) else None for a in args]
    values = [a.value if isinstance(a, Passes) else a for a in args]
    out = jax.vmap(fn, in_axes=axes)(*values)
    lay = Passes.behind if any(a.axis for a in passes) else Passes
    return [lay(o) for o in out] if isinstance(out, list | tuple) else lay(out)


def _shape(v: Any) -> tuple[int, ...]:
    """The shape of one pass's value."""
    if isinstance(v, Passes):
        shape = tuple(jnp.shape(v.value))
        return shape[: v.axis] + shape[v.axis + 1 :]
    return tuple(jnp.shape(v))


@dataclass(frozen=True)
class Bcast:
    """``broadcast`` of ``base`` to ``shape`` with new axes ``new_axes`` (base fills the others);
    ``base`` may carry the passes (:class:`Passes`), ``shape`` is that of one pass.
    ``behind``: materialized with the passes behind its first axis (:meth:`Passes.behind`),
    wherever the base holds them (in front, where the samples are a new axis: the broadcast
    then lays them out behind the samples as it copies, with no transpose of its own)."""

    base: Any
    shape: tuple[int, ...]
    new_axes: tuple[int, ...]
    behind: bool = False

    def kept(self) -> list[int]:
        return [a for a in range(len(self.shape)) if a not in self.new_axes]

    def derive(self, base: Any, shape: tuple[int, ...], new_axes: tuple[int, ...]) -> Bcast:
        """A broadcast computed from this one, laid out as it is."""
        return Bcast(base, shape, new_axes, self.behind)

    def materialize(self) -> Any:
        kept = tuple(self.kept())
        out = lift(lambda b: lax.broadcast_in_dim(b, self.shape, kept), self.base)
        if self.behind and isinstance(out, Passes) and out.axis == 0:
            return Passes.behind(out.value)
        return out


def real(v: Any) -> Any:
    return v.materialize() if isinstance(v, Bcast) else v


def varying_like(t: jax.Array, x: jax.Array) -> jax.Array:
    """``t`` cast to vary over the mesh axes ``x`` varies over (inside ``shard_map``)."""
    missing = tuple(sorted(varying_axes(x) - varying_axes(t)))
    return lax.pcast(t, missing, to="varying") if missing else t


def varying_axes(x: Any) -> frozenset[Any]:
    """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "varying", ()))


def pushes(
    push: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    seed_shape: Sequence[int],
    *,
    shared: bool,
) -> Callable[[jax.Array], jax.Array]:
    """``ts -> stack([push(t) for t in ts])``, the passes on the leading axis of ``ts``.

    ``x`` is the batch-first point of ``push``'s linearization. With ``shared``, each ``t`` is
    one sample's tangent (``seed_shape``) standing for ``broadcast_to(t, (B, *seed_shape))``,
    computed without redundant work; otherwise each ``t`` spans the batch (``seed_shape``
    includes it).
    """
    seed_shape = tuple(seed_shape)
    batch = int(x.shape[0])

    def one(t: jax.Array) -> jax.Array:
        return push(jnp.broadcast_to(t, (batch, *seed_shape)) if shared else t)

    def pushed(ts: jax.Array) -> jax.Array:
        ts = varying_like(ts, x)
        # One pass's aval as the tangents vary (built, not indexed: there may be no pass).
        closed = jax.make_jaxpr(one)(varying_like(jnp.zeros(ts.shape[1:], ts.dtype), ts))
        (out,) = _eval(closed.jaxpr, closed.consts, [Passes(ts)])
        out = real(out)
        if isinstance(out, Passes):
            return out.front()
        return jnp.broadcast_to(out, (ts.shape[0], *jnp.shape(out)))  # no tangent reached it

    return pushed


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _compat.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "broadcast_in_dim":
            outs = _broadcast_in_dim(eqn, ins[0])
        elif any(isinstance(v, Bcast) for v in ins):
            outs = _eqn(eqn, ins)
        else:
            outs = None
        if outs is None:
            outs = _vbind(eqn, *(real(v) for v in ins))
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def bind(eqn: Any, *args: Any) -> Any:
    """Evaluate the primitive of one equation on ordinary values, with its parameters."""
    params = _compat.bind_params(eqn)
    return eqn.primitive.bind(*args, **params)


def _vbind(eqn: Any, *args: Any) -> list[Any]:
    """The outputs of one equation, for every pass of its :class:`Passes` arguments."""
    out: Any = None
    if eqn.primitive.name == "conv_general_dilated":
        out = _conv_passes(eqn, *args)
    elif eqn.primitive.name in _UNARY | _BINARY | {"select_n"}:
        out = _elementwise(eqn, args)
    if out is None:
        out = lift(lambda *a: bind(eqn, *a), *args)
    return list(out) if eqn.primitive.multiple_results else [out]


def _elementwise(eqn: Any, args: Sequence[Any]) -> Passes | None:
    """An element-wise operation on passes laid out behind the samples, its other operands
    broadcast over them (``None``: left to ``jax.vmap``, whose rule moves the passes to the
    front and back around the operation, copies XLA does not always fuse away)."""
    passes = [a for a in args if isinstance(a, Passes)]
    if not passes:
        return None
    shape = tuple(jnp.shape(passes[0].value))
    if passes[0].axis != 1 or any((a.axis, jnp.shape(a.value)) != (1, shape) for a in passes):
        return None
    one = shape[:1] + shape[2:]  # one pass's shape
    if any(not isinstance(a, Passes) and jnp.ndim(a) and jnp.shape(a) != one for a in args):
        return None
    kept = (0, *range(2, len(shape)))
    values = [
        a.value
        if isinstance(a, Passes)
        else lax.broadcast_in_dim(a, shape, kept if jnp.ndim(a) else ())
        for a in args
    ]
    return Passes(bind(eqn, *values), 1)


def _one(eqn: Any, *args: Any) -> Any:
    (out,) = _vbind(eqn, *args)
    return out


def _conv_passes(eqn: Any, lhs: Any, rhs: Any) -> Passes | None:
    """A convolution of every pass, the passes folded into the batch axis behind the samples
    (``None``: left to JAX's batching rule)."""
    if not isinstance(lhs, Passes) or isinstance(rhs, Passes):
        return None
    if eqn.params["batch_group_count"] != 1:
        return None
    dn = eqn.params["dimension_numbers"]
    v = lhs.value
    k, n_axis = v.shape[lhs.axis], dn.lhs_spec[0]
    v = jnp.moveaxis(v, lhs.axis, n_axis + 1)
    merged = (*v.shape[:n_axis], v.shape[n_axis] * k, *v.shape[n_axis + 2 :])
    out = bind(eqn, v.reshape(merged), rhs)
    o = dn.out_spec[0]
    out = out.reshape((*out.shape[:o], out.shape[o] // k, k, *out.shape[o + 1 :]))
    return Passes(jnp.moveaxis(out, o + 1, lhs.axis), lhs.axis)


def _eqn(eqn: Any, ins: list[Any]) -> list[Any] | None:
    """Evaluate an equation with symbolic broadcasts, or ``None`` to materialize them."""
    name = eqn.primitive.name
    p = eqn.params
    out_shape = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else ()
    if name in _UNARY:
        (x,) = ins
        return [x.derive(_one(eqn, x.base), out_shape, x.new_axes)]
    if name in _BINARY and len(ins) == 2:
        a, b = ins
        if isinstance(a, Bcast) and isinstance(b, Bcast):
            if a.shape == b.shape and a.new_axes == b.new_axes:
                return [a.derive(_one(eqn, a.base, b.base), out_shape, a.new_axes)]
            return None
        x, other, first = (a, b, True) if isinstance(a, Bcast) else (b, a, False)
        if not _shape(other):
            args = (x.base, other) if first else (other, x.base)
            return [x.derive(_one(eqn, *args), out_shape, x.new_axes)]
        return None
    if name == "transpose":
        (x,) = ins
        perm = p["permutation"]
        new = tuple(i for i, a in enumerate(perm) if a in x.new_axes)
        kept = x.kept()
        base_perm = [kept.index(a) for a in perm if a not in x.new_axes]
        return [x.derive(lift(lambda b: jnp.transpose(b, base_perm), x.base), out_shape, new)]
    if name == "slice":
        return _slice(p, ins[0], out_shape)
    if name == "squeeze" or (name == "reshape" and p.get("dimensions") is None and len(ins) == 1):
        return _reshape(ins[0], out_shape)
    if name == "reduce_sum":
        (x,) = ins
        axes = tuple(p["axes"])
        if set(axes) & set(x.new_axes):
            return None
        kept = x.kept()
        summed = tuple(kept.index(a) for a in axes)
        base = lift(lambda b: jnp.sum(b, axis=summed), x.base)
        remaining = [a for a in range(len(x.shape)) if a not in axes]
        new = tuple(remaining.index(a) for a in x.new_axes)
        return [x.derive(base, out_shape, new)]
    if name == "concatenate":
        dim = p["dimension"]
        first = ins[0]
        if (
            not all(isinstance(v, Bcast) and v.new_axes == first.new_axes for v in ins)
            or dim in first.new_axes
        ):
            return None
        at = first.kept().index(dim)
        base = lift(lambda *bs: jnp.concatenate(bs, axis=at), *(v.base for v in ins))
        return [first.derive(base, out_shape, first.new_axes)]
    if name == "dot_general":
        return _dot_general(p, ins, out_shape)
    if name == "conv_general_dilated":
        return _conv(eqn, ins, out_shape)
    if name in CALLS:
        return _eval(*_compat.open_jaxpr(_compat.called(eqn)), ins)
    return None


def _slice(p: dict[str, Any], x: Bcast, out_shape: tuple[int, ...]) -> list[Any] | None:
    """A slice that keeps the broadcast axes whole is a slice of the base."""
    starts, limits = p["start_indices"], p["limit_indices"]
    strides = p["strides"] or (1,) * len(starts)
    if any((starts[a], limits[a], strides[a]) != (0, x.shape[a], 1) for a in x.new_axes):
        return None
    kept = x.kept()
    base = lift(
        lambda b: lax.slice(
            b,
            [starts[a] for a in kept],
            [limits[a] for a in kept],
            [strides[a] for a in kept],
        ),
        x.base,
    )
    return [x.derive(base, out_shape, x.new_axes)]


def _reshape(x: Bcast, out_shape: tuple[int, ...]) -> list[Any] | None:
    """A reshape that only adds or drops axes of size 1 (a ``squeeze``, the batch-of-one axes
    around a convolution of ``jax.scipy.signal.convolve2d``) is one of the base: every other
    axis stays broadcast or kept, the axes of size 1 it keeps are the base's."""
    big_in = [a for a, n in enumerate(x.shape) if n != 1]
    big_out = [a for a, n in enumerate(out_shape) if n != 1]
    if [x.shape[a] for a in big_in] != [out_shape[a] for a in big_out]:
        return None
    new = tuple(o for i, o in zip(big_in, big_out, strict=True) if i in x.new_axes)
    base_shape = tuple(n for a, n in enumerate(out_shape) if a not in new)
    base = lift(lambda b: jnp.reshape(b, base_shape), x.base)
    return [x.derive(base, out_shape, new)]


def _broadcast_in_dim(eqn: Any, x: Any) -> list[Any] | None:
    """A pure broadcast (new axes only) becomes symbolic; size-1 expansion is left to XLA."""
    shape = tuple(eqn.params["shape"])
    dims = tuple(eqn.params["broadcast_dimensions"])
    behind = isinstance(x, Passes) and x.axis != 0
    if isinstance(x, Bcast):
        kept = x.kept()
        dims = tuple(dims[a] for a in kept)  # where the base axes land
        x, behind = x.base, x.behind
    if _shape(x) != tuple(shape[d] for d in dims) or list(dims) != sorted(dims):
        return None
    return [Bcast(x, shape, tuple(a for a in range(len(shape)) if a not in dims), behind)]


def _dot_general(p: dict[str, Any], ins: list[Any], out_shape: tuple[int, ...]) -> list[Any] | None:
    lhs, rhs = ins
    if isinstance(lhs, Bcast) and isinstance(rhs, Bcast):
        rhs = rhs.materialize()
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    x, is_lhs = (lhs, True) if isinstance(lhs, Bcast) else (rhs, False)
    contract, batch = (lc, lb) if is_lhs else (rc, rb)
    if set(x.new_axes) & (set(contract) | set(batch)):
        return None
    kept = x.kept()
    remap = lambda axes: tuple(kept.index(a) for a in axes)  # noqa: E731
    preferred = p.get("preferred_element_type")
    if is_lhs:
        dnums = ((remap(lc), tuple(rc)), (remap(lb), tuple(rb)))
        base = lift(
            lambda a, b: lax.dot_general(a, b, dnums, preferred_element_type=preferred),
            x.base,
            rhs,
        )
        free = [a for a in range(len(x.shape)) if a not in lc and a not in lb]
        offset = len(lb)
    else:
        dnums = ((tuple(lc), remap(rc)), (tuple(lb), remap(rb)))
        base = lift(
            lambda a, b: lax.dot_general(a, b, dnums, preferred_element_type=preferred),
            lhs,
            x.base,
        )
        free = [a for a in range(len(x.shape)) if a not in rc and a not in rb]
        n_lhs_free = len(_shape(lhs)) - len(lc) - len(lb)
        offset = len(lb) + n_lhs_free
    new = tuple(offset + free.index(a) for a in x.new_axes)
    return [x.derive(base, out_shape, tuple(sorted(new)))]


def _conv(eqn: Any, ins: list[Any], out_shape: tuple[int, ...]) -> list[Any] | None:
    lhs, rhs = ins
    if not isinstance(lhs, Bcast) or isinstance(rhs, Bcast):
        return None
    dn = eqn.params["dimension_numbers"]
    batch_axis = dn.lhs_spec[0]
    if lhs.new_axes != (batch_axis,) or eqn.params["batch_group_count"] != 1:
        return None
    base = lift(lambda b: jnp.expand_dims(b, batch_axis), lhs.base)
    out = _one(eqn, base, rhs)
    out_batch = dn.out_spec[0]
    squeezed = lift(lambda o: jnp.squeeze(o, out_batch), out)
    return [lhs.derive(squeezed, out_shape, (out_batch,))]
