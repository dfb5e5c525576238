"""The context matrix of the torch transforms (issues 22 and 41): every public transform, with
every method and mode (the table of :mod:`tests.torch.transforms`), on a model zoo
(:mod:`tests.torch.zoo`), against a float64 brute force, along six axes:

- the grad mode around the call: grad on, ``no_grad``, ``inference_mode`` (with inference-tensor
  inputs), ``enable_grad`` inside ``no_grad``, inference-tensor inputs with grad on (made under
  ``inference_mode``, differentiated outside it), an input that requires grad, a model built
  (and called) under ``inference_mode``;
- float64 or float32; called plainly or under ``torch.compile``;
- how the arguments change between two calls of one transformed function (the argument axes
  that found issue 41's stale bi-Laplacian): none (one call, the times ``t`` read from the
  module's buffer), the buffer itself passed as ``t`` and then new times, new tensors of equal
  values, an in-place update of the parameters, and the parameters passed functionally
  (``torch.func.functional_call``): the module's own, then new tensors after an out-of-place
  step, whose gradients are checked too.

Every call is checked against the brute force at the state it is made in. The axes are covered
pairwise (:mod:`tests.pairwise`: every two values of any two axes in some case), not as their
product. The default run is the MLP with every variant once and every value of every axis at
least once (``make test``); the pairwise cover of all the models is marked ``matrix`` (``make
test-matrix-torch``, ~4.5 minutes on 2 cores). CI runs both.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import divjac.torch as dj
from divjac import OptionError, StateUpdateError
from tests.pairwise import all_pairs, each_value, missing_pairs

from .transforms import (
    NOT_TRANSFORMS,
    SEED,
    TABLE,
    VARIANTS,
    K,
    Truth,
    Variant,
    reference_mode,
)
from .zoo import ZOO, RunningScale, Timed, new_times, timed

pytestmark = pytest.mark.filterwarnings(
    # torch's own notice when dynamo traces autograd ops; and the nested-tensor notice of
    # TransformerEncoderLayer's fast path.
    "ignore::UserWarning:torch._dynamo",
    "ignore:enable_nested_tensor:UserWarning",
)

DELTA = 0.05  # the parameters' update between two calls (in place, or out of place)


def test_every_public_transform_is_in_the_table() -> None:
    """A transform added to ``divjac.torch.__all__`` is in the matrix the day it lands."""
    assert set(dj.__all__) - NOT_TRANSFORMS == set(TABLE)
    assert all(TABLE.values())


# --- the brute force ----------------------------------------------------------------------------


@functools.cache
def truth(model: str, shift: float, times: str) -> tuple[Truth, dict[str, torch.Tensor]]:
    """The brute force of the :class:`Timed` model with every parameter moved by ``shift``, at
    its default times (``times="t0"``) or :func:`new_times` (``"t1"``); and its parameters
    (leaves, for the gradients of the functional calls)."""
    module = timed(ZOO[model])
    with torch.no_grad():
        for p in module.parameters():
            p.add_(shift)
    x = ZOO[model].input()
    t = module.t0 if times == "t0" else new_times(x.shape[0])
    return Truth(lambda x: module(x, t), x), dict(module.named_parameters())


# --- the contexts -------------------------------------------------------------------------------


GRADS = ("grad", "no_grad", "inference", "enable_grad", "inference_input", "requires_grad",
         "inference_model")  # fmt: skip
GRAD_OFF = ("no_grad", "inference", "inference_model")
INFERENCE_INPUTS = ("inference", "inference_input", "inference_model")
ARGUMENTS = ("plain", "reached", "equal", "in_place", "functional")
AXES: dict[str, tuple[Any, ...]] = {
    "variant": tuple(VARIANTS),
    "model": tuple(ZOO),
    "grad": GRADS,
    "dtype": ("float64", "float32"),
    "compiled": (False, True),
    "argument": ARGUMENTS,
}

# Not run: dynamo fails inside torch.func.jvp (torch 2.13: its fake group_norm hits the
# _fw_primal assert) and leaves torch.func's interpreter stack behind, which breaks every later
# torch.func call of the process.
_BROKEN = {("unet", "compile")}
_LOG_DET = {v.id for v in TABLE["log_abs_det"]}
COMPILED_BY_DEFAULT = ("divergence-auto-auto", "laplacian-exact")


def _allowed(a: str, va: Any, b: str, vb: Any) -> bool:
    """The pairs of axis values that make a case: a log-determinant of a model whose Jacobians
    are not singular; a compiled call of a variant that compiles (not a pattern or a sparse
    tensor, nor a generator's draws), of a model dynamo traces, of ordinary inputs."""
    pair = {a: va, b: vb}
    if pair.get("variant") in _LOG_DET and "model" in pair and ZOO[pair["model"]].singular:
        return False  # log|det J| = -inf: nothing meaningful to compare
    if pair.get("compiled") is True:
        if "variant" in pair and not VARIANTS[pair["variant"]].compiles:
            return False
        if (pair.get("model"), "compile") in _BROKEN:
            return False
        # With grad on, torch itself refuses inference-tensor inputs to a model, compiled or
        # not ("Inference tensors cannot be saved for backward"); divjac's eager passes
        # take copies (the inference_input context), a compiled program gets torch's error.
        if pair.get("grad") == "inference_input":
            return False
    return True


@dataclass(frozen=True)
class Case:
    variant: str
    model: str
    grad: str
    dtype: str
    compiled: bool
    argument: str

    @property
    def id(self) -> str:
        return "-".join(
            [self.variant, self.model, self.grad, self.dtype]
            + (["compiled"] if self.compiled else [])
            + [self.argument]
        )


def _rows(rows: list[dict[str, Any]]) -> list[Case]:
    return [Case(**row) for row in rows]


_EAGER = {**AXES, "compiled": (False,)}
_COMPILED = {
    **AXES,
    "variant": tuple(v for v in VARIANTS if VARIANTS[v].compiles),
    "model": tuple(m for m in ZOO if (m, "compile") not in _BROKEN),
    "grad": tuple(g for g in GRADS if _allowed("grad", g, "compiled", True)),
    "compiled": (True,),
}
FIRST = tuple(variants[0].id for variants in TABLE.values())
DEFAULT = list(
    dict.fromkeys(
        _rows(each_value({**_EAGER, "model": ("mlp",)}, _allowed))
        + [
            Case(v, "mlp", "grad", "float64", False, argument)
            for v in FIRST
            for argument in ("reached", "functional")
        ]
        + [Case(v, "mlp", "grad", "float64", True, "in_place") for v in COMPILED_BY_DEFAULT]
    )
)
"""The default run: the MLP, every variant once and every value of every axis at least once;
every transform with the two argument axes that found issue 41's stale bi-Laplacian; two
compiled calls (a compilation costs seconds)."""
SLOW = [
    c
    for c in _rows(all_pairs(_EAGER, _allowed)) + _rows(each_value(_COMPILED, _allowed))
    if c not in DEFAULT
]
"""A pairwise cover of all the axes: the uncompiled cases pairwise, and the compiled ones with
every value of every axis (so that every pair with ``compiled=True`` is held too, and a failed
compilation hides no argument axis of an uncompiled case)."""


@contextlib.contextmanager
def _around(grad: str) -> Iterator[None]:
    if grad == "no_grad":
        with torch.no_grad():
            yield
    elif grad in ("inference", "inference_model"):
        with torch.inference_mode():
            yield
    elif grad == "enable_grad":
        with torch.no_grad(), torch.enable_grad():
            yield
    else:
        yield


def _close(got: Any, want: Any, dtype: torch.dtype, what: str = "") -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, dtype, f"{what}[{i}]")
        return
    tol = {"rtol": 1e-7, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 2e-4, "atol": 2e-5}
    assert got.dtype == dtype, what
    torch.testing.assert_close(
        got.detach().to(torch.float64),
        want.detach().reshape(got.shape),
        msg=lambda m: f"{what}: {m}",
        **tol,
    )


def _leaves(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def _inference_copy(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        return tuple(t.clone() for t in tensors)


@dataclass
class Step:
    """One call: its arguments (after the randomness), the brute-force state it is made in
    (parameters moved by ``shift``, times ``t0`` or ``t1``), and what to do before it."""

    args: tuple[Any, ...]
    shift: float
    times: str
    before: Callable[[], None] = lambda: None
    new_params: dict[str, torch.Tensor] | None = None  # whose gradients are checked


def _steps(case: Case, module: Timed, x: torch.Tensor, t: torch.Tensor) -> list[Step]:
    """The calls of the case's argument axis (x and t as the grad context made them)."""
    inference_inputs = case.grad in INFERENCE_INPUTS
    if case.argument == "plain":
        return [Step((x,), 0.0, "t0")]
    if case.argument == "reached":  # the buffer as t, then new times
        return [Step((x, module.t0), 0.0, "t0"), Step((x, t), 0.0, "t1")]
    if case.argument == "equal":  # new tensors, equal values
        x2, t2 = _inference_copy(x, t) if inference_inputs else (x.detach().clone(), t.clone())
        x2.requires_grad_(x.requires_grad)
        return [Step((x, t), 0.0, "t1"), Step((x2, t2), 0.0, "t1")]
    if case.argument == "in_place":

        def update() -> None:
            with torch.inference_mode() if case.grad == "inference_model" else torch.no_grad():
                for p in module.parameters():
                    p.add_(DELTA)

        return [Step((x, t), 0.0, "t1"), Step((x, t), DELTA, "t1", before=update)]
    assert case.argument == "functional"
    own = dict(module.named_parameters())
    new = {k: (p.detach() + DELTA).requires_grad_() for k, p in own.items()}
    return [Step((own, x, t), 0.0, "t1"), Step((new, x, t), DELTA, "t1", new_params=new)]


def _function(case: Case, variant: Variant, module: Timed) -> tuple[Callable[..., Any], int]:
    """The function the transform takes and the position of ``x`` in its arguments."""
    fn: Callable[..., Any] = module
    argnums = 0
    if case.argument == "functional":

        def fn(params: dict[str, torch.Tensor], *args: Any) -> Any:
            return torch.func.functional_call(module, params, args)

        argnums = 1
    if variant.scalar:
        inner = fn
        fn = lambda *args: torch.sin(inner(*args)).flatten(1).sum(1)  # noqa: E731
    return fn, argnums


def _lead(variant: Variant, probes: torch.Tensor) -> tuple[Any, ...]:
    if variant.randomness == "probes":
        return (probes[: variant.drawn],)
    if variant.randomness == "generator":
        return (torch.Generator().manual_seed(SEED),)
    return ()


def _check_result(
    case: Case, variant: Variant, result: Any, step: Step, dtype: torch.dtype, k: int
) -> None:
    what = f"call {k + 1}"
    t, params = truth(case.model, step.shift, step.times)
    want = variant.expect(t, dtype)
    got = variant.out(result)
    if variant.compare == "covers":
        assert got.shape == want.shape
        assert not bool((want & ~got).any()), f"{what}: the pattern misses nonzeros"
        return
    _close(got, want, dtype, what)
    if not variant.differentiable:
        return
    grad_on = case.grad not in GRAD_OFF
    for leaf in _leaves(result):
        assert leaf.requires_grad == grad_on, what
    if step.new_params is not None and grad_on:
        names = list(step.new_params)
        got_grads = torch.autograd.grad(
            sum(leaf.sum() for leaf in _leaves(result)),
            [step.new_params[n] for n in names],
            allow_unused=True,
            retain_graph=True,  # (the gradient w.r.t. the input follows: check())
        )
        with reference_mode():
            total = sum(leaf.sum() for leaf in _leaves(variant.expect(t, dtype)))
            want_grads = torch.autograd.grad(
                total, [params[n] for n in names], allow_unused=True, retain_graph=True
            )
        for name, g, w in zip(names, got_grads, want_grads, strict=True):
            if w is None:
                continue
            assert g is not None, f"{what}: no gradient w.r.t. the new parameter {name!r}"
            _close(g, w, dtype, f"{what}: gradient w.r.t. {name!r}")


def check(case: Case) -> None:
    """Each call of the case's transformed function gives the brute force's numbers at the
    state it is made in; under ``no_grad`` and ``inference_mode`` its results carry no graph,
    with grad on they carry the parameters', and their gradients w.r.t. parameters passed
    functionally are the brute force's."""
    variant, model = VARIANTS[case.variant], ZOO[case.model]
    dtype = getattr(torch, case.dtype)
    dj.clear_caches()
    with torch.inference_mode(case.grad == "inference_model"):
        module = timed(model, dtype)
    x, t = model.input(dtype), new_times(model.shape[0], dtype)
    probes = truth(case.model, 0.0, "t0")[0].probes.to(dtype)
    if case.grad in INFERENCE_INPUTS:  # inference tensors
        x, t, probes = _inference_copy(x, t, probes)
    if case.grad == "requires_grad":
        x.requires_grad_()
    fn, argnums = _function(case, variant, module)
    steps = _steps(case, module, x, t)
    with _around(case.grad):
        transformed = variant.build(fn, argnums, steps[0].args)
    run = transformed
    if case.compiled:
        torch._dynamo.reset()
        run = torch.compile(lambda *a: transformed(*a), fullgraph=True, backend="aot_eager")
        if case.model == "lstm":  # refused, with divjac's reason
            with pytest.raises(Exception, match=r"CompileError: divjac under .*recurrent layer"):
                run(*_lead(variant, probes), *steps[0].args)
            return
    forward = "-fwd" in case.variant or case.variant == "log_abs_det-slq"
    gradient = (
        case.variant.startswith("grad_divergence")
        or case.grad == "requires_grad"
        or (case.argument == "functional" and case.grad not in GRAD_OFF)  # new leaves
    )
    if case.model == "solve" and forward and gradient:
        # torch differentiates linalg's forward derivatives wrong: a gradient through
        # forward passes of a solve is refused, naming the kernel (under torch.compile,
        # wrapped by dynamo)
        refusal = r"(mode='fwd'|method='slq').*_linalg_solve"
        with _around(case.grad), pytest.raises(Exception, match=refusal) as e:
            run(*_lead(variant, probes), *steps[0].args)
        assert case.compiled or e.type is OptionError
        return
    if case.variant == "hessian-fwd" and case.model in ("unet", "transformer"):
        # attention's backward has no forward derivative: refused, naming the kernel
        with _around(case.grad), pytest.raises(Exception, match=r"mode='fwd'.*attention"):
            run(*_lead(variant, probes), *steps[0].args)
        return
    for k, step in enumerate(steps):
        step.before()
        with _around(case.grad):
            result = run(*_lead(variant, probes), *step.args)
        _check_result(case, variant, result, step, dtype, k)
    if case.grad == "requires_grad" and case.variant == "divergence-auto-auto":
        # backpropagates to the input
        (grad,) = torch.autograd.grad(result.sum(), steps[-1].args[argnums])
        _close(grad, truth(case.model, steps[-1].shift, steps[-1].times)[0].grad_div, dtype)


@pytest.mark.parametrize("case", DEFAULT, ids=lambda c: c.id)
def test_context_matrix(case: Case) -> None:
    check(case)


@pytest.mark.matrix
@pytest.mark.parametrize("case", SLOW, ids=lambda c: c.id)
def test_context_matrix_pairwise(case: Case) -> None:
    check(case)


def test_the_matrix_covers_its_axes() -> None:
    """The default run holds every variant and every value of every axis on the MLP, the slow
    run every allowed pair of values of two axes."""
    for name, values in AXES.items():
        held = {getattr(c, name) for c in DEFAULT}
        assert held == ({"mlp"} if name == "model" else set(values)), name
    assert {(c.variant, c.argument) for c in DEFAULT} >= {(v, "reached") for v in FIRST}
    rows = [{name: getattr(c, name) for name in AXES} for c in DEFAULT + SLOW]
    assert not missing_pairs(AXES, rows, _allowed)
    # no log-determinant of singular Jacobians (the transformer's were compared: noise)
    assert not any(c.variant in _LOG_DET and ZOO[c.model].singular for c in DEFAULT + SLOW)


# --- defect 1: inference mode -------------------------------------------------------------------


@functools.cache
def plain_truth(name: str) -> Truth:
    """The brute force of the zoo model itself (not :class:`Timed`)."""
    model = ZOO[name]
    return Truth(model.make(), model.input())


def _mlp(*, inference_inputs: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The zoo's MLP, its input and the fixed probes (inference tensors, or not)."""
    f, x, probes = ZOO["mlp"].make(), ZOO["mlp"].input(), plain_truth("mlp").probes
    if inference_inputs:
        x, probes = _inference_copy(x, probes)
    return f, x, probes


def test_inference_mode_divergence_of_an_mlp_is_not_zero() -> None:
    """Evaluating a CNF's likelihood at test time: under ``torch.inference_mode()`` every
    exact and stochastic divergence, ``jacobian`` and ``value_and_divergence`` give the numbers
    they give with grad on (they gave zeros through the autograd tape, which inference mode
    does not record)."""
    f, x, probes = _mlp(inference_inputs=True)
    t = plain_truth("mlp")
    with torch.inference_mode():
        for method in ("auto", "exact", "sparse"):
            for mode in ("auto", "rev"):
                _close(dj.divergence(f, method=method, mode=mode)(x), t.div, torch.float64)
        _close(
            dj.divergence(f, method="hutchinson", num_probes=K)(probes, x),
            t.stochastic("hutchinson", t.jac),
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
    f, x, probes = _mlp(inference_inputs=True)
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


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_call_under_inference_mode_then_with_gradients(variant: str) -> None:
    """A CNF evaluated under ``inference_mode`` and then trained: what the first call cached
    (seed matrices, traces, programs) is reused by the second, which records a graph. A
    cached inference tensor made it fail ("Inference tensors cannot be saved for backward")."""
    v = VARIANTS[variant]
    f, x, probes = _mlp(inference_inputs=False)
    g = (lambda x: torch.sin(f(x)).flatten(1).sum(1)) if v.scalar else f
    want = v.expect(plain_truth("mlp"), torch.float64)
    dj.clear_caches()
    with torch.inference_mode():
        first = v.build(g, 0, (x,))(*_lead(v, probes), x)
    result = v.build(g, 0, (x,))(*_lead(v, probes), x)
    for got in (first, result):
        if v.compare == "covers":
            assert not bool((want & ~v.out(got)).any())
        else:
            _close(v.out(got), want, torch.float64)
    if v.differentiable:  # and it carries the graph
        assert all(leaf.requires_grad for leaf in _leaves(result))


# --- defect 4: a forward that updates a buffer it reads -----------------------------------------


_REFUSING = {
    "jacobian": lambda f, x: dj.jacobian(f)(x),
    "divergence-rev": lambda f, x: dj.divergence(f, mode="rev")(x),
    "divergence-fwd": lambda f, x: dj.divergence(f, mode="fwd")(x),
    "value_and_divergence": lambda f, x: dj.value_and_divergence(f)(x),
    "laplacian": lambda f, x: dj.laplacian(lambda x: torch.sin(f(x)).flatten(1).sum(1))(x),
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
    with _around(grad):
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
