"""Eager calls of a transform, run as one compiled program that is reused while it is valid.

Called outside ``jax.jit`` (no argument is a tracer, or only the tracers of an eager
``jax.grad`` or ``jax.vmap`` around the call), a transform would run its passes op by op: the
linearization, every pass program and the colour and index arrays are built and moved to the
device at every call (a small LSTM's Hessian under an eager ``grad`` would dispatch thousands
of operations a call). :func:`compiled_when_eager` runs the call as one ``jax.jit`` program
instead, cached in :data:`CACHE` on everything the program depends on:

- the transform and its options, and the registered rules (their
  :func:`~divjac._core.rules.generation`: a rule registered after a call is used by the next);
- the ``DIVJAC_*`` settings (:func:`divjac._core.settings.read`): a memory budget set between
  calls plans the next;
- the traced program of the caller's function at these arguments (traced anew at every call, as
  a jitted call would be while tracing: a new closure over updated weights, a module whose flags
  changed, a dict whose arrays were replaced all give the program they make now), its structure
  (:func:`~divjac.jax._detect.fingerprint`) and the values of its integer and boolean
  constants (indices and masks that detection reads);
- the argument tree, its non-array leaves (static, as ``jax.jit``'s ``static_argnums``) and
  the shapes, dtypes and shardings of the arrays (``jax.jit``'s own cache);
- the tree of what the function returns (an aux's dict keys, a tuple or a list) and which of
  its leaves are arrays. Its other leaves (a Python ``int`` or ``float`` aux) are not part of
  the program: each call returns the values its own trace of the function produced.

The floating-point constants the function captures (weights), its random keys, scalar
constants (step counters) and any value an outer ``grad`` or ``vmap`` traces are arguments of the compiled program, not part of the key: updated
weights reuse it, and the cache keeps none of them alive (each transform keeps its last call's trace, and so its weights, while it lives: :mod:`divjac.jax._trace_reuse`). (Detection then sees such a scalar as
unknown, which may only make a pattern denser, never wrong.)
The program evaluates the traced function (its jaxpr) rather than calling the caller's function
again, so a cached program can never read stale values.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import rules
from .._core.detection import LRU
from .._core.settings import read as read_settings
from . import _compat
from ._detect import GRADIENT, digest, fingerprint, is_array, is_differentiated
from ._jaxpr import is_inexact
from ._trace_reuse import state

__all__ = ["CACHE", "VARYING", "compiled_when_eager"]

CACHE: LRU[Callable[..., Any]] = LRU(64)
"""Compiled eager calls, keyed as described in this module's docstring."""

VARYING: LRU[tuple[tuple[Hashable, ...], frozenset[int]]] = LRU(64)
"""By program (its key without the values of its floating-point literals): the literal values
of its first call and the positions of those that have changed since (:func:`_varying`)."""


def compiled_when_eager(
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    f: Callable[..., Any],
    options: Hashable,
    *,
    skip: int,
    functional: Callable[[Callable[..., Any]], Callable[..., Any]],
    randomness: Callable[[Any], bool],
) -> Callable[..., Any]:
    """The transform ``make(f)``, run as one cached ``jax.jit`` program when called eagerly.

    Args:
        make: builds the transform of a function (``g -> divergence(g, ...)``).
        f: the caller's function.
        options: the transform's name and options (part of the key).
        skip: leading arguments of the call that are not ``f``'s (the randomness of a
            stochastic method).
        functional: how ``f`` is called safely (:meth:`~divjac.jax._backend.JaxBackend.functional`).
        randomness: whether a leading argument is a source of randomness the transform takes.
    """
    transformed = make(f)
    last: list[_Trace] = []  # the last trace of f, reused while its state is unchanged

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args[skip:], kwargs))
        ours = jax.tree_util.tree_leaves(args[:skip])
        if any(_staged(leaf) for leaf in leaves + ours):
            return transformed(*args, **kwargs)  # already traced: the caller's jit compiles
        if len(args) < skip or not all(randomness(a) for a in args[:skip]):
            return transformed(*args, **kwargs)  # no key: the transform says what is missing
        arrays = [is_array(leaf) for leaf in leaves]
        try:
            hash((options, _static_key(leaves, arrays)))
        except TypeError:
            return transformed(*args, **kwargs)  # an unhashable option or argument: not cached
        now = read_settings()  # the memory plan compiled in
        fresh = state(f)
        if fresh is not None:  # the program also depends on the registered rules (patterns)
            fresh = ((rules.generation(), fresh[0]), fresh[1])
        reused = last[0] if last else None
        if fresh is not None and reused is not None and reused.valid(fresh[0], treedef, leaves):
            dyn = [leaf for leaf, d in zip(leaves, reused.dynamic, strict=True) if d]
            program = CACHE.get((reused.key, _differentiated(dyn, reused.weights), now))
            if program is not None:
                return program(reused.weights, list(args[:skip]), dyn, reused.others)
        fun = functional(f)
        # Python floats as weak-typed arguments, as jax.jit takes them; as constants where f
        # needs their value (the trace with them as arguments fails: a shape, a branch).
        floats = [
            a or isinstance(leaf, float | complex) for leaf, a in zip(leaves, arrays, strict=True)
        ]
        traced = _trace(fun, leaves, treedef, floats) if floats != arrays else None
        if traced is None:
            traced = _trace(fun, leaves, treedef, arrays)
        if traced is None:  # f fails at these arguments: the transform reports it
            return transformed(*args, **kwargs)
        closed, out, dynamic = traced
        dyn = [leaf for leaf, d in zip(leaves, dynamic, strict=True) if d]
        closed, n_captured = _literals_as_constants(closed)
        consts = list(closed.consts)
        captured = [i for i in range(n_captured) if _is_weight(consts[i])]
        fixed = tuple(digest(consts[i]) for i in range(n_captured) if i not in captured)
        program_key = (
            (options, fingerprint(closed), fixed, treedef, _static_key(leaves, dynamic), skip),
            rules.generation(),
            (tuple(dynamic), out.treedef, out.arrays),
        )
        literals = tuple(_value(c) for c in consts[n_captured:])
        varying = _varying(program_key, literals)
        weights = captured + [n_captured + j for j in sorted(varying)]
        key = (program_key, varying, tuple(v for j, v in enumerate(literals) if j not in varying))
        inputs = ([consts[i] for i in weights], list(args[:skip]), dyn)
        last.clear()
        if fresh is not None:
            signature = _signature(leaves, dynamic)
            last.append(_Trace(*fresh, treedef, signature, dynamic, key, inputs[0], out.others))
        differentiated = _differentiated(dyn, inputs[0])
        program = CACHE.get((key, differentiated, now))
        if program is not None:
            return program(*inputs, out.others)
        program = _Program(make, closed, weights, leaves, dynamic, treedef, out, differentiated)
        try:
            result = program(*inputs, out.others)
        except Exception:
            # What the transform refuses, it reports on the caller's function; and a custom_jvp
            # rule closing over a value traced inside f (an index array made in f) cannot be
            # differentiated once f's trace is over, as in jacfwd(jit(f)): the transform runs f
            # itself instead, as under the caller's jit.
            return transformed(*args, **kwargs)
        CACHE.put((key, differentiated, now), program)
        return result

    return call


def _differentiated(dyn: list[Any], weights: list[Any]) -> bool:
    """Whether an outer differentiation (an eager ``jax.grad``) runs through this call: its
    program is then planned for the backward (:data:`~divjac.jax._detect.GRADIENT`), which
    its own trace, whose inputs are plain, cannot see; part of the program's key."""
    return any(map(is_differentiated, (*dyn, *weights)))


def _staged(leaf: Any) -> bool:
    """Whether ``leaf`` is being staged out into a program (a ``jit`` or another staging trace
    below it), rather than an eager ``grad``'s or ``vmap``'s tracer of a concrete value, under
    which the transform would otherwise run op by op. Unknown tracers count as staged."""
    if not isinstance(leaf, _compat.Tracer):
        return False
    while isinstance(leaf, _compat.Tracer):
        if not (_compat.is_differentiation(leaf) or _compat.is_batch(leaf)):
            return True  # jit's, shard_map's or another staging trace's
        leaf = _compat.unwrap(leaf)
    return False


def _trace(
    fun: Callable[..., Any], leaves: list[Any], treedef: Any, dynamic: list[bool]
) -> tuple[Any, _Outputs, list[bool]] | None:
    """The jaxpr of ``fun`` with the ``dynamic`` leaves as its inputs (``None`` if tracing
    fails), what it returned, and ``dynamic``."""
    outputs: list[_Outputs] = []

    def flat_f(*dyn_leaves: Any) -> list[Any]:
        a, kw = _rebuild(leaves, dynamic, treedef, dyn_leaves)
        out_leaves, out_def = jax.tree_util.tree_flatten(fun(*a, **kw))
        arrays = tuple(is_array(leaf) for leaf in out_leaves)
        others = [leaf for leaf, d in zip(out_leaves, arrays, strict=True) if not d]
        outputs.append(_Outputs(out_def, arrays, others))
        return [leaf for leaf, d in zip(out_leaves, arrays, strict=True) if d]

    try:
        closed = jax.make_jaxpr(flat_f)(
            *(leaf for leaf, d in zip(leaves, dynamic, strict=True) if d)
        )
    except Exception:
        return None
    return closed, outputs[-1], dynamic


def _static_key(leaves: list[Any], dynamic: list[bool]) -> tuple[Any, ...]:
    """The static leaves, as part of a key: Python numbers by their type only (a program
    depends on their values only through its jaxpr, whose constants and literals are keyed)."""
    return tuple(
        type(leaf) if isinstance(leaf, int | float | complex) else leaf
        for leaf, d in zip(leaves, dynamic, strict=True)
        if not d
    )


def _literals_as_constants(closed: Any) -> tuple[Any, int]:
    """The program with its floating-point scalar literals (the Python floats it computed
    with: closed over, or derived from static arguments) turned into constants appended to its
    own, and the number of its own. Only those of the top-level program: the literals of nested
    programs (a ``scan`` body, an inner ``jit``) stay literals, part of the key."""
    jaxpr = closed.jaxpr
    new_vars: list[Any] = []
    values: list[Any] = []
    eqns = []
    for eqn in jaxpr.eqns:
        invars = list(eqn.invars)
        for k, v in enumerate(invars):
            if isinstance(v, _compat.Literal) and not np.shape(v.val) and is_inexact(v.aval):
                invars[k] = _compat.Var(v.aval)
                new_vars.append(invars[k])
                values.append(v.val)
        eqns.append(eqn if invars == list(eqn.invars) else eqn.replace(invars=invars))
    n = len(closed.consts)
    if not new_vars:
        return closed, n
    lifted = jaxpr.replace(constvars=[*jaxpr.constvars, *new_vars], eqns=eqns)
    return _compat.closed_jaxpr(lifted, [*closed.consts, *values]), n


def _value(c: Any) -> Hashable:
    data = np.asarray(c)
    return (str(data.dtype), data.tobytes())


def _varying(key: Hashable, literals: tuple[Hashable, ...]) -> frozenset[int]:
    """The literals of the program ``key`` whose values have been seen to change between calls:
    arguments of its compiled program from then on (the others are compiled in, as constants
    that XLA folds: ``x ** 2.0`` stays a square)."""
    seen = VARYING.get(key)
    if seen is None:
        VARYING.put(key, (literals, frozenset()))
        return frozenset()
    first, varying = seen
    changed = varying | {j for j, (a, b) in enumerate(zip(first, literals, strict=True)) if a != b}
    if changed != varying:
        VARYING.put(key, (first, frozenset(changed)))
    return frozenset(changed)


def _is_weight(c: Any) -> bool:
    """A constant passed as an argument of the compiled program: floating-point arrays
    (weights), random keys and scalars (counters such as an nnx ``Rngs`` count). The others,
    index arrays and masks that detection may read, are part of the key."""
    if isinstance(c, _compat.Tracer):  # an outer grad's or vmap's: never compiled in
        return True
    dtype = getattr(c, "dtype", None)
    if dtype is None:
        return False
    random = jnp.issubdtype(dtype, jax.dtypes.prng_key)
    return bool(jnp.issubdtype(dtype, jnp.inexact) or random or jnp.ndim(c) == 0)


def _rebuild(leaves: list[Any], dynamic: list[bool], treedef: Any, dyn: Any) -> Any:
    """The argument tree with its array leaves replaced by ``dyn``, in order."""
    it = iter(dyn)
    return jax.tree_util.tree_unflatten(
        treedef, [next(it) if d else leaf for leaf, d in zip(leaves, dynamic, strict=True)]
    )


class _Trace(NamedTuple):
    """The last eager call's trace of the caller's function and the compiled program it chose,
    reused by the next call where :func:`~divjac.jax._trace_reuse.state` of the function, the
    argument tree, the static leaves' values and the dynamic leaves' types are unchanged."""

    state: Hashable
    arrays: list[Any]  # the state's JAX arrays, kept alive so that their ids stay theirs
    treedef: Any
    signature: list[Any]  # static leaves by value, the dynamic ones by :func:`_signature`
    dynamic: list[bool]
    key: Hashable
    weights: list[Any]
    others: list[Any]

    def valid(self, fresh: Hashable, treedef: Any, leaves: list[Any]) -> bool:
        return (
            fresh == self.state
            and treedef == self.treedef
            and _signature(leaves, self.dynamic) == self.signature
        )


def _signature(leaves: list[Any], dynamic: list[bool]) -> list[Any]:
    """What a trace depends on of the argument leaves: the static ones' types and values; the
    arrays' shapes, dtypes, weak types and shardings (a JAX array's abstract value holds the
    first three); the other dynamic leaves' types."""
    return [
        (_array_signature(a) if is_array(a) else type(a)) if d else (type(a), a)
        for a, d in zip(leaves, dynamic, strict=True)
    ]


def _array_signature(a: Any) -> Hashable:
    kind = type(a)
    concrete = _CONCRETE.get(kind)
    if concrete is None:  # a JAX array with its values (not a tracer, not NumPy's)
        concrete = _CONCRETE[kind] = isinstance(a, jax.Array) and not isinstance(a, _compat.Tracer)
    if concrete:
        return a.aval, a.sharding
    return a.shape, a.dtype, getattr(a, "weak_type", False), getattr(a, "sharding", None)


_CONCRETE: dict[type, bool] = {}


class _Outputs(NamedTuple):
    """What one trace of the caller's function returned: its tree, which of its leaves are
    arrays, and the values of the others (Python scalars, strings)."""

    treedef: Any
    arrays: tuple[bool, ...]
    others: list[Any]


class _Slot:
    """Stands for the ``index``-th non-array leaf of the function's output inside the compiled
    program, which returns arrays only; each call puts its own value there."""

    def __init__(self, index: int) -> None:
        self.index = index


class _Program:
    """The jitted call: ``(weights, randomness, array leaves, non-array outputs) -> result``,
    the function being the traced program with the given weights (the other constants are
    those traced)."""

    def __init__(
        self,
        make: Callable[[Callable[..., Any]], Callable[..., Any]],
        closed: Any,
        weights: list[int],
        leaves: list[Any],
        dynamic: list[bool],
        treedef: Any,
        out: _Outputs,
        differentiated: bool,
    ) -> None:
        fixed = {i: c for i, c in enumerate(closed.consts) if i not in weights}
        jaxpr, n_consts = _compat.without_consts(closed), len(closed.consts)  # no weights
        static = [None if d else leaf for leaf, d in zip(leaves, dynamic, strict=True)]
        # The result's tree, with the position of each slot among its leaves (set when traced).
        self._layout: list[tuple[Any, list[int | None]]] = []

        def run(given: list[Any], ours: list[Any], dyn: list[Any]) -> list[Any]:
            values = dict(zip(weights, given, strict=True))
            consts = [values[i] if i in values else fixed[i] for i in range(n_consts)]
            program = _compat.jaxpr_as_fun(_compat.closed_jaxpr(jaxpr, consts))

            def traced_f(*a: Any, **kw: Any) -> Any:
                flat = jax.tree_util.tree_leaves((a, kw))
                computed = iter(
                    program(*(leaf for leaf, d in zip(flat, dynamic, strict=True) if d))
                )
                slots = iter(range(len(out.others)))
                out_leaves = [next(computed) if d else _Slot(next(slots)) for d in out.arrays]
                return jax.tree_util.tree_unflatten(out.treedef, out_leaves)

            a, kw = _rebuild(static, dynamic, treedef, dyn)
            token = GRADIENT.set(differentiated)  # the planner keeps the backward's memory
            try:
                result, result_def = jax.tree_util.tree_flatten(make(traced_f)(*ours, *a, **kw))
            finally:
                GRADIENT.reset(token)
            where = [leaf.index if isinstance(leaf, _Slot) else None for leaf in result]
            self._layout[:] = [(result_def, where)]
            return [leaf for leaf in result if not isinstance(leaf, _Slot)]

        self._jitted = jax.jit(run)

    def __call__(self, given: list[Any], ours: list[Any], dyn: list[Any], others: list[Any]) -> Any:
        arrays = iter(self._jitted(given, ours, dyn))
        result_def, where = self._layout[0]
        leaves = [next(arrays) if i is None else others[i] for i in where]
        return jax.tree_util.tree_unflatten(result_def, leaves)
