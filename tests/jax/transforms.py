"""The table of the public JAX transforms for the context matrix (issue 41): for each name of
``divjac.jax.__all__`` that is a transform, its variants (every method and mode), how each is
called and what the brute force (:class:`Brute`) says it computes.

A variant is called as ``build(fn, argnums, args)(*lead, *args)``: ``fn`` is a batched function
of ``args`` whose argument ``argnums`` is the input ``x``, ``lead`` its randomness (fixed
Rademacher probes, or the key :data:`KEY_SEED`). The brute force is ``vmap(jacfwd)`` /
``vmap(hessian)`` of the per-sample function; the stochastic methods are compared against the
same probes applied to the brute-force Jacobian or Hessian, and a budget of ``K >= n`` probes
is the exact value, as the library computes it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import divjac.jax as dj
from divjac._core.estimators import estimate_trace, slq_log_abs_det

K = 6  # probes of the stochastic methods (a budget that Hutch++ and XTrace accept)
KEY_SEED = 3  # of the key a method that draws its own probes is given

OPERATOR = ((1.0, (0, 0, 0)), (0.5, (-1, -1)))
"""The operator of ``differential_operator``'s variants, ``u_{000} + u_{n-1,n-1} / 2``: one
direction per order, where the stochastic methods are exact."""
MIXED = (0, 0, -1)
"""The mixed partial of ``derivative``'s variant, ``d^3u/dx_0^2 dx_{n-1}``."""

NOT_TRANSFORMS = {"SparsityPattern", "clear_caches", "register_rule"}
"""The names of ``divjac.jax.__all__`` that are not transforms (not in :data:`TABLE`)."""


def _drawn(method: str) -> int:
    """The random vectors a stochastic trace draws for a budget of ``K`` matvecs."""
    return {"hutchinson": K, "hutch++": K * 2 // 3, "xtrace": K // 2}[method]


def weight(n: int, dtype: Any) -> jax.Array:
    """The coefficient ``A`` of ``weighted_laplacian``: shared, symmetric, not diagonal."""
    i = np.arange(n)
    return jnp.asarray(np.eye(n) + 0.3 / (1 + np.abs(i[:, None] - i[None])), dtype)


def factor(n: int, dtype: Any) -> jax.Array:
    """The factor ``S`` ``(n, 2)`` of ``weighted_laplacian(u, factor=S)``: ``tr(S^T H S)``."""
    i = np.arange(n)
    return jnp.asarray(np.stack([np.cos(i), np.sin(i) + 0.5], 1), dtype)


def probes_for(x: jax.Array) -> jax.Array:
    """The stochastic methods' fixed Rademacher probes ``(K, *x.shape)`` for the batch ``x``."""
    signs = np.random.default_rng(1).choice([-1.0, 1.0], size=(K, *x.shape))
    return jnp.asarray(signs, x.dtype)


class Brute:
    """Per-sample derivatives of ``g(p, x, t, *extra)`` (``t`` per sample) at one batch, by
    ``vmap`` over samples of dense ``jax`` derivatives; built inside ``jit``."""

    def __init__(self, g: Callable[..., Any], p: Any, x: jax.Array, t: jax.Array, extra: tuple):
        self.g, self.p, self.x, self.t, self.extra = g, p, x, t, extra
        self.B, self.n = x.shape[0], int(np.prod(x.shape[1:]))
        self.probes = probes_for(x)

    def one(self, xs: jax.Array, ts: jax.Array) -> jax.Array:
        return self.g(self.p, xs[None], ts[None], *self.extra)[0]

    def u_one(self, xs: jax.Array, ts: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sin(self.one(xs, ts)))

    @functools.cached_property
    def value(self) -> jax.Array:
        return self.g(self.p, self.x, self.t, *self.extra)

    @functools.cached_property
    def jac_full(self) -> jax.Array:  # (B, *out, *in)
        return jax.vmap(jax.jacfwd(self.one))(self.x, self.t)

    @property
    def jac(self) -> jax.Array:  # (B, n, n)
        return self.jac_full.reshape(self.B, -1, self.n)

    @property
    def div(self) -> jax.Array:
        return jnp.trace(self.jac, axis1=1, axis2=2)

    @functools.cached_property
    def hess_full(self) -> jax.Array:  # (B, *in, *in)
        return jax.vmap(jax.hessian(self.u_one))(self.x, self.t)

    @property
    def hess(self) -> jax.Array:
        return self.hess_full.reshape(self.B, self.n, self.n)

    def core_probes(self) -> jax.Array:
        return jnp.moveaxis(self.probes.reshape(K, self.B, self.n), 0, -1)  # (B, n, K)

    def grad_of(self, quantity: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
        """Per sample, the gradient w.r.t. the input of ``quantity(J_b(x_b), v_b)``."""

        def q(xs: jax.Array, ts: jax.Array, v: jax.Array) -> jax.Array:
            return quantity(jax.jacfwd(self.one)(xs, ts).reshape(self.n, self.n), v)

        return jax.vmap(jax.grad(q))(self.x, self.t, self.core_probes())

    def grad_div(self) -> jax.Array:
        return self.grad_of(lambda j, v: jnp.trace(j))

    def grad_hutchinson(self) -> jax.Array:
        if self.n <= K:
            return self.grad_div()
        return self.grad_of(lambda j, v: jnp.mean(jnp.sum((j @ v) * v, 0)))

    def bilap(self) -> jax.Array:
        def lap(xs: jax.Array, ts: jax.Array) -> jax.Array:
            return jnp.trace(jax.hessian(self.u_one)(xs, ts).reshape(self.n, self.n))

        return jax.vmap(lambda xs, ts: jnp.trace(jax.hessian(lap)(xs, ts).reshape(self.n, -1)))(
            self.x, self.t
        )

    def operator(self, terms: tuple[tuple[float, tuple[int, ...]], ...]) -> jax.Array:
        """``sum_t c_t d^{alpha_t} u`` by nested ``jacfwd`` of the flat per-sample ``u``."""
        shape, total = self.x.shape[1:], 0.0
        for c, alpha in terms:
            g = lambda xf, ts: self.u_one(xf.reshape(shape), ts)  # noqa: E731
            for _ in alpha:
                g = jax.jacfwd(g)
            per = jax.vmap(lambda xs, ts, g=g, a=alpha: g(xs.reshape(-1), ts)[a])
            total = total + c * per(self.x, self.t)
        return total

    def bilap_hutchinson(self) -> jax.Array:
        """The mean of ``(v . grad)^4 u / 3`` over the Gaussian probes the key draws."""
        dtype = self.x.dtype
        v = jax.random.normal(jax.random.key(KEY_SEED), (self.B, self.n, K), dtype)

        def term(xs: jax.Array, ts: jax.Array, vk: jax.Array) -> jax.Array:
            def phi(s: jax.Array) -> jax.Array:
                return self.u_one(xs + s * vk.reshape(xs.shape), ts)

            return jax.grad(jax.grad(jax.grad(jax.grad(phi))))(jnp.zeros((), dtype))

        per_probe = jax.vmap(term, (None, None, 1))
        return jax.vmap(lambda xs, ts, vb: jnp.mean(per_probe(xs, ts, vb)) / 3)(self.x, self.t, v)

    def stochastic(self, method: str, matrix: jax.Array) -> jax.Array:
        """The trace estimate of ``method`` with :attr:`probes`, on ``matrix`` ``(B, n, n)``."""
        probes = self.core_probes()
        if method == "hutchinson" and self.n <= K:
            return jnp.trace(matrix, axis1=1, axis2=2)
        if method == "hutchinson":
            return jnp.mean(jnp.sum((matrix @ probes) * probes, 1), -1)
        return estimate_trace(method, lambda V: matrix @ V, probes[..., : _drawn(method)])[0]

    def hutchinson_diagonal(self) -> jax.Array:
        exact = jnp.diagonal(self.hess, axis1=1, axis2=2)
        if self.n <= K:
            return exact.reshape(self.x.shape)
        v = self.core_probes()
        return jnp.mean((self.hess @ v) * v, -1).reshape(self.x.shape)

    def weighted(self, A: jax.Array, stochastic: bool) -> jax.Array:
        if not stochastic or self.n <= K:
            return jnp.trace(A @ self.hess, axis1=1, axis2=2)
        v = self.core_probes()
        return jnp.mean(jnp.sum((self.hess @ v) * (A @ v), 1), -1)

    def frobenius(self, *, stochastic: bool, rows: bool) -> jax.Array:
        if not stochastic or self.n <= K:
            return jnp.sum(self.jac**2, (1, 2))
        v = self.core_probes()
        images = jnp.swapaxes(self.jac, 1, 2) @ v if rows else self.jac @ v
        return jnp.mean(jnp.sum(images**2, 1), -1)

    def log_abs_det(self, *, stochastic: bool) -> jax.Array:
        if not stochastic:
            return jnp.linalg.slogdet(self.jac)[1]
        gram = jnp.swapaxes(self.jac, 1, 2) @ self.jac
        return slq_log_abs_det(lambda V: gram @ V, self.core_probes(), min(self.n, 30))[0]


# --- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One transform with one method and mode: how it is called and what it computes."""

    id: str
    build: Callable[[Callable[..., Any], int, tuple[Any, ...]], Callable[..., Any]]
    expect: Callable[[Brute], Any]
    scalar: bool = False  # takes the scalar u of the model
    randomness: str | None = None  # "probes" (the first drawn), or "key"
    drawn: int = K
    traceable: bool = True  # callable under jit and vmap
    differentiable: bool = True  # a dense result, differentiable w.r.t. the parameters
    compare: str = "close"  # or "covers": a pattern that must hold the Jacobian's nonzeros
    out: Callable[[Any], Any] = lambda r: r


def _n(args: tuple[Any, ...], argnums: int) -> int:
    return int(np.prod(args[argnums].shape[1:]))


def _jacobian() -> list[Variant]:
    return [
        Variant(f"jacobian-{mode}", lambda f, a, _, m=mode: dj.jacobian(f, a, mode=m),
                lambda b: b.jac_full)
        for mode in ("auto", "fwd", "rev", "sparse")
    ]  # fmt: skip


def _trace_family(name: str) -> list[Variant]:
    """``divergence`` or ``value_and_divergence``: the exact methods in every mode, the
    stochastic ones (Hutch++ and XTrace sketch J in columns, J^T in rows), and probing with a
    budget of n (its exact coloring)."""
    transform = getattr(dj, name)
    wrap = (lambda b, v: (b.value, v)) if name == "value_and_divergence" else (lambda b, v: v)
    found = [
        Variant(f"{name}-{method}-{mode}",
                lambda f, a, _, me=method, mo=mode: transform(f, a, method=me, mode=mo),
                lambda b: wrap(b, b.div))
        for method in ("auto", "exact", "sparse")
        for mode in ("auto", "fwd", "rev")
    ]  # fmt: skip
    for method, mode in (("hutchinson", "auto"), ("hutch++", "fwd"), ("hutch++", "rev"),
                         ("xtrace", "fwd"), ("xtrace", "rev")):  # fmt: skip
        found.append(
            Variant(
                f"{name}-{method}-{mode}",
                lambda f, a, _, me=method, mo=mode: transform(
                    f, a, method=me, mode=mo, num_probes=K
                ),
                lambda b, me=method, mo=mode: wrap(
                    b, b.stochastic(me, jnp.swapaxes(b.jac, 1, 2) if mo == "rev" else b.jac)
                ),
                randomness="probes",
                drawn=_drawn(method),
            )
        )
    found.append(
        Variant(
            f"{name}-probing",
            lambda f, a, args: transform(f, a, method="probing", num_probes=_n(args, a)),
            lambda b: wrap(b, b.div),
            randomness="key",
        )
    )
    return found


def _grad_divergence() -> list[Variant]:
    found = [
        Variant(f"grad_divergence-{mode}", lambda f, a, _, m=mode: dj.grad_divergence(f, a, mode=m),
                lambda b: b.grad_div())
        for mode in ("auto", "fwd", "rev")
    ]  # fmt: skip
    found.append(
        Variant(
            "grad_divergence-hutchinson",
            lambda f, a, _: dj.grad_divergence(f, a, method="hutchinson", num_probes=K),
            lambda b: b.grad_hutchinson(),
            randomness="probes",
        )
    )
    return found


def _laplacian() -> list[Variant]:
    def lap(b: Brute) -> jax.Array:
        return jnp.trace(b.hess, axis1=1, axis2=2)

    exact = [
        Variant(f"laplacian-{method}", lambda u, a, _, m=method: dj.laplacian(u, a, method=m),
                lap, scalar=True)
        for method in ("auto", "exact", "sparse")
    ]  # fmt: skip
    stochastic = [
        Variant(
            f"laplacian-{method}",
            lambda u, a, _, m=method: dj.laplacian(u, a, method=m, num_probes=K),
            lambda b, m=method: b.stochastic(m, b.hess),
            scalar=True,
            randomness="probes",
            drawn=_drawn(method),
        )
        for method in ("hutchinson", "hutch++", "xtrace")
    ]
    budgeted = [  # a budget of n: every coordinate (stde), the exact coloring (probing)
        Variant(
            f"laplacian-{method}",
            lambda u, a, args, m=method: dj.laplacian(u, a, method=m, num_probes=_n(args, a)),
            lap,
            scalar=True,
            randomness="key",
        )
        for method in ("stde", "probing")
    ]
    return exact + stochastic + budgeted


def _weighted_laplacian() -> list[Variant]:
    def build(method: str) -> Callable[..., Any]:
        def made(u: Any, a: int, args: tuple[Any, ...]) -> Any:
            x = args[a]
            return dj.weighted_laplacian(
                u, weight(_n(args, a), x.dtype), argnums=a, method=method, num_probes=K
            )

        return made

    found = [
        Variant(f"weighted_laplacian-{method}", build(method),
                lambda b, m=method: b.weighted(weight(b.n, b.x.dtype), m == "hutchinson"),
                scalar=True, randomness="probes" if method == "hutchinson" else None)
        for method in ("auto", "exact", "hutchinson")
    ]  # fmt: skip

    def by_factor(u: Any, a: int, args: tuple[Any, ...]) -> Any:
        return dj.weighted_laplacian(u, argnums=a, factor=factor(_n(args, a), args[a].dtype))

    def want(b: Brute) -> jax.Array:
        S = factor(b.n, b.x.dtype)
        return jnp.trace(S.T @ b.hess @ S, axis1=1, axis2=2)

    return [*found, Variant("weighted_laplacian-factor", by_factor, want, scalar=True)]


def _hessian() -> list[Variant]:
    return [
        Variant(f"hessian-{mode}", lambda u, a, _, m=mode: dj.hessian(u, a, mode=m),
                lambda b: b.hess_full, scalar=True)
        for mode in ("auto", "fwd", "rev", "sparse")
    ]  # fmt: skip


def _hessian_diagonal() -> list[Variant]:
    found = [
        Variant(f"hessian_diagonal-{method}",
                lambda u, a, _, m=method: dj.hessian_diagonal(u, a, method=m),
                lambda b: jnp.diagonal(b.hess, axis1=1, axis2=2).reshape(b.x.shape), scalar=True)
        for method in ("auto", "exact", "sparse")
    ]  # fmt: skip
    found.append(
        Variant(
            "hessian_diagonal-hutchinson",
            lambda u, a, _: dj.hessian_diagonal(u, a, method="hutchinson", num_probes=K),
            lambda b: b.hutchinson_diagonal(),
            scalar=True,
            randomness="probes",
        )
    )
    return found


def _bilaplacian() -> list[Variant]:
    found = [
        Variant(f"bilaplacian-{method}", lambda u, a, _, m=method: dj.bilaplacian(u, a, method=m),
                lambda b: b.bilap(), scalar=True)
        for method in ("auto", "exact")
    ]  # fmt: skip
    found.append(
        Variant(
            "bilaplacian-hutchinson",
            lambda u, a, _: dj.bilaplacian(u, a, method="hutchinson", num_probes=K),
            lambda b: b.bilap_hutchinson(),
            scalar=True,
            randomness="key",
        )
    )
    return found


def _operators() -> dict[str, list[Variant]]:
    """Each order of :data:`OPERATOR` has one direction: the stochastic methods are exact."""
    alpha = MIXED
    return {
        "derivative": [
            Variant("derivative", lambda u, a, _: dj.derivative(u, alpha, a),
                    lambda b: b.operator(((1.0, alpha),)), scalar=True)
        ],
        "differential_operator": [
            Variant(f"differential_operator-{method}",
                    lambda u, a, _, m=method: dj.differential_operator(u, OPERATOR, a, method=m),
                    lambda b: b.operator(OPERATOR), scalar=True,
                    randomness="key" if method in ("hutchinson", "stde") else None)
            for method in ("auto", "exact", "hutchinson", "stde")
        ],
    }  # fmt: skip


def _frobenius(name: str) -> list[Variant]:
    """``squared_frobenius_norm`` or ``value_divergence_and_frobenius``: the exact methods in
    every mode, Hutchinson in columns (fwd: ``||J v||^2``) and rows (rev and auto: ``||v^T J||^2``,
    in both frameworks)."""
    transform = getattr(dj, name)
    both = name == "value_divergence_and_frobenius"

    def wrap(b: Brute, norm: jax.Array, div: jax.Array) -> Any:
        return (b.value, div, norm) if both else norm

    found = [
        Variant(f"{name}-{method}-{mode}",
                lambda f, a, _, me=method, mo=mode: transform(f, a, method=me, mode=mo),
                lambda b: wrap(b, b.frobenius(stochastic=False, rows=False), b.div))
        for method, mode in (("auto", "auto"), ("exact", "fwd"), ("exact", "rev"),
                             ("sparse", "auto"))
    ]  # fmt: skip
    found += [
        Variant(
            f"{name}-hutchinson-{mode}",
            lambda f, a, _, mo=mode: transform(f, a, method="hutchinson", mode=mo, num_probes=K),
            lambda b, mo=mode: wrap(
                b,
                b.frobenius(stochastic=True, rows=mo != "fwd"),
                b.stochastic("hutchinson", b.jac),
            ),
            randomness="probes",
        )
        for mode in ("fwd", "rev", "auto")
    ]
    return found


def _log_abs_det() -> list[Variant]:
    found = [
        Variant(f"log_abs_det-{mode}", lambda f, a, _, m=mode: dj.log_abs_det(f, a, mode=m),
                lambda b: b.log_abs_det(stochastic=False))
        for mode in ("auto", "fwd", "rev")
    ]  # fmt: skip
    found.append(
        Variant(
            "log_abs_det-slq",
            lambda f, a, _: dj.log_abs_det(f, a, method="slq", num_probes=K),
            lambda b: b.log_abs_det(stochastic=True),
            randomness="probes",
        )
    )
    return found


def _patterns() -> dict[str, list[Variant]]:
    def pattern(f: Any, a: int, args: tuple[Any, ...]) -> Any:
        return dj.sparsity(f, a)(*args)

    return {
        "sparsity": [
            Variant(
                "sparsity",
                lambda f, a, _: dj.sparsity(f, a),
                lambda b: b.jac[0] != 0,
                traceable=False,
                differentiable=False,
                compare="covers",
                out=lambda p: jnp.asarray(p.csr.toarray()),
            )
        ],
        "sparse_jacobian": [
            Variant(
                "sparse_jacobian",
                lambda f, a, _: dj.sparse_jacobian(f, a),
                lambda b: b.jac,  # per-sample (n_out, n_in) matrices
                differentiable=False,
                out=lambda r: r.todense(),
            )
        ],
        "jacobian_from_pattern": [
            Variant(
                "jacobian_from_pattern",
                lambda f, a, args: dj.jacobian_from_pattern(f, pattern(f, a, args), a),
                lambda b: b.jac_full,
            )
        ],
        "divergence_from_pattern": [
            Variant(
                "divergence_from_pattern",
                lambda f, a, args: dj.divergence_from_pattern(f, pattern(f, a, args), a),
                lambda b: b.div,
            )
        ],
    }


TABLE: dict[str, list[Variant]] = {
    "jacobian": _jacobian(),
    "divergence": _trace_family("divergence"),
    "value_and_divergence": _trace_family("value_and_divergence"),
    "grad_divergence": _grad_divergence(),
    "laplacian": _laplacian(),
    "weighted_laplacian": _weighted_laplacian(),
    "hessian": _hessian(),
    "hessian_diagonal": _hessian_diagonal(),
    "bilaplacian": _bilaplacian(),
    "squared_frobenius_norm": _frobenius("squared_frobenius_norm"),
    "value_divergence_and_frobenius": _frobenius("value_divergence_and_frobenius"),
    "log_abs_det": _log_abs_det(),
    **_operators(),
    **_patterns(),
}
"""Public transform name -> its variants: a new transform in ``__all__`` fails
``test_every_public_transform_is_in_the_table`` until it has an entry here."""

VARIANTS = {v.id: v for variants in TABLE.values() for v in variants}
