"""The context matrix of the JAX transforms (issues 22 and 41): every public transform, with
every method and mode (the table of :mod:`tests.jax.transforms`), on a model zoo
(:mod:`tests.jax.zoo`), against a brute force (``vmap(jacfwd)`` / ``vmap(hessian)`` of the
per-sample function), along four axes:

- the call: an eager call then the same under ``jit``, ``jit`` first then eager, an outer
  ``vmap``, ``jax.grad`` through the transform w.r.t. the parameters (eager and under ``jit``),
  float32, and a Python float argument;
- the model;
- the transform's variant;
- how the arguments change between two calls of one transformed function (the argument axes
  that found issue 41's stale bi-Laplacian in torch): none (one call, the times ``t`` read from
  the closure), the closure's own times passed as ``t`` and then new times, new arrays of equal
  values, parameters replaced in a mutable container the function reads (JAX's closest
  analogue of an in-place update), and the parameters passed as an argument and then replaced
  by new arrays (an out-of-place step), whose gradients are checked too.

Every call is checked against the brute force at the state it is made in. The axes are covered
pairwise (:mod:`tests.pairwise`), not as their product; the default run (``make test``, in CI)
is the MLP with every variant of every transform and every value of every other axis at least
once, the pairwise cover of all the variants and models is marked ``matrix`` (``make
test-matrix-jax``, not in CI: ~9 minutes on 2 cores, past CI's 45-minute budget). The
brute force runs under ``jit``: each variant's program once per process, given the model's
Jacobian and Hessian (one program per model, shared by every variant, and its gradient by the
chain rule), at each state once per process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import divjac.jax as dj
from tests.jax.transforms import KEY_SEED, NOT_TRANSFORMS, TABLE, VARIANTS, Brute, probes_for
from tests.jax.zoo import ZOO, Model
from tests.pairwise import all_pairs, each_value, missing_pairs

DELTA = 0.05  # the parameters' update between two calls

CONTEXTS = ("eager-then-jit", "jit-then-eager", "vmap", "grad", "jit-grad", "float32",
            "python-float")  # fmt: skip
ARGUMENTS = ("plain", "reached", "equal", "in_place", "functional")
AXES: dict[str, tuple[Any, ...]] = {
    "variant": tuple(VARIANTS),
    "model": tuple(ZOO),
    "context": CONTEXTS,
    "argument": ARGUMENTS,
}


def test_every_public_transform_is_in_the_table() -> None:
    """A transform added to ``divjac.jax.__all__`` is in the matrix the day it lands."""
    assert set(dj.__all__) - NOT_TRANSFORMS == set(TABLE)
    assert all(TABLE.values())


def _allowed(a: str, va: Any, b: str, vb: Any) -> bool:
    """The pairs that make a case: ``jit``, ``vmap`` and ``grad`` of a variant that returns
    arrays (not a pattern; a sparse array is not differentiated); ``grad`` w.r.t. parameters
    that are an argument (not read from a container)."""
    pair = {a: va, b: vb}
    context = pair.get("context")
    if "variant" in pair and context is not None:
        variant = VARIANTS[pair["variant"]]
        if context in ("grad", "jit-grad") and not variant.differentiable:
            return False
        if context == "vmap" and not variant.differentiable:
            return False
    return not (context in ("grad", "jit-grad") and pair.get("argument") == "in_place")


@dataclass(frozen=True)
class Case:
    variant: str
    model: str
    context: str
    argument: str

    @property
    def id(self) -> str:
        return f"{self.variant}-{self.model}-{self.context}-{self.argument}"


# The relative cost of a case, from the per-case durations of a run of the cover (2 cores):
# fourth-order transforms compile programs ~6x larger, the LSTM's and the transformer's
# programs are the largest, a gradient or a second jit compiles again.
_HIGH_ORDER = ("bilaplacian", "differential_operator", "derivative")
_WEIGHTS: dict[str, dict[Any, float]] = {
    "model": {"cnn": 1.5, "unet": 2, "transformer": 3, "lstm": 3, "solve": 1.3},
    "context": {"vmap": 1.3, "grad": 2, "jit-grad": 1.5},
    "argument": {"reached": 1.3, "equal": 1.3, "in_place": 1.6, "functional": 1.8},
}


def _cost(row: dict[str, Any]) -> float:
    """The estimated cost of a (partial) row: the cover meets the expensive models and
    transforms in cheap contexts."""
    price = 6.0 if row.get("variant", "").startswith(_HIGH_ORDER) else 1.0
    for axis, weights in _WEIGHTS.items():
        price *= weights.get(row.get(axis), 1.0)
    return price


ILL_CONDITIONED = ("cnn", "unet", "lstm", "equinox_mlp")
"""Models whose per-sample Jacobians have a condition number above 100 at the matrix's states
(CNN 200-760, U-Net 1.5e6-3.3e6, LSTM 40-790, equinox MLP 80-520; MLP, transformer and solve
2-96)."""
_LOG_DET = {v.id for v in TABLE["log_abs_det"]}


def _row_allowed(row: dict[str, Any]) -> bool:
    """No float32 log-determinant of an ill-conditioned Jacobian: there float32 round-off moves
    ``log|det J|`` by up to ``n eps cond`` (``cond**2`` for SLQ, on ``J^T J``), past the float32
    tolerance: 0.12 of -53 on the U-Net, divjac's and the brute force's alike (both within 0.07
    of float64's value), 0.005 of -14.9 by SLQ on the equinox MLP."""
    return not (
        row.get("context") == "float32"
        and row.get("variant") in _LOG_DET
        and row.get("model") in ILL_CONDITIONED
    )


DEFAULT = [Case(**row) for row in each_value({**AXES, "model": ("mlp",)}, _allowed)]
"""The default run: the MLP, every variant of every transform and every value of every other
axis at least once."""
SLOW = [
    c
    for c in (Case(**row) for row in all_pairs(AXES, _allowed, _cost, _row_allowed))
    if c not in DEFAULT
]
"""The pairwise cover of all the axes (every model)."""


# --- the brute force ----------------------------------------------------------------------------


def default_times(B: int, dtype: Any) -> jax.Array:
    return jnp.linspace(0.2, 0.6, B, dtype=dtype)


def new_times(B: int, dtype: Any) -> jax.Array:
    return jnp.linspace(-0.3, 0.5, B, dtype=dtype)


def timed(model: Model) -> Callable[..., jax.Array]:
    """``g(p, x, t, *extra)``: the model at ``x * (1 + t / 2)``, per sample ``t``."""

    def g(p: Any, x: jax.Array, t: jax.Array, *extra: Any) -> jax.Array:
        return model.f(p, x * (1 + t / 2).reshape(-1, *[1] * (x.ndim - 1)), *extra)

    return g


def _shifted(params: Any, shift: float) -> Any:
    return jax.tree_util.tree_map(lambda a: a + jnp.asarray(shift, a.dtype), params)


def _total(tree: Any) -> jax.Array:
    return sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(tree))


def _stacked(x: jax.Array) -> jax.Array:
    """Two batches for the outer ``vmap`` context."""
    return jnp.stack([x, 0.5 * x + 0.1])


def _state(model_name: str, dtype: Any, shift: float, times: str) -> tuple[Any, jax.Array, Any]:
    """The parameters moved by ``shift``, the batch and the times ``t0`` or ``t1``."""
    params, x = ZOO[model_name].init(dtype)
    t = default_times(x.shape[0], dtype) if times == "t0" else new_times(x.shape[0], dtype)
    return _shifted(params, shift), x, t


DERIVATIVES = ("jac_full", "hess_full")


class _Given(Brute):
    """A brute force whose Jacobian and Hessian are given (the shared programs' arrays, or
    placeholders), recording which of them its variant reads."""

    def __init__(self, given: dict[str, Any], *args: Any) -> None:
        super().__init__(*args)
        self.given, self.read = given, set()

    def _get(self, name: str) -> Any:
        self.read.add(name)
        return self.given[name]

    jac_full = property(lambda self: self._get("jac_full"))  # type: ignore[assignment]
    hess_full = property(lambda self: self._get("hess_full"))  # type: ignore[assignment]


@functools.cache
def _derivative(model_name: str, dtype: Any, extra: tuple, name: str) -> Callable[..., Any]:
    """The brute-force ``jac_full`` or ``hess_full`` ``(p, x, t) ->`` of a model, one program
    shared by every variant."""
    g = timed(ZOO[model_name])
    return jax.jit(lambda p, x, t: getattr(Brute(g, p, x, t, extra), name))


@functools.cache
def _derivative_vjp(model_name: str, dtype: Any, extra: tuple, name: str) -> Callable[..., Any]:
    """``(p, x, t, cotangent) ->`` the gradient w.r.t. the parameters through
    :func:`_derivative`, one program shared by every variant."""
    f = _derivative(model_name, dtype, extra, name)
    return jax.jit(lambda p, x, t, ct: jax.vjp(lambda q: f(q, x, t), p)[1](ct)[0])


@functools.cache
def _derivative_at(
    model_name: str, dtype: Any, extra: tuple, name: str, shift: float, times: str, second: bool
) -> jax.Array:
    """:func:`_derivative` at a state, of the batch or (``second``) of the second batch of
    :func:`_stacked`, once per process."""
    params, x, t = _state(model_name, dtype, shift, times)
    return _derivative(model_name, dtype, extra, name)(params, _stacked(x)[int(second)], t)


@functools.cache
def _expected(
    model_name: str, variant: str, dtype: Any, extra: tuple, form: str
) -> tuple[Callable[..., Any], tuple[str, ...]]:
    """The brute force of a variant under ``jit`` given the shared derivatives it reads (the
    names returned), one program for every state: ``(p, x, t, *derivatives)`` for ``form``
    "value", the same over a stack of two batches and their derivatives for "vmap", and for
    "grad" the gradient of the total w.r.t. the parameters (directly) and the derivatives (the
    chain rule through :func:`_derivative_vjp` completes it)."""
    g = timed(ZOO[model_name])
    expect = VARIANTS[variant].expect

    def value(p: Any, x: jax.Array, t: jax.Array, *derivatives: Any, names: tuple) -> Any:
        return expect(_Given(dict(zip(names, derivatives, strict=True)), g, p, x, t, extra))

    params, x, t = _state(model_name, dtype, 0.0, "t0")
    shapes = [
        jax.eval_shape(_derivative(model_name, dtype, extra, n), params, x, t) for n in DERIVATIVES
    ]
    read: set[str] = set()

    def probe(p: Any, x: jax.Array, t: jax.Array, *derivatives: Any) -> Any:
        given = _Given(dict(zip(DERIVATIVES, derivatives, strict=True)), g, p, x, t, extra)
        out = expect(given)
        read.update(given.read)
        return out

    jax.eval_shape(probe, params, x, t, *shapes)  # which derivatives the variant reads
    names = tuple(n for n in DERIVATIVES if n in read)
    fn = functools.partial(value, names=names)
    if form == "grad":
        argnums = tuple(range(3, 3 + len(names)))
        return jax.jit(jax.grad(lambda *a: _total(fn(*a)), argnums=(0, *argnums))), names
    axes = (None, 0, None, *[0] * len(names))
    return jax.jit(fn if form == "value" else jax.vmap(fn, axes)), names


def _expectation(expect: Callable[..., Any]) -> tuple[Any, ...]:
    """What a variant's brute force computes: its code, defaults and captured values (the
    same for the methods of one transform that compute one quantity)."""
    cells = tuple(cell.cell_contents for cell in expect.__closure__ or ())
    return expect.__code__, expect.__defaults__, cells


_FIRST_COMPUTING: dict[tuple[Any, ...], str] = {}
SHARED = {
    name: _FIRST_COMPUTING.setdefault(_expectation(variant.expect), name)
    for name, variant in VARIANTS.items()
}
"""Each variant -> the first variant whose brute force is the same function: they share its
programs and values (a fourth-order reference through the LSTM under ``grad`` is ~40 s to
compile)."""
TRANSFORM = {v.id: name for name, variants in TABLE.items() for v in variants}
"""Each variant -> its transform (a case's xdist group is its model and transform, so that the
variants of a transform meet their shared references in one process)."""


@functools.cache
def _reference(
    model_name: str, variant: str, dtype: Any, extra: tuple, form: str, shift: float, times: str
) -> Any:
    """The brute force of a variant at a state (parameters moved by ``shift``, times ``t0``
    or ``t1``), once per process: ``form`` is "value", "vmap" (over a stack of two batches)
    or "grad" (w.r.t. the parameters)."""
    params, x, t = _state(model_name, dtype, shift, times)
    expected, names = _expected(model_name, variant, dtype, extra, form)

    def at(second: bool) -> list[jax.Array]:
        return [_derivative_at(model_name, dtype, extra, n, shift, times, second) for n in names]

    if form == "value":
        return expected(params, x, t, *at(False))
    if form == "vmap":
        stacked = [jnp.stack(pair) for pair in zip(at(False), at(True), strict=True)]
        return expected(params, _stacked(x), t, *stacked)
    direct, *cotangents = expected(params, x, t, *at(False))
    for name, ct in zip(names, cotangents, strict=True):
        through = _derivative_vjp(model_name, dtype, extra, name)(params, x, t, ct)
        direct = jax.tree_util.tree_map(jnp.add, direct, through)
    return direct


# --- the calls ----------------------------------------------------------------------------------


@dataclass
class Step:
    """One call: its arguments (after the randomness, before the extra ones), the position of
    the parameters among them (``None``: read from a container), the state it is made in,
    and what to do before it."""

    args: tuple[Any, ...]
    shift: float
    times: str
    before: Callable[[], None] = lambda: None
    params_at: int | None = 0
    check_grad: bool = False
    fresh_jit: bool = False  # the function reads a container: a new jit sees its update


@dataclass
class Setup:
    fn: Callable[..., Any]
    argnums: int
    steps: list[Step] = field(default_factory=list)


def _setup(case: Case, params: Any, x: jax.Array, dtype: Any) -> Setup:
    """The function of the case's argument axis and its calls."""
    model = ZOO[case.model]
    g = timed(model)
    B = x.shape[0]
    t0, t1 = default_times(B, dtype), new_times(B, dtype)
    if case.argument == "plain":

        def plain(p: Any, x: jax.Array, *extra: Any) -> jax.Array:
            return g(p, x, t0, *extra)

        return Setup(plain, 1, [Step((params, x), 0.0, "t0")])

    def reaching(p: Any, x: jax.Array, t: jax.Array | None, *extra: Any) -> jax.Array:
        return g(p, x, t0 if t is None else t, *extra)  # t0 in the closure

    if case.argument == "reached":  # the closure's own times as t, then new times
        return Setup(
            reaching, 1, [Step((params, x, t0), 0.0, "t0"), Step((params, x, t1), 0.0, "t1")]
        )
    if case.argument == "equal":  # new arrays of equal values
        copies = jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), (params, x, t1))
        return Setup(reaching, 1, [Step((params, x, t1), 0.0, "t1"), Step(copies, 0.0, "t1")])
    if case.argument == "in_place":  # the parameters replaced in the container it reads
        holder = {"params": params}

        def reading(x: jax.Array, t: jax.Array, *extra: Any) -> jax.Array:
            return g(holder["params"], x, t, *extra)

        def update() -> None:
            holder["params"] = _shifted(holder["params"], DELTA)

        return Setup(
            reading,
            0,
            [
                Step((x, t1), 0.0, "t1", params_at=None, fresh_jit=True),
                Step((x, t1), DELTA, "t1", before=update, params_at=None, fresh_jit=True),
            ],
        )
    assert case.argument == "functional"  # the parameters, then new ones (an out-of-place step)
    new = _shifted(params, DELTA)
    return Setup(
        reaching,
        1,
        [Step((params, x, t1), 0.0, "t1"), Step((new, x, t1), DELTA, "t1", check_grad=True)],
    )


def _lead(variant: Any, x: jax.Array) -> tuple[Any, ...]:
    if variant.randomness == "probes":
        return (probes_for(x)[: variant.drawn],)
    if variant.randomness == "key":
        return (jax.random.key(KEY_SEED),)
    return ()


def check(case: Case) -> None:
    """Each call of the case's transformed function gives the brute force's numbers at the
    state it is made in, in the case's context."""
    model, variant = ZOO[case.model], VARIANTS[case.variant]
    dtype = jnp.float32 if case.context == "float32" else jnp.float64
    tol = {"rtol": 2e-4, "atol": 2e-5} if dtype == jnp.float32 else {"rtol": 1e-9, "atol": 1e-11}
    params, x = model.init(dtype)
    extra = (0.7,) if case.context == "python-float" else ()
    setup = _setup(case, params, x, dtype)
    fn = setup.fn
    if variant.scalar:
        inner = fn

        def fn(*args: Any) -> jax.Array:
            y = jnp.sin(inner(*args))
            return jnp.sum(y.reshape(y.shape[0], -1), axis=1)

    dj.clear_caches()
    transformed = variant.build(fn, setup.argnums, (*setup.steps[0].args, *extra))
    lead = _lead(variant, x)

    def call(*args: Any) -> Any:
        return transformed(*lead, *args, *extra)

    def same(got: Any, want: Any, what: str) -> None:
        if variant.compare == "covers":
            got = variant.out(got)
            assert got.shape == want.shape, what
            assert not bool(jnp.any(want & ~got)), f"{what}: the pattern misses nonzeros"
            return
        got = variant.out(got)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want), what
        for g, w in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            assert g.dtype == w.dtype, (what, g.dtype, w.dtype)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), err_msg=what, **tol)

    jitted = jax.jit(call) if variant.traceable else call
    for k, step in enumerate(setup.steps):
        step.before()
        what = f"call {k + 1}"
        if step.fresh_jit and variant.traceable:
            jitted = jax.jit(lambda *a: call(*a))

        def want(form: str, step: Step = step) -> Any:
            variant = SHARED[case.variant]
            return _reference(case.model, variant, dtype, extra, form, step.shift, step.times)

        if case.context in ("eager-then-jit", "float32", "python-float"):
            same(call(*step.args), want("value"), what)
            same(jitted(*step.args), want("value"), f"{what} (jit)")
        elif case.context == "jit-then-eager":
            same(jitted(*step.args), want("value"), f"{what} (jit)")
            same(call(*step.args), want("value"), what)
        elif case.context == "vmap":
            axes = [None] * len(step.args)
            axes[setup.argnums] = 0
            stacked = list(step.args)
            stacked[setup.argnums] = _stacked(x)
            same(jax.vmap(call, tuple(axes))(*stacked), want("vmap"), f"{what} (vmap)")
        else:
            assert case.context in ("grad", "jit-grad") and step.params_at == 0
            grad = jax.grad(lambda p, *rest: _total(call(p, *rest)))
            got = (jax.jit(grad) if case.context == "jit-grad" else grad)(*step.args)
            same(got, want("grad"), f"{what} (grad)")
        if step.check_grad and variant.differentiable and case.context not in ("grad", "jit-grad"):
            got = jax.grad(lambda p, *rest: _total(call(p, *rest)))(*step.args)
            same(got, want("grad"), f"{what}: gradient w.r.t. the new parameters")


@pytest.mark.parametrize("case", DEFAULT, ids=lambda c: c.id)
def test_context_matrix(case: Case) -> None:
    check(case)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id, marks=pytest.mark.xdist_group(f"{c.model}-{TRANSFORM[c.variant]}"))
        for c in SLOW
    ],
)
def test_context_matrix_pairwise(case: Case) -> None:
    check(case)


def test_the_matrix_covers_its_axes() -> None:
    """The default run holds every variant and every value of every axis on the MLP, the
    matrix every pair of values of two axes."""
    for name, values in {**AXES, "model": ("mlp",)}.items():
        assert {getattr(c, name) for c in DEFAULT} == set(values), name
    rows = [{name: getattr(c, name) for name in AXES} for c in DEFAULT + SLOW]
    assert not missing_pairs(AXES, rows, _allowed)
    assert all(_row_allowed(row) for row in rows)
