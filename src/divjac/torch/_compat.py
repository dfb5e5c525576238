"""Every private or version-dependent PyTorch API divjac uses, and nothing else.

divjac reads PyTorch's internals: ``torch.func``'s interpreter stack, fake and functional
tensors and ``make_fx``'s tracer for its ATen graphs, dynamo's configuration and guards under
``torch.compile``, the decomposition table, ``DistributedDataParallel``'s forward machinery.
They change between releases, so they are reached here only, through small accessors named
after what they give; a branch on the torch version belongs here and nowhere else. A new torch
release means reading this module. ``tests/torch/test_compat_seam.py`` fails if a private torch
name (a ``torch._x`` or ``torch.fx.experimental`` path), or a private attribute of a torch object
(a tensor's ``_version``, an operator's ``_schema``, a module's ``_parameters``), appears in any
other module of divjac.

Run on torch 2.11.0, 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from types import BuiltinMethodType, FrameType, MethodType
from typing import Any, Literal, cast

import torch
import torch.fx
from torch import nn
from torch._ops import HigherOrderOperator, OpOverload
from torch.utils import _pytree as pytree

__all__ = [
    "COMPILES",
    "FAKE_TENSOR_LOGGER",
    "RNN_WEIGHT_CACHE",
    "SPARSE_WARNINGS",
    "BatchNorm",
    "HigherOrderOperator",
    "OpOverload",
    "active_ddp_module",
    "aten_trace",
    "compiled_inlined",
    "compiler_name",
    "custom_operation_applied",
    "ddp_forward",
    "ddp_lacks",
    "decomposition_table",
    "dict_version",
    "differentiates_under_inference_mode",
    "fake_tensors",
    "function_applied",
    "generator_untraceable",
    "has_operator",
    "in_aten_trace",
    "inference_mode_enabled",
    "is_compiled_module",
    "is_generator",
    "is_wrapped",
    "kernel_flags",
    "mark_constant_result",
    "missing_derivative",
    "module_dicts",
    "op_schema",
    "operator_name",
    "original_module",
    "outside_compile_tracing",
    "outside_transforms",
    "pytree",
    "release",
    "set_fast_paths",
    "traced_node",
    "transforms_mode",
    "under_transform",
    "version_counter",
]

FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
"""The logger of torch's fake tensors (which logs the errors they raise at ERROR level)."""

SPARSE_WARNINGS = ("Sparse CSR tensor support is in beta", "Sparse invariant checks are implicitly")
"""The starts of the warnings torch gives, once a process, on building a sparse tensor: CSR is
in beta (2.13 on), the invariants are not checked (2.11, with ``check_invariants=False`` too)."""

BatchNorm = nn.modules.batchnorm._BatchNorm
"""The base class of the batch normalizations (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``)."""


def is_generator(x: Any) -> bool:
    """Whether ``x`` is a ``torch.Generator``. A tensor is ruled out first: torch 2.14 gives
    ``torch.Generator`` a metaclass with an ``__instancecheck__`` of its own, which dynamo
    refuses to run on a tensor (``torch.compile(fullgraph=True)`` of any transform broke)."""
    return not isinstance(x, torch.Tensor) and isinstance(x, torch.Generator)


def set_fast_paths(enabled: bool) -> bool:
    """Switch the fused fast paths of ``nn.MultiheadAttention`` and
    ``nn.TransformerEncoderLayer`` on or off; returns the previous setting. The flag of
    ``torch.backends.mha`` is written directly: dynamo traces that store (and the read in the
    layers' ``forward``), not ``torch.backends.mha.set_fastpath_enabled``."""
    before = bool(torch.backends.mha._is_fastpath_enabled)
    torch.backends.mha._is_fastpath_enabled = enabled
    return before


# --- private attributes of torch's objects ------------------------------------------------------


def version_counter(t: torch.Tensor) -> int:
    """The version counter of ``t``, which every in-place write to it (or to a view of it)
    bumps (none on an inference tensor: see ``t.is_inference()``)."""
    return int(t._version)


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The schema of the ATen overload ``op``: its name (``"aten::add"``, no overload), its
    arguments, its returns and their aliasing, whether it mutates."""
    return op._schema


def operator_name(op: Any) -> str | None:
    """The qualified name (``"mylib::myop"``) of an operator packet (``torch.ops.mylib.myop``)
    or of what ``torch.library.custom_op`` returns, else ``None``."""
    name = getattr(op, "_qualified_op_name", None) or getattr(op, "_qualname", None)
    return name if isinstance(name, str) else None


module_dicts: Callable[[dict[str, Any]], tuple[dict[Any, Any], ...]] = operator.itemgetter(
    "_parameters", "_buffers", "_modules", "_forward_pre_hooks", "_forward_hooks"
)
"""From an ``nn.Module``'s ``vars``, its own dicts (by name) of parameters, buffers, submodules,
forward pre-hooks and forward hooks, in that order (one C call: a cache check reads them for
every module)."""

RNN_WEIGHT_CACHE = frozenset({"_flat_weights", "_flat_weight_refs"})
"""The attributes in which a recurrent layer (``nn.RNNBase``) caches its weights, which its
``forward`` refreshes from its parameters."""


# --- torch.func --------------------------------------------------------------------------------


def is_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` wrapper (its values are not plain data)."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def under_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ...) is active."""
    return torch._C._functorch.peek_interpreter_stack() is not None


@contextlib.contextmanager
def outside_transforms() -> Iterator[None]:
    """Leave any active ``torch.func`` transforms for a while (tracing works on plain tensors)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    with temporarily_clear_interpreter_stack():
        yield


@functools.cache
def differentiates_under_inference_mode() -> bool:
    """Whether ``torch.func`` differentiates under ``torch.inference_mode`` (torch 2.13 on);
    torch 2.11's gives zeros there, silently (and its ``vmap`` of a ``jvp`` raises)."""
    with torch.inference_mode():
        one = torch.ones(())
        return bool(torch.func.jvp(lambda t: 2 * t, (one,), (one,))[1] == 2)


_LEFT_INFERENCE_MODE = contextvars.ContextVar("left_inference_mode", default=False)


@contextlib.contextmanager
def transforms_mode() -> Iterator[None]:
    """Where divjac's ``torch.func`` transforms run: where the caller is, except under
    ``torch.inference_mode`` on a torch whose ``torch.func`` differentiates nothing there
    (2.11): outside it, without gradients, the results of ``torch.no_grad()``
    (:func:`inference_mode_enabled` stays true)."""
    if (
        torch.compiler.is_compiling()  # (no inference mode there; dynamo cannot ask)
        or not torch.is_inference_mode_enabled()
        or differentiates_under_inference_mode()  # (asked once, where first needed)
    ):
        yield
        return
    token = _LEFT_INFERENCE_MODE.set(True)
    try:
        with torch.inference_mode(mode=False), torch.no_grad():
            yield
    finally:
        _LEFT_INFERENCE_MODE.reset(token)


def inference_mode_enabled() -> bool:
    """Whether the caller runs under ``torch.inference_mode`` (which :func:`transforms_mode`
    may have left: no autograd tape records the inference tensors made there)."""
    return torch.is_inference_mode_enabled() or _LEFT_INFERENCE_MODE.get()


# --- ATen graphs ---------------------------------------------------------------------------------


def decomposition_table() -> Mapping[Any, Callable[..., Any]]:
    """PyTorch's decompositions of ATen operations, by overload."""
    from torch._decomp import decomposition_table as table

    return table


def has_operator(name: str) -> bool:
    """Whether torch has an operator of the qualified ``name`` (``"aten::sin"``)."""
    return bool(torch._C._jit_get_schemas_for_operator(name))


def fake_tensors() -> contextlib.AbstractContextManager[Any]:
    """A mode in which new tensors are fake (no memory, no compute); real ones may be mixed in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def aten_trace(
    fn: Callable[..., Any],
    *,
    functional: bool,
    mode: Literal["fake", "real"],
    decompositions: Mapping[Any, Callable[..., Any]],
) -> Callable[..., torch.fx.GraphModule]:
    """``make_fx`` of ``fn`` (functionalized with ``functional``), tracing on fake or real
    tensors: inputs need not be fake, and an operation that depends on data (``.item()``) is
    traced on its value rather than refused."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(
        dispatch_functionalize(fn, FunctionalTensorMode(_allow_token_discovery=True))
        if functional
        else fn,
        tracing_mode=mode,
        decomposition_table=dict(decompositions),
        _allow_non_fake_inputs=True,
        _error_on_data_dependent_ops=False,
    )


def generator_untraceable(err: BaseException) -> bool:
    """Whether ``err`` is ``make_fx``'s refusal of an operation passed a ``torch.Generator``
    (torch 2.11's fx takes no generator as an argument of a node; 2.13's does)."""
    return isinstance(err, NotImplementedError) and str(err).startswith(
        "argument of type: <class 'torch._C.Generator'>"
    )


# Operations torch differentiates from a release on: (release, upstream reference, the
# operations that compute the same and that earlier torches differentiate).
_DERIVATIVES_FROM = {
    "aten::aminmax": ((2, 13), "pytorch/pytorch#148808", "torch.amin and torch.amax"),
}


def missing_derivative(err: BaseException) -> tuple[str, str] | None:
    """``(operation, the way out)`` where ``err`` is torch's refusal to differentiate an
    operation it has no derivative of (``"derivative for aten::aminmax is not implemented"``:
    ``aminmax`` before torch 2.13), else ``None``. The way out names, where known, operations
    this torch differentiates and the torch from which it differentiates the operation."""
    match = re.fullmatch(r"derivative for (\S+) is not implemented", str(err))
    if match is None:
        return None
    op = match[1]
    known = _DERIVATIVES_FROM.get(op)
    if known is None or release() >= known[0]:
        return op, "write the function with operations torch differentiates"
    (major, minor), reference, instead = known
    return op, (
        f"use {instead}, which it differentiates, or torch>={major}.{minor}, which "
        f"differentiates {op} ({reference})"
    )


def in_aten_trace() -> bool:
    """Whether a ``make_fx`` trace is under way."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def traced_node(a: Any) -> Any:
    """The graph node of the tensor ``a`` in the ``make_fx`` trace under way, else ``a``."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None or not isinstance(a, torch.Tensor):
        return a
    slot = get_proxy_slot(a, mode.tracer, None)
    return a if slot is None else slot.proxy.node


Flag = tuple[Callable[[], bool], Callable[[bool], None]]


def kernel_flags(*, cudnn: bool) -> list[Flag]:
    """The getter and setter of oneDNN's global switch, and of cuDNN's with ``cudnn`` (these
    flags alone: ``torch.backends.*.flags`` also reset others)."""
    flags: list[Flag] = [(torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled)]
    if cudnn:
        flags.append((torch._C._get_cudnn_enabled, torch._C._set_cudnn_enabled))
    return flags


def function_applied(frame: FrameType) -> type[torch.autograd.Function] | None:
    """The ``autograd.Function`` that a frame of a traceback applies, else ``None``: the frame
    of ``Function.apply`` itself (torch 2.13: written in Python, the class is its ``cls``), or
    a frame holding a bound ``apply`` of one (torch 2.14's ``apply`` is in C++, with no frame
    of its own: found where the function it was passed as is held)."""
    names = frame.f_locals
    if frame.f_code.co_name == "apply" and _is_function_class(names.get("cls")):
        return cast(type[torch.autograd.Function], names["cls"])
    for value in names.values():
        if isinstance(value, BuiltinMethodType | MethodType) and value.__name__ == "apply":
            owner = value.__self__
            if _is_function_class(owner):
                return cast(type[torch.autograd.Function], owner)
    return None


def custom_operation_applied(frame: FrameType) -> OpOverload | None:
    """The custom operation (not ATen's, not a primitive) whose autograd, generated by
    ``torch.library``, a frame of a traceback runs, else ``None``: the frame of the autograd
    kernel holds it as ``op`` (torch 2.13 on); torch 2.11's holds none, and it is found in the
    closure of the ``forward`` of the ``autograd.Function`` the frame applies."""
    candidates = [frame.f_locals.get("op")]
    cls = function_applied(frame)
    forward = getattr(cls, "forward", None)
    for cell in getattr(forward, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # (an empty cell)
            candidates.append(cell.cell_contents)
    for op in candidates:
        if isinstance(op, OpOverload) and op.namespace not in ("aten", "prims"):
            return op
    return None


def _is_function_class(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, torch.autograd.Function)


# --- torch.compile -------------------------------------------------------------------------------


def mark_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` marked as ``torch._dynamo.assume_constant_result`` marks it (dynamo evaluates its
    calls as constants), without importing dynamo (a large import) with divjac."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def outside_compile_tracing() -> contextlib.AbstractContextManager[Any]:
    """Outside dynamo's tracing context (tensors made inside are not dynamo's fakes)."""
    return torch._guards.tracing(None)


@contextlib.contextmanager
def compiled_inlined() -> Iterator[None]:
    """``torch.compile``'d modules and functions traced through their own code by ``make_fx``
    (dynamo refuses a symbolic trace of them by default; loaded only when the caller has),
    without dynamo's notice about global module hooks (the trace's own, removed after it)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        yield
        return
    with dynamo.config.patch(error_on_nested_fx_trace=False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Using `torch.compile\\(module\\)` when there are global")
        yield


def is_compiled_module(fun: Any) -> bool:
    """Whether ``fun`` is a ``torch.compile``d module (an ``OptimizedModule``)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # none before torch.compile
    return eval_frame is not None and isinstance(fun, eval_frame.OptimizedModule)


def original_module(compiled: Any) -> Any:
    """The module a ``torch.compile``d module compiles."""
    return compiled._orig_mod


dict_version: Any  # Callable[[dict], int] | None
"""The version tag CPython gives every state of a dict (read by ``torch.compile``'s guards);
``None`` where this torch does not expose it."""
try:
    from torch._C._dynamo import guards as _guards

    dict_version = _guards.dict_version
except (ImportError, AttributeError):  # pragma: no cover - no fast checks: the walk every call
    dict_version = None


# --- DistributedDataParallel ---------------------------------------------------------------------

_DDP_MACHINERY = ("_pre_forward", "_post_forward", "_inside_ddp_forward", "_use_python_reducer")


def ddp_lacks(ddp: Any) -> list[str]:
    """The parts of a ``DistributedDataParallel`` wrapper's forward that :func:`ddp_forward`
    needs and this torch's wrapper lacks."""
    return [name for name in _DDP_MACHINERY if not hasattr(ddp, name)]


def ddp_forward(ddp: Any) -> tuple[Callable[..., Any], Callable[[], Any], Callable[[Any], Any]]:
    """The parts of a ``DistributedDataParallel`` wrapper's forward around its module's: the
    step before (taking and returning ``(args, kwargs)``), the context the module runs in and
    the step after (taking and returning the output); see :func:`ddp_lacks`."""

    def inside() -> Any:
        return contextlib.nullcontext() if ddp._use_python_reducer else ddp._inside_ddp_forward()

    return ddp._pre_forward, inside, ddp._post_forward


def active_ddp_module() -> Any:
    """The ``DistributedDataParallel`` wrapper whose forward is running, else ``None``."""
    return nn.parallel.DistributedDataParallel._active_ddp_module


def release() -> tuple[int, int]:
    """torch's ``(major, minor)`` release."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


COMPILES = release() >= (2, 13)
"""Whether divjac's transforms run under ``torch.compile``: from torch 2.13 on. 2.11's dynamo
falls short four times on the way (``tests/torch/test_compile.py`` checks each, on every torch):
``assume_constant_result``, which evaluates divjac's setup ahead of the trace
(:mod:`divjac.torch._compile_setup`), takes no module or other object as an argument
(pytorch/pytorch#173103); a truth test of a dict or set read off its result fails (a guard on a
constant); a method of a frozen dataclass made in the compiled region (divjac's plans, rebuilt
there), called inside ``torch.func.vmap``, finds none of its fields (pytorch/pytorch#173221); and
builtin ``locals()`` (which divjac's public functions read) is not traced, so no transform can be
made there. (A ``torch.Generator`` passed to an operation is refused apart, compiled or not:
:func:`generator_untraceable`.)"""


def compiler_name() -> str | None:
    """The name of the backend dynamo is tracing for (``None`` where it cannot be read)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        compiler: Any = InstructionTranslator.current_tx().output.compiler_fn
    except Exception:  # not tracing, or dynamo's internals moved
        return None
    compiler = getattr(compiler, "_torchdynamo_orig_backend", compiler)
    return getattr(compiler, "compiler_name", None)
