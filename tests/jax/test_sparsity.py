"""Sparsity detection (JAX): soundness, exactness, color counts, coupling, fallbacks, caching."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

import divjac
from divjac._core import coloring
from divjac.jax import divergence, jacobian, sparse_jacobian, sparsity
from divjac.models import jax as models

KEY = jax.random.key(0)


def _normal(key, shape):
    return jax.random.normal(jax.random.key(key), shape)


def _full_jacobian(f, x, reverse=False):
    """Dense Jacobian of the whole batch, ``(B*n_out, B*n_in)``."""
    J = (jax.jacrev if reverse else jax.jacfwd)(f)(x)
    return np.asarray(J).reshape(np.size(f(x)), x.size)


def assert_sound(f, x, *, reverse=False, points=3):
    """The detected per-sample pattern contains every nonzero of every diagonal block, and
    coupling is reported whenever an off-diagonal block has a nonzero."""
    pattern = sparsity(f)(x)
    B = x.shape[0]
    n_in = x.size // B
    for k in range(points):
        xk = x + 0.5 * k * _normal(100 + k, x.shape)
        J = _full_jacobian(f, xk, reverse).reshape(B, -1, B, n_in)
        n_out = J.shape[1]
        nz = np.abs(J) > 0
        for b in range(B):
            missed = nz[b, :, b, :] & ~pattern.csr.toarray().reshape(n_out, n_in)
            assert not missed.any(), f"pattern misses {missed.sum()} nonzeros of sample {b}"
        off = nz.copy()
        off[np.arange(B), :, np.arange(B), :] = False
        if off.any():
            assert not pattern.is_batch_independent
    return pattern


# --- soundness on many architectures -----------------------------------------------------------

W4 = _normal(1, (4, 4))
K33 = _normal(2, (3, 3, 2, 3)) / 3  # HWIO


def conv(x, w=K33, **kw):
    kw.setdefault("window_strides", (1, 1))
    kw.setdefault("padding", "SAME")
    return lax.conv_general_dilated(x, w, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw)


def attention(x):  # x (B, T, D): softmax attention within each sample
    q, k, v = x @ W4, x @ W4.T, x
    a = jax.nn.softmax(q @ jnp.swapaxes(k, 1, 2) / 2.0, axis=-1)
    return a @ v


def residual(x):
    return x + jnp.tanh(conv(jnp.tanh(conv(x, K33[..., :2]))[..., :2], K33[..., :2]))


@jax.custom_jvp
def ste_round(x):
    return jnp.round(x)


ste_round.defjvp(lambda p, t: (ste_round(p[0]), t[0]))


@jax.custom_vjp
def clip_grad(x):
    return jnp.sin(x) * jnp.sum(x, axis=-1, keepdims=True)


def _clip_fwd(x):
    return clip_grad(x), x


def _clip_bwd(x, g):
    return (jax.vjp(lambda z: jnp.sin(z) * jnp.sum(z, axis=-1, keepdims=True), x)[1](g)[0],)


clip_grad.defvjp(_clip_fwd, _clip_bwd)
IDX = jnp.array([3, 0, 2, 2])

IMAGE = (2, 6, 6, 2)
SEQ = (2, 5, 4)
VEC = (3, 4)

ARCHITECTURES = {
    "mlp": (lambda x: jnp.tanh(x @ W4) @ W4.T, VEC, False),
    "conv_same": (lambda x: jnp.tanh(conv(x)), IMAGE, False),
    "conv_valid_strided": (lambda x: conv(x, window_strides=(2, 1), padding="VALID"), IMAGE, False),
    "conv_dilated": (
        lambda x: conv(x, rhs_dilation=(2, 2), padding=((2, 1), (0, 3))),
        IMAGE,
        False,
    ),
    "conv_transpose": (
        lambda x: lax.conv_transpose(
            x, K33, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        ),
        IMAGE,
        False,
    ),
    "conv_groups": (
        lambda x: conv(x, _normal(3, (3, 3, 1, 4)), feature_group_count=2),
        IMAGE,
        False,
    ),
    "conv_groups_layouts": (  # output layout differs from the input's
        lambda x: lax.conv_general_dilated(
            x,
            _normal(4, (4, 1, 3, 3)),
            (1, 2),
            "SAME",
            dimension_numbers=("NHWC", "OIHW", "NCHW"),
            feature_group_count=2,
        ),
        IMAGE,
        False,
    ),
    "residual": (residual, IMAGE, False),
    "max_pool": (
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
        IMAGE,
        False,
    ),
    "avg_pool": (
        lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME") / 9,
        IMAGE,
        False,
    ),
    "upsample_nearest": (lambda x: jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2), IMAGE, False),
    "upsample_bilinear": (lambda x: jax.image.resize(x, (2, 9, 9, 2), "bilinear"), IMAGE, False),
    "attention": (attention, SEQ, False),
    "layer_norm": (
        lambda x: (x - x.mean(-1, keepdims=True)) / jnp.std(x, -1, keepdims=True),
        SEQ,
        False,
    ),
    "gather_static": (lambda x: x[:, IDX] * 2 + jnp.take(x, IDX, axis=1), VEC, False),
    "gather_dynamic": (
        lambda x: jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1),
        VEC,
        False,
    ),
    "scatter_static": (lambda x: x.at[:, IDX].add(x**2).at[:, 1].set(0.0), VEC, False),
    "scatter_dynamic": (
        lambda x: jax.vmap(lambda r: r.at[jnp.argmax(r)].add(r[0] ** 2))(x),
        VEC,
        False,
    ),
    "dynamic_slice": (
        lambda x: jax.vmap(lambda r: lax.dynamic_slice(r, (jnp.argmin(r) % 2,), (2,)))(x),
        VEC,
        False,
    ),
    "cond": (
        lambda x: jax.vmap(lambda r: lax.cond(r[0] > 0, lambda: r[::-1], lambda: r * 2))(x),
        VEC,
        False,
    ),
    "while": (
        lambda x: lax.while_loop(
            lambda c: c[1] < 3, lambda c: (jnp.roll(c[0], 1, 1) * c[0], c[1] + 1), (x, 0)
        )[0],
        VEC,
        False,
    ),
    "scan": (lambda x: lax.scan(lambda c, xi: (c * xi, c + xi), x[:, 0], x.T)[1].T, VEC, False),
    "fori_long": (
        lambda x: lax.fori_loop(0, 40, lambda i, c: jnp.roll(c, 1, 1) * 0.5 + c, x),
        VEC,
        False,
    ),
    "custom_jvp_ste": (lambda x: ste_round(x) * x, VEC, False),
    "custom_vjp": (clip_grad, VEC, True),
    "cumulative": (lambda x: jnp.cumsum(x, 1) + jnp.cumprod(x, 1)[:, ::-1], VEC, False),
    "sort_topk": (lambda x: jnp.sort(x, 1) + lax.top_k(x, 4)[0], VEC, False),
    "fft": (lambda x: jnp.fft.rfft(x, axis=-1).real, VEC, False),
    "solve": (
        lambda x: jnp.linalg.solve(x[:, :2, :2] + 3 * jnp.eye(2), x[:, :2, 2:]),
        (3, 4, 4),
        False,
    ),
    "einsum": (lambda x: jnp.einsum("bij,bkj->bik", x, x), SEQ, False),
    "concat_pad_flip": (
        lambda x: jnp.concatenate(
            [jnp.pad(x, ((0, 0), (1, 0))), jnp.flip(x, 1)[:, :, None][..., 0]], 1
        ),
        VEC,
        False,
    ),
    "approx_max_k": (lambda x: lax.approx_max_k(jnp.sin(x), 2)[0], VEC, False),
    "unstack_reversed": (
        lambda x: jnp.sin(jnp.stack(jnp.unstack(x, axis=1)[::-1], axis=1)),
        VEC,
        False,
    ),
    "where_mask": (lambda x: jnp.where(x > 0, x, jnp.roll(x, 1, 1)), VEC, False),
    "batch_norm_train": (lambda x: (x - x.mean(0)) / jnp.std(x, 0), VEC, False),
    "batch_attention": (lambda x: jax.nn.softmax(x @ x.T, axis=0) @ x, VEC, False),
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_pattern_never_misses_a_nonzero(name):
    f, shape, reverse = ARCHITECTURES[name]
    x = _normal(7, shape)
    pattern = assert_sound(f, x, reverse=reverse)
    if name.startswith("batch_"):
        assert not pattern.is_batch_independent
    else:
        assert pattern.is_batch_independent, pattern.coupling


@pytest.mark.parametrize(
    "name",
    [
        "conv_same",
        "conv_dilated",
        "conv_transpose",
        "conv_groups_layouts",
        "upsample_bilinear",
        "gather_static",
        "unstack_reversed",
    ],
)
def test_precise_patterns_are_exact(name):
    """For linear index maps and stencils the pattern is not only sound but exact."""
    f, shape, _ = ARCHITECTURES[name]
    x = _normal(8, shape)
    pattern = sparsity(f)(x)
    J = _full_jacobian(f, x).reshape(shape[0], pattern.shape[0], shape[0], pattern.shape[1])
    union = np.zeros(pattern.shape, bool)
    for b in range(shape[0]):
        union |= np.abs(J[b, :, b, :]) > 0
    np.testing.assert_array_equal(pattern.csr.toarray(), union)


# --- random programs ------------------------------------------------------------------------------


def _op(kind, seed):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((4, 4)))
    k = jnp.asarray(rng.standard_normal((3, 3, 4, 4)) / 3)
    idx = jnp.asarray(rng.integers(0, 4, size=4))
    return {
        "tanh": jnp.tanh,
        "square": lambda x: x * x,
        "matmul": lambda x: x @ w,
        "conv": lambda x: lax.conv_general_dilated(
            x.reshape(x.shape[0], 2, 2, 4),
            k,
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ).reshape(x.shape),
        "transpose": lambda x: jnp.swapaxes(x, 1, 2),
        "roll": lambda x: jnp.roll(x, int(seed) % 3 + 1, axis=2),
        "cumsum": lambda x: jnp.cumsum(x, axis=1),
        "reduce_broadcast": lambda x: x + jnp.sum(x, axis=2, keepdims=True),
        "slice_pad": lambda x: jnp.pad(x[:, :, 1:], ((0, 0), (0, 0), (0, 1))),
        "gather": lambda x: x[:, :, idx],
        "scatter_add": lambda x: x.at[:, :, idx].add(x),
        "where": lambda x: jnp.where(x > 0.1, x, -x[:, ::-1]),
        "sort": lambda x: jnp.sort(x, axis=2),
        "max_pool": lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 1), (1, 1, 1), "SAME"),
        "concat_slice": lambda x: jnp.concatenate([x, x[:, ::-1]], axis=2)[:, :, 2:6],
    }[kind]


OPS = [
    "tanh", "square", "matmul", "conv", "transpose", "roll", "cumsum", "reduce_broadcast",
    "slice_pad", "gather", "scatter_add", "where", "sort", "max_pool", "concat_slice",
]  # fmt: skip


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(
    program=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1000)), min_size=1, max_size=5)
)
def test_random_programs_are_sound(program):
    ops = [_op(kind, seed) for kind, seed in program]

    def f(x):
        for op in ops:
            x = op(x)
        return x

    assert_sound(f, _normal(11, (2, 4, 4)), points=2)


# --- exactness of the sparse methods --------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["conv_same", "conv_dilated", "residual", "upsample_nearest", "layer_norm"]
)
def test_sparse_jacobian_and_divergence_equal_dense(name):
    f, shape, _ = ARCHITECTURES[name]
    x = _normal(12, shape)
    dense = jacobian(f, mode="fwd")(x)
    np.testing.assert_allclose(jacobian(f, mode="sparse")(x), dense, rtol=1e-6, atol=1e-12)
    B = shape[0]
    matrices = np.asarray(dense).reshape(B, -1, np.size(x) // B)
    np.testing.assert_allclose(sparse_jacobian(f)(x).todense(), matrices, rtol=1e-6, atol=1e-12)
    if matrices.shape[1] == matrices.shape[2]:
        expected = np.trace(matrices, axis1=1, axis2=2)
        np.testing.assert_allclose(divergence(f, method="sparse")(x), expected, rtol=1e-6)


# --- color counts on convolution stencils --------------------------------------------------------


def _conv_stack(layers, channels):
    params = models.init_cnn(
        KEY,
        channels=channels,
        layers=layers,
        in_channels=channels,
        out_channels=channels,
        dtype=jnp.float64,
    )
    return lambda x: models.cnn(params, x)


@pytest.mark.parametrize("channels", [1, 3])
def test_color_counts_reach_the_optimum(channels):
    x = jnp.zeros((1, 16, 16, channels))
    one = sparsity(_conv_stack(1, channels))(x)
    assert one.n_diagonal_colors == 4 * channels
    assert one.n_colors == 9 * channels
    three = sparsity(_conv_stack(3, channels))(x)
    assert three.n_diagonal_colors == 16 * channels
    assert three.n_colors == 49 * channels
    for p in (one, three):
        assert coloring.is_valid_diagonal_coloring(p.csr, p.diagonal_colors)
        assert coloring.is_valid_column_coloring(p.csr, p.colors)
        assert coloring.is_valid_row_coloring(p.csr, p.row_colors)


@pytest.mark.slow
def test_seed_cnn_needs_48_diagonal_and_147_column_colors():
    params = models.init_cnn(KEY, channels=16, layers=3, dtype=jnp.float64)
    pattern = sparsity(models.cnn, argnums=1)(params, jnp.zeros((2, 32, 32, 3)))
    assert (pattern.n_diagonal_colors, pattern.n_colors) == (48, 147)
    assert pattern.shape == (3072, 3072) and 0 < pattern.density < 0.05


# --- the convolution-Jacobian seed story ---------------------------------------------------------


@pytest.mark.slow
def test_gaussian_blur_jacobian_has_121_colors_and_the_pixel_gradient_is_the_flipped_kernel():
    kernel = models.gaussian_kernel(11, 2.0, jnp.float64)
    images = _normal(13, (2, 64, 64))
    pattern = sparsity(models.blur, argnums=0)(images, kernel)
    assert pattern.n_colors == 121 and pattern.n_row_colors == 121
    J = sparse_jacobian(models.blur)(images, kernel)
    assert J.shape == (2, 4096, 4096) and J.nse == pattern.nnz
    # One output pixel's gradient is jax.grad of that pixel; its nonzeros are the flipped window.
    r, c = 30, 40
    grad = jax.grad(lambda img: models.blur(img[None], kernel)[0, r, c])(images[0])
    window = grad[r - 5 : r + 6, c - 5 : c + 6]
    np.testing.assert_allclose(window, kernel[::-1, ::-1], rtol=1e-12)
    assert np.count_nonzero(np.asarray(grad)) == 121
    row = np.asarray(J[0].todense()[r * 64 + c]).reshape(64, 64)
    np.testing.assert_allclose(row, grad, rtol=1e-12, atol=1e-15)


def test_small_blur_sparse_jacobian_equals_dense():
    kernel = models.gaussian_kernel(5, 1.0, jnp.float64)
    images = _normal(14, (2, 12, 12))
    dense = jacobian(models.blur, mode="fwd")(images, kernel).reshape(2, 144, 144)
    np.testing.assert_allclose(
        sparse_jacobian(models.blur)(images, kernel).todense(), dense, rtol=1e-12
    )


# --- unknown primitives, caching, the compiled path ------------------------------------------------

shift_p = Primitive("divjac_test_shift")  # linear; its transpose rule uses known primitives
shift_p.def_impl(lambda x: jnp.roll(x, 1, axis=-1) * 2.0)
shift_p.def_abstract_eval(lambda x: x)
ad.deflinear2(shift_p, lambda ct, x: [jnp.roll(ct, -1, axis=-1) * 2.0])
batching.primitive_batchers[shift_p] = lambda args, dims: (shift_p.bind(args[0]), dims[0])
mlir.register_lowering(shift_p, mlir.lower_fun(lambda x: jnp.roll(x, 1, axis=-1) * 2.0, False))

opaque_p = Primitive("divjac_test_opaque")  # self-adjoint; both rules refer to itself
opaque_p.def_impl(lambda x: x + jnp.flip(x, -1))
opaque_p.def_abstract_eval(lambda x: x)
ad.deflinear2(opaque_p, lambda ct, x: [opaque_p.bind(ct)])
batching.primitive_batchers[opaque_p] = lambda args, dims: (
    opaque_p.bind(jnp.moveaxis(args[0], dims[0], 0)),
    0,
)
mlir.register_lowering(opaque_p, mlir.lower_fun(lambda x: x + jnp.flip(x, -1), False))


def test_primitive_without_rule_uses_its_derivative_rules():
    f = lambda x: jnp.tanh(shift_p.bind(x))  # noqa: E731
    x = _normal(15, (3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", divjac.DenseFallbackWarning)
        pattern = assert_sound(f, x)
    np.testing.assert_array_equal(pattern.todense(), np.roll(np.eye(4, dtype=bool), 1, axis=0))
    assert pattern.is_batch_independent and not pattern.dense_fallbacks


def test_unknown_primitive_warns_and_stays_correct():
    x = _normal(16, (6,))
    single = lambda v: jnp.tanh(opaque_p.bind(v))  # noqa: E731
    with pytest.warns(divjac.DenseFallbackWarning, match="divjac_test_opaque"):
        pattern = sparsity(single, batch_axis=None)(x)
    assert pattern.dense_fallbacks == frozenset({"divjac_test_opaque"})
    assert pattern.nnz == 36  # dense: an over-approximation, never a miss
    expected = jnp.trace(jax.jacfwd(single)(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", divjac.DenseFallbackWarning)
        np.testing.assert_allclose(
            divergence(single, batch_axis=None, method="sparse")(x), expected
        )
        # Applied to a whole batch, its batching rule maps it over each sample on its own: the
        # fallback is dense within each sample, not across the batch (no false coupling).
        batch = jnp.stack([x, 2 * x])
        batched = lambda b: jnp.tanh(opaque_p.bind(b))  # noqa: E731
        blocks = jax.jacfwd(batched)(batch)
        np.testing.assert_allclose(
            divergence(batched)(batch), [jnp.trace(blocks[b, :, b, :]) for b in range(2)]
        )
        exact = [jnp.trace(blocks[b, :, b, :]) for b in range(2)]
        np.testing.assert_allclose(divergence(batched, coupling="exact")(batch), exact, rtol=1e-12)


def test_detection_runs_once_per_shape(monkeypatch):
    from divjac.jax import _detect

    calls = []
    original = _detect.Traced._propagate

    def counting(self, *args, **kwargs):
        calls.append(self.x_shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_detect.Traced, "_propagate", counting)
    f = lambda x: jnp.tanh(conv(x, K33[..., :2]))  # noqa: E731
    div = divergence(f, method="sparse")
    x = _normal(18, IMAGE)
    first = div(x)
    np.testing.assert_allclose(div(x + 1.0), divergence(f, method="exact")(x + 1.0), rtol=1e-10)
    np.testing.assert_allclose(div(x), first)
    assert len(calls) == 1
    divergence(f)(x)  # "auto" (detection with a limit) reuses the completed detection
    jacobian(f)(x)
    assert len(calls) == 1
    div(_normal(17, (3, 6, 6, 2)))
    assert len(calls) == 2
    jitted = jax.jit(div)
    jitted(x)
    jitted(x)
    assert len(calls) == 2  # the jitted call reuses the cached detection


@pytest.mark.slow
def test_compiled_sparse_path_has_only_the_colored_passes():
    params = models.init_cnn(KEY, channels=4, layers=3, dtype=jnp.float64)
    x = jnp.zeros((2, 16, 16, 3))
    n = 16 * 16 * 3
    colors = sparsity(models.cnn, argnums=1)(params, x).n_diagonal_colors
    jaxpr = jax.make_jaxpr(divergence(models.cnn, 1, method="sparse"))(params, x)
    leading = {v.aval.shape[0] for e in jaxpr.jaxpr.eqns for v in e.outvars if v.aval.shape}
    assert colors in leading and n not in leading


@pytest.mark.slow
def test_auto_detection_gives_up_on_density_not_on_batch_size(monkeypatch):
    """Past its floor of entries, "auto" abandons detection only for a dense pattern: the
    entries of a sparse one grow with the batch (every sample is seeded), its density does not.
    """
    from divjac import _call
    from divjac._core import detection

    monkeypatch.setattr(_call, "AUTO_DETECTION_ENTRIES", 2000)
    gave_up = []
    check = detection.EntryLimit.check

    def spy(self, dep, where):
        try:
            check(self, dep, where)
        except detection.TooDense:
            gave_up.append(where)
            raise

    monkeypatch.setattr(detection.EntryLimit, "check", spy)
    params = models.init_cnn(KEY, channels=4, layers=2, dtype=jnp.float64)
    x = _normal(20, (16, 8, 8, 3))  # 16 samples: ~60,000 entries, 4% dense per sample
    n = 8 * 8 * 3
    colors = sparsity(models.cnn, argnums=1)(params, x).n_diagonal_colors
    jaxpr = jax.make_jaxpr(divergence(models.cnn, 1))(params, x)
    leading = {v.aval.shape[0] for e in jaxpr.jaxpr.eqns for v in e.outvars if v.aval.shape}
    assert colors in leading and n not in leading and not gave_up

    mlp_params = models.init_mlp(KEY, (24, 32, 24), jnp.float64)
    xm = _normal(21, (128, 24))  # every hidden unit depends on every input: dense
    jaxpr = jax.make_jaxpr(divergence(models.mlp, 1))(mlp_params, xm)
    leading = {v.aval.shape[0] for e in jaxpr.jaxpr.eqns for v in e.outvars if v.aval.shape}
    assert gave_up and 24 in leading
    np.testing.assert_allclose(
        divergence(models.mlp, 1)(mlp_params, xm),
        divergence(models.mlp, 1, method="exact")(mlp_params, xm),
    )


def test_sparsity_pattern_api():
    f = lambda x: jnp.cumsum(x, axis=1)  # noqa: E731
    p = sparsity(f)(jnp.ones((4, 5)))
    assert p.shape == (5, 5) and p.nnz == 15 and p.density == pytest.approx(0.6)
    assert p.is_batch_independent and p.is_square
    np.testing.assert_array_equal(p.todense(), np.tril(np.ones((5, 5), bool)))
    assert "nnz=15" in repr(p)
    q = sparsity(lambda x: x - x.mean(0))(jnp.ones((4, 5)))
    assert not q.is_batch_independent and q.coupling is not None


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_shared_seeds_detect_what_full_seeds_detect(name, monkeypatch):
    """Detection holds the samples' dependency sets once while they act alike (the cost of
    one sample); seeded in full instead, every architecture gives the same pattern and the
    same coupling."""
    f, shape, _ = ARCHITECTURES[name]
    x = _normal(7, shape)
    shared = sparsity(f)(x)
    seed = divjac._core.detection.P.seed

    def full_seed(layout, *, per_sample):
        s = seed(layout, per_sample=per_sample)
        return type(s)(s.shape, s.n_labels, s.csr)

    monkeypatch.setattr(divjac._core.detection.P, "seed", full_seed)
    divjac.jax._detect.CACHE.clear()
    full = sparsity(f)(x)
    assert (shared.csr != full.csr).nnz == 0
    assert shared.coupling == full.coupling
