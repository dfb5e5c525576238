"""Sparsity rules of divjac.jax: no false coupling, no crash under jit, no side effects.

Every case is a per-sample function; its per-sample Jacobians and divergences are checked
against a brute-force loop over samples (float64) in every mode, and its detected pattern
against the true nonzeros (never a miss; equal to them where the rule is exact).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

import divjac
from divjac.jax import divergence, jacobian, sparsity
from divjac.models import jax as models
from tests.reference import jax_diagonal_blocks, traces

B, N = 4, 5
PERM = jnp.array([1, 0, 3, 4, 2])
LABELS = jnp.array([0, 2, 4, 1])
MODES = ("auto", "sparse", "fwd", "rev")
METHODS = ("auto", "exact", "sparse")


def _normal(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float64)


X = _normal(0, (B, N))


def true_nonzeros(f, x, points=3):
    """Union over samples and random points of the nonzeros of the per-sample Jacobians."""
    found = None
    for k in range(points):
        blocks = jax_diagonal_blocks(f, (x + 0.5 * k * _normal(100 + k, x.shape),))
        nz = (np.abs(blocks) > 0).reshape(x.shape[0], -1, x[0].size).any(0)
        found = nz if found is None else found | nz
    return found


def check_pattern(f, x, *, exact):
    """Batch independent, no rule missing, never misses a nonzero, exact where claimed."""
    pattern = sparsity(f)(x)
    assert pattern.is_batch_independent
    assert pattern.dense_fallbacks == frozenset()
    truth = true_nonzeros(f, x)
    detected = pattern.csr.toarray()
    assert not (truth & ~detected).any(), "the pattern misses true nonzeros"
    if exact:
        np.testing.assert_array_equal(detected, truth)
    return pattern


def check_values(f, x, *, modes=MODES, methods=METHODS, reference=None, rtol=1e-10):
    """Jacobians in ``modes`` and (square) divergences by ``methods`` against brute force."""
    blocks = jax_diagonal_blocks(reference or f, (x,))
    for mode in modes:
        np.testing.assert_allclose(jacobian(f, mode=mode)(x), blocks, rtol=rtol, atol=1e-12)
    if jax.eval_shape(f, x).shape == x.shape:
        expected = traces(blocks, x.shape[1:])
        for method in methods:
            np.testing.assert_allclose(divergence(f, method=method)(x), expected, rtol=rtol)


# --- 1. per-sample picks: x[jnp.arange(B), idx] -------------------------------------------------


def _pick_const(x):
    return jnp.tanh(x) * x[jnp.arange(B), LABELS][:, None]


def _pick_argmax(x):
    return jnp.tanh(x) * x[jnp.arange(B), jnp.argmax(x, axis=1)][:, None]


def _take_along(x):
    return jnp.tanh(x) * jnp.take_along_axis(x, LABELS[:, None], axis=1)


def _vmapped_pick(x):
    return jax.vmap(lambda xb, label: jnp.tanh(xb) * xb[label])(x, LABELS)


def _log_likelihood(x):  # the per-sample pick of a classifier's loss: one output per sample
    return jax.nn.log_softmax(x)[jnp.arange(B), LABELS]


@pytest.mark.parametrize(
    ("f", "exact"),
    [
        (_pick_const, True),
        (_take_along, True),
        (_vmapped_pick, True),
        (_log_likelihood, True),
        (_pick_argmax, False),  # computed labels: any position of the sample's row
    ],
)
def test_per_sample_pick_is_not_coupled(f, exact):
    pattern = check_pattern(f, X, exact=exact)
    if f is _pick_argmax:
        assert pattern.nnz == N * N  # the picked column is unknown, the sample is not
    check_values(f, X)


def test_pick_with_labels_traced_by_jit():
    def loss_divergence(x, labels):
        return divergence(lambda x: jnp.tanh(x) * x[jnp.arange(B), labels][:, None])(x)

    got = jax.jit(loss_divergence)(X, LABELS)
    np.testing.assert_allclose(got, traces(jax_diagonal_blocks(_pick_const, (X,)), (N,)))


def test_unknown_batch_index_stays_conservative():
    shuffle = jnp.array([1, 0, 3, 2])
    f = lambda x: jnp.tanh(x[shuffle])  # noqa: E731 - a known permutation of the samples
    assert not sparsity(f)(X).is_batch_independent
    # Output sample b reads input sample shuffle[b] != b: the diagonal blocks are zero.
    np.testing.assert_allclose(divergence(f, coupling="exact")(X), np.zeros(B))
    # Traced (unknown) sample indices may mix samples: refused.
    with pytest.raises(divjac.BatchCouplingError):
        jax.jit(lambda x, p: divergence(lambda x: jnp.tanh(x[p]))(x))(X, jnp.arange(B))


# --- 2. stack, select_if_vmap (diffrax), psum / pmean, custom_jvp rules that gather -------------


def _stack_square(x):
    return (jnp.stack([jnp.sin(x), x[:, ::-1] ** 2], axis=1) * jnp.array([1.0, 2.0])[:, None]).sum(
        1
    )


def _stack_last(x):
    return jnp.stack([jnp.sin(x), jnp.cos(x[:, PERM])], axis=-1)


def _stack_rows(x):  # per sample (N, 3): stacking along the middle of the sample
    return jnp.stack([x[:, :, 0], x[:, :, 2] * x[:, :, 1]], axis=1)


@pytest.mark.parametrize(
    ("f", "x"), [(_stack_square, X), (_stack_last, X), (_stack_rows, _normal(1, (B, N, 3)))]
)
def test_stack(f, x):
    check_pattern(f, x, exact=True)
    check_values(f, x)


def _psum(v):  # sample (3, 4): sums over the named axis (rows), column by column
    return v * lax.psum(v, "rows")


def _pmean(v):
    return jnp.tanh(v - lax.pmean(v, "rows"))


@pytest.mark.parametrize("inner", [_psum, _pmean])
def test_collectives_over_a_vmapped_named_axis(inner):
    f = jax.vmap(jax.vmap(inner, axis_name="rows"))
    x = _normal(2, (B, 3, 4))
    pattern = check_pattern(f, x, exact=True)
    assert pattern.nnz == 12 * 3  # each element: its column within its own sample
    check_values(f, x)


@pytest.mark.parametrize(("collective", "reduction"), [(lax.pmax, jnp.max), (lax.pmin, jnp.min)])
def test_max_and_min_over_a_vmapped_named_axis(collective, reduction):
    # JAX does not differentiate pmax / pmin; their pattern is that of the reduction.
    named = jax.vmap(jax.vmap(lambda v: v * collective(v, "rows"), axis_name="rows"))
    x = _normal(2, (B, 3, 4))
    pattern = sparsity(named)(x)
    assert pattern.is_batch_independent and pattern.nnz == 12 * 3
    reduced = sparsity(lambda x: x * reduction(x, axis=1, keepdims=True))(x)
    np.testing.assert_array_equal(pattern.todense(), reduced.todense())


def test_a_named_axis_left_over_stays_dense():
    f = jax.pmap(lambda v: v * lax.psum(v, "devices"), axis_name="devices")
    x = _normal(9, (1, 3))  # one device, one sample
    with pytest.warns(divjac.DenseFallbackWarning, match="psum"):
        pattern = sparsity(f)(x)
    assert pattern.nnz == 9


@jax.custom_jvp
def _permuted(x):
    return jnp.take(x, PERM, axis=-1)


@_permuted.defjvp
def _permuted_jvp(primals, tangents):
    return _permuted(primals[0]), jnp.take(tangents[0], PERM, axis=-1)


@jax.custom_jvp
def _picked(x, labels):  # an integer argument: its tangent is float0
    return jnp.take_along_axis(x, labels[:, None], axis=1)


@_picked.defjvp
def _picked_jvp(primals, tangents):
    (x, labels), (tx, _) = primals, tangents
    return _picked(x, labels), tx[jnp.arange(x.shape[0]), labels][:, None]


@pytest.mark.slow
@pytest.mark.parametrize(
    "f", [lambda x: jnp.tanh(_permuted(x)), lambda x: jnp.sin(x) * _picked(x, LABELS)]
)
def test_custom_jvp_whose_rule_gathers(f):
    check_pattern(f, X, exact=True)
    check_values(f, X)


# --- diffrax flow maps (equinox's select_if_vmap, custom_vjp loops) ---------------------------

W1 = _normal(3, (4, 8)) / 2
W2 = _normal(4, (8, 4)) / 3
Y = _normal(5, (3, 4))


def _vector_field(t, y, args):
    return jnp.tanh(y @ W1) @ W2


def _flow(adjoint=None):
    import diffrax

    kw = {} if adjoint is None else {"adjoint": adjoint}

    def flow(y):
        term = diffrax.ODETerm(_vector_field)
        return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0, 1, 0.1, y, **kw).ys[-1]

    return flow


@pytest.mark.slow
@pytest.mark.parametrize(
    "vmapped",
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["vmap", "batched-state"],
)
def test_diffrax_flow_map_is_per_sample(vmapped):
    diffrax = pytest.importorskip("diffrax")
    wrap = jax.vmap if vmapped else (lambda flow: flow)
    f = wrap(_flow())  # reverse mode only (a custom_vjp adjoint)
    forward = wrap(_flow(diffrax.ForwardMode()))  # forward mode only
    pattern = sparsity(f)(Y)
    assert pattern.is_batch_independent and pattern.nnz == 16
    check_values(f, Y, modes=("auto", "sparse", "rev"), reference=forward)
    check_values(forward, Y, modes=("fwd",), methods=())


@jax.custom_vjp
def _act(v):
    return 2 * jnp.tanh(v)


_act.defvjp(lambda v: (_act(v), v), lambda v, g: (g * 2 * (1 - jnp.tanh(v) ** 2),))


def test_custom_vjp_in_every_functional():
    """A ``jax.custom_vjp`` has no forward derivative: the functionals that chose columns
    (from a given pattern, the sparse Hessian) push rows, and those that need a forward pass
    name it (they raised JAX's raw "can't apply forward-mode autodiff")."""
    import divjac.jax as dj

    W = _normal(7, (4, 4))
    f = lambda x: _act(x @ W) @ W.T  # noqa: E731
    twin = lambda x: 2 * jnp.tanh(x @ W) @ W.T  # noqa: E731  (the same function, differentiable)
    u = lambda x: jnp.sum(f(x) ** 2, axis=1)  # noqa: E731
    u_twin = lambda x: jnp.sum(twin(x) ** 2, axis=1)  # noqa: E731
    x = _normal(8, (3, 4))
    pattern = sparsity(twin)(x)
    pairs = [
        (dj.jacobian_from_pattern(f, pattern), dj.jacobian(twin)),
        (dj.divergence_from_pattern(f, pattern), dj.divergence(twin)),
        (dj.hessian_diagonal(u, method="sparse"), dj.hessian_diagonal(u_twin)),
        (dj.hessian(u, mode="sparse"), dj.hessian(u_twin)),
    ]
    for got, want in pairs:
        np.testing.assert_allclose(got(x), want(x), rtol=1e-10, atol=1e-12)
    with pytest.raises(divjac.OptionError, match=r"mode='fwd' .*custom_vjp"):
        dj.jacobian(f, mode="fwd")(x)
    with pytest.raises(divjac.OptionError, match=r"method='slq' .*custom_vjp.*method='exact'"):
        dj.log_abs_det(f, method="slq")(jax.random.key(0), x)


# --- 3. a primitive without a rule, applied per sample ----------------------------------------


def _linear_primitive(name, impl, batched=True):
    """A self-adjoint linear primitive (both derivative rules refer to itself)."""
    prim = Primitive(name)
    prim.def_impl(impl)
    prim.def_abstract_eval(lambda x: x)
    ad.deflinear2(prim, lambda ct, x: [prim.bind(ct)])
    mlir.register_lowering(prim, mlir.lower_fun(impl, False))
    if batched:  # maps each row (its last axis) on its own
        batching.primitive_batchers[prim] = lambda args, dims: (
            prim.bind(jnp.moveaxis(args[0], dims[0], 0)),
            0,
        )
    return prim


def _flip_add(x):
    return x + jnp.flip(x, -1)


rowflip_p = _linear_primitive("divjac_test_rowflip", _flip_add)
unbatched_p = _linear_primitive("divjac_test_unbatched", _flip_add, batched=False)


def test_dense_fallback_keeps_samples_apart():
    f = lambda x: jnp.tanh(rowflip_p.bind(x))  # noqa: E731
    with pytest.warns(divjac.DenseFallbackWarning, match="divjac_test_rowflip"):
        got = jax.jit(lambda x: divergence(f)(x))(X)  # first call: under jit
    np.testing.assert_allclose(got, traces(jax_diagonal_blocks(f, (X,)), (N,)), rtol=1e-10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", divjac.DenseFallbackWarning)
        pattern = sparsity(f)(X)
        check_values(f, X)
    assert pattern.is_batch_independent
    assert pattern.nnz == N * N  # dense within the sample, never a miss
    assert not (true_nonzeros(f, X) & ~pattern.csr.toarray()).any()


def test_dense_fallback_without_batching_rule_stays_coupled():
    f = lambda x: jnp.tanh(unbatched_p.bind(x))  # noqa: E731
    with (
        pytest.warns(divjac.DenseFallbackWarning),
        pytest.raises(
            divjac.BatchCouplingError, match="divjac_test_unbatched had no sparsity rule"
        ),
    ):
        divergence(f)(X)


def test_dense_fallback_is_not_split_where_the_batching_rule_does_not_hold():
    # One sample of shape (6,): the leading axis holds the elements, and the primitive is
    # not defined on its slices (scalars), although its batching rule accepts them.
    x = _normal(6, (6,))
    with pytest.warns(divjac.DenseFallbackWarning):
        pattern = sparsity(lambda v: jnp.tanh(rowflip_p.bind(v)), batch_axis=None)(x)
    assert pattern.nnz == 36


def test_dense_fallback_of_a_primitive_mixing_its_leading_axis_stays_coupled():
    mix_p = _linear_primitive("divjac_test_mix_leading", lambda x: x + jnp.flip(x, 0), False)
    # A batching rule that is not the primitive itself (it flips another axis).
    batching.primitive_batchers[mix_p] = lambda args, dims: (
        jnp.moveaxis(args[0], dims[0], 0) + jnp.flip(jnp.moveaxis(args[0], dims[0], 0), 1),
        0,
    )
    with pytest.warns(divjac.DenseFallbackWarning):
        pattern = sparsity(lambda x: mix_p.bind(x))(X)
    assert not pattern.is_batch_independent


def test_registered_rule_makes_the_pattern_exact_and_replaces_cached_ones():
    from divjac import rules
    from divjac.jax import register_rule

    flipadd_p = _linear_primitive("divjac_test_registered_flipadd", _flip_add)
    f = lambda x: jnp.tanh(flipadd_p.bind(x))  # noqa: E731
    with pytest.warns(divjac.DenseFallbackWarning, match="divjac_test_registered_flipadd"):
        assert sparsity(f)(X).nnz == N * N  # no rule: dense within each sample
    with pytest.raises(rules.RuleError, match="callable"):
        register_rule(flipadd_p, "not a rule")  # type: ignore[arg-type]

    def flip_add(op: rules.Op) -> list[rules.Deps]:
        (x,) = op.ins
        return [rules.union(x, rules.rev(x, [len(x.shape) - 1]))]

    register_rule(flipadd_p, flip_add)
    pattern = check_pattern(f, X, exact=True)  # the cached dense pattern is not reused
    assert pattern.nnz == 2 * N - 1
    check_values(f, X)
    register_rule("divjac_test_registered_flipadd", lambda op: [op.ins[0], op.ins[0]])
    with pytest.raises(rules.RuleError, match="divjac_test_registered_flipadd"):
        sparsity(f)(X)  # a rule that returns two results for one output


def test_a_rule_registered_after_an_eager_call_is_used_by_the_next_call():
    """The eager call's compiled program (kept per transform and in the eager cache) holds the
    pattern of the rules it was made with: a rule registered after it must not be ignored."""
    from divjac import rules
    from divjac.jax import register_rule

    prim = _linear_primitive("divjac_test_reregistered_flipadd", _flip_add)
    f = lambda x: jnp.tanh(prim.bind(x))  # noqa: E731
    sparse = divergence(f, method="sparse")
    want = traces(jax_diagonal_blocks(f, (X,)), (N,))
    # A wrong rule (it misses the flip): wrong numbers, by the caller's own rule.
    register_rule(prim, lambda op: [rules.elementwise(op.out_shapes[0], op.ins[0])])
    assert not np.allclose(sparse(X), want)
    register_rule(
        prim, lambda op: [rules.union(op.ins[0], rules.rev(op.ins[0], [len(op.ins[0].shape) - 1]))]
    )
    np.testing.assert_allclose(sparse(X), want, rtol=1e-6)  # the same transform, the new rule
    register_rule(prim, lambda op: [op.ins[0], op.ins[0]])
    with pytest.raises(rules.RuleError, match="divjac_test_reregistered_flipadd"):
        sparse(X)  # a broken rule is met, not skipped by the program made before it


# --- 4. the first call under jax.jit -------------------------------------------------------------

A = 4.0 * jnp.eye(N) + 0.1 * _normal(7, (N, N))


def _matrices(x):
    return 4.0 * jnp.eye(N) + 0.3 * x[:, :, None] * x[:, None, :]


def _resize(x):
    grid = x.reshape(B, 1, N)
    up = jax.image.resize(grid, (B, 3, 2 * N), "linear")
    return jax.image.resize(up, (B, 1, N), "linear").reshape(B, N) * x


JIT_CASES = {
    "take": lambda x: jnp.tanh(jnp.take(x, PERM, axis=1)) * x,
    "at_add": lambda x: x.at[:, 0].add(x[:, 1] ** 2),
    "fancy_index": lambda x: jnp.sin(x[:, [0, 2, 4, 1, 3]]),
    "argsort": lambda x: jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1) * x,
    "resize": _resize,
    "solve": lambda x: jnp.linalg.solve(A + 0.3 * x[:, :, None] * x[:, None, :], x[..., None])[
        ..., 0
    ],
    "inv": lambda x: (jnp.linalg.inv(_matrices(x)) @ x[..., None])[..., 0],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(JIT_CASES))
def test_first_call_under_jit(name):
    f = lambda x: JIT_CASES[name](x)  # noqa: E731 - never called before this test
    got_div = jax.jit(lambda x: divergence(f)(x))(X)  # its first call: under jit
    got_jac = {mode: jax.jit(lambda x, m=mode: jacobian(f, mode=m)(x))(X) for mode in MODES}
    blocks = jax_diagonal_blocks(JIT_CASES[name], (X,))
    np.testing.assert_allclose(got_div, traces(blocks, (N,)), rtol=1e-10)
    for mode, got in got_jac.items():
        np.testing.assert_allclose(got, blocks, rtol=1e-10, atol=1e-12, err_msg=mode)


def test_jit_with_parameters_as_arguments():
    params = models.init_mlp(jax.random.key(8), (N, 8, N), jnp.float64)

    @jax.jit
    def step(params, perm, x):  # params (floats) and indices (integers) are tracers here
        f = lambda x: models.mlp(params, jnp.take(x, perm, axis=1))  # noqa: E731
        return divergence(f)(x), jacobian(f, mode="sparse")(x)

    div, jac = step(params, PERM, X)
    blocks = jax_diagonal_blocks(lambda x: models.mlp(params, jnp.take(x, PERM, axis=1)), (X,))
    np.testing.assert_allclose(jac, blocks, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(div, traces(blocks, (N,)), rtol=1e-10)


# --- 5. detection leaves the user's functions alone ---------------------------------------------

FWD_SEEN: list[tuple[bool, bool]] = []


@jax.custom_vjp
def _scaled(x, scale):
    return jnp.sin(x) * scale


def _scaled_fwd(x, scale):
    FWD_SEEN.append((x.perturbed, scale.perturbed))
    assert not scale.perturbed, "like Equinox's non-differentiable arguments"
    return jnp.sin(x.value) * scale.value, (x.value, scale.value)


def _scaled_bwd(res, ct):
    x, scale = res
    return jnp.cos(x) * scale * ct, jnp.zeros_like(scale)


_scaled.defvjp(_scaled_fwd, _scaled_bwd, symbolic_zeros=True)
_scaled_jit = jax.jit(_scaled)


def test_detection_does_not_retrace_custom_rules_with_other_perturbations():
    scale = jnp.full((B, N), 2.0)
    f = lambda x: _scaled_jit(x, scale)  # noqa: E731
    y, pull = jax.vjp(f, X)  # the user's own differentiation, before divjac
    expected = pull(jnp.ones_like(y))[0]
    pattern = sparsity(f)(X)
    np.testing.assert_array_equal(pattern.todense(), np.eye(N, dtype=bool))
    assert pattern.is_batch_independent
    assert set(FWD_SEEN) == {(True, False)}
    # The stores JAX keeps for the rule were left filled: a later transformation works.
    xs = jnp.stack([X, 2 * X])
    ys, pull = jax.vjp(jax.vmap(f), xs)
    np.testing.assert_allclose(pull(jnp.ones_like(ys))[0][0], expected, rtol=1e-12)
    np.testing.assert_allclose(
        divergence(f, method="sparse")(X), jnp.sum(2.0 * jnp.cos(X), axis=1), rtol=1e-12
    )


@pytest.mark.slow  # a regression guard (the custom_vjp test reproduces the cause, fast)
@pytest.mark.parametrize("coupling", ["raise", "exact"])
def test_diffrax_user_vjp_after_detection(coupling):
    pytest.importorskip("diffrax")
    flow = _flow()
    f = jax.vmap(flow)
    expected = jax.vmap(jax.jacrev(flow))(Y)
    if coupling == "raise":
        assert sparsity(f)(Y).is_batch_independent
    else:
        np.testing.assert_allclose(
            divergence(f, coupling="exact")(Y), jnp.trace(expected, axis1=1, axis2=2), rtol=1e-10
        )
    for _ in range(2):
        _, pull = jax.vjp(flow, Y[0])
        np.testing.assert_allclose(jax.vmap(pull)(jnp.eye(4))[0], expected[0], rtol=1e-10)
        _, pull = jax.vjp(f, Y)
        cts = jnp.eye(4)[:, None, :] * jnp.ones((1, 3, 1))
        got = jax.vmap(pull)(cts)[0]  # (output element, sample, input element)
        np.testing.assert_allclose(jnp.swapaxes(got, 0, 1), expected, rtol=1e-10)


# --- 6. batched linear algebra, per sample -----------------------------------------------------


def _triangular(x):
    lower = jnp.tril(_matrices(x))
    return jax.scipy.linalg.solve_triangular(lower, x[..., None], lower=True)[..., 0]


def _lu(x):
    return jax.scipy.linalg.lu_solve(jax.scipy.linalg.lu_factor(_matrices(x)), x[..., None])[..., 0]


@pytest.mark.parametrize("left_side", [True, False])
@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("transpose_a", [True, False])
def test_triangular_solve_with_a_shared_matrix(left_side, lower, transpose_a):
    tri = jnp.tril if lower else jnp.triu
    matrix = tri(A) + 2.0 * jnp.eye(N)

    def f(x):  # per sample: a (N, 3) right-hand side (a (3, N) one from the right)
        b = x.reshape(B, N, 3) if left_side else x.reshape(B, 3, N)
        m = jnp.broadcast_to(matrix, (B, N, N))
        out = lax.linalg.triangular_solve(
            m, jnp.sin(b), left_side=left_side, lower=lower, transpose_a=transpose_a
        )
        return out.reshape(B, 3 * N)

    x = _normal(10, (B, 3 * N))
    check_pattern(f, x, exact=True)  # substitution: a prefix or a suffix of a row or column
    check_values(f, x)


# name: (function, whether its pattern is exact: the rules are dense within each matrix, and
# a Cholesky factor or a triangular solve is lower triangular)
LINALG_CASES = {
    "solve": (JIT_CASES["solve"], True),
    "inv": (JIT_CASES["inv"], True),
    "cholesky": (lambda x: (jnp.linalg.cholesky(_matrices(x)) @ x[..., None])[..., 0], False),
    "triangular_solve": (_triangular, False),
    "lu": (_lu, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LINALG_CASES))
def test_batched_linear_algebra(name):
    f, exact = LINALG_CASES[name]
    got = jax.jit(lambda x: divergence(lambda x: f(x))(x))(X)  # first call: under jit
    np.testing.assert_allclose(got, traces(jax_diagonal_blocks(f, (X,)), (N,)), rtol=1e-10)
    check_pattern(f, X, exact=exact)
    check_values(f, X)


def _gathers_with_an_index_made_inside(x):
    idx = jnp.array([1, 2, 3, 0])  # traced with f: the rule closes over a tracer of f's trace

    @jax.custom_jvp
    def g(x):
        return x[:, idx]

    @g.defjvp
    def g_jvp(primals, tangents):
        return g(primals[0]), tangents[0][:, idx]

    return g(x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_jvp_rule_gathering_with_a_closure_captured_index(jit):
    """A custom_jvp rule closing over an index made inside f cannot be traced once f's trace
    is over (JAX's own jacfwd(jit(f)) fails): detection stays conservative (dense, samples
    apart) and the eager call runs f itself rather than failing; true divergence 0."""
    x = _normal(11, (3, 4))
    wrap = jax.jit if jit else (lambda g: g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", divjac.DenseFallbackWarning)
        pattern = sparsity(_gathers_with_an_index_made_inside)(x)
        assert pattern.is_batch_independent
        np.testing.assert_array_equal(wrap(divergence(_gathers_with_an_index_made_inside))(x), 0)
        blocks = wrap(jacobian(_gathers_with_an_index_made_inside))(x)
    np.testing.assert_array_equal(blocks, np.broadcast_to(np.eye(4)[[1, 2, 3, 0]], (3, 4, 4)))
