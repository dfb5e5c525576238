"""JAX's primitives for divjac's transforms (:mod:`divjac._transforms`, :mod:`divjac._divergence`).

Passes are pushed through the JVP of ``jax.linearize`` (or the VJP of ``jax.vjp``) a chunk at a
time (``lax.map`` over the chunks) by :func:`~divjac.jax._tangent_passes.pushes`, which keeps the work of
each sample on the device holding it and computes the batch-constant prefix of the linear
program (the first matmul of an MLP, the first convolution of a CNN) once for a tangent that is
the same in every sample. Passes read their own entries with gathers within each sample.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import sparse as jsparse

from .._backend import Array, Backend, Entries, Finish, Linear, Point, Seed
from .._core import nonzero_codes, plan
from .._core.plan import Chunks
from .._errors import OptionError
from . import _compat, _sharding, _sparse_taylor, _taylor, _taylor_high
from ._detect import Traced, is_array, trace
from ._tangent_passes import pushes, varying_axes, varying_like

__all__ = ["BACKEND", "SEED_MATRIX_ELEMENTS", "JaxBackend"]

#: Largest seed matrix (passes x elements) built as a constant (see ``JaxBackend.indicators``).
SEED_MATRIX_ELEMENTS = 1 << 20

R = TypeVar("R")


class _Linearized(Linear):
    """``jax.linearize`` (or ``jax.vjp``) of the batch-first function, at the call's input."""

    def __init__(self, point: Point[Traced], reverse: bool) -> None:
        aux = None
        if reverse:
            if point.has_aux:
                y, vjp_fn, aux = jax.vjp(point.g, point.xb, has_aux=True)
            else:
                y, vjp_fn = jax.vjp(point.g, point.xb)

            def push(ct: jax.Array) -> jax.Array:
                # Seeds are built like the input; a cotangent has the output's dtype, which
                # differs where f promotes (a float32 input plus a float64 constant).
                return vjp_fn(ct.astype(y.dtype))[0]

        elif point.has_aux:
            y, push, aux = jax.linearize(point.g, point.xb, has_aux=True)
        else:
            y, push = jax.linearize(point.g, point.xb)
        self.value, self.aux = y, aux
        self._push: Callable[[jax.Array], jax.Array] = push
        self._x = point.xb
        self._seed_sample = point.out_sample if reverse else point.in_sample

    def passes(
        self, inputs: jax.Array, seed: Seed, finish: Finish, chunks: Chunks, *, shared: bool
    ) -> jax.Array:
        if int(inputs.shape[0]) == 1 and not shared:
            # One pass (Hutchinson's single probe): a plain JVP or VJP without a pass axis,
            # the program hand-written code runs (the axis of one cost a jitted diffrax CNF
            # training step 1.11-1.24x that code).
            c = inputs[0]
            t = varying_like(seed(c), self._x)
            return cast(jax.Array, finish(c, t, self._push(t)))[None]
        seed_shape = self._seed_sample if shared else (self._x.shape[0], *self._seed_sample)
        pushed = pushes(self._push, self._x, seed_shape, shared=shared)

        def run(cs: jax.Array) -> jax.Array:
            ts = jax.vmap(seed)(cs)
            return jax.vmap(finish)(cs, ts, pushed(ts))

        k, chunk = int(inputs.shape[0]), chunks.size
        if chunk >= k:
            return run(inputs)
        # Differentiated (training through the passes), a chunk keeps its input, not its
        # intermediates: the backward recomputes it, so memory follows the chunk size (CSE
        # cannot merge a recomputation of lax.map's body with its first run).
        run = jax.checkpoint(run, prevent_cse=False)
        full = k - k % chunk
        head = lax.map(run, inputs[:full].reshape(full // chunk, chunk, *inputs.shape[1:]))
        head = head.reshape(full, *head.shape[2:])
        if full == k:
            return head
        return jnp.concatenate([head, run(inputs[full:])])


def _has_while(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` or a program inside it runs a ``while`` loop that reverse mode must
    differentiate: one inside a ``custom_*`` primitive (``custom_jvp`` / ``custom_vjp``
    functions, ``lax.custom_linear_solve``, ``lax.custom_root``) does not count: JAX
    differentiates its rules, not its body (``jax.scipy.special.exp1`` and
    ``jax.scipy.sparse.linalg.cg`` loop and have gradients)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "while":
            return True
        if name.startswith("custom_"):
            continue
        if any(_has_while(sub) for sub in _compat.sub_jaxprs(eqn)):
            return True
    return False


class JaxBackend(Backend[Traced]):
    """The transforms on JAX arrays (``jax.linearize``, ``jax.vjp``, ``jax.vmap``)."""

    array_noun = "array"
    param_grad_hint = "take jax.grad of a loss built on the result"
    input_cast_hint = "x.astype(jnp.float32)"
    output_cast_hint = "cast integer or boolean results"
    randomness_example = "jax.random.key(0)"
    # XLA fuses a collapsed sweep into loops over the samples that hold one intermediate's
    # terms, not every one that bytes_per_pass counts: a tanh MLP d -> 256 -> 256 -> 1 at B =
    # 256 ran at d = 64 in one chunk 25.8 ms, in two 28.6; at d = 256 in chunks of 43-86
    # passes 109-113 ms, of 128 or all 166 (1 thread, 32 MiB cache).
    sweep_cache_share = 2
    narrow_indices = True

    def is_array(self, x: Any) -> bool:
        return is_array(x)

    def is_array_spec(self, x: Any) -> bool:
        return isinstance(x, jax.ShapeDtypeStruct)

    def is_floating_input(self, dtype: Any) -> bool:
        return bool(jnp.issubdtype(dtype, jnp.floating))

    is_floating_output = is_floating_input

    def itemsize(self, x: Array) -> int:
        return int(jnp.dtype(x.dtype).itemsize)

    def asarray(self, x: Any, like: Array) -> jax.Array:
        return jnp.asarray(x, like.dtype)

    def moveaxis(self, x: Array, source: int, destination: int) -> jax.Array:
        return jnp.moveaxis(x, source, destination)

    def reshape_batch(self, x: Array, shape: Sequence[int]) -> jax.Array:
        return _sharding.reshape(x, shape, _sharding.sharded_like(x, slice(1)))

    def zeros_like(self, x: Array) -> jax.Array:
        return jnp.zeros_like(x)

    def concatenate(self, arrays: Sequence[Array]) -> jax.Array:
        return jnp.concatenate(arrays)

    def stack(self, arrays: Sequence[Array]) -> jax.Array:
        return jnp.stack(arrays)

    def map_stacked(
        self, fn: Callable[[jax.Array], jax.Array], xs: jax.Array, chunk: int
    ) -> jax.Array:
        """``jax.vmap``, or ``lax.map`` over chunks of ``chunk`` (not a Python loop, which the
        trace would unroll: its compile time would grow with the number of chunks)."""
        if chunk >= int(xs.shape[0]):
            return jax.vmap(fn)(xs)
        return lax.map(fn, xs, batch_size=chunk)

    def per_sample(self, fn: Callable[[jax.Array], Any], xb: jax.Array) -> jax.Array:
        return jax.vmap(fn)(xb)

    @staticmethod
    def fori_loop(n: int, body: Callable[[Any, Any], Any], carry: Any) -> Any:
        """``lax.fori_loop`` of static bounds (a ``scan``: reverse-differentiable)."""
        return lax.fori_loop(0, n, body, carry)

    def batch_shards(self, xb: Array) -> int:
        """From the array's sharding (a concrete array, or a tracer of an explicitly sharded
        mesh axis); a tracer under ``jit`` of an ``Auto`` mesh carries none (1). Inside
        ``shard_map`` the array is already the shard's own."""
        if isinstance(xb, _compat.Tracer):
            sharding = jax.typeof(xb).sharding
        else:
            sharding = getattr(xb, "sharding", None)
        spec = getattr(sharding, "spec", None)
        if not spec or spec[0] is None:
            return 1
        mesh = sharding.mesh
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        manual = set(getattr(mesh, "manual_axes", ()))
        return math.prod(mesh.shape[a] for a in axes if a not in manual)

    def memory_available(self, x: Array) -> int | None:
        """``bytes_limit - bytes_in_use`` of the device (the least of this process's devices of
        a sharded array; this process's default device for a tracer), where it reports them
        (not on CPU). Only addressable devices are asked: under ``jax.distributed`` the other
        processes' devices cannot report, and their shards have the same shape."""
        sharding = None if isinstance(x, _compat.Tracer) else getattr(x, "sharding", None)
        devices = (
            jax.local_devices()[:1] if sharding is None else list(sharding.addressable_devices)
        )
        free = []
        for device in devices:
            stats = device.memory_stats()
            if not stats or "bytes_limit" not in stats:
                return None
            free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
        return min(free)

    trace = staticmethod(trace)

    def functional(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """A Flax nnx module (or its bound method) is called on a copy of its current state,
        merged anew at every evaluation: nnx refuses mutation from inside a JAX transform
        (BatchNorm's statistics in training mode, Dropout's RNG counts), and divjac's traces
        and passes must not change the caller's module. Other functions are left as they are.
        """
        nnx = sys.modules.get("flax.nnx")
        if nnx is None:
            return fun
        module = fun if isinstance(fun, nnx.Module) else getattr(fun, "__self__", None)
        if not isinstance(module, nnx.Module):
            return fun
        graphdef, state = nnx.split(module)
        method = None if module is fun else fun.__name__

        def on_a_copy(*args: Any, **kwargs: Any) -> Any:
            copy = nnx.merge(graphdef, state, copy=True)
            return (copy if method is None else getattr(copy, method))(*args, **kwargs)

        return on_a_copy

    def prefer_reverse(self, point: Point[Traced], *, measure: bool = False) -> bool:
        """Columns: forward passes share the batch-independent work (broadcast sinking)."""
        return False

    def linearize(self, point: Point[Traced], *, reverse: bool) -> Linear:
        return _Linearized(point, reverse)

    def forward_less(self, point: Point[Traced]) -> frozenset[str]:
        """A ``jax.custom_vjp`` function: JAX has no forward derivative of it."""
        found = point.traced.detect(per_sample=False)
        return (
            frozenset({"a jax.custom_vjp function"})
            if found and found.has_custom_vjp
            else frozenset()
        )

    def reverse_less(self, point: Point[Traced]) -> frozenset[str]:
        """A ``lax.while_loop`` (or a ``fori_loop`` of traced bounds): JAX has no reverse
        derivative of it."""
        return (
            frozenset({"a lax.while_loop"})
            if _has_while(point.traced.closed.jaxpr)
            else frozenset()
        )

    def pass_elements(self, point: Point[Traced]) -> int:
        """Where a gradient flows through the passes (``jax.grad`` of a loss on the result,
        traced under ``jit`` or not), what a pass keeps for the backward, which recomputes it
        chunk by chunk (:meth:`checkpointed`): :attr:`~divjac.jax._detect.Traced.graph_elements`;
        else the program's live peak."""
        traced = point.traced
        return traced.graph_elements if self.recomputes_chunks(point) else traced.pass_elements

    def recomputes_chunks(self, point: Point[Traced]) -> bool:
        """A gradient flows through the passes (``jax.grad`` of a loss on the result, traced
        under ``jit`` or not): each chunk is checkpointed (:meth:`checkpointed`)."""
        return point.traced.differentiated(jax.tree_util.tree_leaves((point.args, point.kwargs)))

    def checkpointed(self, chunks: Chunks) -> Callable[[Callable[..., R]], Callable[..., R]]:
        """``jax.checkpoint`` for more than one chunk: under a gradient every chunk of JAX's
        bounds memory (:attr:`~divjac._backend.Backend.cache_chunks_on_graph` is off), and
        elsewhere it is a no-op that traces a chunk's sweep once per shape."""
        if chunks.count < 2:
            return lambda run: run
        return lambda run: cast(Callable[..., R], jax.checkpoint(run))

    def second_order_sweep(
        self,
        f: Callable[[jax.Array], jax.Array],
        x: jax.Array,
        directions: jax.Array,
        *,
        weights: jax.Array | None,
        collapse: bool,
        traced: Traced | None = None,
        point: Point[Traced] | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``traced`` and ``point`` are not needed: ``f`` is traced anew, as every call's
        passes are."""
        return _taylor.second_order_sweep(f, x, directions, weights=weights, collapse=collapse)

    def taylor_sweep(
        self,
        f: Callable[[jax.Array], jax.Array],
        x: jax.Array,
        directions: jax.Array,
        order: int,
        *,
        weights: jax.Array | None,
        chunk: int,
    ) -> jax.Array:
        """Chunks of ``chunk`` directions by ``lax.map`` (the last padded with zero
        directions, whose terms are zero)."""
        k = int(directions.shape[0])
        if chunk >= k:
            return _taylor_high.taylor_sweep(
                f, x, directions, order, weights=weights, collapse=weights is not None
            )
        n = -(-k // chunk)

        def padded(a: jax.Array) -> jax.Array:
            pad = jnp.zeros((n * chunk - k, *a.shape[1:]), a.dtype)
            return jnp.concatenate([a, pad]).reshape(n, chunk, *a.shape[1:])

        if weights is None:
            terms = lax.map(
                lambda v: _taylor_high.taylor_sweep(f, x, v, order, collapse=False),
                padded(directions),
            )
            return terms.reshape(n * chunk, *terms.shape[2:])[:k]
        parts = lax.map(
            lambda vw: _taylor_high.taylor_sweep(f, x, vw[0], order, weights=vw[1]),
            (padded(directions), padded(weights)),
        )
        return parts.sum(0)

    def sparse_laplacian(
        self,
        f: Callable[[jax.Array], jax.Array],
        x: jax.Array,
        passes: int,
        budget: int,
        point: Point[Traced] | None = None,
    ) -> jax.Array | None:
        n = math.prod(x.shape[1:])
        colored = passes < n
        share = _sparse_taylor.sparse_cost(f, x, against_colors=colored) * n
        # Against the unit basis, the sparse sweep pays at half its passes' count (the dense
        # sweep of shared unit directions fuses into the products); against the passes of a
        # coloring, up to 1.1x their count (1 thread, jit, medians: particles 4.0 vs 4 colors,
        # the sparse sweep 1.4x faster; pairs 6.7 vs 12 colors, 2.7x; Rosenbrock 3.9 vs 2
        # colors, the colors 2.6x faster; a CNN's 117 vs 75 colors, the colors 1.45x).
        limit = 1.1 * passes if colored else passes / 2
        if share > limit or share > budget:
            return None
        return _sparse_taylor.sparse_laplacian(f, x)

    def grad_of_sum(self, fn: Callable[[jax.Array], Any], x: jax.Array, *, has_aux: bool) -> Any:
        if has_aux:

            def summed_and_aux(x: jax.Array) -> tuple[jax.Array, Any]:
                values, aux = fn(x)
                return jnp.sum(values), aux

            return jax.grad(summed_and_aux, has_aux=True)(x)
        return jax.grad(lambda x: jnp.sum(fn(x)))(x)

    def indicators(
        self,
        colors: np.ndarray | None,
        n: int,
        n_passes: int,
        like: Array,
        *,
        indexed: bool = True,
    ) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
        """Unindexed seeds up to :data:`SEED_MATRIX_ELEMENTS` are the rows of a constant seed
        matrix: XLA folds the passes of a linear prefix (all of a linear function) into
        constants, which it does not do for indicators computed from the pass index."""
        dtype = like.dtype
        if not indexed and n_passes * n <= SEED_MATRIX_ELEMENTS:
            labels_np = np.arange(n) if colors is None else np.asarray(colors)
            matrix = labels_np[None, :] == np.arange(n_passes)[:, None]
            return jnp.asarray(matrix, dtype), lambda row: row
        if colors is None:
            return jnp.arange(n_passes), lambda c: jax.nn.one_hot(c, n, dtype=dtype)
        labels = jnp.asarray(colors)
        return jnp.arange(n_passes), lambda c: (labels == c).astype(dtype)

    def arange(self, n: int, like: Array) -> jax.Array:
        return jnp.arange(n)

    def one_hot(self, i: jax.Array, n: int, like: Array) -> jax.Array:
        return jax.nn.one_hot(i, n, dtype=like.dtype)

    def take_sample(self, rows: jax.Array, i: jax.Array) -> jax.Array:
        return rows[i]

    def diagonal_sums(
        self, colors: np.ndarray | None, n_seed: int, batch_size: int, batched: bool
    ) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
        """Gathers the class members of color ``c`` (:func:`~divjac._core.plan.color_classes`)
        instead of masking all ``n`` elements."""
        members = jnp.asarray(plan.color_classes(colors, n_seed))
        B = batch_size
        n = n_seed // B

        def read(c: jax.Array, t: jax.Array, pushed: jax.Array) -> jax.Array:
            if n_seed == 0:  # an empty sample (traced for its zero passes): nothing to read
                return jnp.zeros(B, pushed.dtype)
            idx = members[c]
            valid = idx >= 0
            idx = jnp.maximum(idx, 0)
            if batched:
                own = jnp.take(pushed.reshape(B, -1), idx, axis=1)
                return jnp.sum(jnp.where(valid, own, 0), axis=1)
            vals = jnp.where(valid, pushed.reshape(-1)[idx], 0)
            return jnp.zeros(B, vals.dtype).at[idx // n].add(vals)

        return read

    def take_entries(
        self, compressed: jax.Array, entries: Entries, held: tuple[jax.Array, ...] | None = None
    ) -> jax.Array:
        """One gather at flat indices ``which * m + within`` (int32 where it fits), in bounds
        and unique (no index normalization), from the passes laid out ``(B, k * m)`` (a
        reshape, no copy, for one sample). The indices are computed in the program from the
        plan's columns, rows' counts and colouring (:func:`_nonzeros`; nothing is held)."""
        n_passes, batch, m = compressed.shape
        dtype = _index_dtype((n_passes, m))
        rows, cols = _nonzeros(entries)
        seeded, within = (rows, cols) if entries.reverse else (cols, rows)
        which = seeded if entries.colors is None else _at(_unfolded(entries.colors), seeded)
        flat = which.astype(dtype) * m + within.astype(dtype)
        per_sample = jnp.moveaxis(compressed, 1, 0).reshape(batch, n_passes * m)
        dnums = lax.GatherDimensionNumbers(
            offset_dims=(0,), collapsed_slice_dims=(1,), start_index_map=(1,)
        )
        return lax.gather(
            per_sample,
            flat[:, None],
            dnums,
            slice_sizes=(batch, 1),
            unique_indices=True,
            mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
        )

    def densify(
        self,
        values: jax.Array,
        entries: Entries,
        shape: tuple[int, int, int],
        held: tuple[jax.Array, ...] | None = None,
    ) -> jax.Array:
        """One scatter at the sorted, unique flat positions ``rows * n_in + cols``, sharded as
        ``values`` along the batch where its mesh axis is ``Explicit`` (JAX does not infer the
        sharding of a scatter of sharded updates into a new array)."""
        batch, n_out, n_in = shape
        if values.shape[1] == 0:  # no nonzero (a piecewise constant function): no scatter
            return jnp.zeros(shape, values.dtype)
        dtype = _index_dtype((n_out * n_in,))
        rows, cols = _nonzeros(entries)
        flat = rows.astype(dtype) * n_in + cols.astype(dtype)
        zeros = jnp.zeros_like(values[:, :1])  # sharded like the batch of values
        dense = (
            jnp.broadcast_to(zeros, (batch, n_out * n_in))
            .at[:, flat]
            .set(
                values,
                indices_are_sorted=True,
                unique_indices=True,
                mode="promise_in_bounds",
                out_sharding=_sharding.sharded_like(values, slice(1)),
            )
        )
        return self.reshape_batch(dense, shape)

    def is_randomness(self, x: Any) -> bool:
        """A typed key (``jax.random.key``) or a raw ``uint32`` one (``jax.random.PRNGKey``)."""
        dtype = getattr(x, "dtype", None)
        if not is_array(x) or dtype is None:
            return False
        if jnp.issubdtype(dtype, jax.dtypes.prng_key):
            return True
        return bool(dtype == jnp.uint32 and np.shape(x)[-1:] == (2,))

    def draw(
        self, randomness: Any, shape: Sequence[int], distribution: str, like: Array
    ) -> jax.Array:
        """Inside ``shard_map``, a key that does not vary over the mesh axes the input varies
        over (a replicated key) is first folded with the shard's index over those axes, so
        that each shard draws its own probes (the same key and mesh give the same probes)."""
        missing = tuple(sorted(varying_axes(like) - varying_axes(randomness)))
        if missing:
            randomness = jax.random.fold_in(randomness, lax.axis_index(missing))
        if distribution == "rademacher":
            return jax.random.rademacher(randomness, tuple(shape), like.dtype)
        return jax.random.normal(randomness, tuple(shape), like.dtype)

    def sparse_format(self, layout: Any) -> None:
        """JAX's one sparse format, ``BCOO`` (``layout`` must be ``None``)."""
        if layout is not None:
            raise OptionError(
                f"sparse_jacobian: JAX's sparse Jacobian is a BCOO array; got layout={layout!r}."
            )
        return None

    def sparse_matrix(
        self,
        entries: Entries,
        values: jax.Array,
        shape: tuple[int, int, int],
        *,
        single: bool,
        sparse_format: Any,
    ) -> jsparse.BCOO:
        """The indices, computed in the program (:func:`_nonzeros`), are shared by the batch
        (a batch axis of size 1), flagged sorted and unique so that no BCOO operation sorts or
        deduplicates them again."""
        dtype = _index_dtype(shape[1:])
        indices = jnp.stack([a.astype(dtype) for a in _nonzeros(entries)], axis=1)
        flags = {"indices_sorted": True, "unique_indices": True}
        if single:
            return jsparse.BCOO((values[0], indices), shape=shape[1:], **flags)
        return jsparse.BCOO((values, indices[None]), shape=shape, **flags)


def _nonzeros(entries: Entries) -> tuple[jax.Array, jax.Array]:
    """The rows and columns of the plan's nonzeros, made in the program elementwise, which XLA
    fuses into their users, with no temporary the size of the nonzeros: on a box stencil from
    the rows' pointers and the stencil's offsets (:func:`_stencil_nonzeros`), otherwise from
    compact constants (:mod:`~divjac._core.nonzero_codes`: three bytes a nonzero on a
    stencil); JAX copies a program's constants two to three times over while lowering and
    compiling it. The constants are behind an optimization barrier, which XLA does not fold
    through: folded at compile time, they would be constants again (and folding them takes
    minutes)."""
    dtype = entries.cols.dtype
    if entries.nnz == 0:
        return jnp.zeros(0, dtype), jnp.zeros(0, dtype)
    codes = _encoded(entries)
    if isinstance(codes, _OnStencil):
        return _stencil_nonzeros(codes, entries)
    nnz, block = entries.nnz, nonzero_codes.BLOCK
    starts = _unfolded(codes.starts)
    first = jnp.broadcast_to(starts[:, None], (starts.size, block)).reshape(-1)
    rows = (first + _unfolded(codes.rows).astype(dtype))[:nnz]
    cols = _unfolded(codes.cols)[:nnz].astype(dtype)
    return rows, rows + cols if codes.offsets else cols


@dataclass(frozen=True)
class _OnStencil:
    """A plan's pattern that is a box stencil: the stencil, the row of every ``BLOCK``-th
    nonzero and the most rows a block spans past its first
    (:func:`~divjac._core.nonzero_codes.block_rows`)."""

    stencil: nonzero_codes.Stencil
    starts: np.ndarray
    span: int


STENCIL_MIN_NONZEROS = 1 << 20
"""The fewest nonzeros of a stencil's pattern for them to be decoded from the stencil: below,
their codes (a few MB at most) cost less than the decoding's arithmetic, which each device of
a sharded batch repeats."""

MAX_STENCIL_SPAN = 8
"""The most rows past its block's first a nonzero of a stencil may lie for the stencil's
decoding (one lookup of the rows' pointers a row): past it (rows of fewer than about
``BLOCK / 8`` nonzeros), the codes; so too past ``2**23`` nonzeros a row (the decoding's float32
quotient)."""


def _stencil_nonzeros(found: _OnStencil, entries: Entries) -> tuple[jax.Array, jax.Array]:
    """The rows and columns of a box stencil's nonzeros in CSR order, each from its index
    alone: its row is its block's first, moved past each row's end it lies beyond (looked up
    in the rows' pointers, ``span`` times), and its column the digit of its place in the row
    along each axis of the row's box, clipped to the grid (no table: the box's first column
    and length along an axis follow from the row's coordinate)."""
    dtype = entries.cols.dtype
    stencil = found.stencil
    blocks = (found.starts.size, nonzero_codes.BLOCK)
    block = lax.broadcasted_iota(dtype, blocks, 0)
    p = (block * nonzero_codes.BLOCK + lax.broadcasted_iota(dtype, blocks, 1)).reshape(-1)
    p = p[: entries.nnz]
    indptr = _unfolded(entries.indptr.astype(dtype, copy=False))
    row = _at(_unfolded(found.starts), block.reshape(-1)[: entries.nnz])
    for _ in range(found.span):
        row = row + (p >= _at(indptr, row + 1)).astype(dtype)
    place = p - _at(indptr, row)
    col = jnp.zeros_like(p)
    k = len(stencil.shape)
    for a in reversed(range(k)):
        stride, size = math.prod(stencil.shape[a + 1 :]), stencil.shape[a]
        at = row if stride == 1 else lax.div(row, dtype.type(stride))
        at = at if a == 0 else lax.rem(at, dtype.type(size))
        first = jnp.maximum(at + stencil.lo[a], 0)
        if a == 0:  # the place's last digit
            col = col + (first + place) * stride
            break
        length = jnp.minimum(at + stencil.hi[a], size - 1) - first + 1
        # the quotient in float32 (exact: the place is below the box's size, under 2**23),
        # vectorized where an integer division by a variable is not
        quotient = ((place.astype(np.float32) + 0.5) / length.astype(np.float32)).astype(dtype)
        col = col + (first + place - quotient * length) * stride
        place = quotient
    # one array, written by one loop, that its users read: XLA does not recompute a gather for
    # each of several users, and would keep each lookup's result, the size of the nonzeros
    both = lax.optimization_barrier(jnp.stack([row, col], axis=1))
    return both[:, 0], both[:, 1]


_ENCODED: weakref.WeakKeyDictionary[Entries, nonzero_codes.Codes | _OnStencil] = (
    weakref.WeakKeyDictionary()
)


def _encoded(entries: Entries) -> nonzero_codes.Codes | _OnStencil:
    """How :func:`_nonzeros` makes the plan's nonzeros: from the stencil the pattern is on its
    grid, or from compact constants; found once per plan (kept with it)."""
    if entries not in _ENCODED:
        _ENCODED[entries] = _on_stencil(entries) or nonzero_codes.encode(
            entries.indptr, entries.cols
        )
    return _ENCODED[entries]


def _on_stencil(entries: Entries) -> _OnStencil | None:
    """The stencil the plan's pattern is on its grid, where decoding it pays (see
    :data:`STENCIL_MIN_NONZEROS` and :data:`MAX_STENCIL_SPAN`)."""
    if entries.grid is None or entries.nnz < STENCIL_MIN_NONZEROS:
        return None
    found = nonzero_codes.stencil(entries.indptr, entries.cols, entries.grid)
    if found is None or found.box() >= 2**23:
        return None
    starts, span = nonzero_codes.block_rows(entries.indptr, entries.nnz, entries.cols.dtype)
    return _OnStencil(found, starts, span) if span <= MAX_STENCIL_SPAN else None


def _unfolded(host: np.ndarray) -> jax.Array:
    """``host`` as a value of the program that XLA does not fold (see :func:`_nonzeros`)."""
    return lax.optimization_barrier(host)


def _at(table: jax.Array, index: jax.Array) -> jax.Array:
    """``table[index]`` for indices known to be in bounds (no clamping)."""
    return table.at[index].get(mode="promise_in_bounds", unique_indices=False)


def _index_dtype(shape: Sequence[int]) -> type[np.signedinteger[Any]]:
    """int32 for indices into ``shape`` (and its flat size) where they fit, else int64."""
    return np.int32 if math.prod(shape) < np.iinfo(np.int32).max else np.int64


BACKEND = JaxBackend()
