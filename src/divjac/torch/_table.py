"""The table from ATen operation names to (shared rule, argument and parameter extractor).

Every rule is one of :mod:`divjac._core.rules` (the few that only PyTorch has are written here,
or in :mod:`divjac.torch._table_nn`, with the same signature). An extractor picks the
operation's tensor arguments the rule reads (``op.ins``, in order) and turns its arguments into
the rule's parameters; it returns ``None`` where no rule applies (the dense fallback). Data
movement (views, ``cat``, indexing with known indices, padding, ``where`` with a known mask) is
found by running the operation on positions (:meth:`~divjac.torch._graph.Graph.movement`).
Users add entries with ``divjac.torch.register_rule``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from .._core import rules as D
from .._core.rules import Deps, Op, Rule
from ._aten import bind, dim, dims, is_tensor, packet, shape
from ._compat import pytree
from ._graph import Graph

__all__ = ["TABLE", "Extract", "add", "tensor_args"]

Extracted = tuple[list[Any], Mapping[str, Any]]
Extract = Callable[[Graph, torch.fx.Node], Extracted | None]

TABLE: dict[str, tuple[Rule, Extract]] = {}


def add(names: Sequence[str], rule: Rule, extract: Extract) -> None:
    """Map each of ``names`` (ATen operations without namespace and overload) to the entry."""
    for name in names:
        TABLE[name] = (rule, extract)


def tensor_args(g: Graph, node: torch.fx.Node) -> Extracted:
    """Every argument that depends on the labels, no parameters (element-wise, batched)."""
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if g.has_deps(a)], {}


def _first(g: Graph, node: torch.fx.Node) -> Extracted:
    return [node.args[0]], {}


add(
    ["floor", "ceil", "round", "trunc", "sign", "sgn", "heaviside", "detach", "zeros_like",
     "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
     "bernoulli", "new_zeros", "new_ones", "new_empty", "new_full", "zero", "empty_strided",
     "scalar_tensor", "lift_fresh_copy", "lift_fresh", "rand", "randn", "randint", "normal",
     "uniform", "exponential", "geometric", "cauchy", "log_normal", "randperm"],
    D.nothing_rule,
    tensor_args,
)  # fmt: skip
add(  # same shape in and out, each output element a function of its input element
    ["_to_copy", "clone", "alias", "contiguous", "_conj", "resolve_conj", "resolve_neg",
     "positive", "_conj_physical", "conj_physical", "to", "dropout", "feature_dropout",
     "alpha_dropout", "native_dropout"],
    D.identity_rule,
    _first,
)  # fmt: skip


# Element-wise but not tagged so: kept whole (the decomposition of ``complex`` writes into
# views of an empty tensor in place, which the functional graph does not follow).
add(["complex", "polar"], D.elementwise_rule, tensor_args)


def _fill(g: Graph, node: torch.fx.Node) -> Extracted:
    return [bind(node).get("value")], {}


add(["fill"], D.identity_rule, _fill)


# --- data movement, by running the operation on positions ------------------------------------


def _moved(g: Graph, node: torch.fx.Node) -> Extracted | None:
    found = g.movement(node)
    if found is None:
        return None
    sources, src = found
    return sources, {"src": src}


# Reshapes keep every element's dependency row (no copy, as JAX's ``reshape``); axis
# permutations are one gather (none when the permutation is the identity, as the batch-first
# ``movedim`` of a batch already first). Other views (of another dtype) run on positions.
_RESHAPES = {"view", "_unsafe_view", "reshape", "view_copy", "_unsafe_view_copy", "reshape_copy",
             "unsqueeze", "squeeze", "unsqueeze_copy", "squeeze_copy", "alias_copy"}  # fmt: skip
_PERMUTES = {"permute", "permute_copy", "transpose", "transpose_copy", "t", "t_copy"}


def _view(g: Graph, node: torch.fx.Node) -> Extracted | None:
    x, out = node.args[0], node.meta.get("val")
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not (
        isinstance(val, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and (val.dtype, val.numel()) == (out.dtype, out.numel())
    ):
        return _moved(g, node)
    ndim = val.ndim
    order = list(range(ndim))
    name = packet(node.target)
    if name in ("permute", "permute_copy"):
        order = dims(bind(node)["dims"], ndim)
    elif name in ("transpose", "transpose_copy"):
        b = bind(node)
        i, j = dim(b["dim0"], ndim), dim(b["dim1"], ndim)
        if ndim:
            order[i], order[j] = j, i
    elif name in ("t", "t_copy"):
        order.reverse()
    return [x], {"permutation": None if order == list(range(ndim)) else order}


def _view_rule(op: Op) -> list[Deps]:
    """A reshape after a permutation (params ``permutation``, see
    :func:`~divjac._core.rules.reshape_rule`), or a gather (params ``src``)."""
    if "src" in op.params:
        return D.gather_rule(op)
    return D.reshape_rule(op)


add(sorted(_RESHAPES | _PERMUTES), _view_rule, _view)
add(
    ["_reshape_alias", "expand", "cat", "concat", "stack", "slice", "select", "narrow",
     "flip", "roll", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d",
     "reflection_pad3d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
     "split", "split_with_sizes", "chunk", "tensor_split", "diagonal", "diag_embed",
     "diag", "repeat", "repeat_interleave", "unfold", "im2col", "movedim", "pixel_shuffle",
     "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle", "rot90", "tril", "triu",
     "slice_scatter", "select_scatter", "diagonal_scatter", "copy", "copy_", "masked_select",
     "expand_copy", "slice_copy", "select_copy", "split_copy", "split_with_sizes_copy",
     "diagonal_copy", "unfold_copy", "as_strided", "as_strided_copy", "as_strided_scatter",
     "expand_as", "view_as", "swapaxes", "swapdims"],
    D.gather_rule,
    _moved,
)  # fmt: skip


def _index_axes(g: Graph, node: torch.fx.Node) -> tuple[Any, list[int]]:
    """The data argument of an indexing operation and the axes its unknown indices point along
    (those of ``index``'s known indices are read exactly: a grid sampler's unknown pixel
    indices keep its batch and channel indices, which are ranges)."""
    name = packet(node.target)
    b = bind(node)
    data = b.get("self", b.get("weight"))
    ndim = len(shape(data.meta["val"])) if isinstance(data, torch.fx.Node) else 0
    if name in ("index_select", "gather"):
        return data, [dim(b["dim"], ndim)]
    if name == "embedding":
        return data, [0]
    if name in ("index", "_unsafe_index", "_unsafe_masked_index"):
        axes, pos = [], 0
        for ix in b["indices"]:
            span = 1
            if isinstance(ix, torch.fx.Node) and ix.meta["val"].dtype in (torch.bool, torch.uint8):
                span = ix.meta["val"].ndim
            if ix is not None and g.value(ix) is None:
                axes += list(range(pos, pos + span))
            pos += span
        return data, axes
    return data, list(range(ndim))  # take, masked_select, ...


def _indexing(g: Graph, node: torch.fx.Node) -> Extracted | None:
    """Known indices: an index map. Unknown ones: the data smeared along the axes they index,
    read at index zero (which bounds every index)."""
    found = g.movement(node)
    if found is not None:
        return found[0], {"src": found[1]}
    found = g.movement(node, zero_unknown=True)
    if found is None:
        return None
    sources, src = found
    data, axes = _index_axes(g, node)
    return sources, {"src": src, "unknown": {i: axes for i, s in enumerate(sources) if s is data}}


add(
    ["index_select", "gather", "take", "index", "_unsafe_index", "embedding",
     "_unsafe_masked_index"],
    D.gather_rule,
    _indexing,
)  # fmt: skip


def _select(g: Graph, node: torch.fx.Node) -> Extracted:
    found = g.movement(node)
    if found is None:  # unknown mask: either side may be chosen
        return tensor_args(g, node)[0], {"src": None}
    return found[0], {"src": found[1]}


def _select_rule(op: Op) -> list[Deps]:
    """A known mask (``src``) is an index map of the sources; an unknown one may choose any."""
    if op.params["src"] is None:
        return D.elementwise_rule(op)
    return D.gather_rule(op)


add(["where", "masked_fill", "index_fill"], _select_rule, _select)


# --- reductions, scans, sorting ---------------------------------------------------------------


def _reduction(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    if "other" in b:  # max.other, min.other: element-wise
        return tensor_args(g, node)[0], {"axes": None}
    x = b["self"]
    return [x], {"axes": dims(b.get("dim"), len(g.deps(x).shape))}


def _reduce_rule(op: Op) -> list[Deps]:
    return D.elementwise_rule(op) if op.params["axes"] is None else D.reduce_rule(op)


add(
    ["sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "aminmax",
     "logsumexp", "var", "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "median",
     "nanmedian", "mode", "kthvalue"],
    _reduce_rule,
    _reduction,
)  # fmt: skip


def _along(default: int | None = None) -> Extract:
    """The ``self`` argument and the axis ``dim`` (``default`` if fixed: ``msort``)."""

    def extract(g: Graph, node: torch.fx.Node) -> Extracted:
        b = bind(node)
        axis = default if default is not None else int(b.get("dim", -1))
        return [b["self"]], {"axis": axis}

    return extract


add(["cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"], D.cumulative_rule, _along())
add(["sort", "topk", "argsort"], D.sort_rule, _along())
add(["msort"], D.sort_rule, _along(0))
add(["unbind", "unbind_copy"], D.unstack_rule, _along())
add(["_softmax", "_log_softmax", "_safe_softmax", "softmax", "log_softmax"], D.sort_rule, _along())


def _softmax_backward(op: Op) -> list[Deps]:
    """The gradient of a softmax reads the whole line of the gradient and of the output."""
    return [D.sort_along(D.union(*op.ins), op.params["axis"])]


def _softmax_backward_args(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    return [b["grad_output"], b["output"]], {"axis": int(b["dim"])}


add(
    ["_softmax_backward_data", "_log_softmax_backward_data"],
    _softmax_backward,
    _softmax_backward_args,
)


# --- contractions -------------------------------------------------------------------------------


def _dot(
    lhs: str, rhs: str, contracting: tuple[list[int], list[int]], batch: tuple[list[int], list[int]]
) -> Extract:
    """``dot_general`` of the arguments ``lhs`` and ``rhs`` plus the argument ``self`` where it
    is the added term (``addmm``: named ``lhs`` otherwise)."""

    def extract(g: Graph, node: torch.fx.Node) -> Extracted:
        b = bind(node)
        args = [b[lhs], b[rhs]]
        if lhs != "self":
            args.append(b["self"])
        return args, {"contracting": contracting, "batch": batch}

    return extract


add(["mm"], D.dot_rule, _dot("self", "mat2", ([1], [0]), ([], [])))
add(["addmm", "_addmm_activation"], D.dot_rule, _dot("mat1", "mat2", ([1], [0]), ([], [])))
add(["bmm"], D.dot_rule, _dot("self", "mat2", ([2], [1]), ([0], [0])))
add(["baddbmm"], D.dot_rule, _dot("batch1", "batch2", ([2], [1]), ([0], [0])))
add(["addbmm"], D.dot_rule, _dot("batch1", "batch2", ([0, 2], [0, 1]), ([], [])))
add(["mv"], D.dot_rule, _dot("self", "vec", ([1], [0]), ([], [])))
add(["addmv"], D.dot_rule, _dot("mat", "vec", ([1], [0]), ([], [])))
add(["dot"], D.dot_rule, _dot("self", "tensor", ([0], [0]), ([], [])))
add(["vdot"], D.dot_rule, _dot("self", "other", ([0], [0]), ([], [])))
add(["outer", "ger"], D.dot_rule, _dot("self", "vec2", ([], []), ([], [])))
add(["addr"], D.dot_rule, _dot("vec1", "vec2", ([], []), ([], [])))


def _matmul(g: Graph, node: torch.fx.Node) -> Extracted | None:
    """Normally decomposed by PyTorch; kept for graphs recorded without decomposition."""
    b = bind(node)
    lhs, rhs = g.deps(b["self"]).shape, g.deps(b["other"]).shape
    if len(lhs) < 2 or len(rhs) < 2 or lhs[:-2] != rhs[:-2]:
        return None
    nb = len(lhs) - 2
    return [b["self"], b["other"]], {"contracting": ([nb + 1], [nb]), "batch": ([*range(nb)],) * 2}


add(["matmul"], D.dot_rule, _matmul)


def _cdist(g: Graph, node: torch.fx.Node) -> Extracted | None:
    """Pairwise distances: ``out[..., i, j]`` reads row ``i`` of ``x1`` and row ``j`` of ``x2``;
    the leading (batch) axes broadcast (a vmapped ``x1`` against a shared ``x2``)."""
    x1, x2 = node.args[0], node.args[1]
    s1, s2 = g.deps(x1).shape, g.deps(x2).shape
    try:
        lead = tuple(np.broadcast_shapes(s1[:-2], s2[:-2]))
    except ValueError:
        return None
    return [x1, x2], {"lead": lead}


def _cdist_rule(op: Op) -> list[Deps]:
    """``dot_general`` of the operands broadcast to their common leading axes, contracting the
    last (the coordinates) and batched over the leading ones."""
    lead = op.params["lead"]
    shapes = [(*lead, *d.shape[-2:]) for d in op.ins[:2]]
    values = op.values

    def broadcast(i: int) -> np.ndarray | None:
        value = values(i)
        return None if value is None else np.broadcast_to(value, shapes[i])

    n = len(lead)
    return D.dot_rule(
        op.replace(
            ins=[D.broadcast_to(d, s) for d, s in zip(op.ins[:2], shapes, strict=True)],
            values=broadcast,
            params={"contracting": ([n + 1], [n + 1]), "batch": ([*range(n)],) * 2},
        )
    )


add(["_cdist_forward", "_euclidean_dist"], _cdist_rule, _cdist)


def _trilinear(op: Op) -> list[Deps]:
    """``sum over sumdim of i1 * i2 * i3``, each unsqueezed at its ``expand`` axes."""
    parts = []
    for d, expand in zip(op.ins, op.params["expand"], strict=True):
        dims_ = list(d.shape)
        for axis in sorted(expand):
            dims_.insert(axis, 1)
        parts.append(D.reshape(d, dims_))
    full = np.broadcast_shapes(*(p.shape for p in parts))
    summed = D.reduce(D.elementwise(full, *parts), op.params["sumdim"], keepdims=True)
    return [D.reshape(summed, op.out_shapes[0])]


def _trilinear_args(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    expand = [[int(a) for a in b[f"expand{k}"]] for k in (1, 2, 3)]
    return [b["i1"], b["i2"], b["i3"]], {"expand": expand, "sumdim": [int(a) for a in b["sumdim"]]}


add(["_trilinear"], _trilinear, _trilinear_args)


# --- linear algebra, FFT, complex views ---------------------------------------------------------


def _batched(g: Graph, node: torch.fx.Node) -> Extracted | None:
    """Batched matrix functions: leading axes are a batch, the trailing matrix axes are dense."""
    args = tensor_args(g, node)[0]
    lead = len(g.deps(args[0]).shape) - 2
    return (args, {"lead": lead}) if lead >= 0 else None


add(
    ["_linalg_svd", "linalg_svd", "_linalg_eigh", "linalg_eigh", "linalg_eig", "_linalg_eigvals",
     "linalg_inv_ex", "linalg_inv", "_linalg_det", "linalg_det", "_linalg_slogdet",
     "linalg_cholesky_ex", "cholesky", "linalg_lu_factor_ex", "linalg_lu", "linalg_qr",
     "cholesky_inverse", "linalg_householder_product", "linalg_pinv", "linalg_matrix_exp",
     "_linalg_check_errors", "linalg_ldl_factor_ex", "geqrf", "ormqr", "lu_unpack",
     "linalg_lstsq"],
    D.batched_rule,
    _batched,
)  # fmt: skip

# Solvers of ``A X = B``: the names of ``A`` and ``B`` in their schemas.
_SOLVES = {
    "_linalg_solve_ex": ("A", "B"), "linalg_solve": ("A", "B"), "linalg_solve_ex": ("A", "B"),
    "cholesky_solve": ("input2", "self"), "triangular_solve": ("A", "self"),
    "linalg_solve_triangular": ("self", "B"), "linalg_lu_solve": ("LU", "B"),
    "lu_solve": ("LU_data", "self"),
}  # fmt: skip


def _solve(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    name = packet(node.target)
    a_name, b_name = _SOLVES[name]
    a, rhs = g.deps(b[a_name]).shape, g.deps(b[b_name]).shape
    vector = name in ("_linalg_solve_ex", "linalg_solve", "linalg_solve_ex") and (
        len(rhs) == 1 or (len(rhs) == len(a) - 1 and rhs == a[:-1])
    )  # linalg.solve takes (batches of) vectors
    return [b[a_name], b[b_name]], {"left": b.get("left", True), "vector": vector}


add(list(_SOLVES), D.solve_rule, _solve)


def _fft(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    return [b["self"]], {"axes": dims(b["dim"], len(g.deps(b["self"]).shape))}


add(["_fft_r2c", "_fft_c2r", "_fft_c2c"], D.fft_rule, _fft)


def _view_as_real(op: Op) -> list[Deps]:
    x = op.ins[0]
    return [D.broadcast_to(D.reshape(x, (*x.shape, 1)), op.out_shapes[0])]


def _view_as_complex(op: Op) -> list[Deps]:
    return [D.reduce(op.ins[0], [-1])]


add(["view_as_real"], _view_as_real, _first)
add(["view_as_complex"], _view_as_complex, _first)


# --- scatter-like operations --------------------------------------------------------------------


def _positions(dims_: Sequence[int]) -> torch.Tensor:
    """The flat positions of an array of shape ``dims_``, 1-based (0: nowhere), as float64."""
    n = int(np.prod(dims_))
    return torch.arange(1, n + 1, dtype=torch.float64).reshape(tuple(dims_))


def _targets(dest: torch.Tensor) -> np.ndarray:
    """0-based flat targets (``-1``: nowhere) from 1-based positions."""
    return dest.round().to(torch.int64).cpu().numpy().ravel() - 1


def _index_or_zeros(g: Graph, arg: Any) -> tuple[Any, bool]:
    """The value of an index tensor (zeros if unknown) and whether it was known."""
    if not isinstance(arg, torch.fx.Node):
        return arg, True
    value = g.value(arg)
    if value is None:
        val = arg.meta["val"]
        return torch.zeros(shape(val), dtype=val.dtype), False
    return value.cpu(), True


def _scatter(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    out = shape(node.meta["val"])
    axis = dim(b["dim"], len(out))
    index, known = _index_or_zeros(g, b["index"])
    dest = torch.gather(_positions(out), axis, index)
    src = b.get("src")
    source: Any
    if isinstance(src, torch.fx.Node):  # only src[:index.shape] is scattered
        src_shape = g.deps(src).shape
        window = tuple(slice(0, s) for s in index.shape)
        source, source_index = src, np.arange(int(np.prod(src_shape))).reshape(src_shape)[window]
    else:  # a scalar value: the written elements depend on nothing
        source, source_index = D.empty(tuple(index.shape), g.n_labels), None
    return [b["self"], source], {
        "target": _targets(dest),
        "source_index": source_index,
        "overwrite": packet(node.target) == "scatter" and b.get("reduce") is None,
        "unknown_axes": None if known else [axis],
    }


def _index_add(g: Graph, node: torch.fx.Node) -> Extracted:
    b = bind(node)
    out = shape(node.meta["val"])
    axis = dim(b["dim"], len(out))
    index, known = _index_or_zeros(g, b["index"])
    return [b["self"], b["source"]], {
        "target": _targets(torch.index_select(_positions(out), axis, index)),
        "overwrite": packet(node.target) == "index_copy",
        "unknown_axes": None if known else [axis],
    }


def _index_put(g: Graph, node: torch.fx.Node) -> Extracted | None:
    b = bind(node)
    out = shape(node.meta["val"])
    indices, known, axes, pos = [], True, [], 0
    for ix in b["indices"]:
        value, ok = _index_or_zeros(g, ix)
        known = known and ok
        span = value.ndim if is_tensor(value) and value.dtype == torch.bool else 1
        if ix is not None:
            axes += list(range(pos, pos + span))
        pos += span
        indices.append(value)
    if not known and any(is_tensor(v) and v.dtype == torch.bool for v in indices):
        return None
    dest = _positions(out)[tuple(slice(None) if v is None else v for v in indices)]
    values = g.deps(b["values"]).shape
    n_values = int(np.prod(values))
    return [b["self"], b["values"]], {
        "target": _targets(dest),
        "source_index": np.broadcast_to(np.arange(n_values).reshape(values), tuple(dest.shape)),
        "overwrite": not b.get("accumulate", False),
        "unknown_axes": None if known else axes,
    }


def _masked_scatter(g: Graph, node: torch.fx.Node) -> Extracted | None:
    b = bind(node)
    mask = g.value(b["mask"])
    if mask is None:
        return None
    out = shape(node.meta["val"])
    full = torch.broadcast_to(mask.cpu(), out).reshape(-1)
    dest = torch.flatten(_positions(out))[full]
    return [b["self"], b["source"]], {
        "target": _targets(dest),
        "source_index": np.arange(int(full.sum())),
        "overwrite": True,
    }


def _col2im(g: Graph, node: torch.fx.Node) -> Extracted:
    """``fold`` sums overlapping patches: each output reads the columns ``im2col`` puts it in."""
    b = bind(node)
    out = shape(node.meta["val"])
    dest = torch.ops.aten.im2col(
        _positions(out), b["kernel_size"], b["dilation"], b["padding"], b["stride"]
    )
    return [D.empty(out, g.n_labels), b["self"]], {"target": _targets(dest), "overwrite": False}


add(["scatter", "scatter_add", "scatter_reduce"], D.scatter_rule, _scatter)
add(["index_add", "index_copy"], D.scatter_rule, _index_add)
add(["index_put", "_index_put_impl", "_unsafe_index_put"], D.scatter_rule, _index_put)
add(["masked_scatter"], D.scatter_rule, _masked_scatter)
add(["col2im"], D.scatter_rule, _col2im)
