"""Eager calls of a transform, run as one compiled program that is reused while it is valid.

Called outside ``jax.jit`` (no argument is a tracer), a transform would run its passes op by op:
the linearization, every pass program and the colour and index arrays are built and moved to the
device at every call. :func:`compiled_when_eager` runs the call as one ``jax.jit`` program
instead, cached in :data:`CACHE` on everything the program depends on:

- the transform and its options;
- the traced program of the caller's function at these arguments (traced anew at every call, as
  a jitted call would be while tracing: a new closure over updated weights, a module whose flags
  changed, a dict whose arrays were replaced all give the program they make now), its structure
  (:func:`~divjac.jax._detect.fingerprint`) and the values of its integer and boolean
  constants (indices and masks that detection reads);
- the argument tree, its non-array leaves (static, as ``jax.jit``'s ``static_argnums``) and
  the shapes, dtypes and shardings of the arrays (``jax.jit``'s own cache).

The floating-point constants the function captures (weights), its random keys and scalar
constants (step counters) are arguments of the compiled program, not part of the key: updated
weights reuse it, and the cache keeps none of them alive. (Detection then sees such a scalar as
unknown, which may only make a pattern denser, never wrong.)
The program evaluates the traced function (its jaxpr) rather than calling the caller's function
again, so a cached program can never read stale values.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from .._core.detection import LRU
from ._detect import digest, fingerprint, is_array

__all__ = ["CACHE", "compiled_when_eager"]

CACHE: LRU[Callable[..., Any]] = LRU(64)
"""Compiled eager calls, keyed as described in this module's docstring."""


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

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args[skip:], kwargs))
        ours = jax.tree_util.tree_leaves(args[:skip])
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves + ours):
            return transformed(*args, **kwargs)  # already traced: the caller's jit compiles
        if len(args) < skip or not all(randomness(a) for a in args[:skip]):
            return transformed(*args, **kwargs)  # no key: the transform says what is missing
        dynamic = [is_array(leaf) for leaf in leaves]
        static = tuple(leaf for leaf, d in zip(leaves, dynamic, strict=True) if not d)
        dyn = [leaf for leaf, d in zip(leaves, dynamic, strict=True) if d]
        try:
            hash((options, static))
        except TypeError:
            return transformed(*args, **kwargs)  # an unhashable option or argument: not cached
        fun = functional(f)

        def flat_f(*dyn_leaves: Any) -> Any:
            a, kw = _rebuild(leaves, dynamic, treedef, dyn_leaves)
            return fun(*a, **kw)

        try:
            closed, out_shape = jax.make_jaxpr(flat_f, return_shape=True)(*dyn)
        except Exception:  # f fails at these arguments: the transform reports it
            return transformed(*args, **kwargs)
        consts = list(closed.consts)
        weights = [i for i, c in enumerate(consts) if _is_weight(c)]
        fixed = tuple(digest(c) for i, c in enumerate(consts) if i not in weights)
        key = (options, fingerprint(closed), fixed, treedef, static, tuple(dynamic), skip)
        program = CACHE.get(key)
        if program is not None:
            return program([consts[i] for i in weights], list(args[:skip]), dyn)
        program = _program(make, closed, weights, leaves, dynamic, treedef, out_shape, skip)
        try:
            result = program([consts[i] for i in weights], list(args[:skip]), dyn)
        except jax.errors.UnexpectedTracerError:
            # A custom_jvp rule closing over a value traced inside f (an index array made in
            # f) cannot be differentiated once f's trace is over, as in jacfwd(jit(f)): the
            # transform runs f itself instead, as under the caller's jit.
            return transformed(*args, **kwargs)
        CACHE.put(key, program)
        return result

    return call


def _is_weight(c: Any) -> bool:
    """A constant passed as an argument of the compiled program: floating-point arrays
    (weights), random keys and scalars (counters such as an nnx ``Rngs`` count). The others,
    index arrays and masks that detection may read, are part of the key."""
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


def _program(
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    closed: Any,
    weights: list[int],
    leaves: list[Any],
    dynamic: list[bool],
    treedef: Any,
    out_shape: Any,
    skip: int,
) -> Callable[..., Any]:
    """The jitted call: ``(weights, randomness, array leaves) -> result``, the function being
    the traced program with the given weights (the other constants are those traced)."""
    fixed = {i: c for i, c in enumerate(closed.consts) if i not in weights}
    jaxpr, n_consts = closed.jaxpr, len(closed.consts)  # not the traced weights themselves
    out_tree = jax.tree_util.tree_structure(out_shape)
    static = [None if d else leaf for leaf, d in zip(leaves, dynamic, strict=True)]

    def run(given: list[Any], ours: list[Any], dyn: list[Any]) -> Any:
        values = dict(zip(weights, given, strict=True))
        consts = [values[i] if i in values else fixed[i] for i in range(n_consts)]
        program = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, consts))

        def traced_f(*a: Any, **kw: Any) -> Any:
            flat = jax.tree_util.tree_leaves((a, kw))
            out = program(*(leaf for leaf, d in zip(flat, dynamic, strict=True) if d))
            return jax.tree_util.tree_unflatten(out_tree, out)

        a, kw = _rebuild(static, dynamic, treedef, dyn)
        return make(traced_f)(*ours, *a, **kw)

    return jax.jit(run)
