"""Second-order directional derivatives of a batched function, for many directions at once.

The torch twin of :mod:`divjac.jax._taylor` (same contract): ``f(x)``, the first-order terms
``J v_k`` and the second-order terms ``v_k^T H v_k`` (each, or their weighted sum) of a
batch-first function.

The sweep is collapsed Taylor mode (the forward Laplacian of Li et al. 2023, generalized by
Dangel, Siebert, Zeinhofer & Walther, NeurIPS 2025): the ATen graph of ``f`` (divjac's cached
trace) is run once, and every value that depends on the input carries, beside its primal, the
``K`` first-order terms and ONE second-order term, the weighted sum over the directions (or the
``K`` of them with ``collapse=False``). Per operation:

- linear operations (views, sums, concatenation, a product with a constant, a convolution with
  constant weights) map the first-order terms and the second-order term alike;
- element-wise nonlinearities ``g`` add ``g''(x) sum_k w_k (J_k x)^2`` to ``g'(x) x''`` (exact
  formulas for ``tanh``, ``exp``, ``log``, ``sin``, ``softplus``, ``silu``, ``pow``, ...);
- products (``mul``, ``div``, ``mm``, ``bmm`` with both operands dependent) add
  ``2 sum_k w_k op(a_k', b_k')``, as one contraction over ``k``;
- any other operation is pushed by ``torch.func`` (``jvp`` of ``jvp``, batched over ``k`` with
  ``vmap``) on its own, normalizations in their composed forms (the forward derivatives of
  torch's kernels are wrong or fail under transforms, torch 2.13; as
  :class:`divjac.torch._kernels._ComposedNorms` does for whole functions).

Directions shared by the samples (``[K, 1, *in]``) stay unbroadcast until an operation mixes
them with per-sample values (the first layer computes ``W v_k`` once, not ``B`` times).

Everything is computed by torch operations on the actual tensors (the parameters the graph
captured are the module's own), so autograd differentiates the result w.r.t. them. The trace
is divjac's cached one (its key identifies the parameters and buffers of the modules); other
floating-point tensors it captured (weights in a closure) are checked, at every call, to be
the very ones the function reaches now. The function is run as the generic reference (``jvp``
of ``jvp`` of the whole function, batched over the directions with ``vmap``) where the graph
cannot be run: under ``torch.compile``, when it draws random numbers, or when the tensors it
captured are no longer those the function reaches.

Weights per sample (``[K, B]``) keep the second-order terms per direction and weight them at
the output (the batch axis of an intermediate is not known after views that merge it).
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast, overload

import torch
import torch.fx
from torch.func import jvp, vjp, vmap
from torch.utils import _pytree as pytree

from .._errors import InternalError, OptionError
from ._aten import (
    forward_derivative_wrong,
    inexact,
    lacks_forward_derivative,
    located,
    packet,
    storage_positions,
)
from ._detect import reach, trace
from ._kernels import PlainLayouts, _ComposedNorms, _without_overlap, composed_norm
from ._passes import _Generators
from ._traced import Traced

__all__ = ["second_order_sweep"]

Tensor = torch.Tensor
aten = torch.ops.aten


def second_order_sweep(
    f: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    directions: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    collapse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``f(x)``, ``J v_k`` and ``v_k^T H v_k`` of a batch-first function.

    Args:
        f: ``[B, *in] -> [B, *out]``, batch first, acting on each sample separately (the caller
            has checked coupling).
        x: the point, ``[B, *in]``.
        directions: ``[K, B, *in]``, or ``[K, 1, *in]`` for directions shared by all samples.
        weights: ``None`` (all 1), ``[K]`` or ``[K, B]``: the weight of each direction in the
            collapsed sum.
        collapse: return the weighted sum over ``k`` of the second-order terms (``[B, *out]``)
            instead of each of them (``[K, B, *out]``, unweighted).

    Returns:
        ``(y, first, second)`` as in :func:`divjac.jax._taylor.second_order_sweep`.
    """
    v = directions.to(x.dtype)
    program = _program(f, x)
    if program is None:
        random = not torch.compiler.is_compiling() and _traced(f, x).draws_random
        if random:  # every chunk of directions of the call sees the first chunk's draws
            _rewind(f, x.device)
        return reference_sweep(
            f, x, directions, weights=weights, collapse=collapse, same_randomness=random
        )
    # Weights per sample need the batch axis of every intermediate (views may merge it): the
    # terms are kept per direction and weighted at the output, whose batch axis is known.
    per_sample = weights is not None and weights.ndim == 2
    per_direction = not collapse or per_sample
    w = None if per_direction or weights is None else weights.to(x.dtype)
    y, first, second = program.run(x, v, w, per_direction)
    if collapse and per_direction:
        second = _weighted_sum(second, weights)
    elif collapse:
        second = second[0]
    return y, first, second


def reference_sweep(
    f: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    directions: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    collapse: bool = True,
    same_randomness: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`second_order_sweep` by the generic reference: ``jvp`` of ``jvp`` of ``f``,
    batched over the directions with ``vmap`` (the benchmark's baseline, and the fallback).
    With ``same_randomness``, random operations draw once, for all the directions (``f``'s
    derivatives at one draw), or once per direction from the same state of the generators
    where ``vmap`` cannot batch them.

    Attention runs in its math form and layer and instance normalizations composed
    (:class:`~divjac.torch._kernels._ComposedNorms`): the second forward derivatives of their
    kernels are wrong or missing (torch 2.13); memory formats as in
    :class:`~divjac.torch._kernels.PlainLayouts`.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    v = directions.to(x.dtype).expand(directions.shape[0], *x.shape)

    def jet(vk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def first(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return cast(tuple[torch.Tensor, torch.Tensor], jvp(f, (p,), (vk,)))

        (y, d1), (_, d2) = cast(Any, jvp(first, (x,), (vk,)))
        return y, d1, d2

    with sdpa_kernel(SDPBackend.MATH), _ComposedNorms(forward=True), PlainLayouts():
        if not same_randomness:
            ys, d1, d2 = vmap(jet, randomness="error")(v)
        else:
            start = _Generators(x.device)
            try:
                ys, d1, d2 = vmap(jet, randomness="same")(v)
            except RuntimeError:
                # Some random kernels do not batch (torch 2.13: rrelu's has no batching rule,
                # alpha dropout's jvp of jvp writes into a zero tensor under vmap): one
                # direction at a time then, each from the same draws (an error that is not
                # vmap's is raised again by the first).
                terms = []
                for vk in v:
                    start.rewind()
                    terms.append(jet(vk))
                ys, d1, d2 = (torch.stack(t) for t in zip(*terms, strict=True))
    y = ys[0]
    if not collapse:
        return y, d1, d2
    return y, d1, _weighted_sum(d2, weights)


def _weighted_sum(terms: Tensor, weights: Tensor | None) -> Tensor:
    """``sum_k w_k terms[k]`` with ``w`` of shape ``[K]`` or ``[K, B]`` (``None``: all 1)."""
    if weights is None:
        return terms.sum(0)
    w = weights.to(terms.dtype).reshape(weights.shape + (1,) * (terms.ndim - weights.ndim))
    return (w * terms).sum(0)


# --- the program: divjac's trace of f, run on the actual tensors --------------------------------


@dataclass(frozen=True)
class _Step:
    """One node of the program: how to read its arguments, and which rule runs it."""

    node: torch.fx.Node
    kind: str  # "input", "constant", "getitem", "plain" (no dependent input), "rule", "output"
    inputs: tuple[torch.fx.Node, ...]
    rule: Rule | None = None


@dataclass(frozen=True)
class _Plan:
    """The steps of a trace (its live nodes), and whether every constant it drops is a
    parameter or buffer of its modules (which its cache key identifies)."""

    steps: tuple[_Step, ...]
    module_constants: bool


# The plans of recent traces.
_PLANS: weakref.WeakKeyDictionary[Traced, _Plan] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Program:
    """A plan with the tensors its constants stand for."""

    traced: Traced
    plan: _Plan
    constants: dict[str, Tensor]

    def run(
        self, x: Tensor, v: Tensor, w: Tensor | None, per_direction: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        gm = self.traced.gm
        sweep = _Sweep(int(v.shape[0]), w, per_direction)
        values: dict[torch.fx.Node, Any] = {}
        jets = sweep.jets
        out: Any = None

        def read(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                return values[a]
            if isinstance(a, list | tuple) and a:
                return type(a)(read(e) for e in a)
            return a

        for step in self.plan.steps:
            node, kind = step.node, step.kind
            if kind == "input":
                values[node] = x
                jets[node] = _Jet(v, None)
            elif kind == "constant":
                name = str(node.target)
                found = self.constants.get(name)
                values[node] = found if found is not None else getattr(gm, name)
            elif kind == "output":
                out = step.inputs[0]
            else:
                args = read(node.args)
                kwargs = {k: read(a) for k, a in node.kwargs.items()}
                if kind == "getitem":
                    values[node] = args[0][args[1]]
                    parent = jets.get(node.args[0])  # type: ignore[arg-type]
                    if isinstance(parent, list) and parent[args[1]] is not None:
                        jets[node] = parent[args[1]]
                elif kind == "plain" or not any(a in jets for a in step.inputs):
                    values[node] = node.target(*args, **kwargs)  # type: ignore[operator]
                else:
                    values[node], jet = step.rule(sweep, node, args, kwargs)  # type: ignore[misc]
                    if jet is not None:
                        jets[node] = jet
        if out is None:
            raise InternalError("an ATen graph without output")
        y = values[out]
        K, M = int(v.shape[0]), sweep.m
        jet = jets.get(out)
        if not isinstance(jet, _Jet):
            zeros = y.new_zeros((K, *y.shape))
            return y, zeros, zeros[:M]
        first = jet.first.expand(K, *y.shape)
        second = jet.second
        second = y.new_zeros((M, *y.shape)) if second is None else second.expand(M, *y.shape)
        return y, first, second


def _traced(f: Callable[[Tensor], Tensor], x: Tensor) -> Traced:
    leaves, treedef = pytree.tree_flatten(((x,), {}))
    return trace(f, leaves, treedef, x_leaf=0, batch_axis=0, has_aux=False)


# The generators' state when a call's first sweep of a random function began, by the call's
# function (the one of all its chunks of directions).
_DRAWS: weakref.WeakKeyDictionary[Callable[..., Any], Any] = weakref.WeakKeyDictionary()


def _rewind(f: Callable[[Tensor], Tensor], device: torch.device) -> None:
    """Rewind torch's generators to where the first sweep of ``f`` began (record it if this
    is the first), as the first-order passes do between their chunks."""
    state = _DRAWS.get(f)
    if state is None:
        _DRAWS[f] = _Generators(device)
    else:
        state.rewind()


def _program(f: Callable[[Tensor], Tensor], x: Tensor) -> _Program | None:
    """The trace of ``f`` at ``x``'s shape with the tensors it captured, or ``None`` where the
    sweep runs the reference (see the module docstring)."""
    if torch.compiler.is_compiling():
        return None
    traced = _traced(f, x)
    if traced.draws_random or tuple(traced.out_shape[:1]) != tuple(x.shape[:1]):
        return None
    plan = _PLANS.get(traced)
    if plan is None:
        plan = _PLANS[traced] = _plan(traced)
    constants: dict[str, Tensor] = {}
    # The key of a trace identifies the parameters and buffers of its modules, not the other
    # floating-point tensors it captured: those must be the ones f reaches now.
    reached = None if plan.module_constants else reach(f, [])
    for name, ref in traced.dropped.items():
        t = ref()
        if t is None or (reached is not None and reached.tensors.get(id(t)) is not t):
            return None  # the graph's weights are not (or no longer) those f reaches
        constants[name] = t
    return _Program(traced, plan, constants)


def _plan(traced: Traced) -> _Plan:
    gm = traced.gm
    nodes = list(gm.graph.nodes)
    needed: set[torch.fx.Node] = set()
    for node in reversed(nodes):
        if node.op in ("output", "placeholder") or node in needed:
            needed.add(node)
            needed.update(node.all_input_nodes)
    steps = []
    dependent: set[torch.fx.Node] = set()
    for node in nodes:
        if node not in needed:
            continue
        inputs = tuple(node.all_input_nodes)
        if node.op == "placeholder":
            steps.append(_Step(node, "input", inputs))
            dependent.add(node)
        elif node.op == "get_attr":
            steps.append(_Step(node, "constant", inputs))
        elif node.op == "output":
            out = next(a for a in pytree.tree_leaves(node.args) if isinstance(a, torch.fx.Node))
            steps.append(_Step(node, "output", (out,)))
        elif node.target is operator.getitem:
            steps.append(_Step(node, "getitem", inputs))
            if inputs[0] in dependent:
                dependent.add(node)
        elif any(a in dependent for a in inputs):
            steps.append(_Step(node, "rule", inputs, _RULES.get(node.target, _generic)))
            dependent.add(node)
        else:
            steps.append(_Step(node, "plain", inputs))
    owned = {id(t) for m in traced.modules() for t in (*m.parameters(), *m.buffers())}
    alive = [ref() for ref in traced.dropped.values()]
    return _Plan(tuple(steps), all(t is not None and id(t) in owned for t in alive))


# --- jets ---------------------------------------------------------------------------------------


@dataclass
class _Jet:
    """The Taylor terms of one value of shape ``s``: ``first`` ``[K, *s]`` and ``second``
    ``[M, *s]`` (``M = 1``: the weighted sum; ``M = K``: per direction; ``None``: zero), each
    possibly of size one on axes it is constant along (broadcastable to its full shape)."""

    first: Tensor
    second: Tensor | None


Rule = Callable[["_Sweep", torch.fx.Node, Sequence[Any], dict[str, Any]], tuple[Any, Any]]


class _Sweep:
    """The jets of one run, and the weighted sums over the directions."""

    def __init__(self, k: int, w: Tensor | None, per_direction: bool) -> None:
        self.k = k
        self.m = k if per_direction else 1
        self.w = w
        self.per_direction = per_direction
        self.jets: dict[torch.fx.Node, Any] = {}

    def jet(self, arg: Any) -> _Jet | None:
        found = self.jets.get(arg) if isinstance(arg, torch.fx.Node) else None
        return found if isinstance(found, _Jet) else None

    def needed(self, arg: Any) -> _Jet:
        """The jet of an argument a rule was given as dependent."""
        found = self.jet(arg)
        if found is None:
            raise InternalError(f"second_order_sweep: no jet for the argument {arg}")
        return found

    def weighted(self, terms: Tensor) -> Tensor:
        """``sum_k w_k terms[k]`` (kept as an axis of one), or the terms per direction."""
        if self.per_direction:
            return terms
        if self.w is not None:
            terms = terms * self.w.reshape(self.k, *([1] * (terms.ndim - 1)))
        return terms.sum(0, keepdim=True)

    def quad(self, a: Tensor, b: Tensor) -> Tensor:
        """``sum_k w_k a_k b_k`` (element-wise)."""
        return self.weighted(a * b)


def _add(*terms: Tensor | None) -> Tensor | None:
    found = [t for t in terms if t is not None]
    if not found:
        return None
    total = found[0]
    for t in found[1:]:
        total = total + t
    return total


def _scale(t: Tensor | None, c: Any) -> Tensor | None:
    return None if t is None else t * c


@overload
def _lift(t: Tensor, ndim: int) -> Tensor: ...
@overload
def _lift(t: None, ndim: int) -> None: ...
@overload
def _lift(t: Tensor | None, ndim: int) -> Tensor | None: ...


def _lift(t: Tensor | None, ndim: int) -> Tensor | None:
    """Terms ``[K, *s]`` with axes of one inserted after ``K`` up to ``ndim`` value axes (as
    broadcasting aligns the value with a larger one)."""
    if t is None or t.ndim - 1 >= ndim:
        return t
    return t.reshape(t.shape[0], *([1] * (ndim + 1 - t.ndim)), *t.shape[1:])


def _full(t: Tensor, shape: Sequence[int]) -> Tensor:
    """Terms broadcast to their full shape ``[*, *shape]`` (materialized)."""
    target = (t.shape[0], *shape)
    return t if tuple(t.shape) == target else _lift(t, len(shape)).expand(target).contiguous()


def _map(jet: _Jet, fn: Callable[[Tensor], Tensor]) -> _Jet:
    """The jet of a linear map of the value (``fn`` maps terms with the leading axis)."""
    return _Jet(fn(jet.first), None if jet.second is None else fn(jet.second))


# --- rules ----------------------------------------------------------------------------------------

_RULES: dict[Any, Rule] = {}


def _rule(*targets: Any) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for t in targets:
            _RULES[t] = fn
        return fn

    return register


def _unary(derivatives: Callable[..., tuple[Tensor, Tensor | None]]) -> Rule:
    """An element-wise function of its first argument: ``derivatives(x, y, *params)`` gives
    ``g'`` and ``g''`` (``None``: zero) of a real argument (a complex one is pushed by
    :func:`_generic`: ``abs`` of it is not holomorphic)."""

    def rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if args[0].is_complex() or any(isinstance(a, torch.fx.Node) for a in node.args[1:]):
            return _generic(sw, node, args, kwargs)
        x = args[0]
        y = node.target(*args, **kwargs)  # type: ignore[operator]
        a = sw.needed(node.args[0])
        g1, g2 = derivatives(x, y, *args[1:], **kwargs)
        curvature = None if g2 is None else g2 * sw.quad(a.first, a.first)
        return y, _Jet(g1 * a.first, _add(_scale(a.second, g1), curvature))

    return rule


def _softplus(x: Tensor, y: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Any:
    s = torch.sigmoid(beta * x)
    linear = beta * x > threshold
    return torch.where(linear, 1.0, s), torch.where(linear, 0.0, beta * (s - s * s))


def _silu(x: Tensor, y: Tensor) -> Any:
    s = torch.sigmoid(x)
    ds = s - s * s
    return s + x * ds, ds * (2 + x - 2 * x * s)


def _pow(x: Tensor, y: Tensor, p: float) -> Any:
    if p == 0:
        return torch.zeros_like(x), None
    if p == 1:
        return torch.ones_like(x), None
    if p == 2:
        return 2 * x, 2 * torch.ones_like(x)
    return p * x ** (p - 1), p * (p - 1) * x ** (p - 2)


def _tanh(x: Tensor, y: Tensor) -> Any:
    d = torch.rsub(y * y, 1)
    return d, -2 * y * d


def _sigmoid(x: Tensor, y: Tensor) -> Any:
    d = y - y * y
    return d, d - 2 * y * d


def _log(x: Tensor, y: Tensor) -> Any:
    d = torch.reciprocal(x)
    return d, -d * d


def _log1p(x: Tensor, y: Tensor) -> Any:
    d = torch.reciprocal(x + 1)
    return d, -d * d


def _sqrt(x: Tensor, y: Tensor) -> Any:
    d = 0.5 * torch.reciprocal(y)
    return d, -d * d / y


def _rsqrt(x: Tensor, y: Tensor) -> Any:
    y3 = y * y * y
    return -0.5 * y3, 0.75 * y3 * y * y


def _reciprocal(x: Tensor, y: Tensor) -> Any:
    y2 = y * y
    return -y2, 2 * y2 * y


_UNARY: dict[Any, Callable[..., Any]] = {
    aten.tanh.default: _tanh,
    aten.sigmoid.default: _sigmoid,
    aten.exp.default: lambda x, y: (y, y),
    aten.expm1.default: lambda x, y: (y + 1, y + 1),
    aten.log.default: _log,
    aten.log1p.default: _log1p,
    aten.sin.default: lambda x, y: (torch.cos(x), -y),
    aten.cos.default: lambda x, y: (-torch.sin(x), -y),
    aten.sqrt.default: _sqrt,
    aten.rsqrt.default: _rsqrt,
    aten.reciprocal.default: _reciprocal,
    aten.softplus.default: _softplus,
    aten.silu.default: _silu,
    aten.pow.Tensor_Scalar: _pow,
    aten.relu.default: lambda x, y: ((x > 0).to(x.dtype), None),
    aten.abs.default: lambda x, y: (torch.sgn(x), None),
}
for _op, _d in _UNARY.items():
    _RULES[_op] = _unary(_d)


@_rule(aten.add.Tensor, aten.sub.Tensor)
def _add_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    sign = -alpha if node.target is aten.sub.Tensor else alpha
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    n = y.ndim
    first = _add(
        None if a is None else _lift(a.first, n), None if b is None else _lift(b.first, n) * sign
    )
    second = _add(
        None if a is None else _lift(a.second, n),
        None if b is None else _scale(_lift(b.second, n), sign),
    )
    return y, _Jet(first, second)  # type: ignore[arg-type]


@_rule(aten.mul.Tensor)
def _mul_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[0], args[1]
    y = x * z
    n = y.ndim
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    a1 = None if a is None else _lift(a.first, n)
    b1 = None if b is None else _lift(b.first, n)
    first = _add(_scale(a1, z), _scale(b1, x))
    second = _add(
        None if a is None else _scale(_lift(a.second, n), z),
        None if b is None else _scale(_lift(b.second, n), x),
        None if a1 is None or b1 is None else 2 * sw.quad(a1, b1),
    )
    return y, _Jet(first, second)  # type: ignore[arg-type]


@_rule(aten.logaddexp.default, aten.logaddexp2.default)
def _logaddexp_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x, z = args[0], args[1]
    if x.is_complex() or z.is_complex():
        return _generic(sw, node, args, kwargs)
    y = node.target(x, z)  # type: ignore[operator]
    n = y.ndim
    # y' = s x' + (1 - s) z' with s = sigmoid(c (x - z)), y'' = s x'' + (1 - s) z''
    # + c s (1 - s) (x' - z')^2 (c = 1, or log 2 in base 2). At x = z, s = 1/2, infinities
    # included: where both are -inf (a masked entry) the tangents are zero and so is y'.
    c = 1.0 if node.target is aten.logaddexp.default else math.log(2.0)
    s = torch.sigmoid(c * torch.where(x == z, 0.0, x - z))
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    a1 = None if a is None else _lift(a.first, n)
    b1 = None if b is None else _lift(b.first, n)
    diff = _add(a1, _scale(b1, -1))
    first = _add(_scale(a1, s), _scale(b1, 1 - s))
    second = _add(
        None if a is None else _scale(_lift(a.second, n), s),
        None if b is None else _scale(_lift(b.second, n), 1 - s),
        c * s * (1 - s) * sw.quad(diff, diff),  # type: ignore[arg-type]
    )
    return y, _Jet(first, second)  # type: ignore[arg-type]


def _prefix_average(x: Tensor, y: Tensor, t: Tensor, axis: int) -> Tensor:
    """``sum_{j <= i} exp(x_j - y_i) t_j`` along ``axis`` of terms ``t`` ``[K, *s]``, where
    ``y = logcumsumexp(x)``: in the log domain, the positive and negative parts of ``t``
    apart (as torch's backward of ``logcumsumexp``; its forward derivative normalizes by the
    maximum of the whole axis and adds ``1e-13``, off by ~1e-6 before a large entry). The
    logarithms are taken where they are finite, so that gradients through them are too."""
    y = torch.where(torch.isneginf(y), 0.0, y)  # an empty prefix (all -inf) has zero weights

    def part(mask: Tensor, magnitude: Tensor) -> Tensor:
        log = torch.where(mask, torch.log(torch.where(mask, magnitude, 1.0)), -torch.inf)
        return torch.exp(torch.logcumsumexp(x + log, axis) - y)

    return part(t > 0, t) - part(t < 0, -t)


@_rule(aten.logcumsumexp.default)
def _logcumsumexp_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    if x.is_complex() or x.ndim == 0:
        return _generic(sw, node, args, kwargs)
    axis = int(args[1] if len(args) > 1 else kwargs["dim"]) % x.ndim + 1
    a = sw.needed(node.args[0])
    # y_i = log sum_{j <= i} exp(x_j): y' = P x', y'' = P x'' + P (x')^2 - (y')^2 with
    # P the prefix average of weights exp(x_j - y_i).
    a1 = _full(a.first, tuple(x.shape))
    first = _prefix_average(x, y, a1, axis)
    curvature = sw.weighted(_prefix_average(x, y, a1 * a1, axis) - first * first)
    if a.second is not None:
        curvature = curvature + _prefix_average(x, y, _full(a.second, tuple(x.shape)), axis)
    return y, _Jet(first, curvature)


@_rule(aten.div.Tensor)
def _div_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[0], args[1]
    y = x / z
    n = y.ndim
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    if b is None:
        return y, _map(sw.needed(node.args[0]), lambda t: _lift(t, n) / z)
    # y = x / z: y' = (x' - y z') / z, y'' = (x'' - y z'' - 2 y' z') / z
    b1 = _lift(b.first, n)
    num1 = _add(None if a is None else _lift(a.first, n), -y * b1)
    first = num1 / z
    num2 = _add(
        None if a is None else _lift(a.second, n),
        _scale(_lift(b.second, n), -y),
        -2 * sw.quad(first, b1),
    )
    return y, _Jet(first, num2 / z)


@_rule(aten.mul.Scalar, aten.div.Scalar, aten.neg.default)
def _scalar_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    return y, _map(a, lambda t: node.target(t, *args[1:], **kwargs))  # type: ignore[operator]


@_rule(aten.add.Scalar, aten.sub.Scalar, aten.clone.default, aten.alias.default)
def _shifted_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    return node.target(*args, **kwargs), sw.jet(node.args[0])  # type: ignore[operator]


@_rule(aten.detach.default)
def _detach_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    return args[0].detach(), None


@_rule(aten._to_copy.default)
def _to_copy_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.jet(node.args[0])
    if not inexact(y) or a is None:
        return y, None
    return y, _map(a, lambda t: t.to(dtype=y.dtype, device=y.device))


@_rule(aten.copy.default)
def _copy_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    # copy(self, src): src's values in self's shape and dtype (the functional form of copy_,
    # in circular padding and in-place writes; torch has no forward derivative for it).
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    b = sw.jet(node.args[1])
    if b is None or not inexact(y):
        return y, None
    return y, _map(b, lambda t: _lift(t, y.ndim).to(y.dtype))


@_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    xs, ys = tuple(x.shape), tuple(y.shape)

    def view(t: Tensor) -> Tensor:
        # Terms constant along the batch axis stay so when the view keeps that axis.
        if (
            xs
            and t.ndim == len(xs) + 1
            and tuple(t.shape[2:]) == xs[1:]
            and t.shape[1] == 1
            and xs[:1] == ys[:1]
        ):
            return t.reshape(t.shape[0], 1, *ys[1:])
        return _full(t, xs).reshape(t.shape[0], *ys)

    return y, _map(a, view)


@_rule(aten.permute.default)
def _permute_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    dims = [0, *(int(d) % max(x.ndim, 1) + 1 for d in args[1])]
    return y, _map(a, lambda t: _lift(t, x.ndim).permute(dims))


@_rule(aten.t.default, aten.transpose.int)
def _transpose_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if x.ndim < 2:
        return y, a
    d0, d1 = (0, 1) if node.target is aten.t.default else (int(args[1]), int(args[2]))
    d0, d1 = d0 % x.ndim + 1, d1 % x.ndim + 1
    return y, _map(a, lambda t: _lift(t, x.ndim).transpose(d0, d1))


@_rule(aten.expand.default)
def _expand_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    return y, _map(a, lambda t: _lift(t, y.ndim))


@_rule(aten.unsqueeze.default)
def _unsqueeze_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    d = int(args[1]) % (x.ndim + 1) + 1
    return y, _map(a, lambda t: _lift(t, x.ndim).unsqueeze(d))


@_rule(aten.sum.dim_IntList, aten.mean.dim, aten.sum.default)
def _sum_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    dims_arg = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if dims_arg is None or len(dims_arg) == 0:
        dims = list(range(x.ndim))
    else:  # a 0-d value has no axis to reduce (its dimension 0 or -1 is itself)
        dims = [int(d) % x.ndim for d in dims_arg] if x.ndim else []
    axes = [d + 1 for d in dims]
    mean = node.target is aten.mean.dim

    def reduce(t: Tensor) -> Tensor:
        t = _full(t, tuple(x.shape))
        if not axes:
            return t
        r = t.mean(axes, keepdim=keepdim) if mean else t.sum(axes, keepdim=keepdim)
        return r.to(y.dtype)

    return y, _map(a, reduce)


def _matmul(sw: _Sweep, x: Tensor, z: Tensor, a: _Jet | None, b: _Jet | None, y: Tensor) -> _Jet:
    """The jet of ``y = x @ z`` (``mm``, ``bmm``)."""
    n = y.ndim
    a1 = None if a is None else _lift(a.first, n)
    b1 = None if b is None else _full(b.first, tuple(z.shape))
    if a1 is not None and a1.shape[-1] != x.shape[-1]:
        a1 = _full(a1, tuple(x.shape))
    first = _add(
        None if a1 is None else torch.matmul(a1, z), None if b1 is None else torch.matmul(x, b1)
    )
    second = _add(
        None if a is None or a.second is None else torch.matmul(_full(a.second, x.shape), z),
        None if b is None or b.second is None else torch.matmul(x, _full(b.second, z.shape)),
        None if a1 is None or b1 is None else 2 * _matmul_quad(sw, _full(a1, x.shape), b1),
    )
    return _Jet(first, second)  # type: ignore[arg-type]


def _matmul_quad(sw: _Sweep, a: Tensor, b: Tensor) -> Tensor:
    """``sum_k w_k a_k @ b_k`` as one contraction over ``k`` and the inner axis."""
    if sw.per_direction:
        return torch.matmul(a, b)
    if sw.w is not None:
        a = a * sw.w.reshape(sw.k, *([1] * (a.ndim - 1)))
    k, m = a.shape[0], a.shape[-1]
    lead = tuple(a.shape[1:-2])
    # [K, *lead, n, m] -> [*lead, n, K*m] and [K, *lead, m, p] -> [*lead, K*m, p]
    nd = a.ndim
    order = (*range(1, nd - 1), 0, nd - 1)
    left = a.permute(order).reshape(*lead, a.shape[-2], k * m)
    right = b.permute(*range(1, nd - 2), 0, nd - 2, nd - 1).reshape(*lead, k * m, b.shape[-1])
    return torch.matmul(left, right)[None]


@_rule(aten.mm.default, aten.bmm.default)
def _mm_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x, z = args[0], args[1]
    y = node.target(x, z)  # type: ignore[operator]
    return y, _matmul(sw, x, z, sw.jet(node.args[0]), sw.jet(node.args[1]), y)


@_rule(aten.addmm.default)
def _addmm_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x, z = args[1], args[2]
    beta = kwargs.get("beta", 1)
    alpha = kwargs.get("alpha", 1)
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a, b, cj = sw.jet(node.args[1]), sw.jet(node.args[2]), sw.jet(node.args[0])
    terms = []
    if a is not None or b is not None:  # the product depends on the input
        prod = _matmul(sw, x, z, a, b, y)
        terms.append(_map(prod, lambda t: t * alpha) if alpha != 1 else prod)
    if cj is not None:
        terms.append(_Jet(_lift(cj.first, y.ndim) * beta, _scale(_lift(cj.second, y.ndim), beta)))
    first = _add(*(t.first for t in terms))
    return y, _Jet(first, _add(*(t.second for t in terms)))  # type: ignore[arg-type]


@_rule(aten.convolution.default)
def _conv_rule(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    if any(isinstance(a, torch.fx.Node) and a in sw.jets for a in node.args[1:]):
        return _generic(sw, node, args, kwargs)
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])

    def conv(t: Tensor) -> Tensor:
        if tuple(t.shape[2:]) != tuple(x.shape[1:]):
            t = _full(t, x.shape)
        lead = t.shape[:2]
        out = node.target(t.reshape(-1, *t.shape[2:]), args[1], None, *args[3:])  # type: ignore[operator]
        return out.reshape(*lead, *out.shape[1:])

    return y, _map(a, conv)


def _gathered(t: Tensor, shape: Sequence[int], index: Tensor) -> Tensor:
    """The terms ``[*, *shape]`` of a value at its flat indices ``index`` (shaped as them)."""
    flat = _full(t, shape).reshape(t.shape[0], -1)
    return flat[:, index.reshape(-1)].reshape(t.shape[0], *index.shape)


def _strided_view(args: Sequence[Any], kwargs: dict[str, Any], at: int) -> tuple[Any, Any, int]:
    """``(size, stride, storage_offset)`` of an ``as_strided`` family call whose size is its
    argument ``at`` (the offset defaults to that of the first argument)."""
    size, stride = args[at], args[at + 1]
    offset = args[at + 2] if len(args) > at + 2 else kwargs.get("storage_offset")
    return size, stride, int(args[0].storage_offset() if offset is None else offset)


@_rule(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    # The view reads the storage of its input: its terms are those of the input's elements at
    # the positions it reads (a gather; vmap cannot view a batched tensor so).
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    index, found = located(
        storage_positions(x, *_strided_view(args, kwargs, 1)),
        storage_positions(x, x.shape, x.stride(), int(x.storage_offset())),
    )
    if not bool(found.all()):
        raise OptionError(
            f"the second-order sweep (laplacian, hessian_diagonal) differentiates {node.target} "
            "through its input's elements, but this one reads memory outside its input. Take "
            "the strided view of the whole tensor the function is given."
        )
    return y, _map(a, lambda t: _gathered(t, x.shape, index))


@_rule(aten.as_strided_scatter.default)
def _as_strided_scatter_rule(
    sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    # The input's values, those its strided view reads replaced by src's: the terms likewise,
    # by the storage positions of the output (laid out as the input, or contiguous where the
    # input's elements share memory, as torch's clone_preserve_strides).
    x, src = args[0], args[1]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    out = _without_overlap(x)
    index, written = located(
        storage_positions(x, out.shape, out.stride(), int(out.storage_offset())),
        storage_positions(x, *_strided_view(args, kwargs, 2)),
    )
    n = y.ndim

    def scatter(self_terms: Tensor | None, src_terms: Tensor | None) -> Tensor | None:
        if self_terms is None and src_terms is None:
            return None
        kept = 0 if self_terms is None else _lift(self_terms, n)
        put = 0 if src_terms is None else _gathered(src_terms, src.shape, index)
        return torch.where(written, put, kept).expand(-1, *y.shape)

    first = scatter(None if a is None else a.first, None if b is None else b.first)
    second = scatter(None if a is None else a.second, None if b is None else b.second)
    return y, _Jet(first, second)  # type: ignore[arg-type]


# Operations whose second derivative is zero (linear in their inputs, or piecewise linear):
# their jets are pushed by one ``jvp`` each.
_LINEAR = frozenset(
    {
        "cat", "stack", "slice", "select", "index", "index_select", "gather", "constant_pad_nd",
        "flip", "roll", "repeat", "where", "split", "split_with_sizes", "unbind", "narrow",
        "diagonal", "tril", "triu", "squeeze", "masked_fill", "avg_pool2d", "avg_pool1d",
        "avg_pool3d", "adaptive_avg_pool2d", "max_pool2d_with_indices",
        "reflection_pad2d", "replication_pad2d", "pixel_shuffle", "im2col", "col2im",
        "slice_scatter", "select_scatter", "index_put", "scatter", "scatter_add", "copy",
        "lift_fresh_copy", "expand_copy", "view_copy", "permute_copy", "unfold", "sub", "add",
        "rsub", "amax", "amin", "max", "min", "maximum", "minimum", "clamp", "hardtanh",
        "leaky_relu", "cumsum", "baddbmm", "linear", "einsum", "zeros_like", "new_zeros",
    }
)  # fmt: skip


def _cholesky_inverse(factor: Tensor, upper: bool = False) -> Tensor:
    eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    return torch.cholesky_solve(eye.expand(factor.shape), factor, upper=upper)


def _norm(x: Tensor, p: Any = 2, *, dtype: torch.dtype | None = None) -> Tensor:
    return torch.linalg.vector_norm(x, 2 if p is None else p, dtype=dtype)


# Operations pushed in another form with the same values (torch 2.13): the derivatives of
# ``cholesky_inverse`` are wrong at second order both ways (forward and backward); the forward
# derivative of the norm of all entries (``norm.Scalar``, as ``torch.dist`` records it) has
# the input's rank, not the norm's, and fails.
_REWRITTEN: dict[Any, Callable[..., Any]] = {
    aten.cholesky_inverse.default: _cholesky_inverse,
    aten.norm.Scalar: _norm,
    aten.norm.ScalarOpt_dtype: _norm,
}


def _generic(sw: _Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Any operation, by ``torch.func``: the first-order terms by ``jvp``, the second-order
    ones by ``jvp`` of ``jvp`` (zero for :data:`_LINEAR` operations), batched over the
    directions with ``vmap``."""
    target: Any = node.target
    y = target(*args, **kwargs)
    outs = list(y) if isinstance(y, tuple | list) else [y]
    floating = [i for i, o in enumerate(outs) if inexact(o)]
    if not floating:
        return y, None
    op = composed_norm(target) or _REWRITTEN.get(target, target)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    node_leaves = pytree.tree_leaves((node.args, node.kwargs))
    pos = [i for i, n in enumerate(node_leaves) if sw.jet(n) is not None]
    # Materialized where elements share memory (an expanded value): forward-mode AD writes
    # tangents into a tensor of the primal's layout.
    primals = tuple(_without_overlap(leaves[i]) for i in pos)
    jets = [sw.jet(node_leaves[i]) for i in pos]

    def fn(*deps: Tensor) -> tuple[Tensor, ...]:
        full = list(leaves)
        for i, d in zip(pos, deps, strict=True):
            full[i] = d
        a, kw = pytree.tree_unflatten(full, spec)
        out = op(*a, **kw)
        found = list(out) if isinstance(out, tuple | list) else [out]
        return tuple(found[i] for i in floating)

    firsts = [_full(j.first, p.shape) for j, p in zip(jets, primals, strict=True)]  # type: ignore[union-attr]
    has_second = any(j.second is not None for j in jets)  # type: ignore[union-attr]
    seconds = [
        torch.zeros((sw.m, *p.shape), dtype=p.dtype, device=p.device)
        if j.second is None  # type: ignore[union-attr]
        else _full(j.second, p.shape)  # type: ignore[union-attr]
        for j, p in zip(jets, primals, strict=True)
    ]

    if lacks_forward_derivative(node, {node_leaves[i] for i in pos}):
        raise OptionError(
            "the second-order Taylor sweep (laplacian and the like) pushes forward derivatives, "
            f"but the function runs {target}, which has none in PyTorch. Use "
            "divjac.torch.hessian_diagonal or divjac.torch.hessian (reverse passes of the gradient) "
            "for this function."
        )
    n = len(primals)
    by_reverse = forward_derivative_wrong(target)

    def lin(*pt: Tensor) -> tuple[Tensor, ...]:
        """``J t`` at the primals ``pt[:n]`` for the tangents ``pt[n:]``."""
        if not by_reverse:
            return jvp(fn, pt[:n], pt[n:])[1]
        # J t as the transpose of the VJP (linear in its cotangent): built from the
        # backward formulas, whose forward derivatives are right. With grad mode on:
        # under the caller's no_grad the backward of the VJP is not differentiated.
        with torch.enable_grad():
            y, pull = vjp(fn, *pt[:n])[:2]
            zeros = tuple(torch.zeros_like(o) for o in y)
            transposed = vjp(lambda *c: pull(c), *zeros)[1]
            return cast(tuple[Tensor, ...], transposed(tuple(pt[n:])))

    def push(*t: Tensor) -> tuple[Tensor, ...]:
        return lin(*primals, *t)

    d2: tuple[Tensor, ...] | None
    if packet(target) in _LINEAR:
        d1 = vmap(push)(*firsts)
        d2 = vmap(push)(*seconds) if has_second else None
    else:

        def taylor(*t: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
            # J t, and its derivative along t with t itself held constant (not a tangent of
            # zero: where the derivative of J is infinite, a zero times it would be nan). The
            # tangents are copies made inside: forward AD of an in-place operation (zero_)
            # writes into its tangent, which must not be a tensor the transform captured.
            return jvp(lambda *p: lin(*p, *(ti.clone() for ti in t)), primals, t)  # type: ignore[return-value]

        d1, curv = vmap(taylor)(*firsts)
        d2 = tuple(sw.weighted(c) for c in curv)
        if has_second:
            d2 = tuple(c + s for c, s in zip(d2, vmap(push)(*seconds), strict=True))
    jets_out: list[_Jet | None] = [None] * len(outs)
    for j, i in enumerate(floating):
        jets_out[i] = _Jet(d1[j], None if d2 is None else d2[j])
    return y, jets_out if isinstance(y, tuple | list) else jets_out[0]
