"""Reading ATen graphs for sparsity detection: operation names, arguments, fake values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx

from ._compat import OpOverload, op_schema, pytree

__all__ = [
    "Decomposed",
    "bind",
    "dim",
    "dims",
    "expand",
    "forward_derivative_inexact",
    "forward_derivative_wrong",
    "host",
    "inexact",
    "is_tensor",
    "lacks_forward_derivative",
    "located",
    "outputs",
    "packet",
    "shape",
    "storage_positions",
]


def packet(target: Any) -> str:
    """The operation's name without namespace and overload (``"add"`` for ``aten.add.Tensor``)."""
    if isinstance(target, OpOverload):
        return str(target.overloadpacket.__name__)
    return str(getattr(target, "__name__", target))


def forward_derivative_wrong(target: Any) -> bool:
    """Whether PyTorch's forward derivative of the operation is right but its own derivative
    is not: the linear-algebra kernels (torch 2.13: the solve, determinant, log-determinant,
    eigen- and Householder kernels treat their saved factorizations as constants, so ``jvp``
    of ``jvp`` and the backward of ``jvp`` are wrong; tests/torch/test_taylor.py sweeps
    ``torch.linalg`` against Hessians). The second-order sweep differentiates them through
    their backward formulas; first-order passes that a gradient flows through are rows."""
    name = packet(target)
    return name.startswith(("linalg_", "_linalg_")) or name in _LINALG


def forward_derivative_inexact(target: Any) -> bool:
    """Whether PyTorch's forward derivative of the operation loses accuracy that its backward
    keeps (torch 2.13: ``logcumsumexp``'s normalizes by the maximum of the whole axis and adds
    ``1e-13`` to the denominator, off by ~1e-6 on the entries before a large one): Hessian
    rows through it are pulled, and the second-order sweep has its own rule."""
    return packet(target) in ("logcumsumexp",)


# The linear-algebra operations outside the linalg_ names (torch.cholesky_solve, ...).
_LINALG = frozenset(
    {"cholesky_solve", "cholesky_inverse", "triangular_solve", "lu_solve", "geqrf", "ormqr",
     "logdet", "det", "slogdet", "inverse", "lu_unpack"}
)  # fmt: skip


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def inexact(value: Any) -> bool:
    return is_tensor(value) and (value.dtype.is_floating_point or value.dtype.is_complex)


def shape(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in value.shape)


def outputs(node: torch.fx.Node) -> list[Any]:
    """The fake values of a node's outputs (one list entry per output)."""
    val = node.meta.get("val")
    return list(val) if isinstance(val, tuple | list) else [val]


def bind(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = op_schema(node.target)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def expand(value: Any, n: int) -> list[int]:
    """An int or int list broadcast to ``n`` entries (PyTorch accepts a single value)."""
    if value is None:
        return [0] * n
    values = [int(value)] if isinstance(value, int) else [int(v) for v in value]
    if not values:
        return []
    return values * n if len(values) == 1 else values


def dim(value: Any, ndim: int) -> int:
    """An axis as PyTorch reads it: negative ones from the end, and a 0-d tensor has the axis
    ``0`` (or ``-1``), of length one."""
    return int(value) % max(ndim, 1)


def dims(value: Any, ndim: int) -> list[int]:
    """Reduction axes: ``None`` or an empty list mean all axes."""
    if value is None:
        return list(range(ndim))
    if isinstance(value, int):
        return [dim(value, ndim)]
    axes = [dim(v, ndim) for v in value]
    return axes if axes else list(range(ndim))


def host(value: Any) -> np.ndarray | None:
    """A NumPy copy of a tensor value (``None`` for anything else)."""
    if not is_tensor(value):
        return None
    return value.detach().cpu().resolve_conj().resolve_neg().numpy()


@dataclass(frozen=True)
class Decomposed:
    """A call of an operation that the trace decomposed (its graph has the decomposition's
    nodes in its place), as a graph node reads: its arguments are graph nodes where they are
    traced tensors; ``meta["val"]`` holds its fake outputs."""

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def all_input_nodes(self) -> list[torch.fx.Node]:
        found = pytree.tree_leaves((self.args, self.kwargs))
        return list(dict.fromkeys(a for a in found if isinstance(a, torch.fx.Node)))


# Per ATen operation: whether PyTorch has a forward derivative for it (probed once).
_FORWARD: dict[Any, bool] = {}


def lacks_forward_derivative(node: Any, live: set[Any]) -> bool:
    """Whether the operation of a graph node has no forward derivative in PyTorch for its
    ``live`` arguments (those that depend on the differentiated input), as running it once on
    meta tensors (no data, no compute) with those as dual numbers that require gradients tells
    (once per operation): it raises that forward AD is not supported, or it has a backward
    formula (an output with a ``grad_fn``) but gives none of its floating outputs a tangent
    (``scatter_reduce`` with ``reduce="prod"``, torch 2.13, drops it silently). An operation
    that cannot run so (no meta kernel) counts as having one. ``node`` is a graph node or a
    :class:`Decomposed` call."""
    import torch.autograd.forward_ad as fwAD

    target = node.target
    if (
        not isinstance(target, OpOverload)
        or torch.Tag.nondeterministic_seeded in target.tags  # draws: no derivative to push
        or not any(inexact(v) for v in outputs(node))
    ):
        return False
    # The options too: scatter_reduce's tangent is dropped for reduce="prod" only.
    options = tuple(
        a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, (str, bool))
    )
    key = (target, tuple(a in live for a in node.all_input_nodes), options)
    found = _FORWARD.get(key)
    if found is not None:
        return not found

    def meta(a: Any) -> Any:
        val = a.meta.get("val") if hasattr(a, "meta") else a
        if not isinstance(val, torch.Tensor):
            return val
        t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        if not (inexact(val) and a in live):
            return t
        return fwAD.make_dual(t.requires_grad_(), torch.empty_like(t))

    missing = False
    with torch.inference_mode(mode=False), torch.enable_grad(), fwAD.dual_level():
        try:
            args, kwargs = pytree.tree_map(meta, (node.args, node.kwargs))
            out = [o for o in pytree.tree_leaves(target(*args, **kwargs)) if inexact(o)]
            missing = any(o.grad_fn is not None for o in out) and all(
                fwAD.unpack_dual(o).tangent is None for o in out
            )
        except NotImplementedError as err:  # (an autograd.Function: "forward mode AD")
            missing = "forward AD" in str(err) or "forward mode AD" in str(err)
        except Exception:
            pass
    _FORWARD[key] = not missing
    return missing


def storage_positions(
    t: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int
) -> torch.Tensor:
    """The storage position of every element of the view ``(size, stride, offset)`` (shaped
    ``size``)."""
    pos = torch.tensor(offset, device=t.device)
    for n, step in zip(size, stride, strict=True):
        pos = pos.unsqueeze(-1) + torch.arange(n, device=t.device) * step
    return pos


def located(positions: torch.Tensor, within: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every entry of ``positions``, the flat index of an element of the view whose
    storage positions are ``within``, and whether one is there (each shaped as ``positions``)."""
    flat = within.reshape(-1)
    if not flat.numel():
        return torch.zeros_like(positions), torch.zeros_like(positions, dtype=torch.bool)
    order = torch.argsort(flat, stable=True)
    ordered = flat[order]
    at = torch.searchsorted(ordered, positions.reshape(-1)).clamp(max=flat.numel() - 1)
    return order[at].reshape(positions.shape), (ordered[at] == positions.reshape(-1)).reshape(
        positions.shape
    )
