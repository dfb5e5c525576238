"""Conformance sweep over the primitives reachable from ``jax.numpy``, ``jax.lax``, ``jax.nn``
and ``jax.scipy``: for each case of :data:`CASES` (a single-sample float64 function and the
shape and domain of its input), divjac against JAX's own transforms.

- ``jacobian`` (``batch_axis=None``; and batched, of the vmapped function) equals ``jacrev``;
- the detected pattern misses no nonzero of the dense Jacobian;
- ``divergence`` of a square Jacobian equals its trace;
- ``hessian_diagonal`` and ``laplacian`` of the summed output equal ``jax.hessian``'s.

The primitives the cases reach, and how divjac handles each (an exact rule of its table, the
dense fallback, or a refusal with a divjac error), are written to ``docs/conformance-jax.md``;
``test_coverage_doc_is_current`` fails when that file is stale (``DIVJAC_UPDATE_DOCS=1``
rewrites it). The default run checks :data:`FAST` only; the whole sweep and the table are
``slow`` (``pytest -m slow -n 0 tests/jax/test_conformance.py``).
"""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import jax.scipy.special as jss
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore

import divjac
from divjac.jax import divergence, hessian_diagonal, jacobian, laplacian, sparsity
from divjac.jax._table import TABLE

DOC = Path(__file__).resolve().parents[2] / "docs" / "conformance-jax.md"


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[[jax.Array], jax.Array]
    shape: tuple[int, ...] = (4,)
    domain: str = "real"  # "real", "pos" (> 0.2), "unit" (|x| < 0.8), "unit_pos" (0.1 .. 0.9),
    # "spd" (the identity times 3 plus noise)
    second: bool = True  # smooth enough at the sample for second-order checks


def _x(case: Case, batch: int | None = None) -> jax.Array:
    shape = case.shape if batch is None else (batch, *case.shape)
    x = jax.random.normal(jax.random.key(len(case.name)), shape)
    if case.domain == "pos":
        return jnp.abs(x) + 0.2
    if case.domain == "unit":
        return 0.8 * jnp.tanh(x)
    if case.domain == "unit_pos":
        return 0.5 + 0.4 * jnp.tanh(x)
    if case.domain == "spd":
        return x + 3 * jnp.eye(case.shape[-1])
    return x


M = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)))
IDX = jnp.array([3, 0, 2, 2])
K3 = jnp.asarray(np.random.default_rng(1).standard_normal((3, 3, 1, 1)))


def _sym(a):
    return a @ a.T + 3 * jnp.eye(a.shape[-1])


_UNARY_JNP = [
    "sin", "cos", "tan", "sinh", "cosh", "tanh", "arcsinh", "arctan", "exp", "exp2", "expm1",
    "square", "abs", "negative", "positive", "cbrt", "sinc", "deg2rad", "rad2deg", "fabs",
    "conjugate", "real", "imag", "round", "floor", "ceil", "sign", "trunc", "rint",
    "nan_to_num", "i0", "logaddexp2_self",
]  # fmt: skip
_POS_JNP = ["log", "log1p", "log2", "log10", "sqrt", "reciprocal", "arccosh_shift", "rsqrt"]
_UNIT_JNP = ["arcsin", "arccos", "arctanh"]


def _jnp_unary(name: str) -> Callable:
    if name == "logaddexp2_self":
        return lambda x: jnp.logaddexp2(x, 2 * x)
    if name == "arccosh_shift":
        return lambda x: jnp.arccosh(x + 1.0)
    if name == "rsqrt":
        return lax.rsqrt
    return getattr(jnp, name)


CASES: list[Case] = [
    *(Case(f"jnp.{n}", _jnp_unary(n), second=n not in ("abs", "fabs")) for n in _UNARY_JNP),
    *(Case(f"jnp.{n}", _jnp_unary(n), domain="pos") for n in _POS_JNP),
    *(Case(f"jnp.{n}", _jnp_unary(n), domain="unit") for n in _UNIT_JNP),
    # binary element-wise, with a shifted copy of the input
    *(
        Case(
            f"jnp.{n}",
            (lambda op: lambda x: op(x, jnp.roll(x, 1) + 0.1))(getattr(jnp, n)),
            second=n not in ("maximum", "minimum", "fmax", "fmin", "remainder", "fmod"),
        )
        for n in [
            "add",
            "subtract",
            "multiply",
            "divide",
            "maximum",
            "minimum",
            "fmax",
            "fmin",
            "arctan2",
            "hypot",
            "logaddexp",
            "copysign",
            "remainder",
            "fmod",
            "heaviside",
        ]
    ),
    Case("jnp.power", lambda x: jnp.power(x, jnp.roll(x, 1)), domain="pos"),
    Case("jnp.float_power", lambda x: jnp.float_power(x, 2.5), domain="pos"),
    Case("lax.integer_pow", lambda x: lax.integer_pow(x, 3)),
    Case("jnp.where", lambda x: jnp.where(x > 0, x**2, jnp.sin(x))),
    Case("jnp.clip", lambda x: jnp.clip(x, -0.5, 0.5) * x, second=False),
    Case("lax.clamp", lambda x: lax.clamp(-0.5, x, 0.5), second=False),
    Case("jnp.select", lambda x: jnp.select([x > 1, x < -1], [x, -x], x**3)),
    Case("lax.reduce_precision", lambda x: lax.reduce_precision(x, 8, 23)),
    Case("lax.stop_gradient", lambda x: x * lax.stop_gradient(x)),
    Case("lax.convert_element_type", lambda x: (2 * x.astype(jnp.float32)).astype(x.dtype)),
    Case("lax.bitcast", lambda x: x + lax.bitcast_convert_type(x, jnp.int64).astype(x.dtype) * 0),
    Case("jnp.isfinite", lambda x: jnp.where(jnp.isfinite(x), x, 0.0) * x),
    Case("lax.optimization_barrier", lambda x: lax.optimization_barrier(x) * x),
    # complex intermediates
    Case("jnp.complex_abs", lambda x: jnp.abs(x[:2] + 1j * x[2:])),
    Case("jnp.angle", lambda x: jnp.angle(x[:2] + 1j * x[2:])),
    Case("lax.complex", lambda x: jnp.real(lax.complex(x[:2], x[2:]) ** 2)),
    Case("jnp.conj", lambda x: jnp.imag(jnp.conj(x[:2] + 1j * x[2:]) * (1 + 2j))),
    Case("jnp.exp_complex", lambda x: jnp.real(jnp.exp(x[:2] * 1j + x[2:]))),
    Case("jnp.fft.fft", lambda x: jnp.abs(jnp.fft.fft(x)) ** 2),
    Case("jnp.fft.rfft", lambda x: jnp.real(jnp.fft.irfft(jnp.fft.rfft(x) * (1 + 1j), n=4))),
    Case("jnp.fft.fft2", lambda x: jnp.real(jnp.fft.ifft2(jnp.fft.fft2(x) * 2j)), (2, 3)),
    # data movement
    Case("jnp.reshape", lambda x: jnp.reshape(x, (3, 2)).T * 2, (2, 3)),
    Case("jnp.transpose", lambda x: jnp.transpose(x, (2, 0, 1)), (2, 3, 2)),
    Case("jnp.moveaxis", lambda x: jnp.moveaxis(x, (0, 1), (2, 0)), (2, 1, 3)),
    Case("jnp.broadcast_to", lambda x: jnp.broadcast_to(x, (2, 4)) * jnp.arange(2.0)[:, None]),
    Case("jnp.flip", lambda x: jnp.flip(x, 1), (2, 3)),
    Case("jnp.roll", lambda x: jnp.roll(x, 2)),
    Case("jnp.rot90", lambda x: jnp.rot90(x), (2, 3)),
    Case("lax.slice", lambda x: lax.slice(x, (1,), (4,), (2,))),
    Case("jnp.pad", lambda x: jnp.pad(x, (2, 1), mode="reflect")),
    Case("jnp.pad_wrap", lambda x: jnp.pad(x, (1, 2), mode="wrap")),
    Case("lax.pad_negative", lambda x: lax.pad(x, 0.0, [(-1, 2, 1)])),
    Case("jnp.concatenate", lambda x: jnp.concatenate([x, x[::-1] * 2])),
    Case("jnp.stack", lambda x: jnp.stack([x, jnp.sin(x)], 1)),
    Case("jnp.tile", lambda x: jnp.tile(x, 2)),
    Case("jnp.repeat", lambda x: jnp.repeat(x, 2)),
    Case("jnp.split", lambda x: jnp.split(x, 2)[1] * jnp.split(x, 2)[0]),
    Case("jnp.squeeze", lambda x: jnp.squeeze(x[None], 0) ** 2),
    Case("jnp.expand_dims", lambda x: jnp.expand_dims(x, 0) * x),
    Case("jnp.diag", lambda x: jnp.diag(x)),
    Case("jnp.diagonal", lambda x: jnp.diagonal(x), (3, 3)),
    Case("jnp.triu", lambda x: jnp.triu(x), (3, 3)),
    Case("jnp.kron", lambda x: jnp.kron(x[:2], x[2:])),
    # indexing
    Case("gather.take", lambda x: jnp.take(x, IDX)),
    Case("gather.take_along_axis", lambda x: jnp.take_along_axis(x, jnp.argsort(x), 0)),
    Case("gather.fancy", lambda x: x[IDX[:2], 1:], (4, 3)),
    Case("lax.dynamic_slice", lambda x: lax.dynamic_slice(x, (1,), (2,))),
    Case("lax.dynamic_update_slice", lambda x: lax.dynamic_update_slice(x, x[:2] ** 2, (1,))),
    Case("scatter.set", lambda x: x.at[IDX[:2]].set(x[2:] ** 2)),
    Case("scatter.add", lambda x: x.at[IDX].add(x**2)),
    Case("scatter.mul", lambda x: x.at[IDX[:2]].multiply(x[2:], unique_indices=True)),
    Case("scatter.min", lambda x: x.at[IDX].min(-x), second=False),
    Case("scatter.max", lambda x: x.at[IDX].max(-x), second=False),
    Case("jnp.sort", lambda x: jnp.sort(x), second=False),
    Case("jnp.argsort", lambda x: x[jnp.argsort(x)], second=False),
    Case("lax.top_k", lambda x: lax.top_k(x, 2)[0], second=False),
    Case("jnp.searchsorted", lambda x: x * jnp.searchsorted(jnp.array([0.0]), x)),
    # reductions and scans
    Case("jnp.sum", lambda x: jnp.sum(x**2, axis=0), (3, 2)),
    Case("jnp.prod", lambda x: jnp.prod(x, axis=1), (2, 3)),
    Case("jnp.max", lambda x: jnp.max(x, axis=1), (2, 3), second=False),
    Case("jnp.min", lambda x: jnp.min(x, axis=0), (2, 3), second=False),
    Case("jnp.mean_var", lambda x: jnp.var(x) + jnp.mean(x) * x),
    Case("jnp.linalg.norm", lambda x: jnp.linalg.norm(x) * x),
    Case("jnp.cumsum", lambda x: jnp.cumsum(x)),
    Case("jnp.cumprod", lambda x: jnp.cumprod(x)),
    Case("lax.cummax", lambda x: lax.cummax(x), second=False),
    Case("lax.cummin", lambda x: lax.cummin(x, reverse=True), second=False),
    Case("lax.cumlogsumexp", lambda x: lax.cumlogsumexp(x)),
    Case("jnp.diff", lambda x: jnp.diff(x) ** 2),
    Case("jnp.convolve", lambda x: jnp.convolve(x, jnp.array([1.0, -2.0, 0.5]), mode="same")),
    Case("jnp.correlate", lambda x: jnp.correlate(x, x[:2], mode="valid")),
    Case("reduce_window.avg", lambda x: lax.reduce_window(x, 0.0, lax.add, (2,), (1,), "VALID")),
    Case(
        "reduce_window.max",
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2,), (1,), "SAME"),
        second=False,
    ),
    Case("jax.nn.logsumexp", lambda x: jax.nn.logsumexp(x, axis=1), (2, 3)),
    # contractions
    Case("jnp.matmul", lambda x: x @ M),
    Case("jnp.einsum", lambda x: jnp.einsum("ij,jk,ik->i", x, M[:3], x), (2, 3)),
    Case("jnp.outer", lambda x: jnp.outer(x, x)),
    Case("jnp.dot_self", lambda x: jnp.dot(x, x) * x),
    Case("jnp.tensordot", lambda x: jnp.tensordot(x, x, axes=([1], [1])), (2, 3)),
    Case(
        "lax.conv",
        lambda x: lax.conv_general_dilated(x[None], K3, (1, 1), "SAME")[0],
        (3, 4, 4),
    ),
    Case(
        "lax.conv_1d", lambda x: lax.conv(x[None, None], jnp.ones((1, 1, 2)), (1,), "VALID")[0, 0]
    ),
    # jax.nn
    *(
        Case(f"jax.nn.{n}", getattr(jax.nn, n), second=n not in ("relu", "relu6", "hard_tanh"))
        for n in [
            "relu",
            "relu6",
            "sigmoid",
            "softplus",
            "silu",
            "gelu",
            "elu",
            "celu",
            "selu",
            "leaky_relu",
            "hard_tanh",
            "log_sigmoid",
            "softmax",
            "log_softmax",
            "tanh",
            "mish",
            "squareplus",
            "sparse_plus",
            "standardize",
        ]
        if hasattr(jax.nn, n)
    ),
    Case("jax.nn.glu", lambda x: jax.nn.glu(x)),
    Case("jax.nn.one_hot", lambda x: jax.nn.one_hot(IDX, 4) @ x),
    Case(  # JAX's own jacfwd and jacrev differ by 1e-7 on dot_product_attention: by hand
        "jax.nn.attention",
        lambda x: jax.nn.softmax(x @ x.T / 2, axis=-1) @ x,
        (3, 2),
    ),
    # jax.scipy.special
    *(
        Case(f"jss.{n}", getattr(jss, n), domain=d)
        for n, d in [
            ("erf", "real"),
            ("erfc", "real"),
            ("erfinv", "unit"),
            ("expit", "real"),
            ("gammaln", "pos"),
            ("digamma", "pos"),
            ("i0e", "real"),
            ("i1e", "real"),
            ("i0", "real"),
            ("i1", "real"),
            ("ndtr", "real"),
            ("log_ndtr", "real"),
            ("entr", "pos"),
            ("gamma", "pos"),
            ("logsumexp", "real"),
            ("softmax", "real"),
            ("sinc", "real"),
            ("expi", "pos"),
        ]
        if hasattr(jss, n)
    ),
    # JAX cannot differentiate exp1 twice (jax.hessian fails): see test_exp1_second_order_...
    Case("jss.exp1", jss.exp1, domain="pos", second=False),
    Case("jss.xlogy", lambda x: jss.xlogy(x, x + 1), domain="pos"),
    Case("jss.xlog1py", lambda x: jss.xlog1py(x, x), domain="pos"),
    Case("jss.polygamma", lambda x: jss.polygamma(1, x), domain="pos"),
    Case("jss.zeta", lambda x: jss.zeta(x + 1.5, 2.0), domain="pos"),
    Case("jss.gammainc", lambda x: jss.gammainc(2.0, x), domain="pos"),
    Case("jss.gammaincc", lambda x: jss.gammaincc(x + 1, 1.5), domain="pos", second=False),
    Case("jss.betainc", lambda x: jss.betainc(2.0, 3.0, x), domain="unit_pos"),
    Case("jss.multigammaln", lambda x: jss.multigammaln(x + 2, 2), domain="pos"),
    Case("jss.logit", lambda x: jss.logit(x), domain="unit_pos"),
    Case("jss.ndtri", lambda x: jss.ndtri(x), domain="unit_pos"),
    Case("jss.bessel_jn", lambda x: jss.bessel_jn(x, v=2)[-1], domain="pos", second=False),
    # jax.scipy.linalg and jnp.linalg
    Case("jnp.linalg.solve", lambda a: jnp.linalg.solve(a, jnp.ones(3)), (3, 3), "spd"),
    Case("jnp.linalg.inv", lambda a: jnp.linalg.inv(a), (3, 3), "spd"),
    Case("jnp.linalg.det", lambda a: jnp.linalg.det(a) * a, (3, 3), "spd"),
    Case("jnp.linalg.slogdet", lambda a: jnp.linalg.slogdet(a)[1] * a, (3, 3), "spd"),
    Case("jnp.linalg.cholesky", lambda a: jnp.linalg.cholesky(_sym(a)), (3, 3)),
    Case("jnp.linalg.qr", lambda a: jnp.linalg.qr(a)[1], (3, 3), "spd"),
    Case("jnp.linalg.eigh", lambda a: jnp.linalg.eigh(_sym(a))[0], (3, 3)),
    Case("jnp.linalg.svd", lambda a: jnp.linalg.svd(a, compute_uv=False), (3, 3), "spd"),
    Case("jnp.linalg.pinv", lambda a: jnp.linalg.pinv(a), (3, 3), "spd"),
    Case("jnp.linalg.lstsq", lambda a: jnp.linalg.lstsq(a, jnp.ones(3))[0], (3, 3), "spd"),
    Case(
        "jsp.linalg.lu_factor",
        lambda a: jsp.linalg.lu_solve(jsp.linalg.lu_factor(a), jnp.ones(3)),
        (3, 3),
        "spd",
    ),
    Case(
        "jsp.linalg.solve_triangular",
        lambda a: jsp.linalg.solve_triangular(jnp.triu(a), jnp.arange(3.0), lower=False),
        (3, 3),
        "spd",
    ),
    Case(
        "jsp.linalg.cho_solve",
        lambda a: jsp.linalg.cho_solve(jsp.linalg.cho_factor(_sym(a)), jnp.ones(3)),
        (3, 3),
    ),
    Case("jsp.linalg.expm", lambda a: jsp.linalg.expm(a / 4), (3, 3)),
    Case(
        "jsp.linalg.eigh_tridiagonal",
        lambda x: jsp.linalg.eigh_tridiagonal(x + 3, x[:3], eigvals_only=True),
        second=False,
    ),
    Case("jnp.linalg.matrix_power", lambda a: jnp.linalg.matrix_power(a, 3), (2, 2)),
    Case("jsp.stats.norm.logpdf", lambda x: jsp.stats.norm.logpdf(x, 0.5, 2.0)),
    Case("jsp.stats.gamma.logpdf", lambda x: jsp.stats.gamma.logpdf(x, 2.0), domain="pos"),
    Case("jsp.stats.t.logpdf", lambda x: jsp.stats.t.logpdf(x, 3.0)),
    Case(
        "jsp.stats.multivariate_normal",
        lambda x: jsp.stats.multivariate_normal.logpdf(x, jnp.zeros(4), jnp.eye(4) * 2) * x,
    ),
    Case("jsp.signal.convolve", lambda x: jsp.signal.convolve(x, jnp.array([1.0, 2.0]))),
    # control flow and custom derivatives
    Case("lax.scan", lambda x: lax.scan(lambda c, v: (jnp.sin(c) * v, c), x, x[::-1] ** 2)[0]),
    Case("lax.fori_loop", lambda x: lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c) + x, x)),
    Case("lax.cond", lambda x: lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)),
    Case("lax.switch", lambda x: lax.switch(1, [jnp.sin, jnp.exp], x)),
    Case("lax.map", lambda x: lax.map(lambda r: jnp.sum(r**2), x), (2, 3)),
    Case("jax.checkpoint", lambda x: jax.checkpoint(lambda y: jnp.sin(y) * y)(x)),
    Case("jax.jit", lambda x: jax.jit(lambda y: jnp.exp(y) @ M)(x)),
    Case("lax.custom_root", lambda x: jnp.sqrt(x), domain="pos"),
    Case(
        "lax.custom_linear_solve", lambda a: jsp.sparse.linalg.cg(_sym(a), jnp.ones(3))[0], (3, 3)
    ),
    Case("jax.nn.relu6_custom_jvp", lambda x: jax.nn.relu6(x) * x, second=False),
]
_seen: set[str] = set()
assert not [c.name for c in CASES if c.name in _seen or _seen.add(c.name)], "duplicate names"


# --- the checks ---------------------------------------------------------------------------------

B = 2


def _primitives(closed: jcore.ClosedJaxpr) -> set[str]:
    """Names of the primitives of a program and of the programs nested in it."""
    names: set[str] = set()

    def walk(jaxpr: jcore.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return names


@dataclass
class Outcome:
    """How divjac handled one case: the primitives it reached, those it fell back on (dense)
    and the refusal (a divjac error's message), if any."""

    primitives: set[str]
    fallbacks: frozenset[str]
    refused: str | None


def _detect(case: Case) -> tuple[Outcome, divjac.SparsityPattern | None]:
    x = _x(case)
    prims = _primitives(jax.make_jaxpr(case.fn)(x))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", divjac.DenseFallbackWarning)
            pattern = sparsity(case.fn, batch_axis=None)(x)
    except divjac.DivjacError as err:
        return Outcome(prims, frozenset(), f"{type(err).__name__}: {err}"), None
    return Outcome(prims, pattern.dense_fallbacks, None), pattern


def _jax_differentiates_batched_twice(case: Case, xb: jax.Array) -> bool:
    """Whether JAX's own ``jvp`` of ``jvp`` of the summed case, batched by ``vmap`` and staged
    by ``jit`` (the program divjac's batched second-order transforms read), traces: JAX's
    batching defect jax-ml/jax#16374 fails it for ``jss.i1`` from JAX 0.12 on."""
    ub = jax.jit(jax.vmap(lambda s: jnp.sum(case.fn(s))))
    ones = jnp.ones_like(xb)
    try:
        jax.make_jaxpr(lambda a: jax.jvp(lambda b: jax.jvp(ub, (b,), (ones,))[1], (a,), (ones,)))(
            xb
        )
    except TypeError:
        return False
    return True


def _divjac(
    case: Case, square: bool, *, batched_second: bool
) -> Callable[[jax.Array, jax.Array], dict[str, jax.Array]]:
    """Every divjac result of a case, in one program (one compilation per case). Without
    ``batched_second``, the second-order results batch after the transform (the way out that
    divjac's refusal names)."""
    batched = jax.vmap(case.fn)
    u = lambda s: jnp.sum(case.fn(s))  # noqa: E731
    ub = jax.vmap(u)

    def hessian_diagonal_of(xb: jax.Array) -> jax.Array:
        if batched_second:
            return hessian_diagonal(ub)(xb)
        return jax.vmap(hessian_diagonal(u, batch_axis=None))(xb)

    def laplacian_of(xb: jax.Array, method: str) -> jax.Array:
        if batched_second:
            return laplacian(ub, method=method)(xb)
        return jax.vmap(laplacian(u, batch_axis=None, method=method))(xb)

    def results(x: jax.Array, xb: jax.Array) -> dict[str, jax.Array]:
        out = {
            f"jacobian {mode}": jacobian(case.fn, batch_axis=None, mode=mode)(x)
            for mode in ("fwd", "rev", "sparse")
        }
        out["batched jacobian"] = jacobian(batched)(xb)
        if square:
            for method in ("exact", "sparse"):
                out[f"divergence {method}"] = divergence(batched, method=method)(xb)
        if case.second:
            out["hessian_diagonal"] = hessian_diagonal_of(xb).reshape(B, -1)
            for method in ("exact", "sparse"):
                out[f"laplacian {method}"] = laplacian_of(xb, method)
        return out

    return results


def _reference(case: Case, square: bool) -> Callable[[jax.Array, jax.Array], dict[str, jax.Array]]:
    """The same from JAX's transforms."""

    def results(x: jax.Array, xb: jax.Array) -> dict[str, jax.Array]:
        J = jax.jacrev(case.fn)(x)
        out = {f"jacobian {mode}": J for mode in ("fwd", "rev", "sparse")}
        out["jacfwd"] = jax.jacfwd(case.fn)(x)
        Jb = jax.vmap(jax.jacrev(case.fn))(xb)
        out["batched jacobian"] = Jb
        if square:
            trace = jnp.trace(Jb.reshape(B, x.size, x.size), axis1=1, axis2=2)
            out["divergence exact"] = out["divergence sparse"] = trace
        if case.second:
            H = jax.vmap(jax.hessian(lambda s: jnp.sum(case.fn(s))))(xb).reshape(B, x.size, -1)
            out["hessian_diagonal"] = jnp.diagonal(H, axis1=1, axis2=2)
            out["laplacian exact"] = out["laplacian sparse"] = jnp.trace(H, axis1=1, axis2=2)
        return out

    return results


def check_case(case: Case) -> None:
    """One case: detection, then every result against JAX's (see the module's docstring)."""
    x, xb = _x(case), _x(case, B)
    outcome, pattern = _detect(case)
    if outcome.refused is not None:
        # a refusal names a primitive the case reaches
        assert any(p in outcome.refused for p in outcome.primitives), outcome.refused
        return
    out_shape = jax.eval_shape(case.fn, x).shape
    square = out_shape == x.shape
    want = jax.jit(_reference(case, square))(x, xb)
    truth = np.asarray(want.pop("jacfwd"))
    np.testing.assert_allclose(truth, want["jacobian rev"], atol=1e-10, err_msg="jacfwd/jacrev")
    detected = pattern.csr.toarray()
    missed = (truth.reshape(detected.shape) != 0) & ~detected
    assert not missed.any(), f"{case.name}: the pattern misses {int(missed.sum())} nonzeros"
    batched_second = not case.second or _jax_differentiates_batched_twice(case, xb)
    if not batched_second:  # refused, naming JAX's defect, and computed by the way out
        ub = jax.vmap(lambda s: jnp.sum(case.fn(s)))
        with pytest.raises(divjac.UnsupportedOperationError, match="jax-ml/jax#16374"):
            laplacian(ub)(xb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", divjac.DenseFallbackWarning)
        got = jax.jit(_divjac(case, square, batched_second=batched_second))(x, xb)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-8, atol=1e-10, err_msg=key)


# jss.spence: left out, JAX's own jacfwd and jacrev disagree (nan off the diagonal).
FAST = ["jnp.complex_abs", "scatter.add", "jnp.linalg.solve"]
# Known defects (xfail, strict: they fail the sweep once fixed, to be moved back).
KNOWN = {
    # not divjac's: JAX's jacrev cannot differentiate its while_loop (the reference fails)
    "jsp.linalg.eigh_tridiagonal": "jax.jacrev cannot differentiate it",
}


@pytest.mark.parametrize("name", FAST)
def test_conformance_fast(name):
    check_case(next(c for c in CASES if c.name == name))


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(reason=KNOWN[c.name], strict=True))
        if c.name in KNOWN
        else c
        for c in CASES
    ],
    ids=lambda c: c.name,
)
def test_conformance(case):
    check_case(case)


# --- the coverage table ------------------------------------------------------------------------


def coverage() -> str:
    """The coverage table of ``docs/conformance-jax.md`` (from detection alone: seconds)."""
    cases: dict[str, int] = Counter()
    fallback: dict[str, int] = Counter()
    refused: dict[str, str] = {}
    for case in CASES:
        outcome, _ = _detect(case)
        for p in outcome.primitives:
            cases[p] += 1
        for p in outcome.fallbacks:
            fallback[p] += 1
        if outcome.refused is not None:
            for p in outcome.primitives:
                if p in outcome.refused:
                    refused[p] = outcome.refused.splitlines()[0]
    status = defaultdict(list)
    rows = []
    for p in sorted(cases):
        if p in refused:
            how = f"refused: {refused[p]}"
        elif p in fallback:
            how = f"dense fallback ({fallback[p]} of {cases[p]} cases)"
        elif p in TABLE:
            how = "exact rule"
        else:
            how = "derived from its JVP/VJP rule"
        status[how.split(" (")[0].split(":")[0]].append(p)
        rows.append(f"| `{p}` | {cases[p]} | {how} |")
    unreached = sorted(set(TABLE) - set(cases))
    summary = ", ".join(f"{k}: {len(v)}" for k, v in sorted(status.items()))
    return "\n".join(
        [
            "# JAX conformance coverage",
            "",
            "Generated by `tests/jax/test_conformance.py` (`DIVJAC_UPDATE_DOCS=1` rewrites it);",
            f"{len(CASES)} cases over `jax.numpy`, `jax.lax`, `jax.nn` and `jax.scipy`, each a",
            "float64 single-sample function checked against `jax.jacrev` / `jax.jacfwd` /",
            "`jax.hessian` (`pytest -m slow tests/jax/test_conformance.py`).",
            "",
            f"Rendered on JAX {jax.__version__}, the pinned release. On another, the primitives "
            "reached and the",
            "counts differ; `test_coverage_doc_is_current` then checks that each primitive "
            "reached there has an",
            "exact rule or a derivation, or is handled as this table says.",
            "",
            f"{len(cases)} primitives reached; {summary}.",
            "",
            "| primitive | cases | how divjac handles it |",
            "|---|---|---|",
            *rows,
            "",
            f"## Primitives of divjac's table that no case reaches ({len(unreached)})",
            "",
            ", ".join(f"`{p}`" for p in unreached),
            "",
        ]
    )


def _handling(doc: str) -> dict[str, str]:
    """How each primitive of a coverage table is handled (``exact rule``, ``dense fallback``,
    ``refused``, ``derived from its JVP/VJP rule``), without the counts and messages."""
    rows = re.findall(r"^\| `([^`]+)` \| \d+ \| ([^(:|]+)", doc, flags=re.MULTILINE)
    return {p: how.strip() for p, how in rows}


@pytest.mark.slow  # detection of every case: about a minute on 2 shared cores
def test_coverage_doc_is_current():
    """On the JAX the doc was rendered on, the doc is exactly the table; on another, every
    primitive reached there is handled without a refusal or a dense fallback, or as the doc
    says (a primitive that a new JAX refuses or falls back on fails it)."""
    text = coverage()
    if os.environ.get("DIVJAC_UPDATE_DOCS") == "1":
        DOC.write_text(text)
    doc = DOC.read_text() if DOC.exists() else ""
    rendered_on = re.search(r"Rendered on JAX (\S+),", doc)
    if rendered_on is None or rendered_on[1] == jax.__version__:
        assert doc == text, "docs/conformance-jax.md is stale: rerun with DIVJAC_UPDATE_DOCS=1"
        return
    documented = _handling(doc)
    unlisted = {
        p: how
        for p, how in _handling(text).items()
        if how not in ("exact rule", "derived from its JVP/VJP rule") and documented.get(p) != how
    }
    assert not unlisted, (
        f"on JAX {jax.__version__}, handled otherwise than docs/conformance-jax.md "
        f"(rendered on JAX {rendered_on[1]}) says: {unlisted}"
    )


def test_sparse_jacobian_of_a_piecewise_constant_function_is_zero():
    """No nonzero in the pattern (``sign``, ``floor``): the dense Jacobian is all zeros (the
    scatter of no values failed to broadcast)."""
    import jax
    import jax.numpy as jnp

    from divjac.jax import jacobian

    x = jax.random.normal(jax.random.key(0), (2, 4), jnp.float64)
    for fn in (jnp.sign, jnp.floor):
        got = jacobian(fn, mode="sparse")(x)
        np.testing.assert_array_equal(got, np.zeros((2, 4, 4)))


# --- custom_jvp rules JAX cannot differentiate again ---------------------------------------------


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def _power(k, x):
    return x**k


@_power.defjvp
@jax.jit  # the rule's k is traced, and passed on to _power: expn's shape
def _power_jitted_rule(k, primals, tangents):
    ((x,), (t,)) = primals, tangents
    return _power(k, x), k * _power(k - 1, x) * t


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def _power_plain(k, x):
    return x**k


@_power_plain.defjvp
def _power_plain_rule(k, primals, tangents):
    ((x,), (t,)) = primals, tangents
    return _power_plain(k, x), k * _power_plain(k - 1, x) * t


def _second_order_refused(u, x, name):
    """JAX's own Hessian of ``u`` fails (a tracer of the rule's ended trace), and divjac's
    second-order transforms raise :class:`UnsupportedOperationError` naming ``name``, eagerly
    and under the caller's ``jax.jit`` (whose compiler, not divjac, would have failed)."""
    with pytest.raises((TypeError, jax.errors.UnexpectedTracerError)):
        jax.vmap(jax.hessian(u))(x)
    ub = jax.vmap(u)
    for transform in (
        laplacian(ub),
        laplacian(ub, method="exact"),
        laplacian(ub, method="sparse"),
        hessian_diagonal(ub),
        jax.jit(laplacian(ub)),
    ):
        with pytest.raises(divjac.UnsupportedOperationError, match=name):
            transform(x)
    with pytest.raises(divjac.UnsupportedOperationError, match="custom_jvp"):
        divergence(jax.vmap(jax.grad(u)))(x)


def test_exp1_second_order_is_refused_naming_expn():
    """``jax.scipy.special.exp1`` is ``expn(1, x)``, whose jitted JVP rule calls ``expn`` with
    the order as a traced value: up to JAX 0.11 JAX's ``jax.hessian`` of it fails, so no
    second-order result exists, and divjac names ``expn`` (no raw JAX TypeError). A JAX whose
    Hessian of it succeeds (0.12 on) gets divjac's second-order results, equal to
    ``exp1'' = exp(-x) (1/x + 1/x^2)``. First order stays exact against
    ``exp1' = -exp(-x)/x``."""
    x = jnp.abs(jax.random.normal(jax.random.key(0), (2, 3))) + 0.2
    u = lambda s: jnp.sum(jss.exp1(s))  # noqa: E731
    try:
        jax.hessian(u)(x[0])
    except (TypeError, jax.errors.UnexpectedTracerError):
        _second_order_refused(u, x, "expn")
    else:
        ub = jax.vmap(u)
        want = jnp.sum(jnp.exp(-x) * (1 / x + 1 / x**2), axis=1)
        for second in (
            laplacian(ub),
            laplacian(ub, method="exact"),
            laplacian(ub, method="sparse"),
            jax.jit(laplacian(ub)),
            lambda x: hessian_diagonal(ub)(x).sum(1),
        ):
            np.testing.assert_allclose(second(x), want, rtol=1e-12)
    want = jax.vmap(jnp.diag)(-jnp.exp(-x) / x)
    np.testing.assert_allclose(jacobian(jss.exp1)(x), want, rtol=1e-12)


def test_user_custom_jvp_with_a_jitted_rule_passing_a_traced_argument_is_refused():
    """A user's ``custom_jvp`` of exp1's shape (a jitted rule passing its traced
    non-differentiable argument to a ``custom_jvp`` function) is refused naming it; the same
    function with a plain rule gets the Laplacian of ``jax.hessian`` (float64)."""
    x = jax.random.normal(jax.random.key(1), (2, 3))
    _second_order_refused(lambda s: jnp.sum(jnp.sin(_power(3, s))), x, "_power")
    u = lambda s: jnp.sum(jnp.sin(_power_plain(3, s)))  # noqa: E731
    want = jax.vmap(lambda s: jnp.trace(jax.hessian(u)(s)))(x)
    np.testing.assert_allclose(laplacian(jax.vmap(u))(x), want, rtol=1e-12)
    np.testing.assert_allclose(hessian_diagonal(jax.vmap(u))(x).sum(1), want, rtol=1e-12)


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def _half(k, x):
    return lax.full_like(x, 0.5)  # does not vary over a vmap's batch


@_half.defjvp
def _half_rule(k, primals, tangents):
    ((x,), (t,)) = primals, tangents
    return _half(k, x), x * t


@jax.custom_jvp
def _sin_with_a_constant_inside(x):
    return jnp.sin(x)


@_sin_with_a_constant_inside.defjvp
def _sin_with_a_constant_inside_rule(primals, tangents):
    ((x,), (t,)) = primals, tangents
    return jnp.sin(x), 2 * _half(1, x) * jnp.cos(x) * t  # i1's shape from JAX 0.12 on


def test_batched_custom_jvp_whose_rule_jax_cannot_differentiate_is_refused_naming_the_way_out():
    """JAX's batching defect (jax-ml/jax#16374): a ``custom_jvp`` function of a vmapped ``f``
    whose rule calls a ``custom_jvp`` function with an output that does not vary over the batch
    (``jax.scipy.special.i1``'s rule from JAX 0.12 on) cannot be differentiated twice, by
    ``jax.hessian`` of ``jax.jit(jax.vmap(u))`` either. divjac's second-order transforms of the
    batched function raise :class:`UnsupportedOperationError` naming the function, the defect
    and the way out, batching after the transform, which equals ``jax.hessian``."""
    x = jax.random.normal(jax.random.key(2), (2, 3))
    u = lambda s: jnp.sum(_sin_with_a_constant_inside(s))  # noqa: E731
    ones = jnp.ones_like(x)
    with pytest.raises(TypeError):
        jax.jvp(lambda a: jax.jvp(jax.jit(jax.vmap(u)), (a,), (ones,))[1], (x,), (ones,))
    ub = jax.vmap(u)
    for transform in (laplacian(ub), hessian_diagonal(ub), jax.jit(laplacian(ub))):
        with pytest.raises(divjac.UnsupportedOperationError, match="_sin_with_a_constant_inside"):
            transform(x)
    with pytest.raises(divjac.UnsupportedOperationError, match=r"jax-ml/jax#16374.*batch_axis"):
        laplacian(ub)(x)
    want = jax.vmap(lambda s: jnp.trace(jax.hessian(u)(s)))(x)
    np.testing.assert_allclose(jax.vmap(laplacian(u, batch_axis=None))(x), want, rtol=1e-12)
