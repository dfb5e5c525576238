"""``derivative`` and ``differential_operator`` in both frameworks, against brute force: the
per-sample derivative tensors of nested ``jax.jacfwd`` / ``torch.func.jacfwd``, sample by
sample, in float64, on small tanh MLPs, random compositions of elementary operations and a
vector-valued ``u``; orders 1 to 4, coefficients as numbers, per-sample arrays and functions
of the input; the stochastic methods unbiased, their standard error exact or refused; the
errors."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import divjac

B, D = 4, 3
RNG = np.random.default_rng(0)
W1, W2, WV = RNG.normal(size=(D, 6)) / 2, RNG.normal(size=(6,)), RNG.normal(size=(6, 2))
X = RNG.normal(size=(B, D))


@dataclass(frozen=True)
class Ops:
    name: str
    dj: Any
    asarray: Callable[[Any], Any]
    tanh: Callable[[Any], Any]
    sin: Callable[[Any], Any]
    exp: Callable[[Any], Any]
    brute: Callable[[Callable[..., Any], Any, tuple[int, ...]], np.ndarray]
    randomness: Callable[[int], Any]
    to_numpy: Callable[[Any], np.ndarray]


def _jax() -> Ops:
    import jax
    import jax.numpy as jnp

    import divjac.jax as dj

    def brute(u, x, alpha):
        g = lambda xi: u(xi[None])[0]  # noqa: E731
        for _ in alpha:
            g = jax.jacfwd(g)
        return np.asarray(jax.vmap(lambda xi: g(xi)[(..., *alpha)])(x))

    return Ops(
        "jax",
        dj,
        lambda a: jnp.asarray(a, jnp.float64),
        jnp.tanh,
        jnp.sin,
        jnp.exp,
        brute,
        jax.random.key,
        np.asarray,
    )


def _torch() -> Ops:
    import torch

    import divjac.torch as dt

    def brute(u, x, alpha):
        g = lambda xi: u(xi[None])[0]  # noqa: E731
        for _ in alpha:
            g = torch.func.jacfwd(g)
        return np.stack([g(x[b])[(..., *alpha)].detach().numpy() for b in range(len(x))])

    return Ops(
        "torch",
        dt,
        lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float64),
        torch.tanh,
        torch.sin,
        torch.exp,
        brute,
        lambda seed: torch.Generator().manual_seed(seed),
        lambda a: a.detach().numpy(),
    )


FRAMEWORKS = {"jax": _jax, "torch": _torch}


@pytest.fixture(params=sorted(FRAMEWORKS), scope="module")
def ops(request) -> Ops:
    pytest.importorskip(request.param)
    return FRAMEWORKS[request.param]()


def mlp(o: Ops) -> Callable[..., Any]:
    w1, w2 = o.asarray(W1), o.asarray(W2)
    return lambda x: o.tanh(o.tanh(x @ w1)) @ w2


def vector(o: Ops) -> Callable[..., Any]:
    w1, wv = o.asarray(W1), o.asarray(WV)
    return lambda x: o.tanh(x @ w1) @ wv * x[:, :1]


def composition(seed: int) -> Callable[[Ops], Callable[..., Any]]:
    """A random composition of products, sums and elementary functions of the inputs."""
    rng = np.random.default_rng(seed)
    plan = [(int(rng.integers(3)), int(rng.integers(D)), int(rng.integers(D))) for _ in range(4)]
    scale = rng.normal(size=4)

    def make(o: Ops) -> Callable[..., Any]:
        fns = (o.sin, o.tanh, lambda a: o.exp(0.3 * a))

        def u(x):
            total = x[:, 0] * 0.0
            for (f, i, j), s in zip(plan, scale, strict=True):
                total = total + s * fns[f](x[:, i] * x[:, j] + total * 0.5)
            return total

        return u

    return make


ALPHAS = [(0,), (0, 1), (1, 1), (0, 0, 2), (0, 1, 2), (0, 0, 1, 1), (1, 1, 1, 1), (0, 1, 2, 2)]
FUNCTIONS = {"mlp": mlp, "vector": vector, **{f"comp{s}": composition(s) for s in range(3)}}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_derivative_is_nested_jacfwd(ops, name):
    u, x = FUNCTIONS[name](ops), ops.asarray(X)
    # every order and support size on the MLP, a few on the others (each is a compilation)
    for alpha in ALPHAS if name == "mlp" else ALPHAS[1::3]:
        got = ops.to_numpy(ops.dj.derivative(u, alpha)(x))
        np.testing.assert_allclose(got, ops.brute(u, x, alpha), rtol=1e-9, atol=1e-10)


def test_operator_with_every_kind_of_coefficient(ops):
    u, x = vector(ops), ops.asarray(X)
    c = ops.asarray(np.arange(B) + 1.0)
    terms = [
        (2.0, (0, 0)),
        (c, (0, 1, 2)),
        (lambda xi: xi[0] ** 2, (1, 1, 2, 2)),
        (-1.5, (2,)),
        (0.5, (1, 1)),
    ]
    want = (
        2 * ops.brute(u, x, (0, 0))
        + (np.arange(B) + 1.0)[:, None] * ops.brute(u, x, (0, 1, 2))
        + (X[:, 0] ** 2)[:, None] * ops.brute(u, x, (1, 1, 2, 2))
        - 1.5 * ops.brute(u, x, (2,))
        + 0.5 * ops.brute(u, x, (1, 1))
    )
    for method in ("auto", "exact"):
        got = ops.dj.differential_operator(u, terms, method=method)(x)
        np.testing.assert_allclose(ops.to_numpy(got), want, rtol=1e-9, atol=1e-10)
    value, err = ops.dj.differential_operator(u, terms, return_stderr=True)(x)
    np.testing.assert_allclose(ops.to_numpy(value), want, rtol=1e-9, atol=1e-10)
    assert np.all(ops.to_numpy(err) == 0)


def test_argnums_batch_axis_and_aux(ops):
    w1, w2 = ops.asarray(W1), ops.asarray(W2)

    def u(x, t):
        return ops.tanh(x @ w1 + t) @ w2

    x, t = ops.asarray(X), ops.asarray(RNG.normal(size=(B, 6)))
    rows = range(B)
    want_x = np.concatenate(
        [ops.brute(lambda a, b=b: u(a, t[b : b + 1]), x[b : b + 1], (0, 0, 1)) for b in rows]
    )
    want_t = np.concatenate(
        [ops.brute(lambda a, b=b: u(x[b : b + 1], a), t[b : b + 1], (3, 3)) for b in rows]
    )
    got_x = ops.dj.derivative(u, (0, 0, 1), argnums=(0,))(x, t)[0]
    np.testing.assert_allclose(ops.to_numpy(got_x), want_x, rtol=1e-9, atol=1e-10)
    both = ops.dj.differential_operator(u, [(1.0, (0, 0, 1))], argnums=(0,))(x, t)
    np.testing.assert_allclose(ops.to_numpy(both[0]), want_x, rtol=1e-9, atol=1e-10)
    got_t = ops.dj.derivative(u, (3, 3), argnums=1)(x, t)
    np.testing.assert_allclose(ops.to_numpy(got_t), want_t, rtol=1e-9, atol=1e-10)
    # batch on axis 1, and one sample
    ut = lambda xt: mlp(ops)(xt.T)[None]  # noqa: E731
    got = ops.dj.derivative(ut, (1, 1, 2), batch_axis=1)(ops.asarray(X.T))
    np.testing.assert_allclose(ops.to_numpy(got)[0], ops.brute(mlp(ops), x, (1, 1, 2)), rtol=1e-9)
    single = ops.dj.derivative(lambda xi: mlp(ops)(xi[None])[0], (0, 2), batch_axis=None)
    np.testing.assert_allclose(
        float(ops.to_numpy(single(x[1]))), ops.brute(mlp(ops), x, (0, 2))[1], rtol=1e-9
    )
    # aux
    value, aux = ops.dj.derivative(lambda x: (mlp(ops)(x), x[:, 0]), (0, 0), has_aux=True)(x)
    np.testing.assert_allclose(ops.to_numpy(aux), X[:, 0])
    np.testing.assert_allclose(ops.to_numpy(value), ops.brute(mlp(ops), x, (0, 0)), rtol=1e-9)


STOCHASTIC_TERMS = [
    (1.0, (0, 0)),
    (2.0, (0, 1, 2)),
    (-0.5, (0, 0, 1, 1)),
    (3.0, (1, 2)),
    (1.0, (0,)),
]
"""Every order, mixed partials: 19 directions in orders 2-4 at ``D = 3``."""


@pytest.mark.parametrize("method", ["hutchinson", "stde"])
def test_stochastic_is_unbiased(ops, method):
    u, x = mlp(ops), ops.asarray(X)
    exact = ops.to_numpy(ops.dj.differential_operator(u, STOCHASTIC_TERMS)(x))
    op = ops.dj.differential_operator(u, STOCHASTIC_TERMS, method=method, num_probes=8)
    means = np.stack([ops.to_numpy(op(ops.randomness(seed), x)) for seed in range(200)])
    assert np.all(means.std(0) > 0)  # sampled orders remain at 8 probes
    spread = means.std(0) / np.sqrt(len(means))
    assert np.all(np.abs(means.mean(0) - exact) <= 4.5 * spread)  # heavy-tailed fourth order


@pytest.mark.parametrize("method", ["hutchinson", "stde"])
def test_stochastic_error_bar_is_exact_or_refused(ops, method):
    """Issue 45: a sampled order's terms take few values or are heavy-tailed, and their spread
    covered 0.49-0.96 as an error bar (docs/calibration.md). ``return_stderr=True`` below the
    budget that computes every order exactly raises ``NumProbesError`` naming it; from it the
    value is exact with stderr 0. An order whose directions fit in its share of the budget is
    computed exactly without an error bar too."""
    u, x = mlp(ops), ops.asarray(X)
    exact = ops.to_numpy(ops.dj.differential_operator(u, STOCHASTIC_TERMS)(x))

    def op(k, stderr=True):
        return ops.dj.differential_operator(
            u, STOCHASTIC_TERMS, method=method, num_probes=k, return_stderr=stderr
        )

    with pytest.raises(divjac.NumProbesError, match=r"num_probes >= \d+") as refused:
        op(2)(ops.randomness(0), x)
    needed = int(re.search(r"num_probes >= (\d+)", str(refused.value))[1])
    assert needed == 19 and "method='exact'" in str(refused.value)
    for k in (8, needed - 1):
        with pytest.raises(divjac.NumProbesError, match=f"num_probes >= {needed}"):
            op(k)(ops.randomness(k), x)
    for k in (needed, needed + 5):
        value, err = op(k)(ops.randomness(k), x)
        np.testing.assert_allclose(ops.to_numpy(value), exact, rtol=1e-9, atol=1e-10)
        assert np.all(ops.to_numpy(err) == 0)
    # a zero coefficient (no mass to share the budget by): still exact from the budget named
    zero = [(0.0, (0, 1, 2)), (1.0, (0, 0, 1, 1))]
    with pytest.raises(divjac.NumProbesError) as refused:
        ops.dj.differential_operator(u, zero, method=method, num_probes=2, return_stderr=True)(
            ops.randomness(0), x
        )
    needed = int(re.search(r"num_probes >= (\d+)", str(refused.value))[1])
    value, err = ops.dj.differential_operator(
        u, zero, method=method, num_probes=needed, return_stderr=True
    )(ops.randomness(0), x)
    want = ops.to_numpy(ops.dj.differential_operator(u, zero)(x))
    np.testing.assert_allclose(ops.to_numpy(value), want, rtol=1e-9, atol=1e-10)
    assert np.all(ops.to_numpy(err) == 0)
    # sum_i d^4u/dx_i^4: D directions of one order, exact from D probes, with or without stderr
    quartic = [(1.0, (i,) * 4) for i in range(D)]
    want = ops.to_numpy(ops.dj.differential_operator(u, quartic)(x))
    for seed in range(2):
        got = ops.dj.differential_operator(u, quartic, method=method, num_probes=D)(
            ops.randomness(seed), x
        )
        np.testing.assert_allclose(ops.to_numpy(got), want, rtol=1e-9, atol=1e-10)


def test_errors(ops):
    u, x = mlp(ops), ops.asarray(X)
    for alpha, said in [
        ((), "no derivative"),
        ((0, 0, 0, 0, 0), "order 5"),
        ((0, 3), "out of range"),
        ((0, 1.0), "integer indices"),
        ("ab", "tuple of flat"),
    ]:
        with pytest.raises(divjac.MultiIndexError, match=said):
            ops.dj.derivative(u, alpha)(x)
    with pytest.raises(divjac.MultiIndexError, match="non-empty"):
        ops.dj.differential_operator(u, [])(x)
    with pytest.raises(divjac.CoefficientError, match=r"shape \(B,\)"):
        ops.dj.differential_operator(u, [(ops.asarray(np.ones(B + 1)), (0, 0))])(x)
    with pytest.raises(divjac.CoefficientError, match="a number"):
        ops.dj.differential_operator(u, [("2", (0, 0))])(x)
    with pytest.raises(divjac.OptionError, match="method"):
        ops.dj.differential_operator(u, [(1.0, (0,))], method="sparse")
    with pytest.raises(divjac.InputDtypeError):
        ops.dj.derivative(u, (0, 0))(
            ops.asarray(X).long() if ops.name == "torch" else X.astype(int)
        )
    mixed = lambda x: u(x) + u(x).sum()  # noqa: E731
    with pytest.raises(divjac.BatchCouplingError):
        ops.dj.derivative(mixed, (0, 1))(x)
    with pytest.raises(divjac.MissingKeyError):
        ops.dj.differential_operator(u, [(1.0, (0, 1))], method="stde")(x)


def test_coupled_exact(ops):
    """With ``coupling="exact"``, each sample's own derivative of a function mixing samples."""
    u, x = mlp(ops), ops.asarray(X)
    mixed = lambda x: u(x) + 0.1 * (x[:, 0] ** 2).sum()  # noqa: E731
    for alpha in [(0,), (0, 0), (0, 1, 1), (0, 0, 0, 0)]:
        got = ops.to_numpy(ops.dj.derivative(mixed, alpha, coupling="exact")(x))
        want = ops.brute(u, x, alpha)
        if alpha == (0,):
            want = want + 0.2 * X[:, 0]
        elif alpha == (0, 0):
            want = want + 0.2
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)
    c = np.arange(B) + 1.0
    terms = [(ops.asarray(c), (1, 2)), (lambda xi: xi[1], (0, 1, 1))]
    got = ops.dj.differential_operator(mixed, terms, coupling="exact")(x)
    want = c * ops.brute(u, x, (1, 2)) + X[:, 1] * ops.brute(u, x, (0, 1, 1))
    np.testing.assert_allclose(ops.to_numpy(got), want, rtol=1e-9, atol=1e-10)


def test_pure_powers_merged_by_the_hessian_colors(ops):
    """A sum over pairs ``u = sum_p phi(a_p, b_p)``: ``"auto"`` merges the pure powers
    ``d^k u/dx_i^k`` of one color of the Hessian's pattern (and one sign of coefficient) into
    one direction; against the closed form, with coefficients of both signs and zero, odd and
    even orders, and a mixed term of a pair kept as it is."""
    d = 32  # enough inputs for "auto" to detect the pattern
    x = RNG.normal(size=(2, d))

    def u(z):
        a, b = z[:, 0::2], z[:, 1::2]
        return (ops.sin(a) * ops.exp(0.3 * b) + a * a * b * b).sum(1)

    c = 1.5 - np.arange(d) % 3
    extra = [(-2.0, (1, 1, 1)), (0.8, (4, 4, 4)), (0.5, (2, 2, 3, 3)), (0.3, (5, 5)), (1.0, (4,))]
    terms = [(float(c[i]), (i,) * 4) for i in range(d)] + extra
    got = ops.to_numpy(ops.dj.differential_operator(u, terms)(ops.asarray(x)))
    a, b = x[:, 0::2], x[:, 1::2]
    s, e = np.sin(a) * np.exp(0.3 * b), np.cos(a) * np.exp(0.3 * b)
    want = (c[0::2] * s + c[1::2] * 0.3**4 * s).sum(1)
    want += -2.0 * 0.3**3 * s[:, 0] - 0.8 * e[:, 2] + 0.5 * (-(0.3**2) * s[:, 1] + 4)
    want += 0.3 * (0.3**2 * s[:, 2] + 2 * a[:, 2] ** 2) + e[:, 2] + 2 * a[:, 2] * b[:, 2] ** 2
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)


def test_jax_jit_grad_vmap():
    jax = pytest.importorskip("jax")
    o = _jax()
    x = o.asarray(X)

    def loss(w1):
        u = lambda x: o.tanh(x @ w1) @ o.asarray(W2)  # noqa: E731
        return o.dj.differential_operator(u, [(1.0, (0, 0, 1)), (2.0, (1, 1, 1, 1))])(x).sum()

    def brute_loss(w1):
        u = lambda x: o.tanh(x @ w1) @ o.asarray(W2)  # noqa: E731
        g3 = jax.jacfwd(jax.jacfwd(jax.jacfwd(lambda xi: u(xi[None])[0])))
        g4 = jax.jacfwd(g3)
        return (jax.vmap(g3)(x)[:, 0, 0, 1] + 2 * jax.vmap(g4)(x)[:, 1, 1, 1, 1]).sum()

    w1 = o.asarray(W1)
    np.testing.assert_allclose(jax.jit(loss)(w1), brute_loss(w1), rtol=1e-9)
    np.testing.assert_allclose(jax.grad(loss)(w1), jax.grad(brute_loss)(w1), rtol=1e-8, atol=1e-10)
    u = mlp(o)
    stacked = jax.vmap(o.dj.derivative(u, (0, 1, 1)))(jax.numpy.stack([x, 2 * x]))
    np.testing.assert_allclose(stacked[1], o.brute(u, 2 * x, (0, 1, 1)), rtol=1e-9)


def test_torch_autograd_and_compile():
    torch = pytest.importorskip("torch")
    o = _torch()
    x = o.asarray(X)
    w1 = o.asarray(W1).requires_grad_(True)
    u = lambda x: torch.tanh(x @ w1) @ o.asarray(W2)  # noqa: E731
    terms = [(1.0, (0, 0, 1)), (2.0, (1, 1))]
    (g,) = torch.autograd.grad(o.dj.differential_operator(u, terms)(x).sum(), w1)
    brute = (
        torch.func.vmap(
            torch.func.jacfwd(torch.func.jacfwd(torch.func.jacfwd(lambda xi: u(xi[None])[0])))
        )(x)[:, 0, 0, 1]
        + 2 * torch.func.vmap(torch.func.hessian(lambda xi: u(xi[None])[0]))(x)[:, 1, 1]
    )
    (gb,) = torch.autograd.grad(brute.sum(), w1)
    np.testing.assert_allclose(g.numpy(), gb.numpy(), rtol=1e-8, atol=1e-10)
    from divjac.torch._compat import COMPILES

    if not COMPILES:  # torch < 2.13: torch.compile refused (test_compile.py)
        return
    v = mlp(o)
    op = o.dj.differential_operator(v, [(1.0, (0, 1)), (1.0, (2, 2, 2))])
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: op(x), fullgraph=True, backend="aot_eager")
    want = o.brute(v, x, (0, 1)) + o.brute(v, x, (2, 2, 2))
    np.testing.assert_allclose(compiled(x).detach().numpy(), want, rtol=1e-9)
