"""Reading ATen graphs for sparsity detection: operation names, arguments, fake values."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.fx

__all__ = ["bind", "dims", "expand", "host", "inexact", "is_tensor", "outputs", "packet", "shape"]


def packet(target: Any) -> str:
    """The operation's name without namespace and overload (``"add"`` for ``aten.add.Tensor``)."""
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return str(packet.__name__)
    return str(getattr(target, "__name__", target))


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
    schema = node.target._schema  # type: ignore[union-attr]
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


def dims(value: Any, ndim: int) -> list[int]:
    """Reduction axes: ``None`` or an empty list mean all axes."""
    if value is None:
        return list(range(ndim))
    if isinstance(value, int):
        return [value % max(ndim, 1)]
    axes = [int(v) % max(ndim, 1) for v in value]
    return axes if axes else list(range(ndim))


def host(value: Any) -> np.ndarray | None:
    """A NumPy copy of a tensor value (``None`` for anything else)."""
    if not is_tensor(value):
        return None
    return value.detach().cpu().resolve_conj().resolve_neg().numpy()
