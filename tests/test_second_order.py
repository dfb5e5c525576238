"""The second-order operators (``laplacian``, ``weighted_laplacian``, ``hessian``,
``hessian_diagonal``) in both frameworks, against brute force: the per-sample Hessian of
``jax.hessian`` / ``torch.func.hessian``, sample by sample, in float64.

Functions are written once over a few operations (:class:`Ops`) and run in each framework: an
MLP, a ``net(x, t)``, a CNN, a per-particle sum (a block-diagonal Hessian: ``"sparse"`` and
``"auto"`` sweep fewer directions), elementary functions with products and divisions, and a
vector-valued ``u``. Stochastic methods are checked unbiased (the mean of many runs is the
exact value within its error bar) and calibrated (z-scores over repeated seeds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import divjac

B = 3
RNG = np.random.default_rng(0)
W1, W2 = RNG.normal(size=(5, 7)) / 2, RNG.normal(size=(7,))
WT = RNG.normal(size=(7,))
WV = RNG.normal(size=(7, 3))
KERNEL = RNG.normal(size=(2, 2, 3, 3)) / 3
PARTICLE = RNG.normal(size=(4, 6)) / 2, RNG.normal(size=(6,))


@dataclass(frozen=True)
class Ops:
    """One framework's operations, as the test functions use them."""

    name: str
    dj: Any
    backend_cls: Any
    asarray: Callable[[Any], Any]
    tanh: Callable[[Any], Any]
    softplus: Callable[[Any], Any]
    exp: Callable[[Any], Any]
    log: Callable[[Any], Any]
    sin: Callable[[Any], Any]
    sum: Callable[[Any, Any], Any]  # (a, axis)
    conv: Callable[[Any, Any], Any]  # NCHW, OIHW, same padding
    hessians: Callable[[Callable[..., Any], Any, tuple[Any, ...]], np.ndarray]
    randomness: Callable[[int], Any]
    integers: Callable[[Any], Any]
    to_numpy: Callable[[Any], np.ndarray]


def _jax() -> Ops:
    import jax
    import jax.numpy as jnp

    import divjac.jax as dj
    from divjac.jax import _backend

    def hessians(u, x, rest):  # per sample: jax.hessian of the single-sample function, vmapped
        def one(xb, *rb):
            return u(xb[None], *(r[None] for r in rb))[0]

        return np.asarray(jax.jit(jax.vmap(jax.hessian(one)))(x, *rest))

    def conv(x, k):
        return jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )

    return Ops(
        "jax",
        dj,
        _backend.JaxBackend,
        lambda a: jnp.asarray(a, jnp.float64),
        jnp.tanh,
        jax.nn.softplus,
        jnp.exp,
        jnp.log,
        jnp.sin,
        lambda a, axis: jnp.sum(a, axis=axis),
        conv,
        hessians,
        jax.random.key,
        lambda a: jnp.asarray(np.asarray(a), jnp.int32),
        np.asarray,
    )


def _torch() -> Ops:
    import torch
    from torch.func import hessian

    import divjac.torch as dt
    from divjac.torch import _backend

    def hessians(u, x, rest):
        def one(xb, *rb):
            return u(xb[None], *(r[None] for r in rb))[0]

        return np.stack(
            [hessian(one)(x[b], *(r[b] for r in rest)).detach().numpy() for b in range(len(x))]
        )

    return Ops(
        "torch",
        dt,
        _backend.TorchBackend,
        lambda a: torch.as_tensor(np.asarray(a), dtype=torch.float64),
        torch.tanh,
        torch.nn.functional.softplus,
        torch.exp,
        torch.log,
        torch.sin,
        lambda a, axis: torch.sum(a, dim=axis),
        lambda x, k: torch.nn.functional.conv2d(x, k, padding=1),
        hessians,
        lambda seed: torch.Generator().manual_seed(seed),
        lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int64),
        lambda a: a.detach().numpy(),
    )


FRAMEWORKS = {"jax": _jax, "torch": _torch}


@pytest.fixture(params=sorted(FRAMEWORKS), scope="module")
def ops(request) -> Ops:
    pytest.importorskip(request.param)
    return FRAMEWORKS[request.param]()


@pytest.fixture
def directions(ops, monkeypatch) -> list[int | str]:
    """The number of directions of each Taylor sweep run, ``"sparse"`` for each exact Laplacian
    swept with first-order terms stored sparse."""
    ops.dj.clear_caches()  # JAX's compiled eager calls would not sweep again
    seen: list[int | str] = []
    original = ops.backend_cls.second_order_sweep
    original_sparse = ops.backend_cls.sparse_laplacian

    def counting(self, f, x, dirs, **kwargs):
        seen.append(int(dirs.shape[0]))
        return original(self, f, x, dirs, **kwargs)

    def counting_sparse(self, *args):
        lap = original_sparse(self, *args)
        if lap is not None:
            seen.append("sparse")
        return lap

    monkeypatch.setattr(ops.backend_cls, "second_order_sweep", counting)
    monkeypatch.setattr(ops.backend_cls, "sparse_laplacian", counting_sparse)
    return seen


# --- the functions --------------------------------------------------------------------------


def mlp(o: Ops) -> Callable[..., Any]:
    w1, w2 = o.asarray(W1), o.asarray(W2)
    return lambda x: o.sum(o.tanh(x @ w1) * w2, 1)


def net_xt(o: Ops) -> Callable[..., Any]:
    w1, w2, wt = o.asarray(W1), o.asarray(W2), o.asarray(WT)
    return lambda x, t: o.sum(o.tanh(x @ w1 + t * wt) * w2, 1)


def cnn(o: Ops) -> Callable[..., Any]:
    k = o.asarray(KERNEL)
    return lambda x: o.sum(o.softplus(o.conv(o.tanh(o.conv(x, k)), k)), (1, 2, 3))


def particles(o: Ops) -> Callable[..., Any]:
    """A sum of one MLP over 5 particles of 4 coordinates: a block-diagonal Hessian."""
    w1, w2 = o.asarray(PARTICLE[0]), o.asarray(PARTICLE[1])
    return lambda x: o.sum(o.tanh(x.reshape(x.shape[0], 5, 4) @ w1) @ w2, 1)


def elementary(o: Ops) -> Callable[..., Any]:
    def u(x):
        a, b, c, d = x[:, 0], x[:, 1], x[:, 2], x[:, 3]
        return (
            o.sin(a * b)
            + o.exp(0.3 * c) / (1.0 + d**2)
            + o.log(1.0 + o.softplus(a)) * o.tanh(c * d)
            + a * b * c / (2.0 + o.sin(d))
        )

    return u


def vector(o: Ops) -> Callable[..., Any]:
    w1, wv = o.asarray(W1), o.asarray(WV)
    return lambda x: o.tanh(x @ w1) @ wv * x[:, :1]


SCALAR_CASES = {  # the function, its input, and the operators checked on it
    "mlp": (
        mlp,
        (B, 5),
        (
            "lap",
            "lap-sparse",
            "lap-auto",
            "diag",
            "diag-sparse",
            "hess",
            "hess-sparse",
            "A",
            "A-each",
            "S-each",
        ),
    ),
    "cnn": (cnn, (2, 2, 3, 3), ("lap-sparse", "diag-sparse", "hess-sparse", "S-each")),
    "particles": (particles, (2, 20), ("lap-sparse", "lap-auto", "diag-auto", "hess-sparse", "A")),
    "elementary": (elementary, (B, 4), ("lap", "diag", "hess", "A-each")),
}


def _x(o: Ops, shape: tuple[int, ...], seed: int = 1) -> Any:
    return o.asarray(np.random.default_rng(seed).normal(size=shape))


def _close(o: Ops, got: Any, want: Any) -> None:
    np.testing.assert_allclose(o.to_numpy(got), want, rtol=1e-9, atol=1e-11)


# --- exact operators against brute force ------------------------------------------------------


def _operators(o: Ops, u: Callable[..., Any], shape: tuple[int, ...]) -> dict[str, Any]:
    """Each operator's transform and its brute-force value from the Hessians ``H``."""
    dj = o.dj
    Bx, n = shape[0], int(np.prod(shape[1:]))
    A = np.random.default_rng(2).normal(size=(n, n))
    A_each = np.random.default_rng(3).normal(size=(Bx, n, n))
    S = np.random.default_rng(4).normal(size=(Bx, n, 2))
    square = (*shape[1:], *shape[1:])
    return {
        "lap": (dj.laplacian(u, method="exact"), lambda H: np.trace(H, axis1=1, axis2=2)),
        "lap-sparse": (dj.laplacian(u, method="sparse"), lambda H: np.trace(H, axis1=1, axis2=2)),
        "lap-auto": (dj.laplacian(u), lambda H: np.trace(H, axis1=1, axis2=2)),
        **{
            f"diag{suffix}": (
                dj.hessian_diagonal(u, method=method),
                lambda H: np.diagonal(H, axis1=1, axis2=2).reshape(shape),
            )
            for suffix, method in (("", "exact"), ("-sparse", "sparse"), ("-auto", "auto"))
        },
        **{
            f"hess{suffix}": (dj.hessian(u, mode=mode), lambda H: H.reshape(Bx, *square))
            for suffix, mode in (("", "fwd"), ("-sparse", "sparse"))
        },
        "A": (dj.weighted_laplacian(u, o.asarray(A)), lambda H: np.einsum("ij,bij->b", A, H)),
        "A-each": (
            dj.weighted_laplacian(u, o.asarray(A_each)),
            lambda H: np.einsum("bij,bij->b", A_each, H),
        ),
        "S-each": (
            dj.weighted_laplacian(u, factor=o.asarray(S)),
            lambda H: np.einsum("bir,bjr,bij->b", S, S, H),
        ),
    }


@pytest.mark.parametrize("case", sorted(SCALAR_CASES))
def test_scalar_operators_match_brute_force(ops: Ops, case: str) -> None:
    make, shape, names = SCALAR_CASES[case]
    u, x = make(ops), _x(ops, shape)
    n = int(np.prod(shape[1:]))
    H = ops.hessians(u, x, ()).reshape(shape[0], n, n)
    operators = _operators(ops, u, shape)

    def results(x: Any) -> dict[str, Any]:
        return {name: operators[name][0](x) for name in names}

    if ops.name == "jax":  # one compiled program for them all (and they compose with jit)
        import jax

        results = jax.jit(results)
    for name, got in results(x).items():
        _close(ops, got, operators[name][1](H))


def test_net_of_x_and_t(ops: Ops) -> None:
    """``u(x, t)``: the operators in ``x``, ``t`` passed through (and ``d/dt`` by jacobian)."""
    u, x, t = net_xt(ops), _x(ops, (4, 5)), _x(ops, (4, 1), seed=5)
    H = ops.hessians(u, x, (t,))
    dj = ops.dj
    _close(ops, dj.laplacian(u)(x, t), np.trace(H, axis1=1, axis2=2))
    _close(ops, dj.hessian(u)(x, t), H)
    _close(ops, dj.hessian_diagonal(u)(x, t), np.diagonal(H, axis1=1, axis2=2))
    S = np.random.default_rng(6).normal(size=(5, 3))
    _close(
        ops,
        dj.weighted_laplacian(u, factor=ops.asarray(S))(x, t),
        np.einsum("ij,bij->b", S @ S.T, H),
    )
    u_t = dj.jacobian(u, 1)(x, t)  # (B, 1): the per-sample d/dt
    Ht = ops.hessians(lambda t, x: u(x, t), t, (x,))  # d2u/dt2, (B, 1, 1)
    assert tuple(u_t.shape) == (4, 1) and Ht.shape == (4, 1, 1)
    _close(ops, dj.laplacian(u, 1)(x, t), Ht[:, 0, 0])


def test_vector_valued_u_is_per_output_component(ops: Ops) -> None:
    u, x, dj = vector(ops), _x(ops, (B, 5)), ops.dj
    H = ops.hessians(u, x, ())  # (B, 3, 5, 5)
    assert H.shape == (B, 3, 5, 5)
    for method in ("exact", "sparse", "auto"):
        _close(ops, dj.laplacian(u, method=method)(x), np.trace(H, axis1=2, axis2=3))
    A = np.random.default_rng(7).normal(size=(5, 5))
    _close(ops, dj.weighted_laplacian(u, ops.asarray(A))(x), np.einsum("ij,bcij->bc", A, H))
    # The output's layout is kept: batch_axis=None (one sample) and a batch last.
    one = dj.laplacian(lambda x: u(x[None])[0], batch_axis=None)(x[0])
    _close(ops, one, np.trace(H[0], axis1=1, axis2=2))
    last = dj.laplacian(lambda x: u(x.T).T, batch_axis=1)(x.T)
    _close(ops, last, np.trace(H, axis1=2, axis2=3).T)


def test_sparse_sweeps_one_direction_per_color(ops: Ops, directions: list[int | str]) -> None:
    """Particles of 4 coordinates: a block-diagonal Hessian, 4 diagonal colors for 20 inputs."""
    u, x, dj = particles(ops), _x(ops, (2, 20)), ops.dj
    pattern = dj.sparsity(_gradient_of(ops, u))(x)  # the Hessian's pattern
    assert pattern.n_diagonal_colors == 4
    dj.laplacian(u, method="exact")(x)
    dj.laplacian(u, method="sparse")(x)
    dj.laplacian(u, method="auto")(x)
    # The exact Laplacian stores the per-particle terms sparse (4 of 20 per intermediate).
    assert directions == ["sparse", 4, 4]
    dense = mlp(ops)  # a dense Hessian: auto sweeps the unit basis
    directions.clear()
    dj.laplacian(dense, method="auto")(_x(ops, (2, 5)))
    assert directions == [5]


def rosenbrock(o: Ops) -> Callable[..., Any]:
    """A tridiagonal Hessian."""
    return lambda x: o.sum(100.0 * (x[:, 1:] - x[:, :-1] ** 2) ** 2 + (1.0 - x[:, :-1]) ** 2, 1)


def many_particles(o: Ops) -> Callable[..., Any]:
    """:func:`particles` over 50 particles (Hessian nnz 800 of 40000)."""
    w1, w2 = o.asarray(PARTICLE[0]), o.asarray(PARTICLE[1])
    return lambda x: o.sum(o.tanh(x.reshape(x.shape[0], 50, 4) @ w1) @ w2, 1)


@pytest.mark.parametrize(
    ("case", "shape"),
    [("particles", (2, 200)), ("rosenbrock", (2, 64)), ("cnn", (2, 2, 8, 8))],
)
def test_auto_takes_the_sparse_sweep(
    ops: Ops, directions: list[int | str], case: str, shape
) -> None:
    # The screening of the Hessian's pattern once called these dense: the value of the sum,
    # which the gradient does not read, depends on every input.
    u = {"particles": many_particles, "rosenbrock": rosenbrock, "cnn": cnn}[case](ops)
    x, dj = _x(ops, shape), ops.dj
    auto = dj.laplacian(u, method="auto")(x)
    sparse = dj.laplacian(u, method="sparse")(x)
    n_colors = dj.sparsity(_gradient_of(ops, u))(x).n_diagonal_colors
    assert directions == [n_colors, n_colors]
    assert 2 * n_colors <= int(np.prod(shape[1:]))
    want = np.trace(
        ops.hessians(u, x, ()).reshape(shape[0], -1, int(np.prod(shape[1:]))), axis1=1, axis2=2
    )
    _close(ops, auto, want)
    _close(ops, sparse, want)


def _gradient_of(o: Ops, u: Callable[..., Any]) -> Callable[..., Any]:
    from divjac import _second_order_sweep

    backend = o.backend_cls()
    return _second_order_sweep._gradient(backend, u, 0, False, "laplacian")


def test_chunks_of_directions_and_jit(ops: Ops, directions: list[int | str]) -> None:
    u, x, dj = mlp(ops), _x(ops, (B, 5)), ops.dj
    H = ops.hessians(u, x, ())
    _close(ops, dj.laplacian(u, chunk_size=2)(x), np.trace(H, axis1=1, axis2=2))
    # JAX traces the sweep of a chunk once per shape (the chunks are rematerialized, and
    # jax.checkpoint reuses its trace); torch runs every chunk.
    assert directions == ([2, 1] if ops.name == "jax" else [2, 2, 1])
    # A is an argument of the (JAX: compiled, cached) call, never a constant of it.
    for seed in (12, 13):
        A = np.random.default_rng(seed).normal(size=(5, 5))
        _close(ops, dj.weighted_laplacian(u, ops.asarray(A))(x), np.einsum("ij,bij->b", A, H))
    if ops.name == "jax":
        import jax

        _close(ops, jax.jit(dj.laplacian(u))(x), np.trace(H, axis1=1, axis2=2))
        _close(
            ops,
            jax.jit(dj.weighted_laplacian(u, ops.asarray(np.eye(5))))(x),
            np.trace(H, axis1=1, axis2=2),
        )


def test_has_aux(ops: Ops) -> None:
    u, x, dj = mlp(ops), _x(ops, (B, 5)), ops.dj
    aux_u = lambda x: (u(x), {"y": u(x)})  # noqa: E731
    lap, aux = dj.laplacian(aux_u, has_aux=True)(x)
    _close(ops, lap, ops.to_numpy(dj.laplacian(u)(x)))
    _close(ops, aux["y"], ops.to_numpy(u(x)))
    diag, aux = dj.hessian_diagonal(aux_u, has_aux=True)(x)
    _close(ops, diag, ops.to_numpy(dj.hessian_diagonal(u)(x)))
    hess, aux = dj.hessian(aux_u, has_aux=True)(x)
    _close(ops, hess, ops.to_numpy(dj.hessian(u)(x)))
    wl, aux = dj.weighted_laplacian(aux_u, factor=ops.asarray(np.eye(5)), has_aux=True)(x)
    _close(ops, wl, ops.to_numpy(lap))


# --- gradients w.r.t. parameters --------------------------------------------------------------


def test_gradient_of_a_laplacian_loss_wrt_params(ops: Ops) -> None:
    x = _x(ops, (B, 5))
    if ops.name == "jax":
        import jax
        import jax.numpy as jnp

        def loss(w, lap):
            return jnp.sum(lap(lambda x: jnp.sum(jnp.tanh(x @ w) * jnp.asarray(W2), 1))(x) ** 2)

        def brute(w):
            def one(xb):
                return jnp.trace(
                    jax.hessian(lambda z: jnp.sum(jnp.tanh(z @ w) * jnp.asarray(W2)))(xb)
                )

            return jnp.sum(jax.vmap(one)(x) ** 2)

        w = jnp.asarray(W1)
        want = np.asarray(jax.jit(jax.grad(brute))(w))
        for lap in (ops.dj.laplacian, lambda u: ops.dj.weighted_laplacian(u, jnp.eye(5))):
            _close(ops, jax.jit(jax.grad(loss), static_argnums=1)(w, lap), want)
        # d/dA of tr(A H) is H, also at A = kappa I (repeated eigenvalues)
        u = mlp(ops)
        H = ops.hessians(u, x, ())
        dA = jax.jit(jax.grad(lambda A: jnp.sum(ops.dj.weighted_laplacian(u, A)(x))))(
            2.0 * jnp.eye(5)
        )
        _close(ops, dA, H.sum(0))
        return
    import torch

    def laplacians(w, lap):
        return lap(lambda x: torch.sum(torch.tanh(x @ w) * ops.asarray(W2), 1))(x)

    def brute(w):
        def one(xb):
            return torch.sum(torch.tanh(xb @ w) * ops.asarray(W2))

        return torch.stack([torch.func.hessian(one)(xb).trace() for xb in x])

    w0 = ops.asarray(W1)
    wb = w0.clone().requires_grad_()
    brute(wb).pow(2).sum().backward()
    for lap in (
        ops.dj.laplacian,
        lambda u: ops.dj.weighted_laplacian(u, torch.eye(5, dtype=torch.float64)),
    ):
        w = w0.clone().requires_grad_()
        laplacians(w, lap).pow(2).sum().backward()
        _close(ops, w.grad, wb.grad.numpy())
    A = (2.0 * torch.eye(5, dtype=torch.float64)).requires_grad_()
    u = mlp(ops)
    ops.dj.weighted_laplacian(u, A)(x).sum().backward()
    _close(ops, A.grad, ops.hessians(u, x, ()).sum(0))


# --- coupling -----------------------------------------------------------------------------------


def coupled(o: Ops) -> Callable[..., Any]:
    """Each sample's output reads a coordinate of every sample (a sum over the batch)."""
    return lambda x: o.sum(o.tanh(x) ** 2, 1) + x[:, 0] ** 2 * (1.0 + o.sum(o.tanh(x[:, 1]), 0))


def test_coupled_functions_are_refused_or_exact(ops: Ops) -> None:
    u, x, dj = coupled(ops), _x(ops, (B, 4)), ops.dj
    for transform in (
        dj.laplacian(u),
        dj.hessian(u),
        dj.hessian_diagonal(u),
        lambda x: dj.weighted_laplacian(u, ops.asarray(np.eye(4)))(x),
        lambda x: dj.laplacian(u, method="hutchinson", coupling="exact")(ops.randomness(0), x),
    ):
        with pytest.raises(divjac.BatchCouplingError, match="mixes samples"):
            transform(x)
    # coupling="exact": the per-sample blocks of the whole batch's Hessian
    whole = ops.hessians(lambda X: u(X[0])[None], x[None], ())[0]  # (B, B, 4, B, 4)
    blocks = np.stack([whole[b, b, :, b, :] for b in range(B)])
    _close(ops, dj.laplacian(u, coupling="exact")(x), np.trace(blocks, axis1=1, axis2=2))
    _close(ops, dj.hessian_diagonal(u, coupling="exact")(x), np.diagonal(blocks, axis1=1, axis2=2))
    A = np.random.default_rng(8).normal(size=(4, 4))
    _close(
        ops,
        dj.weighted_laplacian(u, ops.asarray(A), coupling="exact")(x),
        np.einsum("ij,bij->b", A, blocks),
    )
    # The bi-Laplacian of the diagonal blocks: each direction in one sample at a time.
    want = _fourth(ops, u, x, None, coupled=True)
    for method in ("exact", "auto"):
        _close(ops, dj.bilaplacian(u, method=method, coupling="exact")(x), want)
    with pytest.raises(divjac.BatchCouplingError, match="coupling='exact'"):
        dj.bilaplacian(u)(x)
    for stochastic in (dj.laplacian, dj.bilaplacian):
        with pytest.raises(divjac.BatchCouplingError, match="use an exact method"):
            stochastic(u, method="hutchinson", coupling="exact")(ops.randomness(0), x)


# --- stochastic methods -------------------------------------------------------------------------

RUNS = 40


def _check_unbiased_and_calibrated(
    runs: list[tuple[np.ndarray, np.ndarray]], exact: np.ndarray
) -> None:
    est = np.stack([e for e, _ in runs])
    err = np.stack([s for _, s in runs])
    assert np.all(err >= 0)
    # No spread, no error bar: the terms of such an entry were all equal, its estimate exact.
    np.testing.assert_allclose(est[err == 0], np.broadcast_to(exact, est.shape)[err == 0])
    pooled = est.mean(0)
    pooled_err = np.sqrt((err**2).sum(0)) / len(runs)
    assert np.all(np.abs(pooled - exact) <= 4 * pooled_err + 1e-12), (pooled, exact, pooled_err)
    z = ((est - exact) / np.where(err > 0, err, 1.0))[err > 0]
    # +- 2 stderr covers the truth (>= 94 % promised; docs/calibration.md measures it)
    assert np.mean(np.abs(z) < 2) > 0.85
    assert np.mean(np.abs(z) < 0.5) < 0.6  # and the bar is not uselessly wide


@pytest.mark.slow
@pytest.mark.parametrize(
    "what",
    [
        "laplacian-hutchinson",
        "diagonal-hutchinson",
        "weighted-A",
        "weighted-factor",
    ],
)
def test_stochastic_methods_are_unbiased_and_calibrated(ops: Ops, what: str) -> None:
    # 8 probes of n = 20 (the factor: 8 of its r = 10 columns): below n,
    # and enough for Student's factor (kappa(7) = 1.12) to leave the bar narrow enough.
    u, x, dj = particles(ops), _x(ops, (2, 20)), ops.dj
    H = ops.hessians(u, x, ())
    A = np.random.default_rng(9).normal(size=(20, 20))
    S = np.random.default_rng(10).normal(size=(20, 10))
    opts = dict(num_probes=8, return_stderr=True, distribution="gaussian")
    if what == "laplacian-hutchinson":
        fn, exact = dj.laplacian(u, method="hutchinson", **opts), np.trace(H, axis1=1, axis2=2)
    elif what == "diagonal-hutchinson":
        fn = dj.hessian_diagonal(u, method="hutchinson", **opts)
        exact = np.diagonal(H, axis1=1, axis2=2)
    elif what == "weighted-A":
        fn = dj.weighted_laplacian(u, ops.asarray(A), method="hutchinson", **opts)
        exact = np.einsum("ij,bij->b", A, H)
    else:
        fn = dj.weighted_laplacian(u, factor=ops.asarray(S), method="hutchinson", **opts)
        exact = np.einsum("ij,bij->b", S @ S.T, H)
    if ops.name == "jax":
        import jax

        fn = jax.jit(fn)
    runs = []
    for seed in range(RUNS):
        e, s = fn(ops.randomness(seed), x)
        runs.append((ops.to_numpy(e), ops.to_numpy(s)))
    _check_unbiased_and_calibrated(runs, exact)


def test_stde_is_unbiased_and_refuses_an_error_bar_below_n(ops: Ops) -> None:
    """8 of 20 coordinates per sample: the mean over seeds converges to the trace; an error bar
    from the drawn coordinates alone would not hold (docs/calibration.md), so none is given."""
    u, x, dj = particles(ops), _x(ops, (2, 20)), ops.dj
    exact = np.trace(ops.hessians(u, x, ()), axis1=1, axis2=2)
    fn = dj.laplacian(u, method="stde", num_probes=8)
    runs = np.stack([ops.to_numpy(fn(ops.randomness(seed), x)) for seed in range(RUNS)])
    spread = runs.std(0, ddof=1) / np.sqrt(RUNS)
    assert np.all(np.abs(runs.mean(0) - exact) < 4 * spread), (runs.mean(0), exact, spread)
    with pytest.raises(divjac.NumProbesError, match="num_probes=20"):
        dj.laplacian(u, method="stde", num_probes=8, return_stderr=True)(ops.randomness(0), x)


@pytest.mark.slow
def test_stochastic_methods_on_the_callers_probes(ops: Ops) -> None:
    """Given probes ``v``, Hutchinson's terms are ``v^T H v`` and BKS's ``v * H v``."""
    u, x, dj = elementary(ops), _x(ops, (B, 4)), ops.dj
    H = ops.hessians(u, x, ())
    v = np.random.default_rng(11).choice([-1.0, 1.0], size=(2, B, 4))
    lap, _ = dj.laplacian(u, method="hutchinson", num_probes=2, return_stderr=True)(
        ops.asarray(v), x
    )
    terms = np.einsum("kbi,bij,kbj->kb", v, H, v)
    _close(ops, lap, terms.mean(0))
    diag = dj.hessian_diagonal(u, method="hutchinson", num_probes=2)(ops.asarray(v), x)
    _close(ops, diag, np.einsum("kbi,bij,kbj->bi", v, H, v) / 2)
    # STDE at n coordinates is exact, with a zero error bar.
    full, zero = dj.laplacian(u, method="stde", num_probes=4, return_stderr=True)(
        ops.randomness(0), x
    )
    _close(ops, full, np.trace(H, axis1=1, axis2=2))
    _close(ops, zero, np.zeros(B))


def test_the_callers_probes_set_the_budget(ops: Ops) -> None:
    """With ``num_probes`` left out, the budget is the caller's probes' count (the default of
    16 >= n = 4 had returned the exact value, discarding K < n probes); K = n probes pay for
    the exact sum, as for the divergence; a ``num_probes`` that does not match is refused."""
    u, x, dj = elementary(ops), _x(ops, (B, 4)), ops.dj
    H = ops.hessians(u, x, ())
    A = np.random.default_rng(5).normal(size=(4, 4))
    for k in (1, 3, 4):
        v = np.random.default_rng(12 + k).choice([-1.0, 1.0], size=(k, B, 4))
        V = ops.asarray(v)
        terms = np.einsum("kbi,bij,kbj->kbi", v, H, v)
        if k == 4:  # exact
            terms = np.broadcast_to(np.diagonal(H, axis1=1, axis2=2), terms.shape)
        _close(ops, dj.laplacian(u, method="hutchinson")(V, x), terms.sum(-1).mean(0))
        _close(ops, dj.hessian_diagonal(u, method="hutchinson")(V, x), terms.mean(0))
        weighted = dj.weighted_laplacian(u, ops.asarray(A), method="hutchinson")
        given = dj.weighted_laplacian(u, ops.asarray(A), method="hutchinson", num_probes=k)
        _close(ops, weighted(V, x), ops.to_numpy(given(V, x)))
        exact = np.einsum("ij,bij->b", A, H)
        assert np.allclose(ops.to_numpy(weighted(V, x)), exact) == (k == 4), k
    with pytest.raises(divjac.NumProbesError, match="num_probes"):
        dj.laplacian(u, method="hutchinson", num_probes=3)(ops.asarray(v[:1]), x)


# --- errors -------------------------------------------------------------------------------------


def test_errors_name_the_problem(ops: Ops) -> None:
    u, x, dj = mlp(ops), _x(ops, (B, 5)), ops.dj
    with pytest.raises(divjac.CoefficientError, match="exactly one of A"):
        dj.weighted_laplacian(u)
    with pytest.raises(divjac.CoefficientError, match="exactly one of A"):
        dj.weighted_laplacian(u, ops.asarray(np.eye(5)), factor=ops.asarray(np.eye(5)))
    with pytest.raises(divjac.CoefficientError, match=r"shape \(n, n\) or \(B, n, n\) with n = 5"):
        dj.weighted_laplacian(u, ops.asarray(np.eye(4)))(x)
    with pytest.raises(divjac.CoefficientError, match=r"B = 3"):
        dj.weighted_laplacian(u, factor=ops.asarray(np.ones((2, 5, 1))))(x)
    with pytest.raises(divjac.CoefficientError, match="floating"):
        dj.weighted_laplacian(u, ops.integers(np.eye(5)))(x)
    with pytest.raises(divjac.ArgnumsError, match="one int"):
        dj.weighted_laplacian(u, ops.asarray(np.eye(5)), (0,))
    with pytest.raises(divjac.OutputError, match="one scalar per sample"):
        dj.hessian(vector(ops))(x)
    with pytest.raises(divjac.OutputError, match="one scalar per sample"):
        dj.laplacian(vector(ops), method="hutch++", num_probes=3)(ops.randomness(0), x)
    with pytest.raises(divjac.NumProbesError, match="at least 2 probes"):
        dj.laplacian(u, method="hutchinson", num_probes=1, return_stderr=True)(ops.randomness(0), x)
    with pytest.raises(divjac.NumProbesError, match="scalar-per-sample u"):
        dj.laplacian(vector(ops), method="hutchinson", num_probes=2, return_stderr=True)(
            ops.randomness(0), x
        )
    with pytest.raises(divjac.NumProbesError, match="at least 3 probes"):
        dj.hessian_diagonal(u, method="hutchinson", num_probes=2, return_stderr=True)(
            ops.randomness(0), x
        )
    with pytest.raises(divjac.NumProbesError, match="samples coordinates"):
        dj.laplacian(u, method="stde", num_probes=1)(ops.asarray(np.ones((1, B, 5))), x)
    with pytest.raises(divjac.MissingKeyError):
        dj.hessian_diagonal(u, method="hutchinson")(x)
    with pytest.raises(divjac.OptionError, match="method must be one of"):
        dj.hessian_diagonal(u, method="xtrace")
    with pytest.raises(divjac.OptionError, match="mode must be one of"):
        dj.hessian(u, mode="dense")
    with pytest.raises(divjac.InputDtypeError):
        dj.laplacian(u)(ops.integers(np.ones((B, 5))))


# --- the PINN user story ------------------------------------------------------------------------


@pytest.mark.slow  # trains two networks for 5 steps each (about 1 min on 2 busy cores)
def test_pinn_doc_runs_and_its_residuals_are_the_brute_force_ones() -> None:
    """docs/pinn.md's examples run as written (in order, in one namespace, as a user runs
    them: float32), and their residual terms are brute force's."""
    import re
    from pathlib import Path

    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    doc = Path(__file__).resolve().parents[1] / "docs" / "pinn.md"
    # the blocks before the operators' section (tests/test_pinn_operators.py runs those)
    before = doc.read_text().split("## Any linear differential operator", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", before, flags=re.S)
    assert len(blocks) == 4
    ns: dict[str, Any] = {}
    with jax.enable_x64(False):
        for block in blocks:
            exec(compile(block, str(doc), "exec"), ns)
        assert len(ns["losses"]) == 5 and np.all(np.isfinite(ns["losses"]))
        assert ns["losses"][-1] < ns["losses"][0]  # the steps descend
        jnp = jax.numpy
        params, x, t = ns["params"], ns["x"][:4], ns["t"][:4]

        def one(xb, tb):
            return ns["u"](params, xb[None], tb[None])[0]

        H = jax.vmap(jax.hessian(one))(x, t)
        du_dt = jax.vmap(jax.grad(one, argnums=1))(x, t)[:, 0]
        D = ns["sigma"] @ ns["sigma"].T
        heat = du_dt - ns["kappa"] * jnp.trace(H, axis1=1, axis2=2)
        np.testing.assert_allclose(ns["residual"](params, x, t), heat, rtol=1e-4, atol=1e-5)
        flux_div = jax.vmap(
            lambda xb, tb: jnp.trace(
                jax.jacfwd(lambda z: ns["flux"](params, z[None], tb[None])[0])(xb)
            )
        )(x, t)
        fp = du_dt + flux_div - 0.5 * jnp.einsum("ij,bij->b", D, H)
        np.testing.assert_allclose(ns["fokker_planck"](params, x, t), fp, rtol=1e-4, atol=1e-5)
        plate, pts = ns["plate"], ns["points"][:4]

        def lap(z):
            return jnp.trace(jax.hessian(lambda s: plate(s[None])[0])(z))

        bilap = jax.vmap(lambda z: jnp.trace(jax.hessian(lap)(z)))(ns["points"])
        want_plate = ns["rigidity"] * bilap[:4] - ns["load"](pts)
        np.testing.assert_allclose(ns["plate_residual"][:4], want_plate, rtol=1e-3, atol=1e-4)
        # The stochastic estimate (no error bar: its terms give none that holds) is unbiased:
        # its errors over the 64 points average to zero within their own spread.
        errors = np.asarray(ns["estimate"], np.float64) - np.asarray(bilap, np.float64)
        assert np.all(np.isfinite(errors)) and np.std(errors) > 0
        assert abs(errors.mean()) < 4 * errors.std(ddof=1) / np.sqrt(len(errors))
    assert len(ns["torch_losses"]) == 5 and np.all(np.isfinite(ns["torch_losses"]))
    net, xs, ts = ns["net"], ns["xs"][:4], ns["ts"][:4]
    Ht = torch.func.vmap(torch.func.hessian(lambda xb, tb: net(xb[None], tb[None])[0]))(xs, ts)
    D = ns["sigma_t"] @ ns["sigma_t"].T
    want = torch.einsum("ij,bij->b", D, Ht).detach().numpy()
    np.testing.assert_allclose(ns["fp_diffusion"][:4].detach().numpy(), want, rtol=1e-4, atol=1e-5)


# --- the bi-Laplacian ---------------------------------------------------------------------------


def _fourth(
    o: Ops, u: Callable[..., Any], x: Any, v: np.ndarray | None, *, coupled: bool = False
) -> np.ndarray:
    """Per sample, by nested Hessians in float64: ``sum_ij d^4u/dx_i^2 dx_j^2`` (``v=None``),
    or ``(v_k . grad)^4 u`` for each probe ``v_k`` (``v``: ``(k, B, n)``), ``(k, B)``.
    ``coupled``: ``u`` mixes samples; sample ``b``'s output differentiated by its own input,
    the other samples held (the diagonal blocks)."""
    xs = o.to_numpy(x)
    if o.name == "jax":
        import jax
        import jax.numpy as jnp

        def one(z, b):
            return u(jnp.asarray(xs).at[b].set(z) if coupled else z[None])[b if coupled else 0]

        if v is None:

            def bilaplacian(z, b):
                lap = lambda z: jnp.trace(jax.hessian(one)(z, b))  # noqa: E731
                return jnp.trace(jax.hessian(lap)(z))

            return np.array([bilaplacian(xs[b], b) for b in range(len(xs))])
        d = lambda g: jax.grad(g)  # noqa: E731
        return np.array(
            [
                [
                    d(d(d(d(lambda t, z=xs[b], w=vk[b], b=b: one(z + t * w, b)))))(0.0)
                    for b in range(len(xs))
                ]
                for vk in v
            ]
        )
    import torch
    from torch.func import grad, hessian

    def one_t(z, b):
        if not coupled:
            return u(z[None])[0]
        whole = torch.as_tensor(xs)
        return u(torch.cat([whole[:b], z[None], whole[b + 1 :]]))[b]

    rows = []
    for b in range(len(xs)):
        zb = torch.as_tensor(xs[b])
        if v is None:
            lap = lambda z, b=b: torch.trace(hessian(one_t)(z, b))  # noqa: E731
            rows.append(float(torch.trace(hessian(lap)(zb))))
        else:
            d = lambda g: grad(g)  # noqa: E731
            t0 = torch.tensor(0.0, dtype=torch.float64)
            rows.append(
                [
                    float(
                        d(
                            d(
                                d(
                                    d(
                                        lambda t, z=zb, w=vk[b], b=b: one_t(
                                            z + t * torch.as_tensor(w), b
                                        )
                                    )
                                )
                            )
                        )(t0)
                    )
                    for vk in v
                ]
            )
    return np.array(rows) if v is None else np.array(rows).T


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mlp", pytest.param("elementary", marks=pytest.mark.slow)])
def test_bilaplacian_matches_nested_hessians(ops: Ops, case: str) -> None:
    u = {"mlp": mlp, "elementary": elementary}[case](ops)
    x = _x(ops, (B, 4 if case == "elementary" else 5))
    want = _fourth(ops, u, x, None)
    _close(ops, ops.dj.bilaplacian(u, method="exact")(x), want)
    value, err = ops.dj.bilaplacian(u, return_stderr=True)(x)  # auto
    _close(ops, value, want)
    assert np.all(ops.to_numpy(err) == 0)


def test_bilaplacian_hutchinson_terms(ops: Ops, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each Gaussian probe's term is (v . grad)^4 u / 3 (the probes it draws, set here).
    import divjac._second

    u, x = mlp(ops), _x(ops, (B, 5))
    v = np.random.default_rng(9).normal(size=(3, B, 5))
    terms = _fourth(ops, u, x, v) / 3
    monkeypatch.setattr(divjac._second, "draw", lambda *_: ops.asarray(v))
    mean = ops.dj.bilaplacian(u, method="hutchinson", num_probes=3)(ops.randomness(0), x)
    _close(ops, mean, terms.mean(0))
    monkeypatch.undo()
    # The caller's probes are refused: unbiased only for Gaussian ones, which cannot be
    # checked (Rademacher signs gave a third of sum(x**4)'s bi-Laplacian, silently).
    with pytest.raises(divjac.NumProbesError, match="draws its Gaussian probes itself"):
        ops.dj.bilaplacian(u, method="hutchinson", num_probes=3)(ops.asarray(np.sign(v)), x)
    # Heavy-tailed terms: no error bar holds (docs/calibration.md), so none is given.
    with pytest.raises(divjac.OptionError, match="no error bar that holds"):
        ops.dj.bilaplacian(u, method="hutchinson", return_stderr=True)


@pytest.mark.slow
def test_bilaplacian_hutchinson_is_unbiased(ops: Ops) -> None:
    u, x = mlp(ops), _x(ops, (B, 5))
    want = _fourth(ops, u, x, None)
    fn = ops.dj.bilaplacian(u, method="hutchinson", num_probes=16)
    means = np.stack([ops.to_numpy(fn(ops.randomness(seed), x)) for seed in range(8)])
    z = (means.mean(0) - want) / (means.std(0, ddof=1) / np.sqrt(8))
    assert np.all(np.abs(z) < 5), z
