"""What the transforms need from a framework: the interface of a backend (imports no framework).

The transforms (:mod:`divjac._transforms`, :mod:`divjac._divergence`) are written once; each
framework provides one :class:`Backend` (``divjac.jax._backend.JaxBackend``,
``divjac.torch._backend.TorchBackend``) with its primitives: array predicates, tracing, the
linearized function and its batched passes, indicators, gathers and scatters, random draws and
sparse matrices. Arrays are the framework's own (``jax.Array``, ``torch.Tensor``); the transforms
only index, reshape and sum them.

This module imports only NumPy and the core: the modules above it (:mod:`divjac._call`, the
transforms, the framework backends) import it, never the other way round.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import numpy as np

from ._core.detection import Traced
from ._core.plan import Chunks

__all__ = ["Array", "Backend", "Entries", "Finish", "Linear", "Point", "Seed", "TracedT"]

Array: TypeAlias = Any
"""An array of the backend's framework."""

Seed: TypeAlias = Callable[[Array], Array]
"""``c -> t``: the tangent (or cotangent) pushed by the pass of input ``c``."""

Finish: TypeAlias = Callable[[Array, Array, Array], Array]
"""``(c, t, pushed) -> result``: what a pass keeps of the pushed ``t``."""


TracedT = TypeVar("TracedT", bound=Traced)
"""The traced program of a backend (a subclass of :class:`~divjac._core.detection.Traced`)."""

R = TypeVar("R")


class Entries:
    """The nonzeros ``(rows, cols)`` of a sparse plan's per-sample pattern and, per nonzero,
    the pass (``which``) and the element of the pass (``within``) holding it.

    The plan keeps the pattern's CSR arrays and the coloring, four bytes a nonzero; the rows,
    ``which`` and ``within`` follow from them. A backend that runs the plan in a compiled
    program computes them there (JAX: a program that embedded them would hold and copy 12
    bytes more a nonzero while lowering and compiling); the others read them here, made once
    and kept with the plan (the same arrays at every call).

    Args:
        indptr: the CSR row pointers (``n_out + 1``).
        cols: the columns, row-major, sorted within each row (``nnz``).
        colors: the colour of each seeded element: of each column (JVPs) or, with ``reverse``,
            of each row (VJPs); ``None``: every row its own pass (the diagonal blocks of a
            coupled call, with ``reverse``).
        reverse: passes are rows (VJPs): a nonzero is at its column of its row's pass;
            otherwise at its row of its column's pass.
        grid: the per-sample shape of the rows and of the columns where they are the same
            (a backend may then find the pattern to be a stencil on it), else ``None``.
    """

    def __init__(
        self,
        indptr: np.ndarray,
        cols: np.ndarray,
        colors: np.ndarray | None,
        *,
        reverse: bool,
        grid: tuple[int, ...] | None = None,
    ) -> None:
        self.indptr = indptr
        self.cols = cols
        self.colors = None if colors is None else colors.astype(cols.dtype, copy=False)
        self.reverse = reverse
        self.grid = grid

    @property
    def n_rows(self) -> int:
        return len(self.indptr) - 1

    @property
    def nnz(self) -> int:
        return len(self.cols)

    @functools.cached_property
    def counts(self) -> np.ndarray:
        """The nonzeros of each row."""
        return np.diff(self.indptr).astype(self.cols.dtype, copy=False)

    @functools.cached_property
    def rows(self) -> np.ndarray:
        return np.repeat(np.arange(self.n_rows, dtype=self.cols.dtype), self.counts)

    @functools.cached_property
    def which(self) -> np.ndarray:
        """The pass holding each nonzero."""
        seeded = self.rows if self.reverse else self.cols
        return seeded if self.colors is None else self.colors[seeded]

    @property
    def within(self) -> np.ndarray:
        """The element of its pass holding each nonzero."""
        return self.cols if self.reverse else self.rows


@dataclass(frozen=True)
class Point(Generic[TracedT]):
    """The batch-first function of one call at its input: what a backend linearizes.

    Attributes:
        g: the caller's function, batch first in the differentiated argument and the output
            (returning ``(output, aux)`` with ``has_aux``); the other arguments are bound.
        xb: the differentiated input, batch first.
        traced: ``g``'s traced program.
        has_aux: ``g`` returns ``(output, aux)``.
        args: the caller's positional arguments (the differentiated one included).
        kwargs: the caller's keyword arguments.
    """

    g: Callable[[Array], Any]
    xb: Array
    traced: TracedT
    has_aux: bool
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @functools.cached_property
    def facts(self) -> dict[str, Any]:
        """What a backend works out once per call and reads again within it, by name (the
        context a kept setup is looked up by: grad mode, memory settings)."""
        return {}

    @property
    def batch_size(self) -> int:
        return int(self.xb.shape[0])

    @property
    def in_sample(self) -> tuple[int, ...]:
        return tuple(self.xb.shape[1:])

    @property
    def out_sample(self) -> tuple[int, ...]:
        return tuple(self.traced.out_shape[1:])

    @property
    def n_in(self) -> int:
        return math.prod(self.in_sample)

    @property
    def n_out(self) -> int:
        return math.prod(self.out_sample)


class Linear(abc.ABC):
    """The linearized batch-first function of one call: its JVP (or VJP), run as batched passes.

    Attributes:
        value: the batch-first output of the function (known once passes have run).
        aux: its auxiliary output (``has_aux``), else ``None`` (known once passes have run).
    """

    value: Array = None
    aux: Any = None

    @abc.abstractmethod
    def passes(
        self, inputs: Array, seed: Seed, finish: Finish, chunks: Chunks, *, shared: bool
    ) -> Array:
        """``stack([finish(c, t, push(t)) for c in inputs])`` with ``t = seed(c)``.

        ``chunks.size`` passes are run at once (checkpointed: :meth:`Backend.checkpointed`).
        With ``shared``, ``seed`` gives one sample's tangent (shape ``seed_sample``), the same
        in every sample; otherwise a whole batch of them.
        """


class Backend(abc.ABC, Generic[TracedT]):
    """A framework's primitives, as the transforms use them, over its traced programs ``TracedT``.

    Attributes:
        array_noun: what the framework calls an array (in messages).
        param_grad_hint: how to differentiate w.r.t. parameters instead (in messages).
        input_cast_hint: how to cast an integer input to floats (in messages).
        output_cast_hint: how to cast an integer output to floats (in messages).
        randomness_example: a source of randomness of the framework (in messages).
        sweep_cache_share: a second-order sweep's directions hold ``1 / sweep_cache_share`` of
            a pass's bytes in the CPU's cache at once (what chunks them on the host).
        narrow_indices: the index arrays of a plan (the nonzeros of a sparse Jacobian, the
            pass and element holding each) may be int32 where their values fit, not int64.
        cache_chunks_on_graph: where a gradient will flow through the passes and all of them
            fit the memory budget at once, they still run in the CPU cache's chunks, which
            keep their graphs (not checkpointed: :meth:`divjac._call.Call.chunk`).
    """

    array_noun: str
    param_grad_hint: str
    input_cast_hint: str
    output_cast_hint: str
    randomness_example: str
    sweep_cache_share: int = 1
    narrow_indices: bool = False
    cache_chunks_on_graph: bool = False

    # --- arrays and dtypes --------------------------------------------------------------------

    @abc.abstractmethod
    def is_array(self, x: Any) -> bool:
        """Whether ``x`` is an array the framework differentiates."""

    def differentiable(self, x: Array) -> Array:
        """An array the passes differentiate or keep for a gradient (the differentiated input,
        the caller's probes) as they take it: itself (a framework whose arrays can be unfit
        for differentiation returns a fit copy of the same values)."""
        return x

    @abc.abstractmethod
    def is_array_spec(self, x: Any) -> bool:
        """Whether ``x`` describes an array in a traced function's output tree."""

    @abc.abstractmethod
    def is_floating_input(self, dtype: Any) -> bool:
        """Whether an input of ``dtype`` can be differentiated."""

    @abc.abstractmethod
    def is_floating_output(self, dtype: Any) -> bool:
        """Whether an output of ``dtype`` can be differentiated."""

    @abc.abstractmethod
    def itemsize(self, x: Array) -> int:
        """Bytes of one element of ``x``."""

    @abc.abstractmethod
    def asarray(self, x: Any, like: Array) -> Array:
        """``x`` as an array of the dtype (and device) of ``like``."""

    @abc.abstractmethod
    def moveaxis(self, x: Array, source: int, destination: int) -> Array:
        """``x`` with axis ``source`` moved to ``destination``."""

    def reshape_batch(self, x: Array, shape: Sequence[int]) -> Array:
        """``x`` reshaped to ``shape``, whose leading axis (the batch) is ``x``'s."""
        return x.reshape(tuple(shape))

    @abc.abstractmethod
    def zeros_like(self, x: Array) -> Array:
        """Zeros of the shape, dtype (and device) of ``x``."""

    @abc.abstractmethod
    def concatenate(self, arrays: Sequence[Array]) -> Array:
        """``arrays`` joined along their first axis."""

    @abc.abstractmethod
    def stack(self, arrays: Sequence[Array]) -> Array:
        """``arrays`` (of one shape) stacked along a new first axis."""

    def map_stacked(self, fn: Callable[[Array], Array], xs: Array, chunk: int) -> Array:
        """``stack([fn(x) for x in xs])``: where a trace would unroll a loop (JAX), ``xs``'s
        leading axis is a batch axis, ``chunk`` of them at a time (``fn`` traced once, however
        long ``xs`` is); a loop by default (eager frameworks)."""
        return self.stack([fn(xs[i]) for i in range(int(xs.shape[0]))])

    def per_sample(self, fn: Callable[[Array], Any], xb: Array) -> Array:
        """``stack([fn(x) for x in xb])``, ``fn`` a function of one sample (batched where the
        framework maps a function over an axis)."""
        return self.stack([fn(xb[i]) for i in range(int(xb.shape[0]))])

    fori_loop: Callable[[int, Callable[[Any, Any], Any], Any], Any] | None = None
    """``fori_loop(n, body, carry)``, ``carry = body(j, carry)`` for ``j = 0 .. n - 1`` (``carry``
    a tuple of arrays of fixed shapes), where a trace would unroll a Python loop (JAX): one loop
    of the framework, ``body`` traced once for every ``n`` (``j`` then an array); ``None``:
    Python's loop (eager frameworks)."""

    # --- devices ------------------------------------------------------------------------------

    def batch_shards(self, xb: Array) -> int:
        """How many devices the leading (batch) axis of ``xb`` is split over, as far as known
        where the passes are planned (1: on one device, or unknown)."""
        return 1

    def recomputes_chunks(self, point: Point[TracedT]) -> bool:
        """Whether the backward of a gradient recomputes each chunk of passes at ``point``
        (where more chunks cost more than the passes they hold)."""
        return False

    @abc.abstractmethod
    def memory_available(self, x: Array) -> int | None:
        """Free bytes of the device holding ``x``, where the framework reports them (``None``:
        a host, or unknown)."""

    # --- tracing and differentiating ----------------------------------------------------------

    def ahead(self, setup: Callable[..., R], point: Point[TracedT], *static: Any) -> R:
        """``setup(point, *static)``: the part of a call that depends only on its shapes and
        static arguments (detection, planning, seeds), never on the values of its arrays.

        A compiler that traces the call (``torch.compile``) evaluates it once per compilation,
        as a constant, rather than tracing it; ``jax.jit`` runs Python at trace time anyway.
        """
        return setup(point, *static)

    def functional(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """``fun`` as divjac calls it, once per call of a transform: the same function, made
        safe to trace and differentiate repeatedly (the caller's objects are left as they are).
        """
        return fun

    @abc.abstractmethod
    def trace(
        self,
        fun: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        argnum: int,
        batch_axis: int | None,
        has_aux: bool,
    ) -> TracedT:
        """``fun`` traced batch-first in argument ``argnum`` (cached)."""

    @abc.abstractmethod
    def prefer_reverse(self, point: Point[TracedT], *, measure: bool = False) -> bool:
        """Whether to push rows (VJPs) rather than columns when both take as many passes
        (``measure``: many of them will run, so a backend may time a few of each first)."""

    def forward_less(self, point: Point[TracedT]) -> frozenset[str]:
        """The operations of the program at ``point`` without a forward derivative (that can
        be differentiated, where a gradient will flow through the passes): where there are
        some, only rows (VJPs) can be pushed. Asked only of programs about to push columns."""
        return frozenset()

    def first_order_by_sweep(self) -> bool:
        """Whether an operator's first-order terms ``J v`` are the first-order terms of the
        second-order sweep (:meth:`second_order_sweep`) rather than JVPs (:meth:`linearize`)."""
        return False

    def reverse_less(self, point: Point[TracedT]) -> frozenset[str]:
        """The operations of the program at ``point`` without a reverse derivative: its
        per-sample gradient (the Hessian's pattern and products) cannot be formed."""
        return frozenset()

    def rows_overhead_only(self, point: Point[TracedT]) -> bool:
        """Whether batching the rows (VJPs) of the program at ``point``, which share one
        evaluation of it, saves only the overhead of their kernels: then on the host large
        rows are pulled one at a time (:func:`~divjac._core.plan.choose_chunk_size`)."""
        return False

    def pass_elements(self, point: Point[TracedT]) -> int:
        """Elements one pass holds at once at ``point`` (memory planning; an upper bound):
        the traced program's estimate, unless a backend keeps more where a gradient will flow
        through the passes."""
        return point.traced.pass_elements

    def checkpointed(self, chunks: Chunks) -> Callable[[Callable[..., R]], Callable[..., R]]:
        """A wrapper of the work of one chunk of passes or directions (a function of arrays)
        such that, differentiated, a chunk keeps its inputs rather than its intermediates and
        the backward recomputes it, where ``chunks`` are checkpointed: with gradients, memory
        then follows the chunk size, at the cost of computing every chunk twice. The identity
        by default."""
        return lambda run: run

    def pull_hessian_rows(self, point: Point[TracedT]) -> bool:
        """Whether the Hessian-vector products of the per-sample gradient at ``point`` are
        pulled (VJPs of the gradient, ``v^T H``: the same by symmetry) rather than pushed
        (JVPs, forward-over-reverse): where forward passes cannot go through the gradient."""
        return bool(self.forward_less(point))

    @abc.abstractmethod
    def linearize(self, point: Point[TracedT], *, reverse: bool) -> Linear:
        """The JVP (or, with ``reverse``, the VJP) of the batch-first function at ``point``."""

    @abc.abstractmethod
    def second_order_sweep(
        self,
        f: Callable[[Array], Array],
        x: Array,
        directions: Array,
        *,
        weights: Array | None,
        collapse: bool,
        traced: TracedT | None = None,
        point: Point[TracedT] | None = None,
    ) -> tuple[Array, Array, Array]:
        """``(f(x), J v_k, v_k^T H v_k)`` of a batch-first per-sample ``f`` (the framework's
        ``_taylor.second_order_sweep``): directions ``[K, B, *in]`` or ``[K, 1, *in]``, weights
        ``None``, ``[K]`` or ``[K, B]``; the second-order terms summed with the weights
        (``[B, *out]``) with ``collapse``, else each ``[K, B, *out]``. ``f`` is a function made
        anew at each call, which the backend need not trace: ``point``, the call whose
        batch-first function (without its aux) ``f`` is, whose trace the backend may run with
        the call's other arguments; or ``traced``, the trace of such a call, with no other
        argument bound (``f`` at ``x`` alone)."""

    def taylor_sweep(
        self,
        f: Callable[[Array], Array],
        x: Array,
        directions: Array,
        order: int,
        *,
        weights: Array | None,
        chunk: int,
    ) -> Array | None:
        """``(v_k . grad)^order f`` of a batch-first per-sample ``f`` (``order`` 3 or 4) by
        one collapsed Taylor sweep of that order, ``chunk`` directions at once: each term
        ``[K, B, *out]`` with ``weights=None``, else their sum with the weights ``[K]`` or
        ``[K, B]`` (``[B, *out]``). ``None`` where the framework has no such sweep (the caller
        nests second-order sweeps)."""
        return None

    def sparse_laplacian(
        self,
        f: Callable[[Array], Array],
        x: Array,
        passes: int,
        budget: int,
        point: Point[TracedT] | None = None,
    ) -> Array | None:
        """The exact per-sample Laplacian ``[B, *out]`` of the uncoupled batch-first ``f`` by a
        collapsed sweep that stores each intermediate's first-order terms for the inputs it
        depends on only, where its work is at most half that of a dense sweep of ``passes``
        directions and at most ``budget`` passes' worth; ``None`` otherwise, or where the
        framework has no such sweep. ``point`` as in :meth:`second_order_sweep`."""
        return None

    @abc.abstractmethod
    def grad_of_sum(self, fn: Callable[[Array], Any], x: Array, *, has_aux: bool) -> Any:
        """The gradient of ``sum(fn(x))`` w.r.t. ``x``, differentiable again; with ``has_aux``,
        ``fn`` returns ``(values, aux)`` and the result is ``(gradient, aux)``."""

    # --- seeds and reading the passes ---------------------------------------------------------

    @abc.abstractmethod
    def indicators(
        self,
        colors: np.ndarray | None,
        n: int,
        n_passes: int,
        like: Array,
        *,
        indexed: bool = True,
    ) -> tuple[Array, Callable[[Array], Array]]:
        """The passes' inputs and the flat indicator (length ``n``) of the elements of each.

        Pass ``c`` takes the elements of color ``c`` (element ``c`` with ``colors=None``), in
        the dtype of ``like``. With ``indexed=False`` the passes' finish reads only the tangent,
        never the input, so the inputs may be the rows of a constant seed matrix.
        """

    @abc.abstractmethod
    def arange(self, n: int, like: Array) -> Array:
        """``0 .. n-1`` (on the device of ``like``)."""

    def on_device(self, host: np.ndarray, like: Array) -> Any:
        """An integer array of a call's plan (an index array, a coloring) for its passes, on
        the device of ``like``: a backend whose arrays live on a device keeps one there per
        host array, so that a steady-state call copies nothing from the host. By default the
        host array itself (a constant of a compiled program)."""
        return host

    @abc.abstractmethod
    def one_hot(self, i: Array, n: int, like: Array) -> Array:
        """The ``i``-th unit vector of length ``n``, in the dtype of ``like``."""

    @abc.abstractmethod
    def take_sample(self, rows: Array, i: Array) -> Array:
        """Row ``i`` of ``rows`` (``(B, m)``), ``i`` traced."""

    @abc.abstractmethod
    def diagonal_sums(
        self, colors: np.ndarray | None, n_seed: int, batch_size: int, batched: bool
    ) -> Callable[[Array, Array, Array], Array]:
        """The finish of a divergence pass: ``(c, t, pushed) -> (B,)``, per sample the sum of the
        pushed entries at the pass's own elements (those of color ``c``).

        ``batched``: the tangent ``t`` is one sample's (``n_seed`` elements), shared by all;
        otherwise it spans the whole batch (``n_seed = B * n``).
        """

    def held_entries(self, entries: Entries, like: Array) -> tuple[Array, ...] | None:
        """The index arrays a plan of ``entries`` holds for :meth:`take_entries` and
        :meth:`densify` (on the device of ``like``), where the plan is made ahead of a compiler
        that runs no NumPy of it (``torch.compile``); ``None``: read from ``entries``."""
        return None

    @abc.abstractmethod
    def take_entries(
        self, compressed: Array, entries: Entries, held: tuple[Array, ...] | None = None
    ) -> Array:
        """``compressed[which, :, within].T``: per sample (``(B, nnz)``), the entries of the
        passes ``(k, B, m)`` at the (unique) pairs of pass and element of ``entries``
        (``held``: its :meth:`held_entries`)."""

    @abc.abstractmethod
    def densify(
        self,
        values: Array,
        entries: Entries,
        shape: tuple[int, int, int],
        held: tuple[Array, ...] | None = None,
    ) -> Array:
        """The dense ``(B, n_out, n_in)`` array holding ``values`` (``(B, nnz)``) at the
        nonzeros of ``entries`` (``held``: its :meth:`held_entries`)."""

    # --- randomness and sparse results --------------------------------------------------------

    @abc.abstractmethod
    def is_randomness(self, x: Any) -> bool:
        """Whether ``x`` is a source of randomness for :meth:`draw` (a key, a generator)."""

    @abc.abstractmethod
    def draw(self, randomness: Any, shape: Sequence[int], distribution: str, like: Array) -> Array:
        """Raw probes: Rademacher signs or standard normals, in the dtype (and device) of
        ``like``, from the caller's source of randomness."""

    @abc.abstractmethod
    def sparse_format(self, layout: Any) -> Any:
        """The sparse format of ``sparse_jacobian``'s ``layout`` (``None``: the framework's
        default), checked: a :class:`~divjac.OptionError` names the layouts it takes, a
        :class:`~divjac.CompileError` a compiler that cannot trace sparse arrays (asked again
        at each call)."""

    @abc.abstractmethod
    def sparse_matrix(
        self,
        entries: Entries,
        values: Array,
        shape: tuple[int, int, int],
        *,
        single: bool,
        sparse_format: Any,
    ) -> Any:
        """Per-sample ``values`` (``(B, nnz)``) at the (row-major sorted) nonzeros of
        ``entries`` as a sparse matrix batch of ``shape`` (one matrix with ``single``)."""
