"""The rules of the second-order sweep of :mod:`divjac.torch._taylor.sweep` for operations that move,
take, join or pad elements (:data:`_RULES`): linear in the value, they apply to the first- and
second-order terms as to the value, one axis further (the directions' axis first). Terms of
size one along an axis (constant along it: directions shared by the samples) stay so where the
operation keeps that axis constant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx

from ..._errors import OptionError
from .._aten import dims, located, storage_positions
from .._kernels import without_overlap
from .generic import generic
from .jets import Jet, Rule, Sweep, _full, _map, folded, lift, registrar

__all__: list[str] = []

Tensor = torch.Tensor
aten = torch.ops.aten


_RULES: dict[Any, Rule] = {}
_rule = registrar(_RULES)


@_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
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
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    dims = [0, *(int(d) % max(x.ndim, 1) + 1 for d in args[1])]
    return y, _map(a, lambda t: lift(t, x.ndim).permute(dims))


@_rule(aten.t.default, aten.transpose.int)
def _transpose_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if x.ndim < 2:
        return y, a
    d0, d1 = (0, 1) if node.target is aten.t.default else (int(args[1]), int(args[2]))
    d0, d1 = d0 % x.ndim + 1, d1 % x.ndim + 1
    return y, _map(a, lambda t: lift(t, x.ndim).transpose(d0, d1))


@_rule(aten.expand.default)
def _expand_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    return y, _map(a, lambda t: lift(t, y.ndim))


@_rule(aten.unsqueeze.default)
def _unsqueeze_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    d = int(args[1]) % (x.ndim + 1) + 1
    return y, _map(a, lambda t: lift(t, x.ndim).unsqueeze(d))


@_rule(aten.select.int, aten.slice.Tensor)
def _along_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Elements taken along one axis (``u(x)[..., 0]``, ``h[:, 1:3]``): the same taken from
    each direction's terms, one axis further. Terms broadcast along that axis (size one) are
    constant there: taken as they are (``select``: their one element)."""
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if x.ndim == 0:
        return y, a
    dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.ndim
    rest = {k: v for k, v in kwargs.items() if k != "dim"}

    def take(t: Tensor) -> Tensor:
        t = lift(t, x.ndim)
        if t.shape[dim + 1] == x.shape[dim]:
            return node.target(t, dim + 1, *args[2:], **rest)  # type: ignore[operator]
        return t.select(dim + 1, 0) if node.target is aten.select.int else t

    return y, _map(a, take)


@_rule(aten.squeeze.dim, aten.squeeze.dims)
def _squeeze_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """The axes of one removed from each direction's terms too (one axis further)."""
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    dims = args[1] if isinstance(args[1], list | tuple) else [args[1]]
    gone = [int(d) % x.ndim + 1 for d in dims if x.ndim and x.shape[int(d)] == 1]
    return y, _map(a, lambda t: lift(t, x.ndim).squeeze(gone))


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
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
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
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    # The input's values, those its strided view reads replaced by src's: the terms likewise,
    # by the storage positions of the output (laid out as the input, or contiguous where the
    # input's elements share memory, as torch's clone_preserve_strides).
    x, src = args[0], args[1]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    out = without_overlap(x)
    index, written = located(
        storage_positions(x, out.shape, out.stride(), int(out.storage_offset())),
        storage_positions(x, *_strided_view(args, kwargs, 2)),
    )
    n = y.ndim

    def scatter(self_terms: Tensor | None, src_terms: Tensor | None) -> Tensor | None:
        if self_terms is None and src_terms is None:
            return None
        kept = 0 if self_terms is None else lift(self_terms, n)
        put = 0 if src_terms is None else _gathered(src_terms, src.shape, index)
        return torch.where(written, put, kept).expand(-1, *y.shape)

    first = scatter(None if a is None else a.first, None if b is None else b.first)
    second = scatter(None if a is None else a.second, None if b is None else b.second)
    return y, Jet(first, second)  # type: ignore[arg-type]


def _joined(terms: Sequence[Tensor | None], shapes: Sequence[Sequence[int]], axis: int) -> Any:
    """The terms of values of ``shapes`` joined along ``axis`` of the terms (``None``: zero
    terms), each broadcast to its value's shape except along axes (other than ``axis``) where
    all of them are constant; ``None`` where all are zero."""
    found = [t for t in terms if t is not None]
    if not found:
        return None
    n = len(shapes[0])
    lifted = [None if t is None else lift(t, n) for t in terms]
    constant = [
        i != axis - 1 and all(t is None or t.shape[i + 1] == 1 for t in lifted) for i in range(n)
    ]
    parts = []
    for t, shape in zip(lifted, shapes, strict=True):
        size = [1 if c else s for c, s in zip(constant, shape, strict=True)]
        parts.append(
            found[0].new_zeros((found[0].shape[0], *size)) if t is None else t.expand(-1, *size)
        )
    return torch.cat(parts, axis)


def _joined_jet(jets: Sequence[Jet | None], shapes: Sequence[Sequence[int]], axis: int) -> Any:
    first = _joined([None if j is None else j.first for j in jets], shapes, axis)
    second = _joined([None if j is None else j.second for j in jets], shapes, axis)
    return Jet(first, second)


@_rule(aten.cat.default)
def _cat_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % y.ndim
    # torch skips empty one-axis tensors beside values of more axes (legacy concatenation)
    kept = [
        (n, x)
        for n, x in zip(cast(list[torch.fx.Node], node.args[0]), args[0], strict=True)
        if x.ndim == y.ndim
    ]
    jets = [sw.jet(n) for n, _ in kept]
    return y, _joined_jet(jets, [tuple(x.shape) for _, x in kept], dim + 1)


@_rule(aten.stack.default)
def _stack_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % y.ndim
    shape = tuple(args[0][0].shape)  # the same for all

    def stood(t: Tensor) -> Tensor:
        return lift(t, len(shape)).unsqueeze(dim + 1)

    jets = [None if (j := sw.jet(n)) is None else _map(j, stood) for n in node.args[0]]  # type: ignore[union-attr]
    shapes = [(*shape[:dim], 1, *shape[dim:])] * len(jets)
    return y, _joined_jet(jets, shapes, dim + 1)


@_rule(aten.where.self)
def _where_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Each element's terms from the operand the condition picks (zero: a constant's)."""
    cond = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a, b = sw.jet(node.args[1]), sw.jet(node.args[2])
    return y, _paired(a, b, y.ndim, lambda ta, tb: torch.where(cond, ta, tb).to(y.dtype))


def _paired(a: Jet | None, b: Jet | None, n: int, combine: Callable[[Any, Any], Tensor]) -> Jet:
    """The jet of an element-wise choice between two operands of ``n`` axes (at least one
    dependent): ``combine`` of their terms, order by order (a constant's: ``0.0``)."""

    def part(ta: Tensor | None, tb: Tensor | None) -> Tensor | None:
        if ta is None and tb is None:
            return None
        return combine(0.0 if ta is None else lift(ta, n), 0.0 if tb is None else lift(tb, n))

    first = part(None if a is None else a.first, None if b is None else b.first)
    second = part(None if a is None else a.second, None if b is None else b.second)
    return Jet(first, second)  # type: ignore[arg-type]


@_rule(aten.masked_fill.Scalar)
def _masked_fill_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """The value where the mask is set (a constant): zero terms there."""
    x, mask = args[0], args[1]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    return y, _map(a, lambda t: lift(t, x.ndim).masked_fill(mask, 0))


@_rule(aten.flip.default)
def _flip_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if x.ndim == 0:
        return y, a
    axes = [int(d) % x.ndim + 1 for d in args[1]]
    return y, _map(a, lambda t: lift(t, x.ndim).flip(axes))


@_rule(aten.roll.default)
def _roll_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    shifts = args[1]
    axes = args[2] if len(args) > 2 else kwargs.get("dims", [])
    if x.ndim == 0:
        return y, a
    if not axes:  # rolled as flattened

        def flat(t: Tensor) -> Tensor:
            t = _full(t, x.shape)
            return t.reshape(t.shape[0], -1).roll(shifts, 1).reshape(t.shape)

        return y, _map(a, flat)
    moved = [int(d) % x.ndim + 1 for d in axes]
    return y, _map(a, lambda t: lift(t, x.ndim).roll(shifts, moved))


@_rule(aten.repeat.default)
def _repeat_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """Tiled: terms constant along an axis (and along the new leading axes) stay of size one."""
    x, repeats = args[0], [int(r) for r in args[1]]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    extra = len(repeats) - x.ndim

    def tile(t: Tensor) -> Tensor:
        t = lift(t, x.ndim)
        t = t.reshape(t.shape[0], *([1] * extra), *t.shape[1:])
        return t.repeat(1, *(r if s > 1 else 1 for r, s in zip(repeats, t.shape[1:], strict=True)))

    return y, _map(a, tile)


@_rule(aten.index_select.default, aten.gather.default)
def _select_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """Elements taken by an index along one axis (``index_select``: whole slices, terms
    constant along the axis kept as they are; ``gather``: one element per position)."""
    x, index = args[0], args[2]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if x.ndim == 0:
        return y, _map(a, lambda t: t.reshape(t.shape[0], *y.shape))
    axis = int(args[1]) % x.ndim + 1

    def take(t: Tensor) -> Tensor:
        t = lift(t, x.ndim)
        if node.target is aten.gather.default:
            t = t.expand(-1, *x.shape)
            return t.gather(axis, index.expand(t.shape[0], *index.shape))
        return t if t.shape[axis] == 1 else t.index_select(axis, index)

    return y, _map(a, take)


@_rule(aten.index.Tensor, aten._unsafe_index.Tensor)
def _index_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Advanced indexing (``h[:, idx]``, ``h[mask]``): the same indices one axis further.
    Indices apart from each other move their axes first (torch's rule): pushed generically."""
    x, indices = args[0], list(args[1])
    at = [i for i, ix in enumerate(indices) if ix is not None]
    if at != list(range(at[0], at[-1] + 1)):
        return generic(sw, node, args, kwargs)
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    # the axes the indices cover (a boolean mask covers as many as it has)
    axis, covered = 0, list[int]()
    for ix in indices:
        span = ix.ndim if ix is not None and ix.dtype == torch.bool else 1
        if ix is not None:
            covered += range(axis, axis + span)
        axis += span
    key = (slice(None), *(slice(None) if ix is None else ix for ix in indices))

    def take(t: Tensor) -> Tensor:
        t = lift(t, x.ndim)
        shape = [x.shape[i] if i in covered else t.shape[i + 1] for i in range(x.ndim)]
        return t.expand(-1, *shape)[key]

    return y, _map(a, take)


@_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def _split_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Parts of the value along one axis: the parts of the terms (terms constant along it: the
    same for each part)."""
    x = args[0]
    unbind = node.target is aten.unbind.int
    at = 1 if unbind else 2
    dim = int(args[at] if len(args) > at else kwargs.get("dim", 0)) % max(x.ndim, 1)
    outs = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])

    def parts(t: Tensor | None) -> list[Tensor | None]:
        if t is None:
            return [None] * len(outs)
        t = lift(t, x.ndim)
        if t.shape[dim + 1] == 1 and x.shape[dim] != 1:
            return [t.select(dim + 1, 0) if unbind else t] * len(outs)
        if unbind:
            return list(t.unbind(dim + 1))
        return list(torch.split(t, args[1], dim + 1))

    firsts, seconds = parts(a.first), parts(a.second)
    return outs, [Jet(f, s) for f, s in zip(firsts, seconds, strict=True)]  # type: ignore[arg-type]


@_rule(aten.constant_pad_nd.default)
def _pad_rule(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Padded with a constant: zero terms in the padding."""
    x, pad = args[0], [int(p) for p in args[1]]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    padded = range(x.ndim - len(pad) // 2, x.ndim)

    def fill(t: Tensor) -> Tensor:
        t = lift(t, x.ndim)
        shape = [x.shape[i] if i in padded else t.shape[i + 1] for i in range(x.ndim)]
        return torch.constant_pad_nd(t.expand(-1, *shape), pad, 0.0)

    return y, _map(a, fill)


@_rule(
    aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
    aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default,
    aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default,
    aten.replication_pad1d.default, aten.replication_pad2d.default,
    aten.replication_pad3d.default, aten.upsample_nearest1d.default,
    aten.upsample_nearest2d.default, aten.upsample_nearest3d.default,
    aten.upsample_linear1d.default, aten.upsample_bilinear2d.default,
    aten.upsample_trilinear3d.default, aten.upsample_bicubic2d.default,
    aten.pixel_shuffle.default, aten.pixel_unshuffle.default,
)  # fmt: skip
def _per_sample_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """A linear operation on each sample of a batch (pooling by averages, padding by
    reflection or replication, upsampling, pixel shuffles): on the terms with the directions
    folded into the batch axis."""
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    return y, _map(a, lambda t: folded(t, x.shape, lambda f: node.target(f, *args[1:], **kwargs)))  # type: ignore[operator]


@_rule(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def _max_pool_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """The maximum of each window: the terms of the element it takes (torch's indices, flat
    within each channel's plane); a piecewise linear choice (no curvature of its own)."""
    x = args[0]
    values, indices = out = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    spatial = 2 if node.target is aten.max_pool2d_with_indices.default else 3
    lead = tuple(x.shape[: x.ndim - spatial])

    def take(t: Tensor) -> Tensor:
        flat = _full(t, x.shape).reshape(t.shape[0], *lead, -1)
        picked = flat.gather(-1, indices.reshape(1, *lead, -1).expand(t.shape[0], *lead, -1))
        return picked.reshape(t.shape[0], *values.shape)

    return out, [_map(a, take), None]


@_rule(aten.cumsum.default)
def _cumsum_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if x.ndim == 0:
        return y, _map(a, lambda t: t.to(y.dtype))
    axis = int(args[1] if len(args) > 1 else kwargs["dim"]) % x.ndim + 1

    def summed(t: Tensor) -> Tensor:
        t = lift(t, x.ndim)
        return t.expand(*t.shape[:axis], x.shape[axis - 1], *t.shape[axis + 1 :]).cumsum(axis)

    return y, _map(a, lambda t: summed(t).to(y.dtype))


@_rule(aten.tril.default, aten.triu.default, aten.diagonal.default)
def _triangle_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """A triangle or a diagonal of matrices: the same of the terms' matrices."""
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if node.target is aten.diagonal.default:
        names = ("offset", "dim1", "dim2")
        given = (
            {"offset": 0, "dim1": 0, "dim2": 1} | dict(zip(names, args[1:], strict=False)) | kwargs
        )
        offset, d1, d2 = given["offset"], given["dim1"] % x.ndim + 1, given["dim2"] % x.ndim + 1

        def diagonal(t: Tensor) -> Tensor:
            return lift(t, x.ndim).expand(-1, *x.shape).diagonal(offset, d1, d2)

        return y, _map(a, diagonal)
    return y, _map(a, lambda t: node.target(_full(t, x.shape), *args[1:], **kwargs))  # type: ignore[operator]


@_rule(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
def _extremum_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """The largest (smallest) element along axes: its terms, shared evenly among ties (as
    torch's derivative)."""
    x = args[0]
    y = node.target(*args, **kwargs)  # type: ignore[operator]
    a = sw.needed(node.args[0])
    if x.ndim == 0:
        return y, a
    every = node.target in (aten.max.default, aten.min.default)
    reduced = dims(None if every else args[1] if len(args) > 1 else kwargs.get("dim"), x.ndim)
    keepdim = not every and bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    kept = y if keepdim else y.reshape([1 if i in reduced else s for i, s in enumerate(x.shape)])
    ties = (x == kept).to(x.dtype)
    share = ties / ties.sum(reduced, keepdim=True)
    axes = [d + 1 for d in reduced]
    return y, _map(a, lambda t: (lift(t, x.ndim) * share).sum(axes, keepdim=keepdim))


@_rule(aten.max.dim, aten.min.dim)
def _extremum_at_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """The largest (smallest) element along one axis and its index: the terms at the index."""
    x = args[0]
    out = node.target(*args, **kwargs)  # type: ignore[operator]
    indices = out[1]
    a = sw.needed(node.args[0])
    if x.ndim == 0:
        return out, [a, None]
    axis = int(args[1] if len(args) > 1 else kwargs["dim"]) % x.ndim
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    at = indices if keepdim else indices.unsqueeze(axis)

    def take(t: Tensor) -> Tensor:
        t = lift(t, x.ndim).expand(-1, *x.shape)
        picked = t.gather(axis + 1, at.expand(t.shape[0], *at.shape))
        return picked if keepdim else picked.squeeze(axis + 1)

    return out, [_map(a, take), None]


@_rule(aten.maximum.default, aten.minimum.default)
def _larger_rule(
    sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """The larger (smaller) of two values: its terms (at a tie, half of each: torch's)."""
    x, z = args[0], args[1]
    y = node.target(x, z)  # type: ignore[operator]
    larger = x > z if node.target is aten.maximum.default else x < z
    w = larger.to(y.dtype) + 0.5 * (x == z).to(y.dtype)
    a, b = sw.jet(node.args[0]), sw.jet(node.args[1])
    return y, _paired(a, b, y.ndim, lambda ta, tb: ta * w + tb * (1 - w))
