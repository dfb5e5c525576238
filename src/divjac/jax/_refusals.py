"""JAX's own failures to differentiate a ``custom_jvp`` rule again, raised as divjac errors.

A ``custom_jvp`` rule that runs another ``custom_jvp`` function with a value traced by the rule
(``jax.scipy.special.expn``'s jitted rule passes the order ``n`` to ``expn`` as a traced value,
so ``exp1`` does it too), or that closes over a tracer of the function's own trace, cannot be
differentiated again: the inner rule is traced when the outer derivative needs it, after the
trace its value belongs to has ended. JAX then raises ``TypeError: No constant handler for type
...Tracer`` or :class:`jax.errors.UnexpectedTracerError`, and does so for ``jax.hessian`` and
``jax.jacfwd(jax.jacfwd(f))`` as well: there is no second derivative to compute. The
second-order sweep names the ``custom_jvp`` function it was differentiating
(:func:`check_differentiable_twice`); elsewhere (a gradient differentiated again by JAX's transforms)
JAX's filtered traceback names none, and :func:`leaked_tracers_refused` says what it can.

A rule JAX fails to differentiate for another reason, its batching defect (jax-ml/jax#16374) met
by ``jax.scipy.special.i1`` from JAX 0.12 on in a ``vmap``-ed function, is refused the same way,
naming the way out (batching after the transform).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .._errors import UnsupportedOperationError
from . import _compat
from ._tangent_passes import bind

__all__ = ["check_differentiable_twice", "leaked_tracers_refused"]

_WHY = (
    "the rule runs a value traced by another trace, which has ended when the derivative of "
    "the rule is taken (a jitted rule that passes a traced non-differentiable argument to a "
    "custom_jvp function, as jax.scipy.special.expn and exp1 do, or a rule that closes over a "
    "tracer of the function). jax.hessian fails on it the same way, so no second-order result "
    "(laplacian, hessian, the divergence of a gradient) can go through it. Give the function a "
    "custom_jvp whose rule is itself differentiable (for exp1: d/dx exp1(x) = -exp(-x)/x), or "
    "pass the closed-over values as arguments."
)

# JAX's own defect (jax-ml/jax#16374, open): a custom_jvp function staged from a ``vmap`` (the
# program of a batched ``f``) whose rule calls a custom_jvp function with an output that does not
# vary over the batch (``jax.scipy.special.i1``'s rule from JAX 0.12 on: its Maclaurin terms)
# keeps the batch dimensions of the wrong one of the two, and a shape error follows.
_WHY_BATCHED = (
    "JAX's own derivative of the rule fails (JAX's error is chained below), as it does when "
    "the function was batched by jax.vmap before the second derivative was taken, and the "
    "rule calls a custom_jvp function whose output does not vary over the batch (as "
    "jax.scipy.special.i1's rule does from JAX 0.12 on); JAX then mixes up the batch "
    "dimensions of the two (jax-ml/jax#16374), and jax.hessian of jax.jit(jax.vmap(f)) fails "
    "the same way. Batch after the transform instead: jax.vmap(laplacian(u, batch_axis=None)) "
    "for a single-sample u (and the same for the other second-order transforms)."
)


def leaked_tracer(err: BaseException) -> bool:
    """Whether ``err`` is JAX's error for a tracer used after its trace ended."""
    if isinstance(err, jax.errors.UnexpectedTracerError):
        return True
    message = str(err)
    return (
        isinstance(err, TypeError)
        and "No constant handler for type" in message
        and ("Tracer" in message)
    )


def check_differentiable_twice(eqn: Any) -> None:
    """Raise :class:`UnsupportedOperationError` naming the ``custom_jvp`` function of ``eqn``
    (a ``custom_jvp_call`` equation) if JAX cannot differentiate its rule: tracing the
    ``jvp`` of its ``jvp`` (at the operands' abstract values, with the mesh axes they vary
    over inside ``shard_map``) fails with a leaked tracer or with JAX's batching defect
    (``_WHY_BATCHED``), or leaves a
    tracer among the constants of a nested program, which no backend can compile (under the
    caller's ``jax.jit`` the compiler would fail only after divjac returned)."""
    avals = [v.aval for v in eqn.invars]
    floats = [i for i, v in enumerate(eqn.invars) if jnp.issubdtype(v.aval.dtype, jnp.inexact)]

    def twice(*operands: Any) -> Any:
        def fn(*a: Any) -> Any:
            full = list(operands)
            for i, ai in zip(floats, a, strict=True):
                full[i] = ai
            return bind(eqn, *full)

        at = tuple(operands[i] for i in floats)
        ones = tuple(jnp.ones_like(a) for a in at)
        return jax.jvp(lambda *a: jax.jvp(fn, a, ones)[1], at, ones)

    try:
        closed = jax.make_jaxpr(twice)(*avals)
    except (TypeError, jax.errors.UnexpectedTracerError) as err:
        raise _refusal(eqn, _WHY if leaked_tracer(err) else _WHY_BATCHED) from err
    if _nested_tracer(closed.jaxpr):
        raise _refusal(eqn, _WHY)


def _nested_tracer(jaxpr: _compat.Jaxpr) -> bool:
    """Whether a program nested in ``jaxpr`` has a tracer among its constants."""
    return any(
        any(isinstance(c, _compat.Tracer) for c in consts) or _nested_tracer(sub)
        for eqn in jaxpr.eqns
        for sub, consts in _compat.nested_programs(eqn)
    )


def _refusal(eqn: Any, why: str) -> UnsupportedOperationError:
    name = _compat.open_jaxpr(_compat.called(eqn))[0].debug_info.func_name
    rule = getattr(_compat.custom_jvp_rule(eqn), "debug_info", None)
    where = f" ({rule.func_src_info})" if rule is not None else ""
    return UnsupportedOperationError(
        f"the second-order sweep: JAX cannot differentiate the custom_jvp function {name} "
        f"through its rule{where} a second time: {why}"
    )


@contextlib.contextmanager
def leaked_tracers_refused(fname: str) -> Iterator[None]:
    """Re-raise JAX's leaked-tracer errors (:func:`leaked_tracer`) as
    :class:`UnsupportedOperationError`; any other error passes unchanged."""
    try:
        yield
    except (TypeError, jax.errors.UnexpectedTracerError) as err:
        if not leaked_tracer(err):
            raise
        raise UnsupportedOperationError(
            f"{fname}: JAX met a traced value outside its trace while differentiating the "
            "function (JAX's message below). This is JAX's failure to differentiate a "
            f"custom_jvp rule again when {_WHY} A function that keeps a traced value in a "
            "global or an attribute fails the same way."
        ) from err
