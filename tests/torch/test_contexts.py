"""The context matrix of the torch transforms (issue 22): every transform x method x mode of a
model zoo (:mod:`tests.torch.zoo`) under ``no_grad``, ``inference_mode`` (with inference-tensor
inputs, and a model built under it), ``enable_grad`` inside ``no_grad``, inference-tensor inputs
with grad on (made under ``inference_mode``, differentiated outside it), an input that requires
grad, float32 and ``torch.compile``, each against a float64 brute force: per-sample
``torch.func.jacrev`` / ``hessian`` loops, and the stochastic methods with fixed probes against
the same probes applied to the brute-force Jacobian or Hessian.

The default run covers every context on the MLP and the inference-mode and no-grad contexts of
every model; the rest of the product is marked ``slow``
(``pytest -m slow tests/torch/test_contexts.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import divjac.torch as dj
from divjac import OptionError, StateUpdateError
from divjac._core.estimators import estimate_trace

from .zoo import ZOO, RunningScale

pytestmark = pytest.mark.filterwarnings(
    # torch's own notice when dynamo traces autograd ops; and the nested-tensor notice of
    # TransformerEncoderLayer's fast path.
    "ignore::UserWarning:torch._dynamo",
    "ignore:enable_nested_tensor:UserWarning",
)

K = 6  # probes of the stochastic methods (a budget that Hutch++ and XTrace accept)


def _drawn(method: str) -> int:
    """The random vectors a stochastic divergence draws for a budget of ``K`` matvecs."""
    return {"hutchinson": K, "hutch++": K * 2 // 3, "xtrace": K // 2}[method]


def _one(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda xs: f(xs[None])[0]


def _u(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A scalar per sample built on ``f`` (for the second-order transforms)."""
    return lambda x: torch.sin(f(x)).flatten(1).sum(1)


# --- the brute force ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Truth:
    """Per-sample float64 derivatives of a zoo model by ``torch.func`` loops over samples."""

    jac: torch.Tensor  # (B, n_out, n_in), flat
    value: torch.Tensor
    grad_div: torch.Tensor  # (B, *in)
    hess: torch.Tensor  # of _u, (B, n_in, n_in)
    probes: torch.Tensor  # (K, B, *in), Rademacher

    @property
    def div(self) -> torch.Tensor:
        return self.jac.diagonal(0, 1, 2).sum(-1)

    def core_probes(self) -> torch.Tensor:
        return self.probes.flatten(2).permute(1, 2, 0)  # (B, n, K)

    def stochastic(self, method: str, *, transposed: bool = False) -> torch.Tensor:
        """The estimate of ``method`` with :attr:`probes`, on the brute-force Jacobian (or its
        transpose)."""
        probes = self.core_probes()
        jac = self.jac.transpose(1, 2) if transposed else self.jac
        if method == "hutchinson" and probes.shape[-1] >= probes.shape[1]:
            return jac.diagonal(dim1=1, dim2=2).sum(1)  # a budget of n probes: exact
        if method == "hutchinson":
            return ((jac @ probes) * probes).sum(1).mean(-1)
        return estimate_trace(method, lambda V: jac @ V, probes[..., : _drawn(method)])[0]

    def hutchinson_hessian(self, diagonal: bool) -> torch.Tensor:
        probes = self.core_probes()
        if probes.shape[-1] >= probes.shape[1]:  # a budget of n probes is the exact sweep
            exact = self.hess.diagonal(dim1=1, dim2=2)
            return exact if diagonal else exact.sum(1)
        terms = (self.hess @ probes) * probes  # (B, n, K)
        return terms.mean(-1) if diagonal else terms.sum(1).mean(-1)


@functools.cache
def truth(name: str) -> Truth:
    model = ZOO[name]
    f, x = model.make(), model.input()
    f1, u1 = _one(f), _one(_u(f))
    B = x.shape[0]
    # Reverse passes one row at a time (torch.autograd.functional, not vectorized): torch's
    # vmap-batched derivatives are wrong for some kernels (the Hessian of linalg.solve in
    # torch 2.13 for every sample but the first). The math form of attention: torch.func has
    # no batching rule for the fused kernels' backward.
    jacobian = torch.autograd.functional.jacobian
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        jac = torch.stack([jacobian(f1, x[b]) for b in range(B)]).reshape(B, -1, x[0].numel())

        def grad_of_div(s: torch.Tensor) -> torch.Tensor:
            s = s.detach().clone().requires_grad_()
            div = jacobian(f1, s, create_graph=True).reshape(s.numel(), -1).trace()
            return torch.autograd.grad(div, s)[0]

        grad_div = torch.stack([grad_of_div(x[b]) for b in range(B)])
        hess = torch.stack([torch.autograd.functional.hessian(u1, x[b]) for b in range(B)])
        value = f(x)
    g = torch.Generator().manual_seed(2)
    probes = (2 * torch.randint(0, 2, (K, *x.shape), generator=g) - 1).to(x.dtype)
    n = x[0].numel()
    return Truth(
        jac.detach(), value.detach(), grad_div.detach(), hess.reshape(B, n, n).detach(), probes
    )


# --- the transforms -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One transform, method and mode: what it computes and what the brute force says."""

    id: str
    run: Callable[[Any, torch.Tensor, torch.Tensor], Any]  # (f, x, probes) -> result
    expect: Callable[[Truth], Any]
    scalar: bool = False  # run takes the scalar u = _u(f) of the model f


def _cases() -> list[Case]:
    cases = []
    for mode in ("auto", "fwd", "rev", "sparse"):
        cases.append(
            Case(
                f"jacobian-{mode}",
                lambda f, x, p, mode=mode: (
                    dj.jacobian(f, mode=mode)(x)
                    .flatten(1, x.ndim - 1)
                    .reshape(x.shape[0], -1, x[0].numel())
                ),
                lambda t: t.jac,
            )
        )
    for method in ("auto", "exact", "sparse"):
        for mode in ("auto", "fwd", "rev"):
            cases.append(
                Case(
                    f"divergence-{method}-{mode}",
                    lambda f, x, p, method=method, mode=mode: dj.divergence(
                        f, method=method, mode=mode
                    )(x),
                    lambda t: t.div,
                )
            )
    # Hutch++ and XTrace sketch the Jacobian that the passes apply: J in columns (fwd), J^T in
    # rows (rev): two unbiased estimates, each a deterministic function of the probes.
    for method, mode in (("hutchinson", "auto"), ("hutch++", "fwd"), ("hutch++", "rev"),
                         ("xtrace", "fwd"), ("xtrace", "rev")):  # fmt: skip
        cases.append(
            Case(
                "divergence-hutchinson"
                if method == "hutchinson"
                else f"divergence-{method}-{mode}",
                lambda f, x, p, method=method, mode=mode: dj.divergence(
                    f, method=method, mode=mode, num_probes=K
                )(p[: _drawn(method)], x),
                lambda t, method=method, mode=mode: t.stochastic(method, transposed=mode == "rev"),
            )
        )
    for mode in ("auto", "fwd", "rev"):
        cases.append(
            Case(
                f"value_and_divergence-{mode}",
                lambda f, x, p, mode=mode: dj.value_and_divergence(f, mode=mode)(x),
                lambda t: (t.value, t.div),
            )
        )
        cases.append(
            Case(
                f"grad_divergence-{mode}",
                lambda f, x, p, mode=mode: dj.grad_divergence(f, mode=mode)(x),
                lambda t: t.grad_div,
            )
        )
    for method in ("auto", "exact", "sparse"):
        cases.append(
            Case(
                f"laplacian-{method}",
                lambda u, x, p, method=method: dj.laplacian(u, method=method)(x),
                lambda t: t.hess.diagonal(0, 1, 2).sum(-1),
                scalar=True,
            )
        )
        cases.append(
            Case(
                f"hessian_diagonal-{method}",
                lambda u, x, p, method=method: dj.hessian_diagonal(u, method=method)(x).flatten(1),
                lambda t: t.hess.diagonal(0, 1, 2),
                scalar=True,
            )
        )
    cases.append(
        Case(
            "laplacian-hutchinson",
            lambda u, x, p: dj.laplacian(u, method="hutchinson", num_probes=K)(p, x),
            lambda t: t.hutchinson_hessian(diagonal=False),
            scalar=True,
        )
    )
    cases.append(
        Case(
            "hessian_diagonal-hutchinson",
            lambda u, x, p: dj.hessian_diagonal(u, method="hutchinson", num_probes=K)(p, x).flatten(
                1
            ),
            lambda t: t.hutchinson_hessian(diagonal=True),
            scalar=True,
        )
    )
    return cases


CASES = {case.id: case for case in _cases()}


# --- the contexts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """How a transform is called: the grad mode around it, the input and the model."""

    id: str
    dtype: torch.dtype = torch.float64
    grad: str = "grad"  # "grad", "no_grad", "inference", "enable_grad"
    requires_grad: bool = False
    model_in_inference: bool = False  # the model (its parameters) built under inference mode
    input_in_inference: bool = False  # the input and probes made under inference mode
    compiled: bool = False

    def around(self) -> contextlib.AbstractContextManager[Any]:
        if self.grad == "no_grad":
            return torch.no_grad()
        if self.grad == "inference":
            return torch.inference_mode()
        if self.grad == "enable_grad":
            return _enable_grad_in_no_grad()
        return contextlib.nullcontext()


@contextlib.contextmanager
def _enable_grad_in_no_grad() -> Iterator[None]:
    with torch.no_grad(), torch.enable_grad():
        yield


CONTEXTS = {
    c.id: c
    for c in (
        Context("grad"),
        Context("no_grad", grad="no_grad"),
        Context("inference_mode", grad="inference"),
        Context("inference_mode_model", grad="inference", model_in_inference=True),
        Context("enable_grad", grad="enable_grad"),
        Context("inference_input", input_in_inference=True),  # called outside inference mode
        Context("input_requires_grad", requires_grad=True),
        Context("float32", dtype=torch.float32),
        Context("compile", compiled=True),
    )
}

# The cases run in each context (every case runs with grad on): the ones whose passes a
# context changes (tape or torch.func, graph or not) under no_grad and inference_mode, and one
# per transform in the other contexts.
_SENSITIVE = {"jacobian-auto", "jacobian-fwd", "jacobian-rev", "divergence-auto-auto",
              "divergence-auto-fwd", "divergence-auto-rev", "divergence-hutchinson",
              "value_and_divergence-auto", "grad_divergence-auto", "laplacian-auto",
              "laplacian-hutchinson", "hessian_diagonal-auto"}  # fmt: skip
_CORE = {"jacobian-auto", "divergence-auto-auto", "divergence-hutchinson",
         "value_and_divergence-auto", "grad_divergence-auto", "laplacian-auto"}  # fmt: skip
# torch.compile (the stochastic methods take their probes as a tensor argument).
_COMPILED = {"jacobian-auto", "divergence-auto-auto", "divergence-exact-fwd",
             "divergence-hutchinson", "value_and_divergence-auto", "laplacian-exact"}  # fmt: skip


def _included(model: str, case: str, context: str) -> bool:
    """The matrix: every case and context of the MLP; of the other models every case with
    grad on, the context-sensitive ones under no_grad and inference_mode, one per transform
    in the other contexts, two compiled."""
    if context == "compile":
        return case in (_COMPILED if model == "mlp" else {"jacobian-auto", "divergence-auto-auto"})
    if model == "mlp" or context == "grad":
        return True
    if context in ("no_grad", "inference_mode"):
        return case in _SENSITIVE
    return case in _CORE


def _fast(model: str, case: str, context: str) -> bool:
    """The default run: every context of the MLP (one compiled case), and three cases of
    every model under inference_mode and no_grad."""
    if context == "compile":
        return model == "mlp" and case == "divergence-auto-auto"
    if model == "mlp":
        return True
    return context in ("inference_mode", "no_grad") and case in (
        "jacobian-auto",
        "divergence-auto-auto",
        "laplacian-auto",
    )


# Not run: dynamo fails inside torch.func.jvp (torch 2.13: its fake group_norm hits the
# _fw_primal assert) and leaves torch.func's interpreter stack behind, which breaks every later
# torch.func call of the process.
_BROKEN = {("unet", "compile")}


def _params() -> list[Any]:
    found = []
    for model in ZOO:
        for case in CASES:
            for context in CONTEXTS:
                if not _included(model, case, context) or (model, context) in _BROKEN:
                    continue
                marks: list[Any] = [] if _fast(model, case, context) else [pytest.mark.slow]
                found.append(pytest.param(model, case, context, marks=marks))
    return found


def _model_and_input(name: str, context: Context) -> tuple[Any, torch.Tensor, torch.Tensor]:
    model, t = ZOO[name], truth(name)
    with torch.inference_mode(context.model_in_inference):
        f = model.make(context.dtype)
    x, probes = model.input(context.dtype), t.probes.to(context.dtype)
    if context.grad == "inference" or context.input_in_inference:  # inference tensors
        with torch.inference_mode():
            x, probes = x.clone(), probes.clone()
    if context.requires_grad:
        x.requires_grad_()
    return f, x, probes


def _close(got: Any, want: Any, dtype: torch.dtype) -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _close(g, w, dtype)
        return
    tol = {"rtol": 1e-7, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 2e-4, "atol": 2e-5}
    assert got.dtype == dtype
    torch.testing.assert_close(got.detach().to(torch.float64), want.reshape(got.shape), **tol)


def _leaves(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize(("model", "case", "context"), _params())
def test_context_matrix(model: str, case: str, context: str) -> None:
    """The transform gives the brute force's numbers in the context; under ``no_grad`` and
    ``inference_mode`` its results carry no graph, with grad on they carry the parameters'."""
    ctx, the_case = CONTEXTS[context], CASES[case]
    f, x, probes = _model_and_input(model, ctx)
    run = the_case.run
    if ctx.compiled:
        torch._dynamo.reset()
        run = torch.compile(the_case.run, fullgraph=True, backend="aot_eager")
        if model == "lstm":  # refused, with divjac's reason
            with pytest.raises(Exception, match=r"CompileError: divjac under .*recurrent layer"):
                run(f, x, probes)
            return
    forward = case.endswith("-fwd") or "-fwd-" in case
    gradient = case.startswith("grad_divergence") or ctx.requires_grad
    if model == "solve" and forward and gradient and ctx.grad not in ("no_grad", "inference"):
        # torch differentiates linalg's forward derivatives wrong: a gradient through
        # forward passes of a solve is refused, naming the kernel
        with ctx.around(), pytest.raises(OptionError, match=r"mode='fwd'.*_linalg_solve"):
            run(_u(f) if the_case.scalar else f, x, probes)
        return
    with ctx.around():
        result = run(_u(f) if the_case.scalar else f, x, probes)
    _close(result, the_case.expect(truth(model)), ctx.dtype)
    has_params = any(p.requires_grad for p in getattr(f, "parameters", list)())
    for leaf in _leaves(result):
        if ctx.grad in ("no_grad", "inference"):
            assert not leaf.requires_grad
        elif (has_params or ctx.requires_grad) and not ctx.model_in_inference:
            assert leaf.requires_grad
    if ctx.requires_grad and case == "divergence-auto-auto":  # backpropagates to the input
        (grad,) = torch.autograd.grad(result.sum(), x)
        _close(grad, truth(model).grad_div, ctx.dtype)


# --- defect 1: inference mode -------------------------------------------------------------------


def test_inference_mode_divergence_of_an_mlp_is_not_zero() -> None:
    """Evaluating a CNF's likelihood at test time: under ``torch.inference_mode()`` every
    exact and stochastic divergence, ``jacobian`` and ``value_and_divergence`` give the numbers
    they give with grad on (they gave zeros through the autograd tape, which inference mode
    does not record)."""
    f, x, probes = _model_and_input("mlp", CONTEXTS["inference_mode"])
    t = truth("mlp")
    with torch.inference_mode():
        for method in ("auto", "exact", "sparse"):
            for mode in ("auto", "rev"):
                _close(dj.divergence(f, method=method, mode=mode)(x), t.div, torch.float64)
        _close(
            dj.divergence(f, method="hutchinson", num_probes=K)(probes, x),
            t.stochastic("hutchinson"),
            torch.float64,
        )
        _close(dj.jacobian(f)(x), t.jac, torch.float64)
        _close(dj.value_and_divergence(f)(x), (t.value, t.div), torch.float64)
    assert bool((t.div.abs() > 1e-3).all())  # the zeros would not pass


@pytest.mark.parametrize("k", [1, 2])
def test_probes_made_under_inference_mode_train_outside_it(k: int) -> None:
    """Probes sampled under ``inference_mode`` (inference tensors), a training step outside
    it: the few probes the tape pulls one by one are kept for the backward, which torch
    refuses of an inference tensor; divjac takes a copy. The step's parameter gradients equal
    those with ordinary probes."""
    f, x, probes = _model_and_input("mlp", CONTEXTS["inference_input"])
    assert probes.is_inference() and x.is_inference()
    params = [p for p in f.parameters() if p.requires_grad]
    grads = []
    for p in (probes[:k], probes[:k].clone()):
        div = dj.divergence(f, method="hutchinson", num_probes=k)(p, x)
        grads.append(torch.autograd.grad(div.square().sum(), params, allow_unused=True))
    for g, want in zip(*grads, strict=True):
        assert (g is None) == (want is None)
        if g is not None:
            torch.testing.assert_close(g, want, rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_call_under_inference_mode_then_with_gradients(case: str) -> None:
    """A CNF evaluated under ``inference_mode`` and then trained: what the first call cached
    (seed matrices, traces, programs) is reused by the second, which records a graph. A
    cached inference tensor made it fail ("Inference tensors cannot be saved for backward")."""
    the_case = CASES[case]
    f, x, probes = _model_and_input("mlp", CONTEXTS["grad"])
    g = _u(f) if the_case.scalar else f
    dj.clear_caches()
    with torch.inference_mode():
        _close(the_case.run(g, x, probes), the_case.expect(truth("mlp")), torch.float64)
    result = the_case.run(g, x, probes)
    _close(result, the_case.expect(truth("mlp")), torch.float64)
    assert all(leaf.requires_grad for leaf in _leaves(result))  # and it carries the graph


# --- defect 4: a forward that updates a buffer it reads -----------------------------------------


_REFUSING = {
    "jacobian": lambda f, x: dj.jacobian(f)(x),
    "divergence-rev": lambda f, x: dj.divergence(f, mode="rev")(x),
    "divergence-fwd": lambda f, x: dj.divergence(f, mode="fwd")(x),
    "value_and_divergence": lambda f, x: dj.value_and_divergence(f)(x),
    "laplacian": lambda f, x: dj.laplacian(_u(f))(x),
}


@pytest.mark.parametrize("transform", list(_REFUSING))
@pytest.mark.parametrize("grad", ["grad", "no_grad", "inference"])
def test_buffer_updated_by_forward_is_refused_before_any_update(transform: str, grad: str) -> None:
    """A module whose forward updates a running statistic it reads: the call is refused with
    :class:`StateUpdateError` naming the buffer, and the buffer is where it was (it moved
    twice, and the divergence was taken at the moved state; or torch.func's raw "mutate a
    captured Tensor" error reached the caller)."""
    torch.manual_seed(0)
    f = RunningScale().double()
    before = f.scale.clone()
    x = torch.randn(3, 4, dtype=torch.float64)
    with CONTEXTS[
        {"grad": "grad", "no_grad": "no_grad", "inference": "inference_mode"}[grad]
    ].around():
        with pytest.raises(StateUpdateError, match="'scale' of RunningScale"):
            _REFUSING[transform](f, x)
        with pytest.raises(StateUpdateError):  # and again: nothing was cached
            _REFUSING[transform](f, x)
    torch.testing.assert_close(f.scale, before, rtol=0, atol=0)


def test_counter_assigned_in_forward_is_refused_and_left_as_it_was() -> None:
    """``self.n = self.n + 1`` in a forward (a new tensor, not an in-place update): refused,
    and the module still holds its own tensor (not one of the trace's)."""

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.zeros((), dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.n = self.n + 1
            return x * self.n

    f = Counter()
    n = f.n
    with pytest.raises(StateUpdateError, match="'n' of Counter"):
        dj.divergence(f)(torch.ones(2, 3, dtype=torch.float64))
    assert f.n is n and float(n) == 0.0


def test_captured_tensor_updated_in_place_is_refused() -> None:
    """A plain function that updates a tensor of its closure in place: refused, unchanged."""
    seen = torch.zeros(3, dtype=torch.float64)

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.add_(1.0)
        return x * seen

    with pytest.raises(StateUpdateError, match="captured tensor of shape"):
        dj.divergence(f, mode="fwd")(torch.ones(2, 3, dtype=torch.float64))
    assert float(seen.abs().sum()) == 0.0


def test_spectral_norm_in_training_is_refused_and_exact_in_eval() -> None:
    """Spectral normalization's power iteration updates ``_u`` in training mode (refused,
    ``_u`` unchanged); in eval mode it reads it only, and the divergence is exact."""
    torch.manual_seed(0)
    lin = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(3, 3)).double()
    u = lin.parametrizations.weight[0]._u
    kept = u.clone()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(StateUpdateError, match="'_u' of _SpectralNorm"):
        dj.divergence(lin)(x)
    torch.testing.assert_close(u, kept, rtol=0, atol=0)
    lin.eval()
    want = torch.stack([torch.func.jacrev(lin)(x[b]).trace() for b in range(4)])
    torch.testing.assert_close(dj.divergence(lin)(x).detach(), want.detach())
    torch.testing.assert_close(u, kept, rtol=0, atol=0)
