"""The constants of a traced ATen graph: which detection may read, which are weights to drop,
and the clean-ups of the graph that tracing needs (effect tokens, static shapes)."""

from __future__ import annotations

import weakref

import torch
import torch.fx

from ._compat import OpOverload, op_schema, pytree
from ._trace_keys import Reached

__all__ = [
    "captured_floats",
    "check_static",
    "drop_constants",
    "drop_effect_tokens",
    "readable_constants",
]


def drop_effect_tokens(gm: torch.fx.GraphModule) -> None:
    """Remove the effect tokens functionalization threads through side-effect-only operations
    (``_linalg_check_errors``): they return nothing, and their token is a graph input."""
    effects = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.higher_order.with_effects
    ]
    if not effects:
        return
    for node in reversed(effects):
        for use in list(node.users):
            if use.args[1] == 0:  # the new token: the one it was given
                use.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(use)
        gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):
        if node.op == "placeholder" and not node.users and "token" in node.name:
            gm.graph.erase_node(node)
    gm.recompile()


def _mutated_constants(gm: torch.fx.GraphModule) -> set[str]:
    """The constants (``get_attr`` targets) the graph writes to, directly or through a view."""
    roots: dict[torch.fx.Node, str] = {}
    written: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            roots[node] = str(node.target)
        elif node.op == "call_function" and isinstance(node.target, OpOverload):
            schema = op_schema(node.target)
            views = any(r.alias_info is not None for r in schema.returns)
            bound = zip(schema.arguments, node.args, strict=False)
            named = ((a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs)
            for arg, value in (*bound, *named):
                if not isinstance(value, torch.fx.Node) or value not in roots:
                    continue
                if arg.alias_info is not None and arg.alias_info.is_write:
                    written.add(roots[value])
                elif arg.alias_info is not None and views:
                    roots[node] = roots[value]
    return written


def readable_constants(
    gm: torch.fx.GraphModule, reached: Reached
) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    """The constants detection may read, and those that are the caller's own tensors.

    Readable: the literals of the program (``torch.tensor([...])``: only lifted), and captured
    integer and boolean tensors that are the very objects the cache key identifies, with a
    version counter, that the graph does not modify. Never floating-point captured tensors,
    nor a constant the key does not identify (a copy, a tensor reached some other way).
    """
    lifted = {torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default}
    uses: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            uses.setdefault(str(node.target), []).extend(node.users)
    written = _mutated_constants(gm)
    readable: dict[str, torch.Tensor] = {}
    versioned: set[str] = set()
    for name, users in uses.items():
        const = getattr(gm, name, None)
        if not isinstance(const, torch.Tensor) or name in written:
            continue
        if reached.tensors.get(id(const)) is const:
            if const.is_floating_point() or const.is_complex() or const.is_inference():
                continue
            readable[name] = const
            versioned.add(name)
        elif users and all(u.target in lifted for u in users):
            readable[name] = const
    return readable, frozenset(versioned)


def captured_floats(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """The floating-point tensors (not fake, not meta) that the graph holds as constants."""
    found = {}
    for node in gm.graph.nodes:
        const = getattr(gm, str(node.target), None) if node.op == "get_attr" else None
        if (
            isinstance(const, torch.Tensor)
            and (const.is_floating_point() or const.is_complex())
            and const.device.type != "meta"
        ):
            found[id(const)] = const
    return list(found.values())


def drop_constants(
    gm: torch.fx.GraphModule, keep: dict[str, torch.Tensor]
) -> dict[str, weakref.ref[torch.Tensor]]:
    """Replace the constants detection does not read by meta tensors: the cache must not keep
    a model's weights alive. Returns weak references to the tensors replaced, by name (the
    second-order engine runs the graph on them)."""
    dropped: dict[str, weakref.ref[torch.Tensor]] = {}
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op != "get_attr" or name in keep:
            continue
        const = getattr(gm, name, None)
        if isinstance(const, torch.Tensor) and const.device.type != "meta":
            dropped[name] = weakref.ref(const)
            delattr(gm, name)
            setattr(gm, name, torch.empty(const.shape, dtype=const.dtype, device="meta"))
    return dropped


class DataDependentShape(Exception):
    """A graph has a data-dependent (symbolic) shape; the tracer tries the next mode."""


def check_static(gm: torch.fx.GraphModule) -> None:
    """Refuse graphs with data-dependent (symbolic) shapes; they are traced on values instead."""
    for node in gm.graph.nodes:
        for v in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.SymInt) or (
                isinstance(v, torch.Tensor) and not all(isinstance(s, int) for s in v.shape)
            ):
                raise DataDependentShape(node.format_node())
