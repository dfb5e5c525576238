"""The generic rule of the second-order sweep (:func:`generic`): any operation pushed by
``torch.func``, ``jvp`` of ``jvp`` batched over the directions, with the operations whose
derivatives torch gets wrong pushed in other forms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx
from torch.func import jvp, vjp, vmap

from ..._errors import OptionError
from .._aten import forward_derivative_wrong, inexact, lacks_forward_derivative, packet
from .._compat import pytree
from .._kernels import composed_norm, without_overlap
from .jets import Jet, Sweep, _full

__all__: list[str] = []

Tensor = torch.Tensor
aten = torch.ops.aten


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


def _slice_scatter(
    x: Tensor, src: Tensor, dim: int = 0, start: Any = None, end: Any = None, step: int = 1
) -> Tensor:
    """``slice_scatter`` with its end clamped to the axis: the forward derivative of an end
    past it (the backward formula of ``linalg_det`` slices to ``sys.maxsize``) overflows
    (torch 2.13: "IntArrayRef contains an int that cannot be represented as a SymInt")."""
    end = None if end is None else min(end, x.shape[dim])
    return aten.slice_scatter.default(x, src, dim, start, end, step)


# Operations pushed in another form with the same values (torch 2.13): the derivatives of
# ``cholesky_inverse`` are wrong at second order both ways (forward and backward); the forward
# derivative of the norm of all entries (``norm.Scalar``, as ``torch.dist`` records it) has
# the input's rank, not the norm's, and fails; see :func:`_slice_scatter`.
_REWRITTEN: dict[Any, Callable[..., Any]] = {
    aten.cholesky_inverse.default: _cholesky_inverse,
    aten.slice_scatter.default: _slice_scatter,
    aten.norm.Scalar: _norm,
    aten.norm.ScalarOpt_dtype: _norm,
}


def pushed_form(target: Any) -> Callable[..., Any]:
    """The form of an operation that forward derivatives are pushed through: a normalization
    kernel composed (:func:`~divjac.torch._kernels.composed_norm`), :data:`_REWRITTEN`'s, or the
    operation itself."""
    return composed_norm(target) or _REWRITTEN.get(target, target)


def generic(sw: Sweep, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Any operation, by ``torch.func``: the first-order terms by ``jvp``, the second-order
    ones by ``jvp`` of ``jvp`` (zero for :data:`_LINEAR` operations), batched over the
    directions with ``vmap``."""
    target: Any = node.target
    y = target(*args, **kwargs)
    outs = list(y) if isinstance(y, tuple | list) else [y]
    floating = [i for i, o in enumerate(outs) if inexact(o)]
    if not floating:
        return y, None
    op = pushed_form(target)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    node_leaves = pytree.tree_leaves((node.args, node.kwargs))
    pos = [i for i, n in enumerate(node_leaves) if sw.jet(n) is not None]
    # Materialized where elements share memory (an expanded value): forward-mode AD writes
    # tangents into a tensor of the primal's layout.
    primals = tuple(without_overlap(leaves[i]) for i in pos)
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
        fix = (
            "Use divjac.torch.hessian_diagonal or divjac.torch.hessian (reverse passes of the "
            "gradient) for this function."
        )
        if getattr(target, "namespace", "aten") not in ("aten", "prims"):
            fix = (
                "Its reverse passes cannot be differentiated by torch.func either (torch.library "
                "generates an autograd.Function that torch.func refuses, torch 2.13), so no "
                "second-order result of it can be computed: differentiate a composition of "
                "differentiable torch operations instead (the operation's reference path)."
            )
        raise OptionError(
            "the second-order Taylor sweep (laplacian and the like) pushes forward derivatives, "
            f"but the function runs {target}, which has none in PyTorch. {fix}"
        )
    n = len(primals)
    by_reverse = forward_derivative_wrong(target)

    def lin(*pt: Tensor) -> tuple[Tensor, ...]:
        """``J t`` at the primals ``pt[:n]`` for the tangents ``pt[n:]``."""
        if not by_reverse:
            return jvp(fn, pt[:n], pt[n:])[1]
        return _by_reverse(fn, pt[:n], pt[n:])

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
            def along(*p: Tensor) -> tuple[Tensor, ...]:
                return lin(*p, *(ti.clone() for ti in t))

            if by_reverse:
                return along(*primals), _by_reverse(along, primals, t)
            return jvp(along, primals, t)  # type: ignore[return-value]

        d1, curv = vmap(taylor)(*firsts)
        d2 = tuple(sw.weighted(c) for c in curv)
        if has_second:
            d2 = tuple(c + s for c, s in zip(d2, vmap(push)(*seconds), strict=True))
    jets_out: list[Jet | None] = [None] * len(outs)
    for j, i in enumerate(floating):
        jets_out[i] = Jet(d1[j], None if d2 is None else d2[j])
    return y, jets_out if isinstance(y, tuple | list) else jets_out[0]


def _by_reverse(
    fn: Callable[..., tuple[Tensor, ...]], primals: Sequence[Tensor], tangents: Sequence[Tensor]
) -> tuple[Tensor, ...]:
    """``J t`` of ``fn`` at ``primals`` as the transpose of its VJP (linear in the cotangent),
    from backward formulas alone: the forward derivatives of the linear-algebra kernels read
    their saved factorizations, which have no derivative of their own (torch 2.13: the LU of
    ``_linalg_solve_ex``), so any derivative of a forward derivative of them is wrong, also
    where an outer sweep differentiates the program of this one (``bilaplacian``). With grad
    mode on: under the caller's ``no_grad`` the backward of the VJP is not differentiated (and
    the solve's backward itself reads the LU); its results are then detached, as the caller's
    mode records nothing (they required grad, through the parameters, under ``no_grad``)."""
    grad_on = torch.is_grad_enabled()
    with torch.enable_grad():
        y, pull = vjp(fn, *primals)[:2]
        zeros = tuple(torch.zeros_like(o) for o in y)
        transposed = vjp(lambda *c: pull(c), *zeros)[1]
        result = cast(tuple[Tensor, ...], transposed(tuple(tangents)))
    return result if grad_on else tuple(r.detach() for r in result)
