"""Every transform x method x context on a model zoo, against brute force (issue 22).

Brute force is ``vmap(jacfwd)`` of the per-sample function for first order and
``vmap(jax.hessian)`` for second order; stochastic methods get fixed probes and are compared to
the same estimate computed from the brute-force matrices. The contexts: an eager call then the
same under ``jit``, ``jit`` first then eager, an outer ``vmap``, ``jax.grad`` through the
transform w.r.t. the parameters (eager and under ``jit``), float32, and a Python float argument.

The default run covers every transform on the MLP (eager then jit), two sparse transforms on
the CNN, and each context once; the whole product (344 cases, about 27 minutes on 2 busy
cores) is ``@pytest.mark.slow``, in ``make test-slow`` and CI. The brute force runs under
``jit`` and once per process for the transforms that share it (eager, ``vmap(hessian)`` of the
U-Net took 16 s per case).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import divjac.jax as dj
from tests.jax.zoo import ZOO, Model

K = 3  # probes of the stochastic methods

# name -> (transform of (f or u), what it computes, whether it takes u, whether it takes probes)
TRANSFORMS: dict[
    str, tuple[Callable[[Callable[..., Any]], Callable[..., Any]], str, bool, bool]
] = {
    "jacobian-fwd": (lambda f: dj.jacobian(f, 1, mode="fwd"), "jacobian", False, False),
    "jacobian-rev": (lambda f: dj.jacobian(f, 1, mode="rev"), "jacobian", False, False),
    "jacobian-sparse": (lambda f: dj.jacobian(f, 1, mode="sparse"), "jacobian", False, False),
    "jacobian-auto": (lambda f: dj.jacobian(f, 1), "jacobian", False, False),
    "divergence-exact-fwd": (
        lambda f: dj.divergence(f, 1, method="exact", mode="fwd"),
        "divergence",
        False,
        False,
    ),
    "divergence-exact-rev": (
        lambda f: dj.divergence(f, 1, method="exact", mode="rev"),
        "divergence",
        False,
        False,
    ),
    "divergence-sparse": (
        lambda f: dj.divergence(f, 1, method="sparse"),
        "divergence",
        False,
        False,
    ),
    "divergence-auto": (lambda f: dj.divergence(f, 1), "divergence", False, False),
    "divergence-hutchinson": (
        lambda f: dj.divergence(f, 1, method="hutchinson", num_probes=K),
        "hutchinson-divergence",
        False,
        True,
    ),
    "value_and_divergence": (
        lambda f: dj.value_and_divergence(f, 1),
        "value-divergence",
        False,
        False,
    ),
    "grad_divergence": (lambda f: dj.grad_divergence(f, 1), "grad-divergence", False, False),
    "laplacian-exact": (lambda u: dj.laplacian(u, 1, method="exact"), "laplacian", True, False),
    "laplacian-sparse": (lambda u: dj.laplacian(u, 1, method="sparse"), "laplacian", True, False),
    "laplacian-auto": (lambda u: dj.laplacian(u, 1), "laplacian", True, False),
    "laplacian-hutchinson": (
        lambda u: dj.laplacian(u, 1, method="hutchinson", num_probes=K),
        "hutchinson-laplacian",
        True,
        True,
    ),
    "hessian_diagonal-exact": (
        lambda u: dj.hessian_diagonal(u, 1, method="exact"),
        "hessian-diagonal",
        True,
        False,
    ),
    "hessian_diagonal-sparse": (
        lambda u: dj.hessian_diagonal(u, 1, method="sparse"),
        "hessian-diagonal",
        True,
        False,
    ),
    "hessian_diagonal-hutchinson": (
        lambda u: dj.hessian_diagonal(u, 1, method="hutchinson", num_probes=K),
        "hutchinson-diagonal",
        True,
        True,
    ),
    "hessian": (lambda u: dj.hessian(u, 1), "hessian", True, False),
}
TRANSFORMS_TAKING_U = {kind: takes_u for _, kind, takes_u, _ in TRANSFORMS.values()}
CORE = ("jacobian-auto", "divergence-auto", "divergence-hutchinson", "laplacian-auto", "hessian")
CONTEXTS = (
    "eager-then-jit",
    "jit-then-eager",
    "vmap",
    "grad",
    "jit-grad",
    "float32",
    "python-float",
)


def _scalar(model: Model) -> Callable[..., jax.Array]:
    """``u``: one scalar per sample from the model's output."""

    def u(p: Any, x: jax.Array, scale: float = 1.0) -> jax.Array:
        y = jnp.sin(model.f(p, x, scale))
        return jnp.sum(y.reshape(y.shape[0], -1), axis=1)

    return u


def _brute_force(
    kind: str, fun: Callable[..., Any], params: Any, x: jax.Array, extra: tuple, probes: Any
) -> Any:
    """What the transform computes, from ``vmap(jacfwd)`` / ``vmap(hessian)`` of one sample."""
    B, sample = x.shape[0], x.shape[1:]
    n = math.prod(sample)

    def one(p: Any, xs: jax.Array) -> jax.Array:
        return fun(p, xs[None], *extra)[0]

    if kind in ("jacobian", "divergence", "value-divergence", "hutchinson-divergence"):
        J = jax.vmap(jax.jacfwd(one, 1), (None, 0))(params, x)
        square = J.reshape(B, n, n)
        if kind == "jacobian":
            return J
        if kind == "hutchinson-divergence" and n > K:
            v = probes.reshape(K, B, n)
            return jnp.einsum("kbi,bij,kbj->b", v, square, v) / K
        div = jnp.trace(square, axis1=1, axis2=2)
        return (fun(params, x, *extra), div) if kind == "value-divergence" else div
    if kind == "grad-divergence":

        def trace(xs: jax.Array) -> jax.Array:
            return jnp.trace(jax.jacfwd(one, 1)(params, xs).reshape(n, n))

        return jax.vmap(jax.grad(trace))(x)
    H = jax.vmap(jax.hessian(one, 1), (None, 0))(params, x)
    square = H.reshape(B, n, n)
    if kind == "hessian":
        return H
    # A budget of K >= n probes is the exact sum (n directions, no error).
    if kind == "laplacian" or (kind == "hutchinson-laplacian" and n <= K):
        return jnp.trace(square, axis1=1, axis2=2)
    if kind == "hessian-diagonal" or (kind == "hutchinson-diagonal" and n <= K):
        return jnp.diagonal(square, axis1=1, axis2=2).reshape(x.shape)
    v = probes.reshape(K, B, n)
    if kind == "hutchinson-laplacian":
        return jnp.einsum("kbi,bij,kbj->b", v, square, v) / K
    return (jnp.einsum("kbi,bij,kbj->bi", v, square, v) / K).reshape(x.shape)


def _total(tree: Any) -> jax.Array:
    return sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(tree))


def _probes(x: jax.Array) -> jax.Array:
    """The stochastic methods' fixed Rademacher probes for the batch ``x``."""
    signs = np.random.default_rng(1).choice([-1.0, 1.0], size=(K, *x.shape))
    return jnp.asarray(signs, x.dtype)


@functools.cache
def _reference(model_name: str, kind: str, dtype: Any, extra: tuple, form: str) -> Any:
    """The brute force for a case, under ``jit`` (eager ``vmap(hessian)`` of the U-Net takes
    seconds per call) and computed once per process for the transforms that share it: ``form``
    is "value", "vmap" (over a stack of two batches) or "grad" (w.r.t. the parameters)."""
    model = ZOO[model_name]
    fun = _scalar(model) if TRANSFORMS_TAKING_U[kind] else model.f
    params, x = model.init(dtype)
    probes = _probes(x) if kind.startswith("hutchinson") else None
    expected = jax.jit(lambda p, x: _brute_force(kind, fun, p, x, extra, probes))
    if form == "vmap":
        return jax.vmap(expected, (None, 0))(params, _stacked(x))
    if form == "grad":
        return jax.jit(jax.grad(lambda p: _total(expected(p, x))))(params)
    return expected(params, x)


def _stacked(x: jax.Array) -> jax.Array:
    """Two batches for the outer ``vmap`` context."""
    return jnp.stack([x, 0.5 * x + 0.1])


def check(model_name: str, transform_name: str, context: str) -> None:
    model = ZOO[model_name]
    build, kind, takes_u, stochastic = TRANSFORMS[transform_name]
    dtype = jnp.float32 if context == "float32" else jnp.float64
    tol = {"rtol": 2e-4, "atol": 2e-5} if dtype == jnp.float32 else {"rtol": 1e-9, "atol": 1e-11}
    params, x = model.init(dtype)
    transformed = build(_scalar(model) if takes_u else model.f)
    extra = (0.7,) if context == "python-float" else ()
    lead = (_probes(x),) if stochastic else ()

    def call(p: Any, x: jax.Array) -> Any:
        return transformed(*lead, p, x, *extra)

    def same(got: Any, want: Any) -> None:
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        for g, w in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            assert g.dtype == w.dtype, (g.dtype, w.dtype)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol)

    if context in ("eager-then-jit", "float32", "python-float"):
        want = _reference(model_name, kind, dtype, extra, "value")
        same(call(params, x), want)
        same(jax.jit(call)(params, x), want)
    elif context == "jit-then-eager":
        want = _reference(model_name, kind, dtype, extra, "value")
        same(jax.jit(call)(params, x), want)
        same(call(params, x), want)
    elif context == "vmap":
        want = _reference(model_name, kind, dtype, extra, "vmap")
        same(jax.vmap(call, (None, 0))(params, _stacked(x)), want)
    else:
        assert context in ("grad", "jit-grad")
        grad = jax.grad(lambda p: _total(call(p, x)))
        got = (jax.jit(grad) if context == "jit-grad" else grad)(params)
        same(got, _reference(model_name, kind, dtype, extra, "grad"))


DEFAULT = (
    [
        ("mlp", t, "eager-then-jit")
        for t in (
            "jacobian-auto",
            "jacobian-rev",
            "divergence-exact-fwd",
            "divergence-hutchinson",
            "value_and_divergence",
            "grad_divergence",
            "laplacian-exact",
            "hessian_diagonal-hutchinson",
            "hessian",
        )
    ]
    + [("cnn", "divergence-sparse", "jit-then-eager")]
    + [("mlp", "divergence-auto", c) for c in ("vmap", "jit-grad", "float32", "python-float")]
)
FULL = [(m, t, "eager-then-jit") for m in ZOO for t in TRANSFORMS] + [
    (m, t, c) for m in ZOO for t in CORE for c in CONTEXTS if c != "eager-then-jit"
]
SLOW = [case for case in FULL if case not in DEFAULT]


@pytest.mark.parametrize(("model", "transform", "context"), DEFAULT)
def test_context(model: str, transform: str, context: str) -> None:
    check(model, transform, context)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "transform", "context"), SLOW)
def test_context_matrix(model: str, transform: str, context: str) -> None:
    check(model, transform, context)
