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
  :class:`divjac.torch._kernels.ComposedNorms` does for whole functions).

Directions shared by the samples (``[K, 1, *in]``) stay unbroadcast until an operation mixes
them with per-sample values (the first layer computes ``W v_k`` once, not ``B`` times).

Everything is computed by torch operations on the actual tensors (the parameters the graph
captured are the module's own), so autograd differentiates the result w.r.t. them. The trace
is divjac's cached one (its key identifies the parameters and buffers of the modules); other
floating-point tensors it captured (weights in a closure) are, at every call, the ones the
function reaches now at the place where the trace's call reached them (a closure made anew
over new tensors of the same shapes runs on the new ones). The function is run as the
generic reference (``jvp`` of ``jvp`` of the whole function, batched over the directions with
``vmap``; under ``torch.compile`` transposed VJPs) where the graph cannot be run: under
``torch.compile``, when it draws random numbers, or when a tensor it captured is not found
among those the function reaches.

Weights per sample (``[K, B]``) keep the second-order terms per direction and weight them at
the output (the batch axis of an intermediate is not known after views that merge it).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx
from torch.func import jvp, vmap

from ..._backend import Point
from ..._errors import InternalError
from .._aten import inexact
from .._compat import pytree
from .._detect import reach, trace
from .._kernels import ComposedNorms, PlainLayouts
from .._passes import Generators
from .._side_effects import NoFastPaths
from .._trace_keys import Reached
from .._traced import Traced
from . import arithmetic, moves, reductions
from .generic import _by_reverse, generic
from .jets import Jet, Propagation, Rule, Sweep

__all__ = ["second_order_sweep"]

Tensor = torch.Tensor


def second_order_sweep(
    f: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    directions: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    collapse: bool = True,
    traced: Traced | None = None,
    point: Point[Traced] | None = None,
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
        traced: the trace of the call whose batch-first function ``f`` is, with no other
            tensor argument bound (see :func:`program_of`).
        point: the call whose batch-first function (without its aux) ``f`` is (see
            :func:`program_of`).

    Returns:
        ``(y, first, second)`` as in :func:`divjac.jax._taylor.second_order_sweep`.

    Under ``torch.compile`` the sweep is a transposed VJP (so is a sweep of a sweep). Forward
    mode fails there wherever the function multiplies by a captured tensor that requires grad
    (a parameter), torch 2.13 and 2.14.1, hand-written ``torch.func`` code too: the backward of
    ``vmap(jvp(jvp(u)))`` finds a real tensor among dynamo's fake ones (AOT autograd's
    ``Please convert all Tensors to FakeTensors``), four levels an internal assert in
    ``_fw_primal``; an outer forward sweep of an inner reverse one crashes inductor.
    """
    v = directions.to(x.dtype)
    program = program_of(f, x, traced, point)
    if program is None:
        random = not torch.compiler.is_compiling() and _traced(f, x).draws_random
        if random:  # every chunk of directions of the call sees the first chunk's draws
            _rewind(f, x.device)
        known = traced if traced is not None else point.traced if point is not None else None
        return reference_sweep(
            f,
            x,
            directions,
            weights=weights,
            collapse=collapse,
            same_randomness=random,
            by_reverse=torch.compiler.is_compiling()
            or (known is not None and bool(known.forward_twice_wrong)),
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
    by_reverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`second_order_sweep` by the generic reference: ``jvp`` of ``jvp`` of ``f``,
    batched over the directions with ``vmap`` (the benchmark's baseline, and the fallback).
    With ``same_randomness``, random operations draw once, for all the directions (``f``'s
    derivatives at one draw), or once per direction from the same state of the generators
    where ``vmap`` cannot batch them.

    Attention runs in its math form, without the fused fast paths of
    :class:`~divjac.torch._side_effects.NoFastPaths`, and layer and instance normalizations composed
    (:class:`~divjac.torch._kernels.ComposedNorms`): the second forward derivatives of their
    kernels are wrong or missing (torch 2.13); memory formats as in
    :class:`~divjac.torch._kernels.PlainLayouts`. With ``by_reverse`` (a function that runs a
    linear-algebra kernel, whose forward derivative PyTorch differentiates wrong), both
    derivatives are transposed VJPs (:func:`~divjac.torch._taylor.generic._by_reverse`).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    v = directions.to(x.dtype).expand(directions.shape[0], *x.shape)

    def jet(vk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def first(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return cast(tuple[torch.Tensor, torch.Tensor], jvp(f, (p,), (vk,)))

        if by_reverse:
            along = lambda p: _by_reverse(lambda q: (f(q),), (p,), (vk.clone(),))  # noqa: E731
            return f(x), along(x)[0], _by_reverse(along, (x,), (vk,))[0]
        (y, d1), (_, d2) = cast(Any, jvp(first, (x,), (vk,)))
        return y, d1, d2

    with (
        sdpa_kernel(SDPBackend.MATH),
        NoFastPaths(),
        ComposedNorms(layer_and_instance=True),
        PlainLayouts(),
    ):
        if not same_randomness:
            ys, d1, d2 = vmap(jet, randomness="error")(v)
        else:
            start = Generators(x.device)
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
class Plan:
    """The steps of a trace (its live nodes), and whether every constant it drops is a
    parameter or buffer of its modules (which its cache key identifies)."""

    steps: tuple[_Step, ...]
    module_constants: bool


# The rules by ATen operation (any other: the generic one).
_RULES: dict[Any, Rule] = {
    **arithmetic._RULES,
    **moves._RULES,
    **reductions._RULES,
}

# The plans of recent traces.
_PLANS: weakref.WeakKeyDictionary[Traced, Plan] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Program:
    """A plan with the tensors its constants stand for."""

    traced: Traced
    plan: Plan
    constants: dict[str, Tensor]
    # By placeholder, in order (``None``: x's): the call's other tensors (a rewriting of the
    # graph, which copies its nodes, keeps its placeholders' order).
    inputs: tuple[Tensor | None, ...] = ()

    def run(
        self, x: Tensor, v: Tensor, w: Tensor | None, per_direction: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        sweep = Sweep(int(v.shape[0]), w, per_direction)
        y, jet = self.evaluate(x, sweep, Jet(v, None))
        K, M = int(v.shape[0]), sweep.m
        if not isinstance(jet, Jet):
            zeros = y.new_zeros((K, *y.shape))
            return y, zeros, zeros[:M]
        first = jet.first.expand(K, *y.shape)
        second = jet.second
        second = y.new_zeros((M, *y.shape)) if second is None else second.expand(M, *y.shape)
        return y, first, second

    def evaluate(self, x: Tensor, sweep: Propagation, seed: Any) -> tuple[Tensor, Any]:
        """The graph's output at ``x`` and its jet, the input's jet being ``seed`` (the jets of
        the steps are :meth:`Sweep.apply`'s)."""
        gm = self.traced.gm
        others = iter(self.inputs)
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
                other = next(others, None)
                if other is not None:
                    values[node] = other
                else:
                    values[node] = x
                    jets[node] = seed
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
                    values[node], jet = sweep.apply(step.rule, node, args, kwargs)  # type: ignore[arg-type]
                    if jet is not None:
                        jets[node] = jet
        if out is None:
            raise InternalError("an ATen graph without output")
        return values[out], jets.get(out)


def _discrete(node: torch.fx.Node) -> bool:
    """Whether the node's value is a tensor of integers or booleans (a comparison, an index):
    no terms, computed as a constant is."""
    val = node.meta.get("val")
    return isinstance(val, Tensor) and not inexact(val)


def _traced(
    f: Callable[[Tensor], Tensor], x: Tensor, walked: list[Reached] | None = None
) -> Traced:
    leaves, treedef = pytree.tree_flatten(((x,), {}))
    return trace(f, leaves, treedef, x_leaf=0, batch_axis=0, has_aux=False, walked=walked)


# The generators' state when a call's first sweep of a random function began, by the call's
# function (the one of all its chunks of directions).
_DRAWS: weakref.WeakKeyDictionary[Callable[..., Any], Any] = weakref.WeakKeyDictionary()


def _rewind(f: Callable[[Tensor], Tensor], device: torch.device) -> None:
    """Rewind torch's generators to where the first sweep of ``f`` began (record it if this
    is the first), as the first-order passes do between their chunks."""
    state = _DRAWS.get(f)
    if state is None:
        _DRAWS[f] = Generators(device)
    else:
        state.rewind()


def program_of(
    f: Callable[[Tensor], Tensor],
    x: Tensor,
    traced: Traced | None = None,
    point: Point[Traced] | None = None,
) -> Program | None:
    """The trace of ``f`` at ``x``'s shape with the tensors it captured, or ``None`` where the
    sweep runs the reference (see the module docstring).

    ``f`` is made anew at each call, so tracing it walks what it reaches each time. ``point``:
    the call whose batch-first function (without its aux) ``f`` is: its trace runs as it is,
    its other inputs the call's other tensor arguments (``t``, parameters passed in), where
    its constants are the parameters and buffers of its modules, which the call's own checks
    found unchanged; ``traced``: the trace of such a call that binds no other tensor argument,
    run likewise where ``x`` is its only input. Else ``f`` is traced."""
    if torch.compiler.is_compiling():
        return None
    given: Traced | None = None
    inputs: tuple[Tensor | None, ...] = ()
    if point is not None:
        others = _other_inputs(point)
        if others is not None:
            given, inputs = point.traced, others
    elif traced is not None and len(traced.gm.graph.find_nodes(op="placeholder")) == 1:
        given = traced
    walked: list[Reached] = []  # the walk of f that found its trace, if one did
    traced = given if given is not None else _traced(f, x, walked)
    if traced.draws_random or tuple(traced.out_shape[:1]) != tuple(x.shape[:1]):
        return None
    plan = _PLANS.get(traced)
    if plan is None:
        plan = _PLANS[traced] = _plan(traced)
    if plan.module_constants:
        constants: dict[str, Tensor] = {}
        for name, ref in traced.dropped.items():
            t = ref()
            if t is None:
                return None
            constants[name] = t
        return Program(traced, plan, constants, inputs)
    if given is not None:  # other captured tensors: found by the walk of f, on f's own trace
        return program_of(f, x)
    found = _captured(traced, walked[0] if walked else reach(f, []))
    return None if found is None else Program(traced, plan, found)


def _other_inputs(point: Point[Traced]) -> tuple[Tensor | None, ...] | None:
    """The call's tensor arguments, ``None`` for the differentiated one, in the order of the
    inputs of its trace (the tensor leaves of its arguments, in order: as the trace took them);
    ``None`` where they are not those (a trace made of other leaves), or where one is an
    integer or boolean tensor (an index, a mask), whose values the sparse sweep may read: a
    trace of ``f`` captures it as a constant, which its checks guard by value."""
    placeholders = [n for n in point.traced.gm.graph.nodes if n.op == "placeholder"]
    leaves = pytree.tree_leaves((point.args, point.kwargs))
    tensors = [a for a in leaves if isinstance(a, Tensor)]
    if len(tensors) != len(placeholders) or not all(map(inexact, tensors)):
        return None
    x_pos = point.traced.x_pos
    return tuple(None if i == x_pos else t for i, t in enumerate(tensors))


# Where the trace's call found each tensor the graph captured, by the trace: the position
# among the tensors it reached (``Reached.ids``), and the tensor's shape, dtype and device.
_FOUND: weakref.WeakKeyDictionary[Traced, dict[str, tuple[int, Any]]] = weakref.WeakKeyDictionary()


def _captured(traced: Traced, reached: Reached) -> dict[str, Tensor] | None:
    """The tensors that the constants of ``traced`` stand for in this call, or ``None`` where
    one is not among those the function reaches now.

    The key of a trace identifies the parameters and buffers of its modules, not the other
    floating-point tensors it captured: a closure made anew at each call over new tensors of
    the same shapes (the inner directions of a nested sweep) finds the trace by the signature
    of what it reaches, which equals the trace's call's. Each captured tensor stands for the
    tensor found at its place in the walk now, which must have its shape, dtype and device
    (by place, not by identity: a tensor of the trace's call may be reached now at another
    place, for another use, as in a history of weights shifted by one).
    """
    where = _FOUND.get(traced)
    if where is None:
        place = {i: k for k, i in enumerate(reached.ids)}
        where = {}
        for name, ref in traced.dropped.items():
            t = ref()
            if t is None or reached.tensors.get(id(t)) is not t:
                return None  # not (or no longer) what f reaches
            where[name] = (place[id(t)], (t.shape, t.dtype, t.device))
        _FOUND[traced] = where
    constants: dict[str, Tensor] = {}
    for name, (k, spec) in where.items():
        t = reached.tensors[reached.ids[k]] if k < len(reached.ids) else None
        if t is None or (t.shape, t.dtype, t.device) != spec:
            return None
        constants[name] = t
    return constants


def _plan(traced: Traced, graph: torch.fx.Graph | None = None) -> Plan:
    """The plan of ``traced``'s graph (or of ``graph``, a rewriting of it on its constants)."""
    nodes = list((traced.gm.graph if graph is None else graph).nodes)
    x_node = [node for node in nodes if node.op == "placeholder"][traced.x_pos]
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
            if node is x_node:
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
        elif any(a in dependent for a in inputs) and not _discrete(node):
            rule = _RULES.get(node.target) or arithmetic.elementwise_rule(node.target)
            steps.append(_Step(node, "rule", inputs, rule or generic))
            dependent.add(node)
        else:
            steps.append(_Step(node, "plain", inputs))
    owned = {id(t) for m in traced.modules() for t in (*m.parameters(), *m.buffers())}
    alive = [ref() for ref in traced.dropped.values()]
    return Plan(tuple(steps), all(t is not None and id(t) in owned for t in alive))
