"""The table of the public torch transforms for the context matrix (issue 41): for each name of
``divjac.torch.__all__`` that is a transform, its variants (every method and mode), how each is
called and what the float64 brute force (:class:`Truth`) says it computes.

A variant is called as ``build(fn, argnums, args)(*lead, *args)``: ``fn`` is a batched function
of ``args`` whose argument ``argnums`` is the input ``x`` (``args = (x, t)``, or
``(params, x, t)`` for a module called functionally), ``lead`` its randomness (fixed
Rademacher probes, or a fresh generator seeded :data:`SEED`). The stochastic methods are
compared against the same probes applied to the brute-force Jacobian or Hessian; a budget of
``K >= n`` probes is the exact value, as the library computes it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import divjac.torch as dj
from divjac._core.estimators import estimate_trace, slq_log_abs_det
from tests.reference import torch_composed_norms

K = 6  # probes of the stochastic methods (a budget that Hutch++ and XTrace accept)
SEED = 3  # of the generator a method that draws its own probes is given

OPERATOR = ((1.0, (0, 0, 0)), (0.5, (-1, -1)))
"""The operator of ``differential_operator``'s variants, ``u_{000} + u_{n-1,n-1} / 2``: one
direction per order, where the stochastic methods are exact."""
MIXED = (0, 0, -1)
"""The mixed partial of ``derivative``'s variant, ``d^3u/dx_0^2 dx_{n-1}``."""

NOT_TRANSFORMS = {"SparsityPattern", "clear_caches", "register_rule"}
"""The names of ``divjac.torch.__all__`` that are not transforms (not in :data:`TABLE`)."""


def _drawn(method: str) -> int:
    """The random vectors a stochastic trace draws for a budget of ``K`` matvecs."""
    return {"hutchinson": K, "hutch++": K * 2 // 3, "xtrace": K // 2}[method]


def u_of(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A scalar per sample built on ``f`` (for the second-order transforms)."""
    return lambda *args: torch.sin(f(*args)).flatten(1).sum(1)


def weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The coefficient ``A`` of ``weighted_laplacian``: shared, symmetric, not diagonal."""
    i = torch.arange(n, dtype=torch.float64)
    return (torch.eye(n, dtype=torch.float64) + 0.3 / (1 + (i[:, None] - i[None]).abs())).to(dtype)


def factor(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The factor ``S`` ``(n, 2)`` of ``weighted_laplacian(u, factor=S)``: ``tr(S^T H S)``."""
    i = torch.arange(n, dtype=torch.float64)
    return torch.stack([torch.cos(i), torch.sin(i) + 0.5], 1).to(dtype)


def gaussian_probes(B: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``(B, n, K)`` Gaussian probes a method draws from a generator seeded :data:`SEED`."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randn((B, n, K), generator=g, dtype=dtype).to(torch.float64)


def _per_sample(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, b: int) -> Callable:
    """Sample ``b`` of ``f``'s output as a function of sample ``b`` of its input."""

    def one(xb: torch.Tensor) -> torch.Tensor:
        return f(torch.cat([x[:b], xb[None], x[b + 1 :]]))[b]

    return one


def _nth(phi: Callable[[torch.Tensor], torch.Tensor], order: int) -> torch.Tensor:
    """The ``order``-th derivative at 0 of a scalar function of a scalar."""
    s = torch.zeros((), dtype=torch.float64, requires_grad=True)
    out = phi(s)
    for _ in range(order):
        (out,) = torch.autograd.grad(out, s, create_graph=True)
    return out


@contextlib.contextmanager
def reference_mode() -> Iterator[None]:
    """Grad on (also inside ``inference_mode``), the math form of attention: torch has no
    double backward of the fused kernels (``_scaled_dot_product_flash_attention_for_cpu_backward``),
    and normalizations composed: torch's have wrong derivatives above the second
    (:func:`~tests.reference.torch_composed_norms`)."""
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        sdpa_kernel(SDPBackend.MATH),
        torch_composed_norms(),
    ):
        yield


class Truth:
    """Per-sample float64 derivatives of a batched ``f`` at ``x`` by loops over samples with
    ``torch.autograd.functional`` (one row at a time: torch's vmap-batched derivatives are
    wrong for some kernels, the Hessian of ``linalg.solve`` in torch 2.13). Every quantity is
    built with ``create_graph=True``, so that it can be differentiated w.r.t. the parameters
    ``f`` closes over."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
        self.f, self.x = f, x
        self.B, self.n = x.shape[0], x[0].numel()
        g = torch.Generator().manual_seed(2)
        self.probes = (2 * torch.randint(0, 2, (K, *x.shape), generator=g) - 1).to(x.dtype)

    def _each(self, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        with reference_mode():
            return torch.stack([make(b) for b in range(self.B)])

    @functools.cached_property
    def value(self) -> torch.Tensor:
        with reference_mode():
            return self.f(self.x)

    @functools.cached_property
    def jac(self) -> torch.Tensor:  # (B, m, n)
        jacobian = torch.autograd.functional.jacobian

        def one(b: int) -> torch.Tensor:
            j = jacobian(_per_sample(self.f, self.x, b), self.x[b], create_graph=True)
            return j.reshape(-1, self.n)

        return self._each(one)

    @property
    def div(self) -> torch.Tensor:
        return self.jac.diagonal(0, 1, 2).sum(-1)

    @functools.cached_property
    def hess(self) -> torch.Tensor:  # of u_of(f), (B, n, n)
        u = u_of(self.f)

        def one(b: int) -> torch.Tensor:
            h = torch.autograd.functional.hessian(
                _per_sample(u, self.x, b), self.x[b], create_graph=True
            )
            return h.reshape(self.n, self.n)

        return self._each(one)

    def _grad_of(self, quantity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
        """Per sample, the gradient w.r.t. the input of ``quantity(J_b(x_b), b)``."""
        jacobian = torch.autograd.functional.jacobian

        def one(b: int) -> torch.Tensor:
            xb = self.x[b].detach().clone().requires_grad_()
            j = jacobian(_per_sample(self.f, self.x, b), xb, create_graph=True)
            q = quantity(j.reshape(-1, self.n), b)
            return torch.autograd.grad(q, xb, create_graph=True)[0]

        return self._each(one)

    @functools.cached_property
    def grad_div(self) -> torch.Tensor:
        return self._grad_of(lambda j, b: j.trace())

    @functools.cached_property
    def grad_hutchinson(self) -> torch.Tensor:
        v = self.core_probes()
        if self.n <= K:
            return self.grad_div
        return self._grad_of(lambda j, b: ((j @ v[b]) * v[b]).sum(0).mean())

    @functools.cached_property
    def bilap(self) -> torch.Tensor:
        u = u_of(self.f)

        def one(b: int) -> torch.Tensor:
            def lap(xb: torch.Tensor) -> torch.Tensor:
                h = torch.autograd.functional.hessian(
                    _per_sample(u, self.x, b), xb, create_graph=True
                )
                return h.reshape(self.n, self.n).trace()

            h = torch.autograd.functional.hessian(lap, self.x[b], create_graph=True)
            return h.reshape(self.n, self.n).trace()

        return self._each(one)

    def operator(self, terms: tuple[tuple[float, tuple[int, ...]], ...]) -> torch.Tensor:
        """``sum_t c_t d^{alpha_t} u`` by nested ``autograd.grad`` of the flat sample."""
        u = u_of(self.f)

        def one(b: int) -> torch.Tensor:
            xb = self.x[b].detach().clone().requires_grad_()
            total = torch.zeros((), dtype=torch.float64)
            for c, alpha in terms:
                out = _per_sample(u, self.x, b)(xb)
                for i in alpha:
                    (g,) = torch.autograd.grad(out, xb, create_graph=True, materialize_grads=True)
                    out = g.flatten()[i]
                total = total + c * out
            return total

        return self._each(one)

    def bilap_hutchinson(self, dtype: torch.dtype) -> torch.Tensor:
        """The mean of ``(v . grad)^4 u / 3`` over the Gaussian probes of :func:`gaussian_probes`."""
        v = gaussian_probes(self.B, self.n, dtype)
        u = u_of(self.f)

        def one(b: int) -> torch.Tensor:
            ub = _per_sample(u, self.x, b)
            terms = [
                _nth(lambda s, k=k: ub(self.x[b] + s * v[b, :, k].reshape(self.x[b].shape)), 4)
                for k in range(K)
            ]
            return torch.stack(terms).mean() / 3

        return self._each(one)

    def core_probes(self) -> torch.Tensor:
        return self.probes.flatten(2).permute(1, 2, 0)  # (B, n, K)

    def stochastic(self, method: str, matrix: torch.Tensor) -> torch.Tensor:
        """The trace estimate of ``method`` with :attr:`probes`, on ``matrix`` ``(B, n, n)``."""
        probes = self.core_probes()
        if method == "hutchinson" and self.n <= K:
            return matrix.diagonal(dim1=1, dim2=2).sum(1)  # a budget of n probes: exact
        if method == "hutchinson":
            return ((matrix @ probes) * probes).sum(1).mean(-1)
        return estimate_trace(method, lambda V: matrix @ V, probes[..., : _drawn(method)])[0]

    def hutchinson_diagonal(self) -> torch.Tensor:
        probes = self.core_probes()
        if self.n <= K:
            return self.hess.diagonal(dim1=1, dim2=2)
        return ((self.hess @ probes) * probes).mean(-1)

    def weighted(self, A: torch.Tensor, stochastic: bool) -> torch.Tensor:
        """``tr(A H)``, or its Hutchinson estimate ``mean v^T H A v`` with :attr:`probes`."""
        if not stochastic or self.n <= K:
            return (A @ self.hess).diagonal(dim1=1, dim2=2).sum(1)
        v = self.core_probes()
        return ((self.hess @ v) * (A @ v)).sum(1).mean(-1)

    def frobenius(self, *, stochastic: bool, rows: bool) -> torch.Tensor:
        """``||J||_F^2``, or its estimate ``mean ||J v||^2`` (columns) / ``||v^T J||^2`` (rows)
        with :attr:`probes`."""
        if not stochastic or self.n <= K:
            return self.jac.square().sum((1, 2))
        v = self.core_probes()
        images = self.jac.transpose(1, 2) @ v if rows else self.jac @ v
        return images.square().sum(1).mean(-1)

    def log_abs_det(self, *, stochastic: bool) -> torch.Tensor:
        if not stochastic:
            return torch.linalg.slogdet(self.jac)[1]
        gram = self.jac.transpose(1, 2) @ self.jac
        return slq_log_abs_det(lambda V: gram @ V, self.core_probes(), min(self.n, 30))[0]


# --- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One transform with one method and mode: how it is called and what it computes."""

    id: str
    build: Callable[[Callable[..., Any], int, tuple[Any, ...]], Callable[..., Any]]
    expect: Callable[[Truth, torch.dtype], Any]
    scalar: bool = False  # takes the scalar u = u_of(f) of the model f
    randomness: str | None = None  # "probes" (the first _drawn(method)), or "generator"
    drawn: int = K
    compiles: bool = True  # callable inside torch.compile
    differentiable: bool = True  # a tensor result, differentiable w.r.t. the parameters
    compare: str = "close"  # or "covers": a pattern that must hold the Jacobian's nonzeros
    out: Callable[[Any], Any] = lambda r: r


def _n(args: tuple[Any, ...], argnums: int) -> int:
    return args[argnums][0].numel()


def _jacobian() -> list[Variant]:
    return [
        Variant(f"jacobian-{mode}", lambda f, a, _, m=mode: dj.jacobian(f, a, mode=m),
                lambda t, d: t.jac)
        for mode in ("auto", "fwd", "rev", "sparse")
    ]  # fmt: skip


def _trace_family(name: str) -> list[Variant]:
    """``divergence`` or ``value_and_divergence``: exact methods x modes, the stochastic ones
    (Hutch++ and XTrace sketch J in columns, J^T in rows: two estimates, each a deterministic
    function of the probes), probing with a budget of n (its exact coloring)."""
    transform = getattr(dj, name)
    wrap = (lambda t, v: (t.value, v)) if name == "value_and_divergence" else (lambda t, v: v)
    found = [
        Variant(f"{name}-{method}-{mode}",
                lambda f, a, _, me=method, mo=mode: transform(f, a, method=me, mode=mo),
                lambda t, d: wrap(t, t.div))
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
                lambda t, d, me=method, mo=mode: wrap(
                    t, t.stochastic(me, t.jac.transpose(1, 2) if mo == "rev" else t.jac)
                ),
                randomness="probes",
                drawn=_drawn(method),
            )
        )
    found.append(
        Variant(
            f"{name}-probing",
            lambda f, a, args: transform(f, a, method="probing", num_probes=_n(args, a)),
            lambda t, d: wrap(t, t.div),
            randomness="generator",
            compiles=False,
        )
    )
    return found


def _grad_divergence() -> list[Variant]:
    found = [
        Variant(f"grad_divergence-{mode}", lambda f, a, _, m=mode: dj.grad_divergence(f, a, mode=m),
                lambda t, d: t.grad_div)
        for mode in ("auto", "fwd", "rev")
    ]  # fmt: skip
    found.append(
        Variant(
            "grad_divergence-hutchinson",
            lambda f, a, _: dj.grad_divergence(f, a, method="hutchinson", num_probes=K),
            lambda t, d: t.grad_hutchinson,
            randomness="probes",
        )
    )
    return found


def _laplacian() -> list[Variant]:
    exact = [
        Variant(f"laplacian-{method}", lambda u, a, _, m=method: dj.laplacian(u, a, method=m),
                lambda t, d: t.hess.diagonal(0, 1, 2).sum(-1), scalar=True)
        for method in ("auto", "exact", "sparse")
    ]  # fmt: skip
    stochastic = [
        Variant(
            f"laplacian-{method}",
            lambda u, a, _, m=method: dj.laplacian(u, a, method=m, num_probes=K),
            lambda t, d, m=method: t.stochastic(m, t.hess),
            scalar=True,
            randomness="probes",
            drawn=_drawn(method),
        )
        for method in ("hutchinson", "hutch++", "xtrace")
    ]
    # A budget of n: every coordinate (stde), the exact coloring (probing).
    budgeted = [
        Variant(
            f"laplacian-{method}",
            lambda u, a, args, m=method: dj.laplacian(u, a, method=m, num_probes=_n(args, a)),
            lambda t, d: t.hess.diagonal(0, 1, 2).sum(-1),
            scalar=True,
            randomness="generator",
            compiles=False,
        )
        for method in ("stde", "probing")
    ]
    return exact + stochastic + budgeted


def _weighted_laplacian() -> list[Variant]:
    def build(method: str) -> Callable[..., Any]:
        def made(u: Any, a: int, args: tuple[Any, ...]) -> Any:
            x = args[a]
            return dj.weighted_laplacian(
                u, weight(x[0].numel(), x.dtype), argnums=a, method=method, num_probes=K
            )

        return made

    found = [
        Variant(f"weighted_laplacian-{method}", build(method),
                lambda t, d, m=method: t.weighted(weight(t.n, torch.float64), m == "hutchinson"),
                scalar=True, randomness="probes" if method == "hutchinson" else None)
        for method in ("auto", "exact", "hutchinson")
    ]  # fmt: skip

    def by_factor(u: Any, a: int, args: tuple[Any, ...]) -> Any:
        x = args[a]
        return dj.weighted_laplacian(u, argnums=a, factor=factor(x[0].numel(), x.dtype))

    def want(t: Truth, d: torch.dtype) -> torch.Tensor:
        S = factor(t.n, torch.float64)
        return (S.T @ t.hess @ S).diagonal(dim1=1, dim2=2).sum(1)

    return [*found, Variant("weighted_laplacian-factor", by_factor, want, scalar=True)]


def _hessians() -> list[Variant]:
    found = [
        Variant(f"hessian-{mode}", lambda u, a, _, m=mode: dj.hessian(u, a, mode=m),
                lambda t, d: t.hess, scalar=True)
        for mode in ("auto", "fwd", "rev", "sparse")
    ]  # fmt: skip
    found += [
        Variant(f"hessian_diagonal-{method}",
                lambda u, a, _, m=method: dj.hessian_diagonal(u, a, method=m),
                lambda t, d: t.hess.diagonal(0, 1, 2), scalar=True)
        for method in ("auto", "exact", "sparse")
    ]  # fmt: skip
    found.append(
        Variant(
            "hessian_diagonal-hutchinson",
            lambda u, a, _: dj.hessian_diagonal(u, a, method="hutchinson", num_probes=K),
            lambda t, d: t.hutchinson_diagonal(),
            scalar=True,
            randomness="probes",
        )
    )
    return found


def _bilaplacian() -> list[Variant]:
    found = [
        Variant(f"bilaplacian-{method}", lambda u, a, _, m=method: dj.bilaplacian(u, a, method=m),
                lambda t, d: t.bilap, scalar=True)
        for method in ("auto", "exact")
    ]  # fmt: skip
    found.append(
        Variant(
            "bilaplacian-hutchinson",
            lambda u, a, _: dj.bilaplacian(u, a, method="hutchinson", num_probes=K),
            lambda t, d: t.bilap_hutchinson(d),
            scalar=True,
            randomness="generator",
            compiles=False,
        )
    )
    return found


def _operators() -> dict[str, list[Variant]]:
    """Each order of :data:`OPERATOR` has one direction: the stochastic methods are exact."""
    alpha = MIXED
    return {
        "derivative": [
            Variant("derivative", lambda u, a, _: dj.derivative(u, alpha, a),
                    lambda t, d: t.operator(((1.0, alpha),)), scalar=True)
        ],
        "differential_operator": [
            Variant(f"differential_operator-{method}",
                    lambda u, a, _, m=method: dj.differential_operator(u, OPERATOR, a, method=m),
                    lambda t, d: t.operator(OPERATOR), scalar=True,
                    randomness="generator" if method in ("hutchinson", "stde") else None)
            for method in ("auto", "exact", "hutchinson", "stde")
        ],
    }  # fmt: skip


def _frobenius(name: str) -> list[Variant]:
    """``squared_frobenius_norm`` or ``value_divergence_and_frobenius``: the exact methods in
    every mode, Hutchinson in columns (fwd: ``||J v||^2``) and rows (rev and auto: ``||v^T J||^2``,
    in both frameworks)."""
    transform = getattr(dj, name)
    both = name == "value_divergence_and_frobenius"

    def wrap(t: Truth, norm: torch.Tensor, div: torch.Tensor) -> Any:
        return (t.value, div, norm) if both else norm

    found = [
        Variant(f"{name}-{method}-{mode}",
                lambda f, a, _, me=method, mo=mode: transform(f, a, method=me, mode=mo),
                lambda t, d: wrap(t, t.frobenius(stochastic=False, rows=False), t.div))
        for method, mode in (("auto", "auto"), ("exact", "fwd"), ("exact", "rev"),
                             ("sparse", "auto"))
    ]  # fmt: skip
    found += [
        Variant(
            f"{name}-hutchinson-{mode}",
            lambda f, a, _, mo=mode: transform(f, a, method="hutchinson", mode=mo, num_probes=K),
            lambda t, d, mo=mode: wrap(
                t,
                t.frobenius(stochastic=True, rows=mo != "fwd"),
                t.stochastic("hutchinson", t.jac),
            ),
            randomness="probes",
        )
        for mode in ("fwd", "rev", "auto")
    ]
    return found


def _log_abs_det() -> list[Variant]:
    found = [
        Variant(f"log_abs_det-{mode}", lambda f, a, _, m=mode: dj.log_abs_det(f, a, mode=m),
                lambda t, d: t.log_abs_det(stochastic=False))
        for mode in ("auto", "fwd", "rev")
    ]  # fmt: skip
    found.append(
        Variant(
            "log_abs_det-slq",
            lambda f, a, _: dj.log_abs_det(f, a, method="slq", num_probes=K),
            lambda t, d: t.log_abs_det(stochastic=True),
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
                lambda t, d: t.jac[0] != 0,
                compiles=False,
                differentiable=False,
                compare="covers",
                out=lambda p: torch.as_tensor(p.csr.toarray()),
            )
        ],
        "sparse_jacobian": [
            Variant(
                f"sparse_jacobian-{name}",
                lambda f, a, _, lay=layout: dj.sparse_jacobian(f, a, layout=lay),
                lambda t, d: t.jac,
                compiles=False,
                differentiable=False,
                out=lambda r: r.to_dense(),
            )
            for name, layout in (("coo", torch.sparse_coo), ("csr", torch.sparse_csr))
        ],
        "jacobian_from_pattern": [
            Variant(
                "jacobian_from_pattern",
                lambda f, a, args: dj.jacobian_from_pattern(f, pattern(f, a, args), a),
                lambda t, d: t.jac,
            )
        ],
        "divergence_from_pattern": [
            Variant(
                "divergence_from_pattern",
                lambda f, a, args: dj.divergence_from_pattern(f, pattern(f, a, args), a),
                lambda t, d: t.div,
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
    "hessian": [v for v in _hessians() if v.id.startswith("hessian-")],
    "hessian_diagonal": [v for v in _hessians() if v.id.startswith("hessian_diagonal-")],
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
