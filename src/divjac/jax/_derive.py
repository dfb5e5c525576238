"""Patterns of primitives without a rule, from their own derivative and batching rules.

A primitive that the table does not know is not assumed dense right away: its JVP rule (or its
VJP rule), traced, is a program of primitives with rules, linear in the tangents, which gives a
precise pattern. Where neither can be followed, the dense fallback keeps the slices of the
leading axis apart when the primitive's batching rule shows that it maps itself over them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import rules as D
from .._core.rules import Deps
from . import _compat
from ._jaxpr import Runner, Scope, evaluate, is_inexact, shape, single_eqn_fun

__all__ = ["per_slice", "via_jvp", "via_vjp"]


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

    def wrapper(it: Runner, scope: Scope, eqn: Any) -> list[Deps] | None:
        key = (eqn.primitive.name, id(_compat.called(eqn)))
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
    scope: Scope, eqn: Any
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
    fn, var_in = single_eqn_fun(eqn)
    moving = [is_inexact(v.aval) and not scope.read(v).is_empty for v in var_in]

    def call(primals: Sequence[Any], moved: Sequence[Any]) -> list[Any]:
        replaced = iter(moved)
        return fn(*(next(replaced) if m else p for p, m in zip(primals, moving, strict=True)))

    return call, var_in, moving


@_guarded
def via_jvp(it: Runner, scope: Scope, eqn: Any) -> list[Deps] | None:
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
def via_vjp(it: Runner, scope: Scope, eqn: Any) -> list[Deps] | None:
    """Dependencies from the equation's VJP (transpose) rule, as a local Jacobian pattern.

    Each floating-point output element gets its own label; pulling the labels back through the
    VJP gives the local pattern (inputs x outputs), which is then composed with the inputs'
    dependency sets. ``None`` if the rule cannot be traced or refers to the primitive itself.
    """
    call, var_in, moving = _moving(scope, eqn)
    avals = [_struct(v) for v in var_in]
    kept = [k for k, v in enumerate(eqn.outvars) if is_inexact(v.aval)]

    def cotangents_in(primals: list[Any], cts: list[Any]) -> Any:
        start = [p for p, m in zip(primals, moving, strict=True) if m]
        outputs = lambda *moved: [call(primals, moved)[k] for k in kept]  # noqa: E731
        return jax.vjp(outputs, *start)[1](cts)

    try:
        vjp_jaxpr = jax.make_jaxpr(cotangents_in)(avals, [_struct(eqn.outvars[k]) for k in kept])
    except Exception:
        return None
    outs = [shape(eqn.outvars[k].aval) for k in kept]
    sizes = [math.prod(s) for s in outs]
    n_out = sum(sizes)
    offsets = np.cumsum([0, *sizes])
    seeds = [
        D.from_labels(s, np.arange(n) + off, n_out)
        for s, n, off in zip(outs, sizes, offsets[:-1], strict=True)
    ]
    local = it.local(n_out)
    values = [*(scope.value(v) for v in var_in), *[None] * len(seeds)]
    empties = [D.empty(a.shape, n_out) for a in avals]
    pulled = local.run(vjp_jaxpr, [*empties, *seeds], in_values=values)
    it.fallbacks |= local.fallbacks
    moved_deps = [scope.read(v) for v, m in zip(var_in, moving, strict=True) if m]
    stacked_in = D.concatenate([D.reshape(d, (d.size,)) for d in moved_deps], 0)
    pattern = D.concatenate([D.reshape(p, (p.size,)) for p in pulled], 0).matrix().T.tocoo()
    results = [D.empty(shape(v.aval), it.n_labels) for v in eqn.outvars]
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
    fn, var_in = single_eqn_fun(eqn)
    var_axes = tuple(a for v, a in zip(eqn.invars, axes, strict=True) if isinstance(v, _compat.Var))
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
        and [isinstance(v, _compat.Var) for v in again.invars]
        == [isinstance(v, _compat.Var) for v in eqn.invars]
        and [v for v in again.invars if isinstance(v, _compat.Var)] == list(mapped.invars)
        and list(again.outvars) == list(mapped.outvars)
    )


def _random(aval: Any, rng: np.random.Generator) -> np.ndarray:
    dims, dtype = shape(aval), np.dtype(aval.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return rng.standard_normal(dims).astype(dtype)
    return rng.integers(0, 2, dims).astype(dtype)


def _agrees_on_slices(eqn: Any, axes: list[int | None], length: int) -> bool:
    """The batching rule's claim, checked at a random point on the first and last slices.

    Guards against a batching rule that does not hold for these slices (a primitive whose
    abstract evaluation accepts them but which is not defined on them).
    """
    if eqn.effects:
        return False
    rng = np.random.default_rng(0)
    try:
        whole_in = [
            _random(v.aval, rng) if isinstance(v, _compat.Var) else None for v in eqn.invars
        ]
    except TypeError:  # opaque dtypes (PRNG keys): cannot be drawn
        return False
    whole = evaluate(eqn, whole_in)
    for b in sorted({0, length - 1}):
        sliced = [
            x if x is None or a is None else x[b] for x, a in zip(whole_in, axes, strict=True)
        ]
        part = evaluate(eqn, sliced)
        if whole is None or part is None:
            return False
        close = (
            np.allclose(w[b], q, rtol=1e-5, atol=1e-6, equal_nan=True)
            for w, q in zip(whole, part, strict=True)
        )
        if not all(close):
            return False
    return True


def per_slice(scope: Scope, eqn: Any) -> list[Deps] | None:
    """A dense fallback that keeps the slices of the leading axis apart, where that is sound.

    When the equation maps itself over the leading axis of its inputs (those of the outputs'
    leading length; the others are shared by every slice), output slice ``b`` depends on the
    input slices ``b`` and the shared inputs only: each slice is dense, samples stay apart.
    ``None`` otherwise.
    """
    lead = {s[:1] for s in (shape(v.aval) for v in eqn.outvars)}
    if len(lead) != 1 or lead == {()} or lead == {(0,)}:
        return None
    (length,) = lead.pop()
    axes = [
        0 if isinstance(v, _compat.Var) and shape(v.aval)[:1] == (length,) else None
        for v in eqn.invars
    ]
    if not (_maps_itself(eqn, axes) and _agrees_on_slices(eqn, axes, length)):
        return None
    n_labels = scope.interp.n_labels
    sliced = [scope.read(v) for v, a in zip(eqn.invars, axes, strict=True) if a == 0]
    shared = [scope.read(v) for v, a in zip(eqn.invars, axes, strict=True) if a is None]
    results = []
    for v in eqn.outvars:
        s = shape(v.aval)
        parts = [D.batched_dense(d, len(d.shape) - 1, s, len(s) - 1) for d in sliced]
        results.append(D.union(D.empty(s, n_labels), *parts, *(D.dense(s, d) for d in shared)))
    return results
