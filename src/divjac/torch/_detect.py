"""Tracing a batched function into an ATen graph and detecting its per-sample pattern (cached).

The function is traced batch-first with ``make_fx`` on fake tensors (no memory, no compute), with
functionalization (no aliasing or in-place mutation left in the graph) and PyTorch's
decompositions for the operations the interpreter has no rule for.

A trace is reused while nothing it was made from has changed, like ``torch.compile``'s guards.
The cache key holds the function (a plain function by its code), the shapes, dtypes and devices
of the tensor arguments, the other (static) arguments, the grad mode, and the signature of the
state the function reaches (:func:`reach`): the modules (class, train/eval mode, plain Python
attributes, hooks, and the identity, shape, dtype and device of their parameters and buffers),
and the tensors, scalars, containers and objects reachable from the function's closure, globals,
defaults and ``self`` (of plain objects, the scalar attributes its code names; of lists, their
items; of a log the function appends to, the objects in it, not its numbers). Computing
it walks those objects at every call (the cost grows with the number of modules and tensors,
never with their sizes); tensor values are not part of
it. A function that changes what it reaches at every call (a counter in a module attribute) is
traced at every call, with a warning.

Detection never reads the values of captured floating-point tensors (weights change between
calls): training a model, ``load_state_dict`` or ``optimizer.step()`` never re-trace. It may
read captured integer and boolean tensors (indices, masks) that the key identifies, and the
constants the program builds itself; a trace records the version counter of every captured
tensor its detections read, and is redone once one of them was modified in place.

A function whose control flow depends on values (``if x.sum() > 0``) cannot be traced on fake
tensors. It is traced on the actual values; such a trace holds for the inputs that take the same
branches, so the values the control flow read (the scalars it took from tensors, the shapes of
data-dependent results) are recomputed at every call by the part of the graph that computes them,
and select the trace of the branch taken (a few per function are kept).
"""

from __future__ import annotations

import contextlib
import inspect
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx
from torch import nn

from .._core import detection
from .._core.detection import LRU
from .._errors import DivjacError, StateUpdateError, UnsupportedOperationError
from ._aten import Decomposed
from ._branches import (
    MAX_BRANCHES as _MAX_BRANCHES,  # noqa: F401 (tests read it here)
    Branches,
    branch,
)
from ._compat import (
    aten_trace,
    compiled_inlined,
    fake_tensors,
    generator_untraceable,
    in_aten_trace,
    is_wrapped,
    outside_transforms,
    pytree,
    traced_node,
)
from ._constants import (
    captured_floats,
    check_static,
    drop_constants,
    drop_effect_tokens,
    readable_constants,
)
from ._interpret import decompositions
from ._retraces import check_own_changes, warn_numbers_retraced, warn_uncached
from ._side_effects import (
    KeptState,
    NoFastPaths,
    plain_kernels,
    quiet_batch_norm,
    quiet_fake_tensors,
    updates_running_stats,
)
from ._trace_keys import (
    Checks,
    Reached,
    changed_lists,
    library,
    mark_logs,
    module_signature,
    reach,
)
from ._traced import DECOMPOSED, TensorSpec, Traced, live_peak

__all__ = [
    "CACHE",
    "Reached",
    "TensorSpec",
    "Traced",
    "plain_kernels",
    "quiet_batch_norm",
    "reach",
    "trace",
]


# --- tracing --------------------------------------------------------------------------------


CACHE: LRU[Traced | Branches] = LRU(64)
"""Traced functions, shared by all transforms (weights are not kept alive by it)."""


def _key(
    fun: Any,
    static: tuple[Any, ...],
    leaves: Sequence[Any],
    dynamic: Sequence[bool],
    treedef: Any,
    reached: Reached,
) -> _Key | None:
    """The cache key (``None`` if a static argument is unhashable, or the function reaches an
    object its signature cannot tell apart from another: traced at every call). A plain function counts by
    its code, other callables and static modules are held weakly: the cache keeps no model
    alive. The objects the signature holds by ``id`` are checked alive on a hit
    (:meth:`Traced.current`), so a new object at a recycled address is not mistaken for a
    dead one."""
    if not reached.keyable:
        return None
    try:
        key = (
            # A plain function by its code (what it reaches is in the signature): a closure
            # made anew at every call, over the same objects, finds its trace.
            fun.__code__
            if isinstance(fun, types.FunctionType) and not library(fun)
            else _weak(fun),
            static,
            treedef,
            tuple(
                (tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device) if dyn else _weak(leaf)
                for leaf, dyn in zip(leaves, dynamic, strict=True)
            ),
            reached.signature,
        )
        return _Key(key)
    except TypeError:
        return None


class _Key:
    """A cache key that hashes its (long) parts once: the cache looks it up more than once."""

    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple[Any, ...]) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self._hash == other._hash and self.parts == other.parts


def _weak(obj: Any) -> Any:
    """A weak reference to a function or module (equal while alive), else ``obj`` itself."""
    if not (callable(obj) or isinstance(obj, nn.Module)):
        return obj
    try:
        return weakref.WeakMethod(obj) if inspect.ismethod(obj) else weakref.ref(obj)
    except TypeError:  # builtins cannot be weakly referenced (and are never freed)
        return obj


def trace(
    fun: Callable[..., Any],
    leaves: list[Any],
    treedef: Any,
    *,
    x_leaf: int,
    batch_axis: int | None,
    has_aux: bool,
    walked: list[Reached] | None = None,
) -> Traced:
    """Trace ``fun`` batch-first in the leaf ``x_leaf`` of its ``(args, kwargs)`` (cached).

    ``leaves`` and ``treedef`` are the flattened ``(args, kwargs)``. Tensor leaves are graph
    inputs; everything else is static and part of the cache key (with the signature of what
    ``fun`` reaches), like ``jax.jit``'s. Results are cached in :data:`CACHE`. ``walked``
    receives the walk of what ``fun`` reaches now where this call found the trace by it (not
    by the memo), for a caller that needs the tensors it reaches.
    """
    dynamic = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    options = (x_leaf, batch_axis, has_aux)
    memo = _memo_of(fun)
    call = _call_of(options, leaves, dynamic, treedef)
    if isinstance(memo, _Memo) and (found := memo.reuse(fun, call)) is not None:
        return found
    static = [leaf for leaf, d in zip(leaves, dynamic, strict=True) if not d]
    reached = reach(fun, static, record=memo is not _NO_MEMO)
    key = _key(fun, options, leaves, dynamic, treedef, reached)
    warn_uncached(fun, reached)
    cached = CACHE.get(key) if key is not None else None
    if isinstance(cached, Traced) and cached.current():
        _remember(fun, call, reached, key, cached)
        if walked is not None:
            walked.append(reached)
        return cached
    x_pos = sum(dynamic[:x_leaf])
    tensors = [leaf for leaf, d in zip(leaves, dynamic, strict=True) if d]
    actual = _actual_inputs(tensors, x_pos, batch_axis)
    needs_values = isinstance(cached, Branches) and actual is not None
    if isinstance(cached, Branches) and actual is not None:
        with outside_transforms():
            found = cached.select(actual, reached)
        if found is not None:
            return found
    out_tree: list[Any] = []

    def batch_first(*dyn_leaves: torch.Tensor) -> torch.Tensor:
        it = iter(dyn_leaves)
        full = [next(it) if d else leaf for leaf, d in zip(leaves, dynamic, strict=True)]
        xb = full[x_leaf]
        if batch_axis is None:
            full[x_leaf] = xb[0]
        elif batch_axis:  # (a batch already first would trace an identity permute)
            full[x_leaf] = torch.movedim(xb, 0, batch_axis)
        call_args, call_kwargs = pytree.tree_unflatten(full, treedef)
        out = fun(*call_args, **call_kwargs)
        out_tree.append(
            pytree.tree_map(
                lambda a: TensorSpec(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a,
                out,
            )
        )
        y = out[0] if has_aux and isinstance(out, tuple | list) and len(out) == 2 else out
        if not isinstance(y, torch.Tensor) or (has_aux and not isinstance(out, tuple | list)):
            return torch.zeros(0)  # reported by the caller from out_tree
        if batch_axis is None:
            return y[None]
        return torch.movedim(y, batch_axis, 0) if batch_axis and y.ndim > batch_axis else y

    ran: list[nn.Module] = []
    with outside_transforms():
        state = KeptState(reached.tensors.values(), reached.modules)
        try:
            with quiet_batch_norm(reached.modules, ran):
                gm, on_values = _trace_graph(
                    batch_first, tensors, x_pos, batch_axis, out_tree, actual, values=needs_values
                )
        except DivjacError:
            raise
        except Exception as err:  # the update may be what the trace failed on
            _check_kept(fun, state, reached, cause=err)
            raise
        _check_kept(fun, state, reached)
        taken = branch(gm, reached, actual) if on_values and actual is not None else None
    after = reach(fun, static)
    logs = changed_lists(reached, after)
    if logs and mark_logs(fun, logs):
        # Lists the call itself changed are logs: keyed again without their contents, the
        # next call finds this trace.
        reached = reach(fun, static, record=memo is not _NO_MEMO)
        key = _key(fun, options, leaves, dynamic, treedef, reached)
    else:
        check_own_changes(fun, reached, after)
    if key is not None:
        warn_numbers_retraced(fun, call, reached, after)
    readable, versioned = readable_constants(gm, reached)
    captured = captured_floats(gm)
    dropped = drop_constants(gm, keep=readable)
    found_ids = {id(m) for m in reached.modules}
    unreached = {id(m): m for m in ran if id(m) not in found_ids}
    out_val = next(n for n in gm.graph.nodes if n.op == "output").args[0].meta["val"]
    traced = Traced(
        x_shape=detection.batch_first_shape(tuple(tensors[x_pos].shape), batch_axis),
        out_shape=tuple(out_val.shape),
        out_tree=out_tree[0],
        pass_elements=2 * live_peak(gm),
        gm=gm,
        x_pos=x_pos,
        module_refs=tuple(weakref.ref(m) for m in (*reached.modules, *unreached.values())),
        readable=readable,
        versioned=versioned,
        identified=tuple(weakref.ref(obj) for obj in reached.identified),
        unreached=tuple((weakref.ref(m), module_signature(m)) for m in unreached.values()),
        batch_norms=tuple(
            weakref.ref(m) for m in {id(m): m for m in ran}.values() if updates_running_stats(m)
        ),
        captured=tuple(weakref.ref(t) for t in captured),
        dropped=dropped,
    )
    traced.forward_twice_wrong  # noqa: B018 (computed now: torch.compile reads it, not a property)
    if key is not None:
        if not on_values:
            CACHE.put(key, traced)
            _remember(fun, call, reached, key, traced)
        else:
            branches = cached if isinstance(cached, Branches) else Branches(fun)
            branches.add(taken, traced)
            CACHE.put(key, branches)
    return traced


def _check_kept(
    fun: Callable[..., Any], state: KeptState, reached: Reached, cause: Exception | None = None
) -> None:
    """Raise :class:`StateUpdateError` if tracing ``fun`` updated a tensor it reaches (restored
    first): a call evaluates ``fun`` more than once (its trace, then its passes),
    and every evaluation would update it again and see a moved state."""
    written = state.restore()
    if not written:
        return
    t = written[0]
    what = f"a captured tensor of shape {tuple(t.shape)}"
    for m in reached.modules:
        for kind, named in (("buffer", m.named_buffers), ("parameter", m.named_parameters)):
            found = next((n for n, held in named(recurse=False) if held is t), None)
            if found is not None:
                what = f"the {kind} {found!r} of {type(m).__name__}"
    name = getattr(fun, "__qualname__", type(fun).__qualname__)
    raise StateUpdateError(
        f"divjac: {name} updates a tensor it reads, {what}, in place or by assigning a new "
        "one (a running statistic, a counter, a power iteration). A divjac call evaluates the "
        "function more than once (to trace it, then in its passes), so the update would be "
        "applied several times and the derivative taken at a moved state; the tensor was "
        "restored, nothing was computed. Update the state outside the transformed function "
        "(e.g. one forward pass under torch.no_grad() before the call), or put the module in "
        "eval mode where the update is made only in training."
    ) from cause


@dataclass(frozen=True, eq=False)
class _Memo:
    """The last trace of a function found in :data:`CACHE`, and what tells, without the walk
    of :func:`reach` nor the cache key, that a call would find it again: its arguments look
    the same (shapes, dtypes and devices; the other arguments equal), the grad mode is the
    same, and :class:`~divjac.torch._checks.Checks` hold."""

    fun: weakref.ref[Any]
    call: tuple[Any, ...]
    grad: bool
    checks: Checks
    key: _Key
    traced: weakref.ref[Traced]

    def reuse(self, fun: Any, call: tuple[Any, ...]) -> Traced | None:
        traced = self.traced()
        if (
            traced is None
            or self.fun() is not fun  # an equal function is not the same one
            or self.grad is not torch.is_grad_enabled()
            or call != self.call
            or not self.checks.hold()
            or CACHE.get(self.key) is not traced  # still cached (and now the most recent)
            or not traced.current()
        ):
            return None
        return traced


# The last trace of each function (weakly keyed: a memo dies with its function).
_MEMOS: weakref.WeakKeyDictionary[Any, _Memo] = weakref.WeakKeyDictionary()
_NO_MEMO = object()  # a function without memo: not weakly referenceable, or unhashable


def clear_memos() -> None:
    """Forget the memos (the next call of each function walks what it reaches)."""
    _MEMOS.clear()


def _memo_of(fun: Any) -> Any:
    """The memo of ``fun``: a :class:`_Memo`, ``None`` (none yet), or :data:`_NO_MEMO`."""
    try:
        return _MEMOS.get(fun)
    except TypeError:
        return _NO_MEMO


def _call_of(
    options: tuple[Any, ...], leaves: Sequence[Any], dynamic: Sequence[bool], treedef: Any
) -> tuple[Any, ...]:
    """What a memo compares of a call: the options, the tree, and per leaf its shape, memory
    layout, dtype and device (a tensor) or itself (weakly, when a function or module)."""
    return (
        options,
        treedef,
        tuple(
            (leaf.shape, leaf.stride(), leaf.dtype, leaf.device) if dyn else _weak(leaf)
            for leaf, dyn in zip(leaves, dynamic, strict=True)
        ),
    )


def _remember(
    fun: Any, call: tuple[Any, ...], reached: Reached, key: _Key | None, traced: Traced
) -> None:
    if reached.checks is None or key is None:
        return
    with contextlib.suppress(TypeError):
        memo = _Memo(
            weakref.ref(fun),
            call,
            torch.is_grad_enabled(),
            reached.checks,
            key,
            weakref.ref(traced),
        )
        _MEMOS[fun] = memo


def _actual_inputs(
    tensors: Sequence[torch.Tensor], x_pos: int, batch_axis: int | None
) -> list[torch.Tensor] | None:
    """The graph's inputs from the actual values (``None`` under a ``torch.func`` transform,
    where they are not plain data)."""
    if any(is_wrapped(t) for t in tensors):
        return None
    inputs = [t.detach() for t in tensors]
    x = inputs[x_pos]
    inputs[x_pos] = x[None] if batch_axis is None else torch.movedim(x, batch_axis, 0)
    return inputs


def _dense_strides(shape: Sequence[int], strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """``strides`` where they lay the elements out densely without overlap but not
    contiguous (a transposed or ``channels_last`` tensor: the graph is traced at that layout,
    at which the passes run the function, e.g. a group normalization of a ``channels_last``
    convolution needs a contiguous copy in forward mode), else ``None`` (contiguous, also for
    an expanded tensor)."""
    pairs = [(size, stride) for size, stride in zip(shape, strides, strict=True) if size != 1]
    inner_first = sorted(pairs, key=lambda p: p[1])
    expected = 1
    for size, stride in inner_first:
        if stride != expected:
            return None  # overlapping (expanded) or with gaps: traced contiguous
        expected *= size
    return None if inner_first == pairs[::-1] else strides


def _trace_graph(
    fn: Callable[..., torch.Tensor],
    tensors: Sequence[torch.Tensor],
    x_pos: int,
    batch_axis: int | None,
    out_tree: list[Any],
    actual: list[torch.Tensor] | None,
    *,
    values: bool,
) -> tuple[torch.fx.GraphModule, bool]:
    """The functional graph of ``fn`` and whether it was traced on the ``actual`` inputs.

    Fake tensors first (unless ``values``: the function is known to need its values), with
    autograd as the caller has it, then without it (some modules trace only so); if both fail
    (value-dependent control flow or shapes), the actual values. Functionalization removes
    in-place mutation and aliasing from the graph (:func:`_functional_trace`). Random draws while tracing do not advance
    the caller's generators; oneDNN is off (PyTorch then decomposes LSTMs into operations with
    rules rather than into ``mkldnn_rnn_layer``).
    """
    shapes = [tuple(t.shape) for t in tensors]
    shapes[x_pos] = detection.batch_first_shape(shapes[x_pos], batch_axis)
    strides = [None if is_wrapped(t) else _dense_strides(t.shape, t.stride()) for t in tensors]
    x = tensors[x_pos]
    if not is_wrapped(x):  # the batch-first view's (its batch moved first, or a new axis)
        moved = list(x.stride())
        moved.insert(0, moved.pop(batch_axis) if batch_axis is not None else x.numel())
        strides[x_pos] = _dense_strides(shapes[x_pos], tuple(moved))
    devices = sorted({t.device for t in tensors if t.device.type not in ("cpu", "meta")}, key=str)
    rng_devices = [d.index or 0 for d in devices[:1]]
    device_type = devices[0].type if devices else "cuda"
    errors: list[Exception] = []
    modes: tuple[Literal["fake", "real"], ...] = ("real",) if values else ("fake", "real")
    for mode in modes:
        if mode == "real":
            if actual is None:
                break  # under a torch.func transform the values are not plain data
            inputs = actual
        for grad in (torch.is_grad_enabled(), False):
            out_tree.clear()
            try:
                with (
                    torch.set_grad_enabled(grad),
                    torch.random.fork_rng(rng_devices, device_type=device_type),
                    plain_kernels(),
                    NoFastPaths(),
                    compiled_inlined(),
                    quiet_fake_tensors(),
                ):
                    if mode == "fake":
                        with fake_tensors():
                            inputs = [
                                torch.empty_strided(s, st, dtype=t.dtype, device=t.device)
                                if st is not None
                                else torch.empty(s, dtype=t.dtype, device=t.device)
                                for s, st, t in zip(shapes, strides, tensors, strict=True)
                            ]
                    gm = _functional_trace(fn, inputs, mode)
                drop_effect_tokens(gm)
                check_static(gm)
                return gm, mode == "real"
            except DivjacError:
                raise
            except Exception as err:
                if generator_untraceable(err):
                    raise UnsupportedOperationError(
                        f"the function passes a torch.Generator to an operation, which "
                        f"torch {torch.__version__}'s make_fx cannot trace (torch 2.13 can): "
                        "seed torch's global generator (torch.manual_seed) instead of passing "
                        "generator=, draw the random numbers outside the function and pass "
                        "them in, or upgrade to torch>=2.13."
                    ) from err
                errors.append(err)
    raise errors[-1] if len(errors) > 2 else errors[0]


def _functional_trace(
    fn: Callable[..., Any], inputs: Sequence[torch.Tensor], mode: Literal["fake", "real"]
) -> torch.fx.GraphModule:
    """The functionalized ATen graph of ``fn`` on ``inputs``.

    Functionalization wraps the inputs only: where ``fn`` writes a traced value into a tensor
    computed from captured ones alone (``cosine_similarity`` clamps the norm of a captured
    operand in place with a scalar it builds; ``batch_norm`` updates captured running
    statistics), PyTorch refuses with an internal assert. The graph is then traced without
    functionalization, its tensor constants made inputs, and that graph functionalized; the
    constants go back in, and the writes into them are dropped (detection and the graph's
    evaluations never update the caller's tensors)."""
    calls: list[Decomposed] = []

    def traced(f: Callable[..., Any], *, functional: bool) -> Callable[..., torch.fx.GraphModule]:
        calls.clear()
        return aten_trace(
            f,
            functional=functional,
            mode=mode,
            decompositions={op: _recorded(op, fn, calls) for op, fn in decompositions().items()},
        )

    try:
        gm = traced(fn, functional=True)(*inputs)
        gm.meta[DECOMPOSED] = tuple(calls)
        return gm
    except RuntimeError as err:
        if "mutating a non-functional tensor with a functional tensor" not in str(err):
            raise
        refused = err
    plain = traced(fn, functional=False)(*inputs)
    graph = plain.graph
    constants = [
        node
        for node in graph.nodes
        if node.op == "get_attr" and isinstance(getattr(plain, str(node.target)), torch.Tensor)
    ]
    names = list(dict.fromkeys(str(node.target) for node in constants))
    first = next(node for node in graph.nodes if node.op != "placeholder")
    with graph.inserting_before(first):
        lifted = {name: graph.placeholder(f"_divjac_const_{i}") for i, name in enumerate(names)}
    for node in constants:
        node.replace_all_uses_with(lifted[str(node.target)])
        graph.erase_node(node)
    plain.recompile()
    values = [getattr(plain, name) for name in names]
    try:
        gm = traced(plain, functional=True)(*inputs, *values)
    except RuntimeError:
        raise refused from None
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    consts = placeholders[len(inputs) :]
    for node in list(gm.graph.nodes):  # the writes back into the constants
        if node.target is torch.ops.aten.copy_.default and node.args[0] in consts:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    with gm.graph.inserting_before(placeholders[-1].next):
        for i, (node, value) in enumerate(zip(consts, values, strict=True)):
            name = f"_divjac_const_{i}"
            setattr(gm, name, value)
            const = gm.graph.create_node("get_attr", name)
            const.meta.update(node.meta)
            node.replace_all_uses_with(const)
            gm.graph.erase_node(node)
    gm.recompile()
    gm.meta[DECOMPOSED] = tuple(calls)
    return gm


def _recorded(op: Any, fn: Callable[..., Any], calls: list[Decomposed]) -> Callable[..., Any]:
    """The decomposition ``fn`` of ``op``, recording each call into ``calls`` with the graph
    nodes of its traced arguments (what :attr:`Traced.forward_less` probes: the graph keeps
    no node of a decomposed operation)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if in_aten_trace():
            nodes, named = pytree.tree_map(traced_node, (args, kwargs))
            calls.append(Decomposed(op, tuple(nodes), dict(named), {"val": out}))
        return out

    return run
