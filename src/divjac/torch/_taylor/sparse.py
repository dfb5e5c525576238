"""The exact Laplacian by a collapsed Taylor sweep that stores first-order terms sparse (torch).

The twin of :mod:`divjac.jax._sparse_taylor`: where an intermediate depends on a few of the
``d`` inputs (a per-particle feature, a neighbourhood), its first-order terms are stored for
those inputs only, ``[m, *S]`` with the index of :mod:`divjac._core.sparse_index`, instead of
the ``d`` of the dense sweep of :mod:`divjac.torch._taylor.sweep`. A step whose dependent operands
combine elements gets each operand's terms laid out on its output's index (a gather): then
slot ``j`` is the same input in every term the step combines, and the dense sweep's rule of
the step is right as it stands (its curvature summed over the slots, zero terms adding
nothing). The index follows element-wise operations (:func:`divjac.torch._ops.is_elementwise`), moves of
elements (views, permutations, slices, concatenation, padding: the operation itself applied
to each slot of the index), reductions along axes (sums, means, maxima, norms, softmax) and products
with a constant (``mm``, ``bmm``, ``mv``, ``addmm``; over a concatenation, split by
:func:`_distributed`); any other step, or one whose output would depend on more than half the
inputs, takes its operands dense (``d`` slots, by a scatter; a sum or mean summing in it) and
the sweep goes on dense from there. Convolutions take the dense terms: their windows laid by
gathers were slower than the dense sweep, which runs the convolution itself.

PyTorch has no trace time: the index is computed once per trace, by a run of the graph with
the index in place of the terms (:class:`_Indexing`), and kept as the gathers of each step's
operands with the sweep's cost against the dense one's (:class:`_Layouts`); a call then runs
the rules on the laid terms (:class:`_Laying`). The index depends on the graph's structure,
and on the integer tensors that move elements (read again when modified in place).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch
import torch.fx

from ..._backend import Point
from ..._core.plan import sparse_sweep_share
from ..._core.sparse_index import compressed, positions, union
from .._aten import bind, dims, inexact, packet
from .._ops import is_elementwise
from .._traced import Traced
from .jets import Jet, Rule, Sweep, lift
from .sweep import Plan, Program, _plan, program_of

__all__ = ["sparse_laplacian"]

Tensor = torch.Tensor
aten = torch.ops.aten

# The index of a step's output: per element the inputs it depends on, or DENSE (all of them).
DENSE: Any = "dense"

# Moves of elements: the output's elements are some of the operands' (a slot of the index is
# moved by the operation itself; constant operands contribute no input).
_MOVES = frozenset(
    {
        "view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "unsqueeze",
        "squeeze", "slice", "select", "cat", "stack", "constant_pad_nd", "flip", "roll",
        "repeat", "narrow", "index_select", "index", "gather", "diagonal", "unfold",
        "view_copy", "permute_copy", "expand_copy", "unsqueeze_copy", "squeeze_copy",
        "transpose_copy", "slice_copy", "select_copy", "alias_copy", "pixel_shuffle",
        "pixel_unshuffle", "movedim",
    }
)  # fmt: skip

# Reductions along axes (the output's element depends on the operand's along them), and the
# operations that normalize along one axis (each output element depends on its whole line).
_REDUCTIONS = frozenset(
    {"sum", "mean", "amax", "amin", "logsumexp", "nansum", "linalg_vector_norm"}
)
_ALONG = frozenset({"_softmax", "_safe_softmax", "_log_softmax", "softmax", "log_softmax"})

# Products ``a @ b`` with one dependent operand, and where the operands are among the args.
_PRODUCTS = {aten.mm.default: (0, 1), aten.bmm.default: (0, 1), aten.mv.default: (0, 1),
             aten.addmm.default: (1, 2)}  # fmt: skip


def sparse_laplacian(
    f: Any, x: Tensor, passes: int, budget: int, point: Point[Traced] | None = None
) -> Tensor | None:
    """The exact per-sample Laplacian ``[B, *out]`` of the uncoupled batch-first ``f`` at ``x``
    by the sparse sweep, where its work is at most half that of ``passes`` dense directions
    and at most ``budget`` directions' worth (``None`` otherwise, and where the graph cannot
    be run: :func:`~divjac.torch._taylor.sweep.program_of`, which may run ``point``'s trace)."""
    program = program_of(f, x, point=point)
    if program is None or x.is_complex():
        return None
    layouts = _layouts(program, x)
    share = layouts.share * layouts.n
    if 2 * share > passes or share > budget:
        return None
    seed = Jet(x.new_ones((1,) * (x.ndim + 1)), None)
    program = replace(program, plan=layouts.plan)
    y, jet = program.evaluate(x, _Laying(layouts), seed)
    second = jet.second if isinstance(jet, Jet) else None
    return y.new_zeros(y.shape) if second is None else second.expand(1, *y.shape)[0]


@dataclass(frozen=True)
class _Layout:
    """How an operand's terms are laid on a step's index: gathered at the positions ``index``,
    or (``dense``) scattered to the dense terms by their inputs ``index`` (``n``: none); and
    where ``summed`` holds axes, summed over them in the scatter (a sum or mean whose output
    depends on most inputs: its dense first-order terms at once, times ``scale``)."""

    index: Tensor
    dense: bool = False
    summed: tuple[int, ...] | None = None
    scale: float = 1.0


@dataclass(frozen=True)
class _SumTo:
    """The index a sum or mean over ``axes`` lays its operand on when its output depends on
    most inputs: dense, summed in the scatter (``scale``: 1 or one over the elements summed)."""

    axes: tuple[int, ...]
    scale: float


@dataclass(frozen=True)
class _Layouts:
    """The steps of the trace with its products distributed (:func:`_distributed`); per step,
    how its dependent operands' terms are laid on its index (:data:`_Layout`); and the sparse
    sweep's cost as a fraction of the dense sweep's over ``n`` inputs (``share``, see
    :class:`_Indexing`)."""

    plan: Plan
    n: int
    share: float
    device: torch.device
    gathers: dict[torch.fx.Node, dict[torch.fx.Node, _Layout]]


# The layouts of recent traces.
_LAYOUTS: weakref.WeakKeyDictionary[Traced, _Layouts] = weakref.WeakKeyDictionary()


def _layouts(program: Program, x: Tensor) -> _Layouts:
    found = _LAYOUTS.get(program.traced)
    if found is not None and found.device == x.device:
        return found
    graph = _distributed(program.traced.gm, program.traced.x_pos)
    if graph is not None:
        program = replace(program, plan=_plan(program.traced, graph))
    n = math.prod(x.shape[1:])
    labels = np.arange(n).reshape(1, 1, *x.shape[1:])
    indexing = _Indexing(n, x.device)
    with torch.no_grad():
        program.evaluate(x.detach(), indexing, np.broadcast_to(labels, (1, *x.shape)))
    program.traced.record_reads(indexing.read)
    share = sparse_sweep_share(indexing.stored, indexing.dense, moved=indexing.moved)
    layouts = _Layouts(program.plan, n, share, x.device, indexing.gathers)
    _LAYOUTS[program.traced] = layouts
    return layouts


class _Laying(Sweep):
    """The sweep whose steps read their dependent operands' terms laid out on their index."""

    def __init__(self, layouts: _Layouts) -> None:
        super().__init__(layouts.n, None, per_direction=False)
        self.layouts = layouts
        self.laid: dict[torch.fx.Node, Jet] = {}

    def jet(self, arg: Any) -> Jet | None:
        found = self.laid.get(arg) if self.laid and isinstance(arg, torch.fx.Node) else None
        return found if found is not None else super().jet(arg)

    def apply(
        self, rule: Rule, node: torch.fx.Node, args: Any, kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        gathers = self.layouts.gathers.get(node)
        if not gathers:
            return rule(self, node, args, kwargs)
        summed = None
        for arg, lay in gathers.items():
            own = super().jet(arg)
            if own is None:
                continue
            if lay.summed is not None:  # the rule is left the second-order term only
                summed = _scattered(own.first, lay.index, self.k, lay.summed) * lay.scale
                self.laid[arg] = Jet(own.first[:1], own.second)
            elif lay.dense:
                self.laid[arg] = Jet(_scattered(own.first, lay.index, self.k), own.second)
            else:
                self.laid[arg] = Jet(_gathered(own.first, lay.index), own.second)
        try:
            y, jet = rule(self, node, args, kwargs)
        finally:
            self.laid = {}
        if summed is not None:
            jet = Jet(summed.reshape(self.k, *y.shape), jet.second)
        return y, jet


def _scattered(terms: Tensor, idx: Tensor, n: int, axes: tuple[int, ...] = ()) -> Tensor:
    """The dense terms ``[n, *S]`` of ``terms`` ``[m, *s]`` whose inputs are ``idx``
    ``[m, *S]`` (``n``: none), summed over the ``axes`` of ``S`` (dropped)."""
    terms = lift(terms, idx.ndim - 1)
    shape = torch.broadcast_shapes(terms.shape[1:], idx.shape[1:])
    kept = [a for a in range(len(shape)) if a not in axes]
    order = (0, *(1 + a for a in axes), *(1 + a for a in kept))
    sizes = [shape[a] for a in kept]

    def fold(t: Tensor) -> Tensor:  # the summed axes with the slots
        return t.expand(idx.shape[0], *shape).permute(order).reshape(-1, *sizes)

    out = terms.new_zeros((n + 1, *sizes))
    return out.scatter_add_(0, fold(idx), fold(terms))[:n]


def _gathered(terms: Tensor, pos: Tensor) -> Tensor:
    """``terms`` ``[m, *s]`` at the slots ``pos`` ``[m', *S]`` (``m``: zero), broadcast."""
    terms = lift(terms, pos.ndim - 1)
    padded = torch.cat([terms, terms.new_zeros((1, *terms.shape[1:]))])
    shape = torch.broadcast_shapes(padded.shape[1:], pos.shape[1:])
    # gather on expanded views: 3x faster than take_along_dim (torch 2.13, CPU)
    return torch.gather(padded.expand(-1, *shape), 0, pos.expand(-1, *shape))


# --- products distributed over concatenations -----------------------------------------------------

_ROWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _distributed(gm: torch.fx.GraphModule, x_pos: int) -> torch.fx.Graph | None:
    """``gm``'s graph with its products by a factor that does not depend on the input at ``x_pos``
    (a constant, or another argument: weights passed in) of a concatenation along the contracted
    axis distributed over the parts (``cat([a, b]) @ W`` as ``a @ W_a + b @ W_b``), a part
    broadcast along the rows (``expand(g)``) multiplied before it is broadcast: a FermiNet layer
    on ``[h_i, mean_j h_j]``, each product at its own size, the per-electron part's terms sparse
    (``None``: no such product)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    dependent = {[n for n in graph.nodes if n.op == "placeholder"][x_pos]}  # x (not t, params)
    for node in graph.nodes:
        if any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    changed = False
    for node in list(graph.nodes):
        at = {aten.mm.default: 0, aten.addmm.default: 1}.get(node.target)
        if at is None or node.kwargs:
            continue
        rows, w = node.args[at], node.args[at + 1]
        if not isinstance(rows, torch.fx.Node) or rows not in dependent or w in dependent:
            continue
        cat = rows.args[0] if rows.target in _ROWS else None
        if not isinstance(cat, torch.fx.Node) or cat.target is not aten.cat.default:
            continue
        shape = _meta_shape(cat)
        axis = int(cat.args[1]) if len(cat.args) > 1 else 0  # type: ignore[arg-type]
        if axis % len(shape) != len(shape) - 1 or _meta_shape(rows) != (
            math.prod(shape[:-1]),
            shape[-1],
        ):
            continue
        width = _meta_shape(node)[-1]
        with graph.inserting_before(node):
            total, start = None, 0
            for part in cast(list[torch.fx.Node], cat.args[0]):
                size = _meta_shape(part)[-1]
                piece = graph.call_function(aten.slice.Tensor, (w, 0, start, start + size))
                start += size
                term = _part_product(graph, part, piece, width)
                total = (
                    term if total is None else graph.call_function(aten.add.Tensor, (total, term))
                )
            if at == 1:
                total = graph.call_function(aten.add.Tensor, (total, node.args[0]))
        node.replace_all_uses_with(cast(torch.fx.Node, total))
        graph.erase_node(node)
        changed = True
    return graph if changed else None


def _part_product(
    graph: torch.fx.Graph, part: torch.fx.Node, piece: torch.fx.Node, width: int
) -> torch.fx.Node:
    """The rows of ``part`` (flattened but the last axis) times ``piece``; an ``expand`` of a
    value of its rank multiplied first, then broadcast."""
    shape = _meta_shape(part)
    call = graph.call_function
    src = part.args[0] if part.target is aten.expand.default else None
    if isinstance(src, torch.fx.Node) and len(_meta_shape(src)) == len(shape):
        small = _meta_shape(src)
        product = call(aten.mm.default, (call(aten.reshape.default, (src, [-1, shape[-1]])), piece))
        back = call(aten.reshape.default, (product, [*small[:-1], width]))
        wide = call(aten.expand.default, (back, [*shape[:-1], width]))
        return call(aten.reshape.default, (wide, [-1, width]))
    return call(aten.mm.default, (call(aten.reshape.default, (part, [-1, shape[-1]])), piece))


def _meta_shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)


# --- the index, once per trace -------------------------------------------------------------------


class _Indexing(Sweep):
    """A run of the graph's values with each dependent value's index in place of its jet
    (``DENSE``: all inputs), recording how the steps' operands are laid on their index and
    counting the work on first-order terms of the sparse sweep (``stored``) and of the dense
    one (``dense``): per output element and slot, the length of a product's contraction (1
    for the other steps); and the elements the gathers and scatters write (``moved``)."""

    def __init__(self, n: int, device: torch.device) -> None:
        super().__init__(n, None, per_direction=False)
        self.n = n
        self.device = device
        self.stored = 0
        self.moved = 0
        self.dense = 0
        self.gathers: dict[torch.fx.Node, dict[torch.fx.Node, _Layout]] = {}
        self.read: set[str] = set()  # the graph's constants an index was computed from

    def apply(
        self, rule: Rule, node: torch.fx.Node, args: Any, kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        y = node.target(*args, **kwargs)  # type: ignore[operator]
        ins = {a: self.jets[a] for a in node.all_input_nodes if a in self.jets}
        values = _input_values(node, args, kwargs)
        if isinstance(y, tuple | list):  # several outputs: dense
            self.lay(node, ins, {a: DENSE for a in ins}, values)
            outs = [DENSE if inexact(o) else None for o in y]
            for o in y:
                if inexact(o):
                    self.count(o, DENSE, 1)
            return y, outs
        if node.target is aten.detach.default or not inexact(y):
            return y, None
        out, want, work = _index(node, y, ins, values, self.n)
        if packet(node.target) in _MOVES:  # moved by the values of its other operands
            self.read |= _constants_above([a for a in node.all_input_nodes if a not in ins])
        self.lay(node, ins, want, values)
        self.count(y, out, work)
        return y, out

    def lay(
        self,
        node: torch.fx.Node,
        ins: dict[torch.fx.Node, Any],
        want: dict[torch.fx.Node, Any],
        values: dict[torch.fx.Node, Any],
    ) -> None:
        """Record how each operand's terms are laid on ``want`` (its index): gathered, or
        scattered to the dense terms."""
        gathers = {}
        for arg, target in want.items():
            have = ins[arg]
            if have is DENSE:
                continue  # dense in, dense out (no step goes from dense back to sparse)
            if target is DENSE or isinstance(target, _SumTo):  # scattered to the inputs' slots
                shape = tuple(values[arg].shape)
                core, _ = compressed(np.where(have < 0, self.n, have))
                index = torch.as_tensor(core, device=self.device)
                if isinstance(target, _SumTo):
                    gathers[arg] = _Layout(
                        index, dense=True, summed=target.axes, scale=target.scale
                    )
                    kept = [s for a, s in enumerate(shape) if a not in target.axes]
                    self.moved += have.shape[0] * math.prod(shape) + self.n * math.prod(kept)
                else:
                    gathers[arg] = _Layout(index, dense=True)
                    self.moved += self.n * math.prod(shape)
                continue
            have = _spread(have, target.shape[1:])
            if have.shape == target.shape and np.array_equal(have, target):
                continue
            pos = positions(have, target)
            gathers[arg] = _Layout(torch.as_tensor(pos, device=self.device))
            self.moved += math.prod(target.shape)
        if gathers:
            self.gathers[node] = gathers

    def count(self, y: Tensor, out: Any, work: int) -> None:
        size = y.numel() * work
        self.dense += self.n * size
        self.stored += (self.n if out is DENSE else out.shape[0]) * size


def _constants_above(nodes: list[torch.fx.Node]) -> set[str]:
    """The names of the graph's constants that ``nodes`` are computed from."""
    names, seen, todo = set(), set(), list(nodes)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr":
            names.add(str(node.target))
        todo.extend(node.all_input_nodes)
    return names


def _input_values(node: torch.fx.Node, args: Any, kwargs: dict[str, Any]) -> dict[Any, Any]:
    """The values of the nodes among ``node``'s arguments, read from ``args`` and ``kwargs``."""
    found: dict[Any, Any] = {}

    def pair(a: Any, v: Any) -> None:
        if isinstance(a, torch.fx.Node):
            found[a] = v
        elif isinstance(a, list | tuple):
            for ai, vi in zip(a, v, strict=True):
                pair(ai, vi)

    pair(node.args, args)
    for k, a in node.kwargs.items():
        pair(a, kwargs[k])
    return found


def _spread(idx: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``idx`` ``[m, *s]`` broadcast to ``[m, *shape]`` (as its value broadcasts to ``shape``)."""
    s = idx.shape[1:]
    lifted = idx.reshape(idx.shape[0], *(1 for _ in range(len(shape) - len(s))), *s)
    return np.broadcast_to(lifted, (idx.shape[0], *shape))


def _index(
    node: torch.fx.Node,
    y: Tensor,
    ins: dict[torch.fx.Node, Any],
    values: dict[torch.fx.Node, Any],
    n: int,
) -> tuple[Any, dict[torch.fx.Node, Any], int]:
    """``(out, want, work)``: the index of the step's output, the index each dependent operand
    is laid on (``DENSE``: all inputs), and the length of its contraction."""
    target: Any = node.target
    dense = {a: DENSE for a in ins}
    if any(i is DENSE for i in ins.values()):
        return DENSE, dense, 1
    name = packet(target)
    shape = tuple(y.shape)
    if is_elementwise(target):
        spread = [_spread(i, shape) for i in ins.values()]
        if len(spread) == 1:  # its terms broadcast as its value does
            return spread[0], {}, 1
        idx = union(np.concatenate(spread))
        return (DENSE, dense, 1) if 2 * idx.shape[0] > n else (idx, dict.fromkeys(ins, idx), 1)
    if name in _MOVES:
        return _moved(node, ins, values), {a: _padded(i, _slots(ins)) for a, i in ins.items()}, 1
    if name in _REDUCTIONS or name in _ALONG:
        (a,) = ins
        return _reduced(node, values[a], y, ins[a], name in _ALONG, n, dense)
    if target in _PRODUCTS:
        return _product(node, values, y, ins, n, dense)
    return DENSE, dense, 1


def _slots(ins: dict[torch.fx.Node, Any]) -> int:
    return max(i.shape[0] for i in ins.values())


def _padded(idx: np.ndarray, m: int) -> np.ndarray:
    if idx.shape[0] == m:
        return idx
    return np.concatenate([idx, np.full((m - idx.shape[0], *idx.shape[1:]), -1, idx.dtype)])


def _moved(
    node: torch.fx.Node, ins: dict[torch.fx.Node, Any], values: dict[Any, Any]
) -> np.ndarray:
    """The index of a move: the operation applied to each slot of its operands' indices
    (plus one, so that zero, as constant operands and padding give, is no input)."""
    m = _slots(ins)
    slots = []
    for j in range(m):

        def put(a: torch.fx.Node, j: int = j) -> Any:
            if a in ins:
                return torch.from_numpy(np.array(_padded(ins[a], m)[j], np.int64, order="C")) + 1
            value = values[a]
            if isinstance(value, Tensor) and inexact(value):
                return torch.zeros(value.shape, dtype=torch.int64)
            return value

        args = torch.fx.node.map_arg(node.args, put)
        kwargs = torch.fx.node.map_arg(node.kwargs, put)
        if packet(node.target) == "constant_pad_nd":
            args = (*args[:2], 0)
        slots.append(node.target(*args, **kwargs).numpy() - 1)  # type: ignore[operator]
    return np.stack(slots)


def _reduced(
    node: torch.fx.Node,
    x: Tensor,
    y: Tensor,
    idx: np.ndarray,
    along: bool,
    n: int,
    dense: dict[torch.fx.Node, Any],
) -> tuple[Any, dict[torch.fx.Node, Any], int]:
    """A reduction along axes (``along``: a normalization along one axis, shaped as its
    operand): an output element depends on the union of the operand's along them."""
    bound = bind(node)
    axes = dims(bound.get("dim"), x.ndim) if x.ndim else []
    xs = tuple(x.shape)
    kept = [a for a in range(x.ndim) if a not in axes]
    folded = idx.transpose((0, *(1 + a for a in axes), *(1 + a for a in kept)))
    u = union(folded.reshape(-1, *(xs[a] for a in kept)))
    if 2 * u.shape[0] > n:
        if packet(node.target) in ("sum", "mean") and bound.get("dtype") is None:
            size = math.prod(xs[a] for a in axes)
            scale = 1.0 / size if packet(node.target) == "mean" else 1.0
            return DENSE, dict.fromkeys(dense, _SumTo(tuple(axes), scale)), 1
        return DENSE, dense, 1
    lifted = u.reshape(u.shape[0], *(1 if a in axes else xs[a] for a in range(x.ndim)))
    back = np.broadcast_to(lifted, (u.shape[0], *xs))
    if along:
        return back, dict.fromkeys(dense, back), 1
    out = lifted if bound.get("keepdim") else u
    return np.broadcast_to(out, (u.shape[0], *y.shape)), dict.fromkeys(dense, back), 1


def _product(
    node: torch.fx.Node,
    values: dict[Any, Any],
    y: Tensor,
    ins: dict[torch.fx.Node, Any],
    n: int,
    dense: dict[torch.fx.Node, Any],
) -> tuple[Any, dict[torch.fx.Node, Any], int]:
    """``a @ b`` with one of ``a``, ``b`` dependent and the other constant (``addmm``'s added
    term constant too): an output element depends on the union over the contracted axis of
    the dependent operand's line (a row of ``a``, a column of ``b``)."""
    i, j = _PRODUCTS[node.target]  # type: ignore[index]
    left, right = node.args[i], node.args[j]
    on_left = left in ins
    own = cast(torch.fx.Node, left if on_left else right)
    a = values[own]
    axis = a.ndim - 1 if on_left else a.ndim - 2  # the contracted axis of the operand
    work = int(a.shape[axis]) if a.ndim else 1
    if list(ins) not in ([left], [right]) or a.ndim < 2:  # both dependent, or mv's vector
        return DENSE, dense, work
    moved = np.moveaxis(ins[own], 1 + axis, 1)
    u = union(moved.reshape(-1, *moved.shape[2:]))
    if 2 * u.shape[0] > n:
        return DENSE, dense, work
    lifted = np.expand_dims(u, 1 + axis)  # [m', ..., 1 at the contracted axis, ...]
    back = np.broadcast_to(lifted, (u.shape[0], *a.shape))
    if y.ndim < a.ndim:  # mv: the contracted axis is gone
        out = u
    else:
        out = np.broadcast_to(lifted, (u.shape[0], *y.shape))
    return out, {own: back}, work
