"""What one call of a transform is: the options it was built with and its prepared arguments.

A transform is built with a :class:`Spec` (its backend, function and options); each call of the
function it returns is prepared into a :class:`Call` (:func:`prepare`): the arguments checked, the
function traced batch first, and the batch-first function at its input, which the backend
linearizes (a :class:`~divjac._backend.Point`). The option types (:data:`Mode`, :data:`Method`,
...) are defined here once, for the public signatures of both frameworks.

Imports the backend interface and the core, never a transform (nor a framework).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np

from ._backend import Array, Backend, Point
from ._core import checks, plan, timing
from ._core.detection import AUTO_DETECTION_ENTRIES, Detection, Traced
from ._core.settings import Settings, read as read_settings
from ._errors import (
    ArgnumsError,
    BatchAxisError,
    InternalError,
    NotCallableError,
    NumProbesError,
    OptionError,
    OutputError,
    UnexpectedRandomnessError,
)

__all__ = [
    "BiLaplacianMethod",
    "Call",
    "Coupling",
    "DiagonalMethod",
    "Direction",
    "Distribution",
    "FrobeniusMethod",
    "LaplacianMethod",
    "LogDetMethod",
    "Method",
    "Mode",
    "OperatorMethod",
    "Spec",
    "WeightedMethod",
    "check_differentiable",
    "check_floating_output",
    "check_num_probes",
    "check_option",
    "from_axis",
    "prepare",
    "to_axis",
]

Mode: TypeAlias = Literal["auto", "fwd", "rev", "sparse"]
"""How ``jacobian`` computes: one JVP per input element (``"fwd"``), one VJP per output element
(``"rev"``), one pass per color of the detected pattern (``"sparse"``), or the cheapest
(``"auto"``)."""

Direction: TypeAlias = Literal["auto", "fwd", "rev"]
"""How a divergence pushes its passes: JVPs (``"fwd"``: columns, ``J v``), VJPs (``"rev"``: rows,
``u^T J``), or what the backend chooses from the traced program (``"auto"``)."""

Method: TypeAlias = Literal["auto", "exact", "sparse", "hutchinson", "hutch++", "xtrace", "probing"]
"""How a divergence (or Laplacian) is computed: exact (``"auto"``, ``"exact"``, ``"sparse"``) or
estimated (``"hutchinson"``, ``"hutch++"``, ``"xtrace"``, ``"probing"``)."""

LaplacianMethod: TypeAlias = Literal[
    "auto", "exact", "sparse", "hutchinson", "stde", "hutch++", "xtrace", "probing"
]
"""How a Laplacian is computed: exact (``"auto"``, ``"exact"``: one Taylor sweep of the unit
basis; ``"sparse"``: of the colors of the Hessian pattern) or estimated (``"hutchinson"``,
``"stde"``: random jets; ``"hutch++"``, ``"xtrace"``, ``"probing"``: Hessian-vector products)."""

DiagonalMethod: TypeAlias = Literal["auto", "exact", "sparse", "hutchinson"]
"""How the diagonal of a Hessian is computed: exact (``"auto"``, ``"exact"``, ``"sparse"``) or
estimated (``"hutchinson"``: Bekas, Kokiopoulou & Saad)."""

WeightedMethod: TypeAlias = Literal["auto", "exact", "hutchinson"]
"""How ``tr(A H)`` is computed: exact (``"auto"``, ``"exact"``) or estimated (``"hutchinson"``)."""

BiLaplacianMethod: TypeAlias = Literal["auto", "exact", "hutchinson"]
"""How a bi-Laplacian is computed: exact (``"auto"``, ``"exact"``) or estimated
(``"hutchinson"``: Gaussian directions)."""

OperatorMethod: TypeAlias = Literal["auto", "exact", "hutchinson", "stde"]
"""How a linear differential operator is computed: exact (``"auto"``, ``"exact"``: its
directional derivatives, one computation per order) or estimated (``"hutchinson"``, ``"stde"``:
its (direction, weight) pairs sampled in proportion to the weights)."""

FrobeniusMethod: TypeAlias = Literal["auto", "exact", "sparse", "hutchinson"]
"""How a squared Frobenius norm (with or without the divergence) is computed: exact
(``"auto"``, ``"exact"``, ``"sparse"``: by a column or row coloring) or estimated
(``"hutchinson"``: ``E ||J v||^2 = ||J||_F^2``)."""

LogDetMethod: TypeAlias = Literal["auto", "exact", "slq"]
"""How ``log|det J|`` is computed: exact (``"auto"``, ``"exact"``: per-sample Jacobians and
their LU) or estimated (``"slq"``: stochastic Lanczos quadrature on ``J^T J``)."""

Distribution: TypeAlias = Literal["rademacher", "gaussian", "sphere"]
"""The distribution of the probes of a stochastic method."""

Coupling: TypeAlias = Literal["raise", "exact"]
"""What to do with a function that mixes samples: refuse it, or compute its exact per-sample
diagonal blocks."""


def check_option(name: str, value: object, options: Any, *, fname: str) -> None:
    """Raise :class:`OptionError` unless ``value`` is one of the ``Literal`` type ``options``."""
    choices = typing.get_args(options)
    if value not in choices:
        raise OptionError(f"{fname}: {name} must be one of {choices}; got {value!r}.")


def check_num_probes(num_probes: object, *, fname: str) -> None:
    """Raise :class:`NumProbesError` unless ``num_probes`` is ``None`` (the method's default) or
    a positive integer (each method checks what else it needs, such as a multiple of 3)."""
    if num_probes is None:
        return
    if isinstance(num_probes, bool) or not isinstance(num_probes, numbers.Integral):
        raise NumProbesError(
            f"{fname}: num_probes must be a positive integer, or None for the method's default; "
            f"got {num_probes!r} of type {type(num_probes).__name__}."
        )
    if num_probes < 1:
        raise NumProbesError(
            f"{fname}: num_probes must be a positive integer, or None for the method's default; "
            f"got {num_probes}. A stochastic method needs at least one probe."
        )


@dataclass(frozen=True)
class Spec:
    """What a transform was built with (shared by all its calls).

    Attributes:
        backend: the framework's primitives.
        fun: the caller's (batched) function.
        argnums: the position of the differentiated argument.
        batch_axis: its batch axis (and the output's); ``None``: a single sample.
        has_aux: ``fun`` returns ``(output, aux)``.
        coupling: what to do when ``fun`` mixes samples.
        fname: the public name of the transform (in messages).
        prefer_reverse: rows rather than columns on a tie; ``None``: the backend decides from the
            traced program.
        direction: the caller's choice of passes (``"auto"``: ``prefer_reverse`` decides).
    """

    backend: Backend[Any]
    fun: Callable[..., Any]
    argnums: int
    batch_axis: int | None
    has_aux: bool
    coupling: Coupling
    fname: str
    prefer_reverse: bool | None = None
    direction: Direction = "auto"

    def __post_init__(self) -> None:
        if not callable(self.fun):
            raise NotCallableError(
                f"{self.fname}: the function to differentiate is not callable (got "
                f"{type(self.fun).__name__}). Pass the function itself, {self.fname}(f, ...), "
                "then call the result on f's arguments."
            )

    @functools.cached_property
    def options(self) -> tuple[Any, ...]:
        """Its fields but the function and the backend (which a trace of the function
        implies): what a setup of a call reads of the spec."""
        return tuple(
            getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("backend", "fun")
        )


@dataclass(frozen=True)
class Call(Point[Traced]):
    """One call of a transform: the batch-first function at its input, and its :class:`Spec`
    (whose ``batch_axis`` is normalized to a non-negative axis)."""

    spec: Spec

    @property
    def backend(self) -> Backend[Any]:
        return self.spec.backend

    @functools.cached_property
    def settings(self) -> Settings:
        """The environment's settings (``DIVJAC_*``), read once for this call."""
        return read_settings()

    def unbatch(self, yb: Array) -> Array:
        """A batch-first result back to the caller's layout."""
        return to_axis(self.backend, yb, self.spec.batch_axis)

    def bytes_per_pass(self) -> int:
        """Bytes one pass holds on one device: its share of a batch split over devices."""
        xb, traced = self.xb, self.traced
        passed = self.backend.pass_elements(self)
        elements = math.prod(xb.shape) + math.prod(traced.out_shape) + passed
        return self.backend.itemsize(xb) * elements // self.backend.batch_shards(xb)

    def chunk(
        self,
        n_passes: int,
        chunk_size: int | None,
        in_cache: bool = True,
        share: int = 1,
        *,
        reverse: bool = False,
    ) -> plan.Chunks:
        """How ``n_passes`` passes run: ``chunk_size`` at a time, or as many as fit the memory
        budget (of the device, where the framework reports its free memory). ``in_cache``:
        passes (or the directions of a second-order sweep) that on the host run fastest in
        chunks that stay in the CPU's cache (:func:`plan.choose_chunk_size`); ``False`` for a
        bound by memory alone. ``share``: passes hold ``1 / share`` of their bytes in the cache
        at once. ``reverse``: the passes pull rows, which the backend may batch for little gain
        (:meth:`~divjac._backend.Backend.rows_overhead_only`).

        Where a gradient will flow through the passes, chunks that bound their memory (the
        budget's, or ``chunk_size``'s) are checkpointed: the backward recomputes each, keeping
        only its inputs. Where all passes fit the budget at once, the chunks the cache asks for
        keep their graphs (which together hold no more than one chunk of all), where the
        backend runs them so (:attr:`~divjac._backend.Backend.cache_chunks_on_graph`); else
        the passes run in one chunk. A 10-class ResNet's rows pulled one at a time at
        ``B = 8`` (torch, 2 threads) trained 1.5x slower checkpointed than so."""
        recomputed = self.backend.recomputes_chunks(self)
        available = self.backend.memory_available(self.xb)
        per_pass = self.bytes_per_pass()
        fits = n_passes * per_pass <= plan.memory_budget(available, self.settings)
        # Chunks that keep their graphs: any without a gradient; with one, the cache's where
        # the backend runs them so and all passes fit the budget at once.
        free = not recomputed or (fits and self.backend.cache_chunks_on_graph)
        size = plan.choose_chunk_size(
            n_passes,
            per_pass,
            chunk_size,
            available=available,
            in_cache=in_cache and free,
            cache_share=share,
            settings=self.settings,
            overhead_only=reverse and self.backend.rows_overhead_only(self),
        )
        count = -(-n_passes // size)
        bounded = chunk_size is not None or not free
        return plan.Chunks(size, count, checkpointed=recomputed and bounded and count > 1)

    def detect(
        self, *, per_sample: bool, auto: bool = False, dense_passes: int | None = None
    ) -> Detection:
        """Detect the pattern (abandoned in ``auto`` mode when too dense, or past its memory
        budget); checks coupling. ``dense_passes``: what the dense plan that ``auto`` falls
        back to takes; past the memory budget it warns, or refuses a dense plan of more than
        :data:`plan.AUTO_DENSE_MAX_PASSES` (:func:`plan.dense_fallback`)."""
        limit = AUTO_DETECTION_ENTRIES if auto else None
        with timing.stage("detection" if per_sample else "coupling check"):
            found = self.traced.detect(per_sample=per_sample, max_entries=limit)
        stop = self.traced.memory_stop() if found is None and per_sample else None
        if stop is not None and dense_passes is not None:
            plan.dense_fallback(stop, dense_passes, fname=self.spec.fname)
        if found is None:
            with timing.stage("coupling check"):
                found = self.traced.detect(per_sample=False)
        if found is None:
            raise InternalError("a detection without an entry limit gave up")
        if found.coupling is not None and self.spec.coupling == "raise":
            raise checks.coupling_error(
                found.coupling, fname=self.spec.fname, fallbacks=found.fallbacks
            )
        return found

    def prefer_reverse(self, found: Detection | None, *, measure: bool = False) -> bool:
        """Rows rather than columns on a tie (and always where forward mode cannot go, as
        ``found`` or :meth:`columns_possible` tells; ``None``: nothing was detected), unless
        the caller chose. ``measure``: the passes are many (an exact or sparse plan of a square
        Jacobian), so the backend may time a few of each direction to choose."""
        if self.spec.direction != "auto":
            return self.spec.direction == "rev" or not self.columns_possible(self.spec.direction)
        if found is not None and found.has_custom_vjp:
            return True
        if not self.columns_possible("auto"):
            return True
        if self.spec.prefer_reverse is not None:
            return self.spec.prefer_reverse
        return self.backend.prefer_reverse(self, measure=measure)

    def columns_possible(self, mode: str) -> bool:
        """Whether forward passes can run: not where an operation of the program has no
        forward derivative (then rows are pushed); when the caller chose ``mode="fwd"``,
        :class:`OptionError` names those operations."""
        missing = self.backend.forward_less(self)
        if missing and mode == "fwd":
            raise OptionError(
                f"{self.spec.fname}: mode='fwd' pushes forward derivatives, but the function "
                f"runs {', '.join(sorted(missing))}, which has none in this framework (or, "
                "with gradients on, one whose own derivative the framework gets wrong: "
                "gradients through forward passes of it would be wrong). Use mode='rev' or "
                "'auto' (reverse passes)."
            )
        return not missing


def from_axis(backend: Backend[Any], t: Array, axis: int | None) -> Array:
    """Batch axis ``axis`` (``None``: no batch) moved first."""
    return t[None] if axis is None else backend.moveaxis(t, axis, 0)


def to_axis(backend: Backend[Any], t: Array, axis: int | None) -> Array:
    """The leading batch axis moved to ``axis`` (``None``: removed)."""
    return t[0] if axis is None else backend.moveaxis(t, 0, axis)


def prepare(spec: Spec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """Check the arguments of one call, trace ``spec.fun`` batch first and bind it."""
    backend, fname = spec.backend, spec.fname
    if args and backend.is_randomness(args[0]):
        _check_no_randomness(spec, args, kwargs)
    argnum = checks.normalize_argnum(spec.argnums, len(args), fname=fname)
    x = args[argnum]
    check_differentiable(backend, x, spec.argnums, argnum, fname)
    x_shape = tuple(x.shape)
    axis = checks.normalize_batch_axis(
        spec.batch_axis, x_shape, what="differentiated input", fname=fname
    )
    if axis is not None and x_shape[axis] == 0:
        raise BatchAxisError(
            f"{fname}: the batch is empty (the differentiated input has shape {x_shape}, size "
            f"0 on batch_axis={axis}): there is no sample to differentiate. Skip empty batches "
            "(e.g. drop_last in the data loader), or check batch_axis."
        )
    fit = backend.differentiable(x)
    if fit is not x:
        x, args = fit, (*args[:argnum], fit, *args[argnum + 1 :])
    fun, has_aux = backend.functional(spec.fun), spec.has_aux
    with timing.stage("trace"):
        try:
            traced = backend.trace(
                fun, args, kwargs, argnum=argnum, batch_axis=axis, has_aux=has_aux
            )
        except TypeError as error:  # f's own error, unless the caller passed probes to f
            _check_no_randomness(spec, args, kwargs, error)
            raise
    _check_output(spec, traced.out_tree, x_shape, axis)
    if axis != spec.batch_axis:
        spec = dataclasses.replace(spec, batch_axis=axis)

    def g(xb: Array) -> Any:
        out = fun(*args[:argnum], to_axis(backend, xb, axis), *args[argnum + 1 :], **kwargs)
        y, aux = out if has_aux else (out, None)
        yb = from_axis(backend, y, axis)
        return (yb, aux) if has_aux else yb

    xb = from_axis(backend, x, axis)
    return Call(g, xb, traced, has_aux, args, kwargs, spec)


def check_differentiable(
    backend: Backend[Any], x: Any, argnums: int, argnum: int, fname: str
) -> None:
    """Raise :class:`ArgnumsError` or :class:`InputDtypeError` unless ``x``, the argument
    ``argnums`` selects (at position ``argnum``), is a floating array."""
    dtype = getattr(x, "dtype", None)
    integers = isinstance(dtype, np.dtype) and np.issubdtype(dtype, np.integer)  # (legacy keys)
    if x is not None and backend.is_randomness(x) and not integers:
        raise ArgnumsError(
            f"{fname}: argnums={argnums} selects a source of randomness ({type(x).__name__}); "
            "a stochastic method takes its key, generator or probes as the call's first "
            f"argument, before the function's own: fn({backend.randomness_example}, *args)."
        )
    if not backend.is_array(x):
        noun = backend.array_noun
        raise ArgnumsError(
            f"{fname}: argnums={argnums} selects an argument of type {type(x).__name__}; "
            f"divjac differentiates with respect to one {noun}. Pass the {noun} there (to "
            f"differentiate w.r.t. parameters, {backend.param_grad_hint})."
        )
    if not backend.is_floating_input(x.dtype):
        raise checks.not_floating(
            x.dtype, argnum=argnum, fname=fname, cast_hint=backend.input_cast_hint
        )


def _check_no_randomness(
    spec: Spec, args: tuple[Any, ...], kwargs: dict[str, Any], error: TypeError | None = None
) -> None:
    """Raise :class:`UnexpectedRandomnessError` where the call's first argument is a key, a
    generator or probes (a floating array) that the function does not take: its signature
    binds the call's arguments without the first one, and not with it."""
    backend = spec.backend
    first: Any = args[0] if args else None
    if backend.is_randomness(first):
        what = f"a source of randomness ({type(first).__name__})"
    elif backend.is_array(first) and backend.is_floating_input(first.dtype):
        noun = backend.array_noun
        article = "an" if noun[0] in "aeiou" else "a"
        what = f"{article} {noun} of shape {tuple(first.shape)} (probes?)"
    else:
        return
    try:
        signature = inspect.signature(spec.fun)
    except (TypeError, ValueError):  # no signature to read (a builtin): f reports the call
        return
    try:
        signature.bind(*args, **kwargs)
        return
    except TypeError:
        pass
    try:
        signature.bind(*args[1:], **kwargs)
    except TypeError:
        return
    raise UnexpectedRandomnessError(
        f"{spec.fname}: the call's first argument is {what}, which the function does not take. "
        "Only a stochastic method (method='hutchinson', 'hutch++', 'xtrace', 'probing', or "
        "'stde' for a Laplacian) takes a key, generator or probes first; with this method, call "
        "the transformed function with the function's own arguments only, or choose a "
        "stochastic method to use these probes."
    ) from error


def _check_output(spec: Spec, out: Any, x_shape: tuple[int, ...], axis: int | None) -> None:
    """Check what the traced function returned (``out``: its tree of array specs)."""
    backend, fname = spec.backend, spec.fname
    if spec.has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise OutputError(
                f"{fname}: has_aux=True needs the function to return a pair (output, aux); "
                f"got {_described(backend, out)}."
            )
        out = out[0]
    if not backend.is_array_spec(out):
        raise checks.not_an_array(out, what="function's output", fname=fname)
    check_floating_output(backend, out.dtype, fname)
    if axis is None:
        return
    given = spec.batch_axis
    if given is not None and not -len(out.shape) <= given < len(out.shape):
        raise BatchAxisError(
            f"{fname}: batch_axis={given} is the batch axis of the input and of the "
            f"function's output, but the output has shape {tuple(out.shape)}: no axis {given}. "
            "Return the batch on the same axis as the input (a scalar per sample with the "
            "batch on axis 1: shape (1, B)), or move the batch to axis 0 of both."
        )
    out_axis = checks.normalize_batch_axis(
        spec.batch_axis, out.shape, what="function's output", fname=fname
    )
    if out_axis is None:
        raise InternalError("a batch axis normalized to None")
    if out.shape[out_axis] != x_shape[axis]:
        raise checks.batch_size_mismatch(x_shape, axis, out.shape, out_axis, fname=fname)


def _described(backend: Backend[Any], out: Any) -> str:
    """What the function returned, for a message (``out``: its tree of array specs)."""
    if backend.is_array_spec(out):
        return f"one {backend.array_noun} of shape {tuple(out.shape)}"
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of {len(out)} elements"
    return type(out).__name__


def check_floating_output(backend: Backend[Any], dtype: Any, fname: str) -> None:
    """Raise :class:`OutputError` unless an output of ``dtype`` can be differentiated."""
    if not backend.is_floating_output(dtype):
        raise OutputError(
            f"{fname}: the function's output has dtype {dtype}; derivatives need a real "
            f"floating output. Return floats ({backend.output_cast_hint})."
        )
