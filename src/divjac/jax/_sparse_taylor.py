"""The exact Laplacian by a collapsed Taylor sweep that stores first-order terms sparse.

:func:`~divjac.jax._taylor.second_order_sweep` over the unit basis carries ``d`` first-order terms
for every element of every intermediate. An element of an intermediate that depends on a few of
the ``d`` inputs (a per-particle or per-electron feature, a window of an image) has only those
few nonzero: this sweep stores them alone, as the forward Laplacian of Li et al. (2023) does with
its sparsity and LapJAX after it. An intermediate ``z`` (per pass shape ``S``, batch included)
carries ``terms`` ``[m, *S]`` and a static index ``idx`` ``[m, *S]``: ``terms[j][e]`` is
``dz_e / dx_{idx[j][e]}`` (``x``'s per-sample position), ``idx`` ``-1`` where ``e`` has fewer
than ``m`` inputs (a zero term). The second-order term is one per element either way (the sum
over the directions), so it is stored as the dense sweep stores it.

An equation whose dependent operands are stored sparse gets each operand's terms laid out on its
output's index (the union of the operands' indices over the elements it combines): then slot
``j`` is the same input direction in every operand, and the dense sweep's rule of the equation
(its linearization pushed per slot, the curvature summed over the slots) is right as it stands.
The index follows element-wise operations, moves of elements (reshape, transpose, slice,
broadcast, concatenation, padding), reductions and products with a constant (``dot_general``
with one dependent operand; a convolution is swept as its kernel's offsets, and a product of a
concatenation or a broadcast split, by :func:`_distributed`); any other equation, or one whose
output would depend on more than half the inputs, gets its operands expanded to the dense
``[d, *S]`` (a one-hot product) and the sweep goes on dense from there. The index is computed
from the jaxpr at trace time (NumPy), and so is this sweep's work against the dense one's
(:func:`sparse_cost`), which decides whether it pays.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core.plan import sparse_sweep_share
from .._core.sparse_index import compressed, positions, union
from . import _compat
from ._ops import ELEMENTWISE, SWEPT_CALLS
from ._tangent_passes import Passes, bind, real, varying_like
from ._taylor import Sweep, inexact

__all__ = ["sparse_cost", "sparse_laplacian"]

_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min"}
# Primitives that bind only inside ``shard_map`` (they read its manual mesh axes): never
# evaluated at compile time, even on constants (JAX 0.12 marks a jitted function's integer
# literals as varying over the mesh axes: ``pvary 0``).
_MESH_BOUND = frozenset(["pvary", "pcast", "axis_index", "psum", "pmax", "pmin", "all_gather"])


@dataclass(frozen=True)
class _Sparse:
    """First-order terms ``terms`` ``[m, *S]`` of the inputs ``idx`` ``[m, *S]`` (``-1``: none)."""

    terms: Any
    idx: np.ndarray


def sparse_laplacian(f: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """The exact per-sample Laplacian ``[B, *out]`` of the batch-first ``f`` at ``x``
    ``[B, *in]`` (samples independent: the caller has checked coupling)."""
    return _run(f, x)[0]


def sparse_cost(
    f: Callable[[jax.Array], jax.Array], x: jax.Array, *, against_colors: bool
) -> float:
    """The sparse sweep's work on first-order terms (:meth:`_SparseSweep.count`, and its
    gathers), as a fraction of the dense sweep's, from the structure alone (nothing is
    computed), by the cost model :func:`divjac._core.plan.sparse_sweep_share`, against the
    passes of a coloring or of the unit basis."""
    box: list[_SparseSweep] = []

    def run(z: jax.Array) -> jax.Array:
        lap, sweep = _run(f, z)
        box.append(sweep)
        return lap

    jax.eval_shape(run, x)
    sweep = box[0]
    return sparse_sweep_share(
        sweep.stored,
        sweep.dense,
        moved=sweep.moved,
        convolved=sweep.convolved,
        against_colors=against_colors,
    )


def _run(f: Callable[[jax.Array], jax.Array], x: jax.Array) -> tuple[jax.Array, _SparseSweep]:
    n = math.prod(x.shape[1:])
    traced = jax.make_jaxpr(lambda p: jnp.asarray(f(p)))(x)
    closed = jax.make_jaxpr(lambda p: _distributed(traced.jaxpr, traced.consts, p))(x)
    labels = np.broadcast_to(np.arange(n).reshape(1, 1, *x.shape[1:]), (1, *x.shape))
    seed = _Sparse(varying_like(jnp.ones((1, *x.shape), x.dtype), x), labels)
    sweep = _SparseSweep(n)
    ((y, _, s),) = sweep.eval(closed.jaxpr, closed.consts, [(x, seed, None)])
    lap = jnp.zeros_like(y) if s is None else jnp.broadcast_to(s, jnp.shape(y))
    return lap, sweep


def _distributed(jaxpr: Any, consts: Sequence[Any], x: jax.Array) -> Any:
    """``jaxpr`` evaluated with its products by a constant distributed over their dependent
    operand where that keeps terms apart: ``concatenate([a, b]) @ W`` along a contracted axis as
    ``a @ W_a + b @ W_b``, ``broadcast(g) @ W`` along free axes as ``broadcast(g @ W)`` (a
    FermiNet layer on ``[h_i, mean_j h_j]``: the sparse ``h_i`` part and the shared part, each
    product at its own size)."""
    env: dict[Any, Any] = {}
    made: dict[Any, Any] = {}
    dependent: set[Any] = set(jaxpr.invars)

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _compat.Literal) else env[v]

    def depends(v: Any) -> bool:
        return not isinstance(v, _compat.Literal) and v in dependent

    def product(v: Any, rhs: Any, eqn: Any) -> Any:
        (lc, rc), _ = eqn.params["dimension_numbers"]
        src = made.get(v)
        if src is not None and src.primitive.name == "concatenate":
            dim = src.params["dimension"]
            if dim in lc:
                axis, start, total = rc[lc.index(dim)], 0, None
                for part in src.invars:
                    width = part.aval.shape[dim]
                    piece = lax.slice_in_dim(rhs, start, start + width, axis=axis)
                    start += width
                    own = depends(part)
                    term = product(part, piece, eqn) if own else bind(eqn, read(part), piece)
                    total = term if total is None else total + term
                return total
        if src is not None and src.primitive.name == "broadcast_in_dim" and len(src.invars) == 1:
            (g,) = src.invars
            shape = tuple(src.params["shape"])
            if not isinstance(g, _compat.Literal) and len(g.aval.shape) == len(shape):
                grown = [a for a in range(len(shape)) if g.aval.shape[a] != shape[a]]
                (_, (lb, _)) = eqn.params["dimension_numbers"]
                if not set(grown) & (set(lc) | set(lb)):
                    out_shape = tuple(eqn.outvars[0].aval.shape)
                    return jnp.broadcast_to(product(g, rhs, eqn), out_shape)
        return bind(eqn, read(v), rhs)

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    env[jaxpr.invars[0]] = x
    for eqn in jaxpr.eqns:
        lhs = eqn.invars[0] if eqn.invars else None
        if eqn.primitive.name == "dot_general" and depends(lhs) and not depends(eqn.invars[1]):
            outs = [product(lhs, read(eqn.invars[1]), eqn)]
        elif _plain_conv(eqn) and depends(lhs) and not depends(eqn.invars[1]):
            with jax.named_scope(_CONV_SCOPE):
                outs = [_conv_as_products(eqn, read(lhs), read(eqn.invars[1]))]
        else:
            out = bind(eqn, *(read(v) for v in eqn.invars))
            outs = list(out) if eqn.primitive.multiple_results else [out]
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
            made[var] = eqn
            if any(depends(v) for v in eqn.invars):
                dependent.add(var)
    (out,) = (read(v) for v in jaxpr.outvars)
    return out


_CONV_SCOPE = "divjac_conv_offsets"


def _plain_conv(eqn: Any) -> bool:
    p = eqn.params
    return (
        eqn.primitive.name == "conv_general_dilated"
        and p["feature_group_count"] == 1
        and p["batch_group_count"] == 1
        and all(d == 1 for d in p["lhs_dilation"])
    )


def _conv_as_products(eqn: Any, lhs: Any, rhs: Any) -> Any:
    """A convolution as the sum over the kernel's offsets of a strided slice of the padded input
    times that offset's ``[out, in]`` matrix: moves and products over the input channels, which
    keep an output element's terms to its window."""
    p = eqn.params
    dn = p["dimension_numbers"]
    x = jnp.transpose(lhs, dn.lhs_spec)  # (N, C, *spatial)
    kernel = jnp.transpose(rhs, dn.rhs_spec)  # (O, I, *window)
    config = [(0, 0, 0), (0, 0, 0), *((lo, hi, 0) for lo, hi in p["padding"])]
    x = lax.pad(x, jnp.zeros((), x.dtype), config)
    out = eqn.outvars[0].aval.shape
    sizes = [out[a] for a in dn.out_spec[2:]]
    total: Any = None
    for offset in itertools.product(*(range(n) for n in kernel.shape[2:])):
        starts = [o * d for o, d in zip(offset, p["rhs_dilation"], strict=True)]
        limits = [
            a + (n - 1) * st + 1
            for a, n, st in zip(starts, sizes, p["window_strides"], strict=True)
        ]
        piece = lax.slice(x, [0, 0, *starts], [*x.shape[:2], *limits], [1, 1, *p["window_strides"]])
        term = lax.dot_general(
            piece,
            kernel[tuple([slice(None), slice(None), *offset])],
            (((1,), (1,)), ((), ())),
            precision=p["precision"],
            preferred_element_type=p["preferred_element_type"],
        )  # (N, *spatial, O)
        total = term if total is None else total + term
    held = [0, *range(2, len(out)), 1]  # the canonical axes (N, O, *spatial) of ``total``
    return jnp.transpose(total, [held.index(dn.out_spec.index(a)) for a in range(len(out))])


class _SparseSweep(Sweep):
    """The collapsed sweep over the unit basis of ``k`` inputs, first-order terms stored sparse
    while that pays; ``stored`` and ``dense`` count the work on first-order terms it does and
    the dense sweep would (:meth:`count`), ``moved`` the elements its gathers move,
    ``convolved`` the part of ``stored`` in products of a convolution's offsets."""

    def __init__(self, k: int) -> None:
        super().__init__(None, apart=False)
        self.k = k
        self.stored = 0
        self.dense = 0
        self.moved = 0
        self.convolved = 0

    def constant(self, eqn: Any, values: list[Any]) -> Any:
        """Integer values computed from constants only (the indices of a gather) are computed
        now, so that the index can follow them (:func:`_moved`); not those of the mesh
        (:data:`_MESH_BOUND`)."""
        concrete = not any(isinstance(v, _compat.Tracer) for v in values)
        if (
            concrete
            and eqn.primitive.name not in _MESH_BOUND
            and not any(inexact(v.aval) for v in eqn.outvars)
        ):
            with jax.ensure_compile_time_eval():
                return bind(eqn, *values)
        return bind(eqn, *values)

    def equation(self, eqn: Any, ins: list[Any], dep: list[int]) -> list[Any]:
        if eqn.primitive.name in SWEPT_CALLS:  # its equations are counted one by one
            return super().equation(eqn, ins, dep)
        sparse = [i for i in dep if isinstance(ins[i][1], _Sparse)]
        planned = _layout(eqn, ins, dep, self.k) if len(sparse) == len(dep) else None
        if planned is None and eqn.primitive.name == "reduce_sum" and sparse == [0]:
            # Summed while expanded: the one-hot product contracts the summed axes too.
            ((p, t, s),) = ins
            y, dense_t = bind(eqn, p), _expand(t, self.k, eqn.params["axes"])
            outs = [(y, dense_t, None if s is None else bind(eqn, s))]
            self.count(eqn, outs, [None])
            return outs
        if planned is None:
            dense = [(p, _expand(t, self.k) if isinstance(t, _Sparse) else t, s) for p, t, s in ins]
            outs = super().equation(eqn, dense, dep)
            self.count(eqn, outs, [None] * len(outs))
            return outs
        laid, idxs = planned
        # A gather per element of an operand laid out anew (counted as work too).
        self.moved += sum(math.prod(laid[i].shape) for i in laid if laid[i] is not ins[i][1].terms)
        pushed = [(p, Passes(laid[i]) if i in laid else t, s) for i, (p, t, s) in enumerate(ins)]
        sparse_outs: list[Any] = [
            (y, None if t is None else _Sparse(real(t).front(), idx), s)
            for (y, t, s), idx in zip(super().equation(eqn, pushed, dep), idxs, strict=True)
        ]
        self.count(eqn, sparse_outs, idxs)
        return sparse_outs

    def count(self, eqn: Any, outs: list[Any], idxs: Sequence[np.ndarray | None]) -> None:
        """Add the work of ``eqn``'s first-order terms: per term and output element, the
        length of a product's contraction (1 for the other equations), and of the products
        of a convolution's offsets to ``convolved`` too."""
        work, convolved = 1, False
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            work = math.prod(eqn.invars[0].aval.shape[a] for a in lc)
            convolved = _CONV_SCOPE in str(eqn.source_info.name_stack)
        for (y, t, _), idx in zip(outs, idxs, strict=True):
            if t is not None:
                size = math.prod(jnp.shape(y)) * work
                self.dense += self.k * size
                stored = (self.k if idx is None else idx.shape[0]) * size
                self.stored += stored
                self.convolved += stored if convolved else 0


def _layout(
    eqn: Any, ins: list[Any], dep: list[int], k: int
) -> tuple[dict[int, Any], list[np.ndarray]] | None:
    """The dependent operands' terms laid out on the outputs' index, and that index, for the
    equations that keep terms sparse (``None``: go dense)."""
    name = eqn.primitive.name
    tangents: dict[int, _Sparse] = {i: ins[i][1] for i in dep}
    shape = tuple(eqn.outvars[0].aval.shape)
    if len(eqn.outvars) != 1:
        return None
    if name in ELEMENTWISE or (name == "custom_jvp_call" and _elementwise_call(eqn)):
        if len(tangents) == 1 and name != "custom_jvp_call":  # broadcast along axes of one
            ((i, t),) = tangents.items()
            if t.idx.ndim == len(shape) + 1:
                return {i: t.terms}, [np.broadcast_to(t.idx, (t.idx.shape[0], *shape))]
        if any(t.idx.shape[1:] != shape for t in tangents.values()):
            return None
        idx = union(np.concatenate([t.idx for t in tangents.values()]))
        if 2 * idx.shape[0] > k:
            return None
        return {i: _laid(t, idx) for i, t in tangents.items()}, [idx]
    if name == "concatenate":
        m = max(t.idx.shape[0] for t in tangents.values())
        parts = [
            _padded(tangents[i].idx, m, -1) if i in tangents else np.full((m, *v.aval.shape), -1)
            for i, v in enumerate(eqn.invars)
        ]
        idx = np.concatenate(parts, axis=eqn.params["dimension"] + 1)
        return {i: _padded(t.terms, m, 0) for i, t in tangents.items()}, [idx]
    if dep != [0]:
        return None
    t = tangents[0]
    if name in _REDUCTIONS:
        axes = tuple(a + 1 for a in eqn.params["axes"])
        kept = [a for a in range(t.idx.ndim) if a not in axes]
        folded = t.idx.transpose((*axes, *kept)).reshape(-1, *(t.idx.shape[a] for a in kept[1:]))
        idx = union(folded)
        if 2 * idx.shape[0] > k:
            return None
        back = np.broadcast_to(np.expand_dims(idx, axes), (idx.shape[0], *t.idx.shape[1:]))
        return {0: _laid(t, back)}, [idx]
    if name == "dot_general":
        return _dot(eqn, t, shape, k)
    if name == "gather":
        moved = _gathered_index(eqn, t.idx, ins[1][0])
        return None if moved is None else ({0: t.terms}, [moved])
    moved = _moved(eqn, t.idx)
    return None if moved is None else ({0: t.terms}, [moved])


def _dot(
    eqn: Any, t: _Sparse, shape: tuple[int, ...], k: int
) -> tuple[dict[int, Any], list[np.ndarray]] | None:
    """``dot_general`` of a sparse left operand and a constant right one: the output element
    ``(batch, free, rhs free)`` depends on the union over the contracted axes."""
    (contract, _), (batch, _) = eqn.params["dimension_numbers"]
    ndim = t.idx.ndim - 1
    free = [a for a in range(ndim) if a not in contract and a not in batch]
    order = [*batch, *free, *contract]
    arranged = t.idx.transpose((0, *(a + 1 for a in order)))
    kept_shape = arranged.shape[1 : 1 + len(batch) + len(free)]
    folded = np.moveaxis(arranged.reshape(arranged.shape[0], *kept_shape, -1), -1, 1)
    idx = union(folded.reshape(-1, *kept_shape))
    m = idx.shape[0]
    if 2 * m > k:
        return None
    # Back on the operand: the same index over the contracted axes.
    spread = np.broadcast_to(
        idx.reshape(*idx.shape, *(1 for _ in contract)), (m, *arranged.shape[1:])
    )
    back = spread.transpose((0, *(1 + order.index(a) for a in range(ndim))))
    out = np.broadcast_to(
        idx.reshape(*idx.shape, *(1 for _ in range(len(shape) - len(kept_shape)))), (m, *shape)
    )
    return {0: _laid(t, back)}, [out]


def _moved(eqn: Any, idx: np.ndarray) -> np.ndarray | None:
    """The index of an equation that moves elements without combining them (``None``: other)."""
    name, p = eqn.primitive.name, eqn.params
    m = idx.shape[0]
    out_shape = tuple(eqn.outvars[0].aval.shape)
    if (name == "reshape" and p.get("dimensions") is None) or name == "squeeze":
        return idx.reshape(m, *out_shape)
    if name == "transpose":
        return idx.transpose((0, *(a + 1 for a in p["permutation"])))
    if name == "broadcast_in_dim":
        if len(eqn.invars) != 1:
            return None
        placed = [1] * len(out_shape)
        for src, dst in enumerate(p["broadcast_dimensions"]):
            placed[dst] = idx.shape[1 + src]
        return np.broadcast_to(idx.reshape(m, *placed), (m, *out_shape))
    if name == "slice":
        strides = p["strides"] or (1,) * len(out_shape)
        window = zip(p["start_indices"], p["limit_indices"], strides, strict=True)
        index = [slice(None), *(slice(a, b, s) for a, b, s in window)]
        return idx[tuple(index)]
    if name == "rev":
        return np.flip(idx, tuple(a + 1 for a in p["dimensions"]))
    if name == "pad":
        config = p["padding_config"]
        if any(lo < 0 or hi < 0 or inner != 0 for lo, hi, inner in config):
            return None
        return np.pad(idx, [(0, 0), *((lo, hi) for lo, hi, _ in config)], constant_values=-1)
    return None


def _gathered_index(eqn: Any, idx: np.ndarray, indices: Any) -> np.ndarray | None:
    """The index of a gather by indices known now (computed from constants): the gather of
    each slot of the index (``None`` where the indices depend on traced values)."""
    if isinstance(indices, _compat.Tracer):
        return None
    with jax.ensure_compile_time_eval():
        slots = [np.asarray(bind(eqn, jnp.asarray(i + 1, jnp.int32), indices)) for i in idx]
    moved = np.stack(slots).astype(np.int64) - 1
    return np.where(moved < 0, -1, moved)  # a filled (out of bounds) element has no input


def _elementwise_call(eqn: Any) -> bool:
    """A ``custom_jvp`` function (``relu``, ``softplus``, ...) made of element-wise equations on
    arrays of its operands' shape."""
    jaxpr, _ = _compat.open_jaxpr(_compat.called(eqn))
    shapes = {tuple(v.aval.shape) for v in eqn.invars} | {tuple(v.aval.shape) for v in eqn.outvars}
    return len(shapes) == 1 and _elementwise_jaxpr(jaxpr, shapes.pop())


def _elementwise_jaxpr(jaxpr: Any, shape: tuple[int, ...]) -> bool:
    for e in jaxpr.eqns:
        if e.primitive.name in SWEPT_CALLS or e.primitive.name == "custom_jvp_call":
            sub, _ = _compat.open_jaxpr(_compat.called(e))
            if not _elementwise_jaxpr(sub, shape):
                return False
        elif e.primitive.name not in ELEMENTWISE and not (
            e.primitive.name == "broadcast_in_dim" and not e.invars[0].aval.shape
        ):
            return False
        if any(tuple(v.aval.shape) not in ((), shape) for v in e.outvars):
            return False
    return True


# --- the index: unions, layouts, expansion -------------------------------------------------------


def _laid(t: _Sparse, idx: np.ndarray) -> Any:
    """``t``'s terms ``[m, *S]`` on the index ``idx`` (``[m', *S]``, a superset of ``t.idx``
    per element): slot ``j`` holds the term of input ``idx[j]``, zero where ``t`` has none."""
    if t.idx.shape == idx.shape and np.array_equal(t.idx, idx):
        return t.terms
    pos = positions(t.idx, idx).astype(np.int32)
    padded = jnp.concatenate([t.terms, jnp.zeros((1, *t.terms.shape[1:]), t.terms.dtype)])
    return jnp.take_along_axis(padded, jnp.asarray(pos), axis=0, mode="clip")


def _padded(a: Any, m: int, fill: int) -> Any:
    """``a`` ``[m0, *S]`` padded with ``fill`` to ``[m, *S]``."""
    if a.shape[0] == m:
        return a
    if isinstance(a, np.ndarray):
        return np.concatenate([a, np.full((m - a.shape[0], *a.shape[1:]), fill, a.dtype)])
    return jnp.concatenate([a, jnp.zeros((m - a.shape[0], *a.shape[1:]), a.dtype)])


def _expand(t: _Sparse, k: int, axes: Sequence[int] = ()) -> Passes:
    """The dense first-order terms ``[k, *S]`` of ``t``, summed over its ``axes`` (of ``S``):
    one product with the one-hot matrix of its index (contracting the slots and the summed
    axes), over the axes along which the index varies only."""
    core, shape = compressed(t.idx)
    terms = t.terms
    varying = [a for a in range(len(shape)) if core.shape[1 + a] > 1]
    flat = [a for a in axes if a not in varying]  # the index is the same along these: sum first
    if flat:
        terms = terms.sum(tuple(1 + a for a in flat))
    rest = [a for a in range(len(shape)) if a not in flat]
    onehot = core.reshape(core.shape[0], *(shape[a] for a in varying))[..., None] == np.arange(k)
    summed = [a for a in axes if a in varying]
    batch = [a for a in varying if a not in axes]
    dims = (
        ((0, *(1 + rest.index(a) for a in summed)), (0, *(1 + varying.index(a) for a in summed))),
        (tuple(1 + rest.index(a) for a in batch), tuple(1 + varying.index(a) for a in batch)),
    )
    dense = lax.dot_general(
        terms, jnp.asarray(onehot, terms.dtype), dims, precision=lax.Precision.HIGHEST
    )
    order = [*batch, *(a for a in rest if a not in varying), -1]  # the product's axes
    kept = [a for a in range(len(shape)) if a not in axes]
    return Passes(dense.transpose((len(order) - 1, *(order.index(a) for a in kept))))
