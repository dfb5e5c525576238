"""Third- and fourth-order directional derivatives of a batched function, for many directions
at once: ``sum_k w_k (v_k . grad)^K f`` by one collapsed univariate Taylor sweep of order ``K``
(the torch twin of :mod:`divjac.jax._taylor_high`, same contract).

Along a direction ``v`` every intermediate ``z`` of ``f`` has the Taylor series
``z(x + t v) = z_0 + z_1 t + ... + z_K t^K + O(t^(K+1))``, and ``K! z_K = (v . grad)^K z``. The
sweep runs the program of the second-order sweep (divjac's cached ATen trace of ``f``, on the
actual tensors: :class:`divjac.torch._taylor.sweep.Program`) once; every value that depends on
the input carries its coefficients ``z_1 ... z_(K-1)`` per direction (``[R, *s]``) and ONE top
coefficient ``sum_k w_k z_K[v_k]``, which enters every operation linearly, so the products of
lower coefficients that feed it are summed over the directions where they are made (the
collapse of Dangel, Siebert, Zeinhofer & Walther, NeurIPS 2025). Per operation:

- linear ones (views, reductions, sums, a product with a constant, a concatenation): every
  coefficient by the operation itself (``vmap`` over the directions), the top alike;
- an element-wise ``p`` of one dependent operand: the composition of ``p``'s series at ``a_0``
  (``p^(q)(a_0)`` by nested ``jvp`` of ``p`` alone) with ``a(t) - a_0`` (Faa di Bruno);
- a product of two dependent operands (``mul``, ``mm``, ``bmm``, ``matmul``, ``addmm``; ``div``
  as the product with the reciprocal's series): the Cauchy product of the two series.

Any other operation depending on the input, a program that draws random numbers or a call under
``torch.compile`` has no sweep here (:class:`Unsupported`, or ``None`` from
:func:`taylor_sweep`): the caller nests second-order sweeps, which cover every operation.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx
from torch.func import jvp, vmap

from ..._errors import InternalError
from .._aten import forward_derivative_inexact, forward_derivative_wrong, lacks_forward_derivative
from .._kernels import without_overlap
from .._ops import DERIVATIVES, is_elementwise
from .._traced import Traced
from .generic import pushed_form
from .jets import add as _add, lift
from .sweep import Program, program_of

__all__ = ["taylor_sweep"]

Tensor = torch.Tensor
aten = torch.ops.aten


class Unsupported(Exception):
    """An operation depending on the input that the sweep has no rule for."""


@dataclass
class Series:
    """The Taylor coefficients of one value beyond its own: ``low[k - 1]`` is ``z_k`` per
    direction (``[R, *s]``, ``None``: zero) for ``k = 1 .. K - 1``, ``top`` is ``z_K``, summed
    over the directions with their weights (``[*s]``) or, apart, per direction (``[R, *s]``)."""

    low: list[Tensor | None]
    top: Tensor | None


class HighSweep:
    """The series of one run (the ``sweep`` of :meth:`Program.evaluate`)."""

    def __init__(self, order: int, k: int, w: Tensor | None, apart: bool) -> None:
        self.order = order
        self.k = k
        self.w = w
        self.apart = apart
        self.jets: dict[torch.fx.Node, Any] = {}

    # --- the algebra of series -----------------------------------------------------------

    def collapse(self, terms: Tensor | None) -> Tensor | None:
        """``sum_r w_r terms[r]`` of per-direction terms (kept per direction when apart)."""
        if terms is None or self.apart:
            return terms
        if self.w is not None:
            terms = terms * self.w.reshape(-1, *([1] * (terms.ndim - 1)))
        return terms.sum(0)

    def full(self, c: Tensor | None, like: Tensor, per_direction: bool) -> Tensor:
        """Terms broadcast to the shape of the value ``like`` (zeros for ``None``), with the
        directions' axis in front when ``per_direction``."""
        lead = (self.k,) if per_direction else ()
        if c is None:
            return like.new_zeros((*lead, *like.shape))
        return (
            lift(c, like.ndim).expand(*lead, *like.shape) if per_direction else c.expand(like.shape)
        )

    def linear(self, s: Series, like: Tensor, fn: Callable[[Tensor], Tensor]) -> Series:
        """The series of a linear map ``fn`` of the value ``like``: each per-direction
        coefficient (broadcast to its shape) mapped by a ``vmap`` of ``fn``."""

        def mapped(c: Tensor | None, per_direction: bool) -> Tensor | None:
            if c is None:
                return None
            full = self.full(c, like, per_direction)
            return vmap(fn)(full) if per_direction else fn(full)

        return Series([mapped(c, True) for c in s.low], mapped(s.top, self.apart))

    def product(
        self, a: Series | None, a0: Tensor, b: Series | None, b0: Tensor, bil: Callable
    ) -> Series:
        """The series of ``bil(a, b)``, ``bil`` bilinear (a missing series: a constant)."""
        K = self.order

        def coef(s: Series | None, k: int) -> Tensor | None:
            if s is None:
                return None
            return s.top if k == K else s.low[k - 1]

        def term(x: Tensor | None, y: Tensor | None) -> Tensor | None:
            return None if x is None or y is None else bil(x, y)

        low: list[Tensor | None] = []
        for k in range(1, K):
            parts = [term(coef(a, k), b0), term(a0, coef(b, k))]
            parts += [term(coef(a, i), coef(b, k - i)) for i in range(1, k)]
            low.append(_add(*parts))
        inner = _add(*(term(coef(a, i), coef(b, K - i)) for i in range(1, K)))
        top = _add(term(coef(a, K), b0), term(a0, coef(b, K)), self.collapse(inner))
        return Series(low, top)

    def compose(
        self,
        p: Callable[[Tensor], Tensor],
        a0: Tensor,
        s: Series,
        known: Sequence[Tensor] = (),
    ) -> Series:
        """The series of the element-wise ``p(a)``: ``z_k = sum_q p^(q)(a_0) / q! [t^k]
        (a(t) - a_0)^q``; the top's terms of ``q >= 2`` hold only per-direction coefficients.
        ``p``'s derivatives at ``a_0`` are the ``known`` ones (its first), the others by nested
        ``jvp`` of ``p``."""
        K = self.order
        derivatives = list(known[:K])
        g = p
        for q in range(1, K + 1):
            g = _derivative(g)
            if q > len(derivatives):
                derivatives.append(g(a0))
        # powers[q - 1][k - 1]: [t^k] of (a(t) - a_0)^q per direction, k <= K (without the
        # top: the powers q >= 2 never reach it)
        first = [*s.low, None]
        powers = [first]
        for _ in range(1, K):
            prev = powers[-1]
            powers.append(
                [
                    _add(
                        *(
                            prev[i - 1] * first[k - i - 1]  # type: ignore[operator]
                            for i in range(1, k)
                            if prev[i - 1] is not None and first[k - i - 1] is not None
                        )
                    )
                    for k in range(1, K + 1)
                ]
            )
        scale = [d if q == 0 else d / math.factorial(q + 1) for q, d in enumerate(derivatives)]

        def series_term(k: int, q_from: int, collapse: Callable[[Any], Any]) -> Tensor | None:
            """``sum_(q >= q_from) p^(q)(a_0) / q! collapse([t^k] (a(t) - a_0)^q)`` (the
            derivatives are the same for every direction: the top's sum over the directions
            is taken before they multiply it)."""
            found = [
                scale[q - 1] * collapse(powers[q - 1][k - 1])
                for q in range(q_from, k + 1)
                if powers[q - 1][k - 1] is not None
            ]
            return _add(*found)

        low = [series_term(k, 1, lambda t: t) for k in range(1, K)]
        top = _add(None if s.top is None else scale[0] * s.top, series_term(K, 2, self.collapse))
        return Series(low, top)

    # --- the operations ---------------------------------------------------------------------

    def apply(
        self, rule: Any, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        """The value of ``node`` and its series (the second-order ``rule`` is not used)."""
        value = node.target(*args, **kwargs)  # type: ignore[operator]
        target = node.target
        series = [self.jets.get(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
        dependent = [i for i, s in enumerate(series) if s is not None]
        if any(not isinstance(s, Series) for s in series if s is not None):
            raise Unsupported(f"{target} of a multiple output")
        if not isinstance(value, Tensor):
            return value, self.generic(node, args, kwargs, series, value)
        ndim = value.ndim
        if target in _LINEAR and dependent == [0]:
            rest = args[1:]
            # (a coefficient may be broadcast or transposed where the value is not: reshaped)
            mapped = aten.reshape.default if target in _VIEWS else target
            fn = lambda c: mapped(c, *rest, **kwargs)  # noqa: E731
            return value, self.linear(cast(Series, series[0]), args[0], fn)
        if target is aten.convolution.default and dependent == [0]:  # linear but the bias
            weight, rest = args[1], args[3:]
            conv = lambda c: target(c, weight, None, *rest)  # noqa: E731
            return value, self.linear(cast(Series, series[0]), args[0], conv)
        if target in (aten.add.Tensor, aten.sub.Tensor):
            alpha = kwargs.get("alpha", 1) * (-1 if target is aten.sub.Tensor else 1)
            return value, self._sum(series[0], series[1], alpha, ndim)
        if target in _PRODUCTS:
            return value, self._product(target, args, series, kwargs, ndim)
        if target is aten.div.Tensor:
            return value, self._quotient(args, series, ndim)
        if target is aten.cat.default:
            return value, self._cat(node, args, kwargs, ndim)
        if is_elementwise(target) and len(dependent) == 1 and not kwargs.get("out"):
            i = dependent[0]

            def p(z: Tensor) -> Tensor:
                return target(*args[:i], z, *args[i + 1 :], **kwargs)  # type: ignore[operator]

            s = cast(Series, series[i])
            lifted = Series([lift(c, ndim) for c in s.low], s.top)
            known = _closed(target, args[0], value, args[1:], kwargs) if i == 0 else []
            return value, self.compose(p, args[i], lifted, known)
        return value, self.generic(node, args, kwargs, series, value)

    def generic(
        self,
        node: torch.fx.Node,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        series: list[Series | None],
        value: Any,
    ) -> Any:
        """The series of any operation of tensor arguments, by nested ``jvp`` in ``t`` of the
        operation at ``a_0 + a_1 t + ... + a_(K-1) t^(K-1)`` (its ``K``-th derivative at 0
        over ``K!``, and each lower one), ``vmap``-ped over the directions; the top's part
        linear in the operands' tops by one ``jvp``. A tuple of outputs gets a list of series
        (``None`` for an integer output)."""
        K = self.order
        target = node.target
        dependent = [i for i, s in enumerate(series) if s is not None]
        if any(isinstance(a, list | tuple) and any(isinstance(e, torch.fx.Node) and
               e in self.jets for e in a) for a in node.args):  # fmt: skip
            raise Unsupported(f"{target} of a list of dependent tensors")
        live = {node.args[i] for i in dependent}
        if (
            forward_derivative_wrong(target)
            or forward_derivative_inexact(target)
            or lacks_forward_derivative(node, live)
        ):  # the nested second-order sweeps push these in other forms
            raise Unsupported(f"{target}: forward derivatives wrong, inexact or missing")
        op = pushed_form(target)
        outputs = value if isinstance(value, list | tuple) else (value,)
        if not all(isinstance(o, Tensor) for o in outputs):
            raise Unsupported(f"{node.target} without tensor outputs")
        inexact = [o.is_floating_point() for o in outputs]

        def call(operands: Sequence[Tensor]) -> tuple[Tensor, ...]:
            full = list(args)
            for i, a in zip(dependent, operands, strict=True):
                full[i] = a
            out = op(*full, **kwargs)
            found = out if isinstance(out, list | tuple) else (out,)
            return tuple(o for o, keep in zip(found, inexact, strict=True) if keep)

        a0 = [without_overlap(args[i]) for i in dependent]
        count = K if self.apart else K - 1
        coefficients = [
            torch.stack(
                [
                    self.full(series[i].low[k] if k < K - 1 else series[i].top, args[i], True)  # type: ignore[union-attr]
                    for k in range(count)
                ]
            )
            for i in dependent
        ]  # per operand [count, R, *s]

        def along(cs: Sequence[Tensor]) -> tuple[tuple[Tensor, ...], ...]:
            """The derivatives ``0 .. K`` in ``t`` at 0 of the operation along the series."""

            def at(t: Tensor) -> tuple[Tensor, ...]:
                shifted = []
                for a, c in zip(a0, cs, strict=True):
                    powers = torch.stack([t ** (k + 1) for k in range(count)])
                    shifted.append(a + (powers.reshape(-1, *[1] * a.ndim) * c).sum(0))
                return call(shifted)

            levels: Callable[[Tensor], tuple[tuple[Tensor, ...], ...]] = lambda t: (at(t),)  # noqa: E731
            for _ in range(K):
                levels = _next_level(levels)
            return levels(torch.zeros((), dtype=a0[0].dtype, device=a0[0].device))

        try:
            derivatives = vmap(along, in_dims=(1,))(coefficients)  # levels of [R, *out]
        except RuntimeError as err:  # (torch 2.13: four nested jvp of a float32 convolution)
            raise Unsupported(f"{target}: nested jvp failed ({err})") from err
        top_linear: tuple[Tensor, ...] | None = None
        if not self.apart and any(series[i].top is not None for i in dependent):  # type: ignore[union-attr]
            tangents = tuple(self.full(series[i].top, args[i], False) for i in dependent)  # type: ignore[union-attr]
            top_linear = jvp(lambda *ops: call(ops), tuple(a0), tangents)[1]
        per_output: list[Series | None] = []
        j = 0
        for keep in inexact:
            if not keep:
                per_output.append(None)
                continue
            low = [derivatives[k][j] / math.factorial(k) for k in range(1, K)]
            swept = self.collapse(derivatives[K][j] / math.factorial(K))
            top = _add(swept, None if top_linear is None else top_linear[j])
            per_output.append(Series(low, top))  # type: ignore[arg-type]
            j += 1
        return per_output if isinstance(value, list | tuple) else per_output[0]

    def _sum(self, a: Series | None, b: Series | None, alpha: Any, ndim: int) -> Series:
        def pair(x: Tensor | None, y: Tensor | None, apart: bool) -> Tensor | None:
            if apart:
                x, y = lift(x, ndim), lift(y, ndim)
            return _add(x, None if y is None else y if alpha == 1 else alpha * y)

        K = self.order
        low = [pair(a.low[k] if a else None, b.low[k] if b else None, True) for k in range(K - 1)]
        top = pair(a.top if a else None, b.top if b else None, self.apart)
        return Series(low, top)

    def _product(
        self, target: Any, args: Sequence[Any], series: list[Any], kwargs: dict[str, Any], ndim: int
    ) -> Series:
        if target is aten.addmm.default:
            a0, b0 = args[1:3]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            product = self.product(series[1], a0, series[2], b0, torch.matmul)
            if alpha != 1:
                product = Series([None if c is None else alpha * c for c in product.low],
                                 None if product.top is None else alpha * product.top)  # fmt: skip
            return self._sum(product, series[0], beta, ndim)
        a0, b0 = args[:2]
        if target is aten.mul.Tensor:
            return self._lifted_product(series[0], a0, series[1], b0, ndim)
        if a0.ndim < 2 or b0.ndim < 2:
            raise Unsupported(f"{target} of a vector")
        return self.product(series[0], a0, series[1], b0, torch.matmul)

    def _lifted_product(
        self, a: Series | None, a0: Tensor, b: Series | None, b0: Tensor, ndim: int
    ) -> Series:
        """The series of the element-wise ``a * b`` (per-direction terms aligned to ``ndim``
        value axes, as broadcasting aligns the values)."""

        def align(s: Series | None) -> Series | None:
            if s is None:
                return None
            top = lift(s.top, ndim) if self.apart else s.top
            return Series([lift(c, ndim) for c in s.low], top)

        return self.product(align(a), a0, align(b), b0, torch.mul)

    def _quotient(self, args: Sequence[Any], series: list[Any], ndim: int) -> Series:
        a0, b0 = args[:2]
        if series[1] is None:
            return self.linear(series[0], a0, lambda c: c / b0)
        b = series[1]
        lifted = Series([lift(c, b0.ndim) for c in b.low], b.top)
        r0 = torch.reciprocal(b0)
        known = _closed(aten.reciprocal.default, b0, r0, (), {})
        reciprocal = self.compose(torch.reciprocal, b0, lifted, known)
        return self._lifted_product(series[0], a0, reciprocal, r0, ndim)

    def _cat(
        self, node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any], ndim: int
    ) -> Series:
        pieces, values = node.args[0], args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        found = [self.jets.get(p) if isinstance(p, torch.fx.Node) else None for p in pieces]  # type: ignore[union-attr]
        if not all(s is None or isinstance(s, Series) for s in found):
            raise Unsupported("cat")

        def joined(cs: list[Tensor | None], apart: bool) -> Tensor | None:
            if all(c is None for c in cs):
                return None
            full = [self.full(c, v, apart) for c, v in zip(cs, values, strict=True)]
            return torch.cat(full, dim=dim + 1 if apart and dim >= 0 else dim)

        K = self.order
        low = [joined([s.low[k] if s else None for s in found], True) for k in range(K - 1)]
        top = joined([s.top if s else None for s in found], self.apart)
        return Series(low, top)


def _next_level(
    levels: Callable[[Tensor], tuple[tuple[Tensor, ...], ...]],
) -> Callable[[Tensor], tuple[tuple[Tensor, ...], ...]]:
    """From ``t -> (g(t), g'(t), ..., g^(q)(t))`` (each a tuple of outputs) to the same up to
    ``g^(q + 1)``, by one ``jvp`` in ``t``."""

    def more(t: Tensor) -> tuple[tuple[Tensor, ...], ...]:
        primal, tangent = jvp(levels, (t,), (torch.ones_like(t),))[:2]
        return (*primal, tangent[-1])

    return more


def _derivative(g: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """The derivative of the element-wise ``g`` (``jvp`` along ones)."""
    return lambda z: jvp(g, (z,), (torch.ones_like(z),))[1]


def _closed(
    target: Any, z: Tensor, y: Tensor, rest: Sequence[Any], kwargs: dict[str, Any]
) -> list[Tensor]:
    """The derivatives of the element-wise ``target`` at ``z`` (``y`` its value) known in closed
    form: the first two from the op-fact table (:data:`divjac.torch._ops.DERIVATIVES`; zero
    past the first for a piecewise-linear function), the third and fourth from
    :data:`_HIGHER` where it has them (else none: nested ``jvp``)."""
    found = DERIVATIVES.get(target)
    if found is None:
        return []
    d1, d2 = found(z, y, *rest, **kwargs)
    if d2 is None:
        zero = torch.zeros_like(d1)
        return [d1, zero, zero, zero]
    higher = _HIGHER.get(target)
    return [d1, d2] if higher is None else [d1, d2, *higher(z, y, d1, d2, *rest)]


def _power(c: float) -> Callable[..., tuple[Tensor, Tensor]]:
    """The third and fourth derivatives of ``z ** c`` from the second (``z != 0``)."""

    def higher(z: Tensor, y: Tensor, d1: Tensor, d2: Tensor) -> tuple[Tensor, Tensor]:
        d3 = (c - 2) * d2 / z
        return d3, (c - 3) * d3 / z

    return higher


def _pow(z: Tensor, y: Tensor, d1: Tensor, d2: Tensor, c: Any) -> tuple[Tensor, Tensor]:
    """``z ** c``'s, zero past a non-negative integer ``c`` (defined at ``z = 0``)."""
    out = []
    for q in (3, 4):
        if float(c) == int(c) and 0 <= c < q:
            out.append(torch.zeros_like(d2))
        else:
            out.append(math.prod(c - i for i in range(q)) * z ** (c - q))
    return out[0], out[1]


def _sigmoid_higher(s: Tensor, d1: Tensor, d2: Tensor) -> tuple[Tensor, Tensor]:
    d3 = d2 * (1 - 2 * s) - 2 * d1 * d1
    return d3, d3 * (1 - 2 * s) - 6 * d1 * d2


def _silu(z: Tensor, y: Tensor, d1: Tensor, d2: Tensor) -> tuple[Tensor, Tensor]:
    """``z s(z)``: its ``n``-th derivative is ``z s^(n) + n s^(n - 1)``, ``s`` the sigmoid."""
    s = torch.sigmoid(z)
    s1 = s * (1 - s)
    s2 = s1 * (1 - 2 * s)
    s3, s4 = _sigmoid_higher(s, s1, s2)
    return z * s3 + 3 * s2, z * s4 + 4 * s3


def _tanh(z: Tensor, y: Tensor, d1: Tensor, d2: Tensor) -> tuple[Tensor, Tensor]:
    d3 = -2 * (d1 * d1 + y * d2)
    return d3, -2 * (3 * d1 * d2 + y * d3)


# The third and fourth derivatives of element-wise operations, from the input, the value and
# the first two derivatives.
_HIGHER: dict[Any, Callable[..., tuple[Tensor, Tensor]]] = {
    aten.tanh.default: _tanh,
    aten.sigmoid.default: lambda z, y, d1, d2: _sigmoid_higher(y, d1, d2),
    aten.silu.default: _silu,
    aten.exp.default: lambda z, y, d1, d2: (y, y),
    aten.sin.default: lambda z, y, d1, d2: (-d1, y),
    aten.cos.default: lambda z, y, d1, d2: (-d1, y),
    aten.log.default: lambda z, y, d1, d2: (-2 * d2 / z, -6 * d1**4),
    aten.reciprocal.default: _power(-1.0),
    aten.sqrt.default: _power(0.5),
    aten.rsqrt.default: _power(-0.5),
    aten.pow.Tensor_Scalar: _pow,
}


# Operations linear in their first argument (the others constant).
_LINEAR = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.select.int,
    aten.slice.Tensor, aten.sum.default, aten.sum.dim_IntList, aten.mean.dim,
    aten.mean.default, aten.neg.default, aten.clone.default, aten.alias.default,
    aten._to_copy.default, aten.index_select.default, aten.flip.default,
    aten.repeat.default, aten.diagonal.default,
}  # fmt: skip
_VIEWS = {aten.view.default, aten._unsafe_view.default}
_PRODUCTS = {aten.mul.Tensor, aten.mm.default, aten.bmm.default, aten.matmul.default,
             aten.addmm.default}  # fmt: skip


# The traces holding an operation without a rule here (their calls nest second-order sweeps).
_UNSUPPORTED: weakref.WeakSet[Traced] = weakref.WeakSet()


def taylor_sweep(
    f: Callable[[Tensor], Tensor],
    x: Tensor,
    directions: Tensor,
    order: int,
    *,
    weights: Tensor | None,
    chunk: int,
) -> Tensor | None:
    """``(v_k . grad)^order f`` of a batch-first per-sample function, ``chunk`` directions at a
    time: each term ``[K, B, *out]`` with ``weights=None``, else their sum with the weights
    ``[K]`` or ``[K, B]``; ``None`` where the program cannot be run or holds an operation
    without a rule here."""
    if order < 2:
        raise InternalError(f"taylor_sweep: order {order} (2 or more)")
    program = program_of(f, x)
    if program is None or program.traced in _UNSUPPORTED:
        return None
    parts = []
    for start in range(0, int(directions.shape[0]), chunk):
        w = None if weights is None else weights[start : start + chunk]
        try:
            part = _run(program, x, directions[start : start + chunk], order, w)
        except Unsupported:
            _UNSUPPORTED.add(program.traced)
            return None
        parts.append(part)
    return torch.cat(parts) if weights is None else functools.reduce(torch.add, parts)


def _run(
    program: Program, x: Tensor, directions: Tensor, order: int, weights: Tensor | None
) -> Tensor:
    """One chunk of directions of :func:`taylor_sweep`."""
    k = int(directions.shape[0])
    v = directions.to(x.dtype)  # [K, 1, *in] stays shared until an operation mixes in the samples
    per_sample = weights is not None and weights.ndim == 2
    apart = weights is None or per_sample
    w = None if apart or weights is None else weights.to(x.dtype)
    sweep = HighSweep(order, k, w, apart)
    seed = Series([v, *[None] * (order - 2)], None)
    y, out = program.evaluate(x, sweep, seed)
    top = out.top if isinstance(out, Series) else None
    if top is None:
        top = y.new_zeros((k, *y.shape) if apart else y.shape)
    else:  # (terms shared by the samples, as the directions, broadcast)
        top = lift(top, y.ndim).expand(k, *y.shape) if apart else top.expand(y.shape)
    terms = math.factorial(order) * top
    if weights is None or not apart:
        return terms
    w2 = weights.to(terms.dtype).reshape(*weights.shape, *([1] * (terms.ndim - 2)))
    return (w2 * terms).sum(0)
