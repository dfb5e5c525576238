"""Pushing a tangent that is the same in every sample without repeating work per sample.

The batch trick pushes one tangent ``broadcast(e)`` (the same ``e`` in every sample) through the
linearized batched function. Its first linear operations (the first ``dot_general`` of an MLP,
the first convolution of a CNN) act on a batch-constant array, so computing them on the
broadcast array repeats identical work ``B`` times; XLA does not sink the broadcast through a
dot or a convolution. Hand-written ``vmap(jacfwd(f))`` does not pay this: its basis is unbatched.

:func:`shared_push` evaluates the linear program with broadcasts kept symbolic: a value may be
a :class:`_Bcast` (a base array and the axes broadcast over), and dot products, convolutions,
element-wise operations, transposes, concatenations and sums are computed on the base. A value
is materialized (broadcast for real) only where an operation needs it, typically the first
product with a batch-dependent residual. The result is the same function, with the batch-constant
prefix computed once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

__all__ = ["shared_push"]

_UNARY = {"neg", "convert_element_type", "copy", "copy_p", "reduce_precision", "real", "imag"}
_BINARY = {"add", "add_any", "sub", "mul", "div", "max", "min"}
_CALLS = {"jit", "pjit", "closed_call", "core_call"}


@dataclass(frozen=True)
class _Bcast:
    """``broadcast`` of ``base`` to ``shape`` with new axes ``new_axes`` (base fills the others)."""

    base: Any
    shape: tuple[int, ...]
    new_axes: tuple[int, ...]

    def kept(self) -> list[int]:
        return [a for a in range(len(self.shape)) if a not in self.new_axes]

    def materialize(self) -> Any:
        return lax.broadcast_in_dim(self.base, self.shape, tuple(self.kept()))


def _real(v: Any) -> Any:
    return v.materialize() if isinstance(v, _Bcast) else v


def shared_push(
    push: Callable[[jax.Array], jax.Array], batch: int, seed_shape: Sequence[int], dtype: Any
) -> Callable[[jax.Array], jax.Array]:
    """``e -> push(broadcast_to(e, (batch, *seed_shape)))``, computed without redundant work."""
    seed_shape = tuple(seed_shape)
    closed = jax.make_jaxpr(lambda e: push(jnp.broadcast_to(e, (batch, *seed_shape))))(
        jax.ShapeDtypeStruct(seed_shape, dtype)
    )

    def pushed(e: jax.Array) -> jax.Array:
        (out,) = _eval(closed.jaxpr, closed.consts, [e])
        return _real(out)

    return pushed


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "broadcast_in_dim":
            outs = _broadcast_in_dim(eqn, ins[0])
        elif any(isinstance(v, _Bcast) for v in ins):
            outs = _eqn(eqn, ins)
        else:
            outs = None
        if outs is None:
            out = _bind(eqn, *(_real(v) for v in ins))
            outs = list(out) if eqn.primitive.multiple_results else [out]
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _eqn(eqn: Any, ins: list[Any]) -> list[Any] | None:
    """Evaluate an equation with symbolic broadcasts, or ``None`` to materialize them."""
    name = eqn.primitive.name
    p = eqn.params
    out_shape = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else ()
    if name in _UNARY:
        (x,) = ins
        return [_Bcast(_bind(eqn, x.base), out_shape, x.new_axes)]
    if name in _BINARY and len(ins) == 2:
        a, b = ins
        if isinstance(a, _Bcast) and isinstance(b, _Bcast):
            if a.shape == b.shape and a.new_axes == b.new_axes:
                return [_Bcast(_bind(eqn, a.base, b.base), out_shape, a.new_axes)]
            return None
        x, other, first = (a, b, True) if isinstance(a, _Bcast) else (b, a, False)
        if jnp.ndim(other) == 0:
            args = (x.base, other) if first else (other, x.base)
            return [_Bcast(_bind(eqn, *args), out_shape, x.new_axes)]
        return None
    if name == "transpose":
        (x,) = ins
        perm = p["permutation"]
        new = tuple(i for i, a in enumerate(perm) if a in x.new_axes)
        kept = x.kept()
        base_perm = [kept.index(a) for a in perm if a not in x.new_axes]
        return [_Bcast(jnp.transpose(x.base, base_perm), out_shape, new)]
    if name == "reduce_sum":
        (x,) = ins
        axes = tuple(p["axes"])
        if set(axes) & set(x.new_axes):
            return None
        kept = x.kept()
        base = jnp.sum(x.base, axis=tuple(kept.index(a) for a in axes))
        remaining = [a for a in range(len(x.shape)) if a not in axes]
        new = tuple(remaining.index(a) for a in x.new_axes)
        return [_Bcast(base, out_shape, new)]
    if name == "concatenate":
        dim = p["dimension"]
        first = ins[0]
        if (
            not all(isinstance(v, _Bcast) and v.new_axes == first.new_axes for v in ins)
            or dim in first.new_axes
        ):
            return None
        base = jnp.concatenate([v.base for v in ins], axis=first.kept().index(dim))
        return [_Bcast(base, out_shape, first.new_axes)]
    if name == "dot_general":
        return _dot_general(p, ins, out_shape)
    if name == "conv_general_dilated":
        return _conv(eqn, ins, out_shape)
    if name in _CALLS:
        sub = p.get("jaxpr", p.get("call_jaxpr"))
        closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, [])
        return _eval(closed.jaxpr, closed.consts, ins)
    return None


def _bind(eqn: Any, *args: Any) -> Any:
    """Evaluate the primitive of one equation on ordinary values, with its parameters."""
    params = eqn.primitive.get_bind_params(eqn.params)
    return eqn.primitive.bind(*args, **params)


def _broadcast_in_dim(eqn: Any, x: Any) -> list[Any] | None:
    """A pure broadcast (new axes only) becomes symbolic; size-1 expansion is left to XLA."""
    shape = tuple(eqn.params["shape"])
    dims = tuple(eqn.params["broadcast_dimensions"])
    if isinstance(x, _Bcast):
        kept = x.kept()
        dims = tuple(dims[a] for a in kept)  # where the base axes land
        x = x.base
    if tuple(jnp.shape(x)) != tuple(shape[d] for d in dims) or list(dims) != sorted(dims):
        return None
    return [_Bcast(x, shape, tuple(a for a in range(len(shape)) if a not in dims))]


def _dot_general(p: dict[str, Any], ins: list[Any], out_shape: tuple[int, ...]) -> list[Any] | None:
    lhs, rhs = ins
    if isinstance(lhs, _Bcast) and isinstance(rhs, _Bcast):
        rhs = rhs.materialize()
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    x, is_lhs = (lhs, True) if isinstance(lhs, _Bcast) else (rhs, False)
    contract, batch = (lc, lb) if is_lhs else (rc, rb)
    if set(x.new_axes) & (set(contract) | set(batch)):
        return None
    kept = x.kept()
    remap = lambda axes: tuple(kept.index(a) for a in axes)  # noqa: E731
    if is_lhs:
        dnums = ((remap(lc), tuple(rc)), (remap(lb), tuple(rb)))
        base = lax.dot_general(
            x.base, rhs, dnums, preferred_element_type=p.get("preferred_element_type")
        )
        free = [a for a in range(len(x.shape)) if a not in lc and a not in lb]
        offset = len(lb)
    else:
        dnums = ((tuple(lc), remap(rc)), (tuple(lb), remap(rb)))
        base = lax.dot_general(
            lhs, x.base, dnums, preferred_element_type=p.get("preferred_element_type")
        )
        free = [a for a in range(len(x.shape)) if a not in rc and a not in rb]
        n_lhs_free = len(lhs.shape) - len(lc) - len(lb)
        offset = len(lb) + n_lhs_free
    new = tuple(offset + free.index(a) for a in x.new_axes)
    return [_Bcast(base, out_shape, tuple(sorted(new)))]


def _conv(eqn: Any, ins: list[Any], out_shape: tuple[int, ...]) -> list[Any] | None:
    lhs, rhs = ins
    if not isinstance(lhs, _Bcast) or isinstance(rhs, _Bcast):
        return None
    dn = eqn.params["dimension_numbers"]
    batch_axis = dn.lhs_spec[0]
    if lhs.new_axes != (batch_axis,) or eqn.params["batch_group_count"] != 1:
        return None
    base = jnp.expand_dims(lhs.base, batch_axis)
    out = _bind(eqn, base, rhs)
    out_batch = dn.out_spec[0]
    return [_Bcast(jnp.squeeze(out, out_batch), out_shape, (out_batch,))]
