"""divjac.jax in training loops: no stale cached detection, the caller's keywords reach ``f``.

After every change of what ``f`` captures (weights trained from zero, Flax nnx modules updated in
place, optax steps, flags that change the program), the result equals a fresh brute-force
reference; the cache holds no captured weights and detects again only when the program changed.
"""

from __future__ import annotations

import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import divjac
from divjac import _core
from divjac.jax import (
    _detect,
    clear_caches,
    divergence,
    grad_divergence,
    jacobian,
    laplacian,
    sparsity,
    value_and_divergence,
)
from divjac.models import jax as models
from tests.reference import jax_diagonal_blocks, traces


@pytest.fixture
def detections(monkeypatch):
    """Counts the detections that run (each one a propagation through the program)."""
    calls = []
    original = _core.detection.detect

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_core.detection, "detect", counting)
    clear_caches()
    return calls


def _check_all(f, x, n):
    """Jacobian (auto, sparse) and divergence (auto, sparse, exact) against a loop over samples."""
    blocks = jax_diagonal_blocks(f, (x,))
    expected = traces(blocks, (n,))
    for mode in ("auto", "sparse"):
        np.testing.assert_allclose(jacobian(f, mode=mode)(x), blocks, rtol=1e-10, atol=1e-12)
    for method in ("auto", "sparse", "exact"):
        np.testing.assert_allclose(divergence(f, method=method)(x), expected, rtol=1e-10)


def test_weights_zero_then_trained_closure():
    """A zero-initialized layer (as in most score U-Nets), trained after the first call."""
    state = {"W": jnp.zeros((4, 4))}
    f = lambda x: jnp.tanh(x @ state["W"])  # noqa: E731
    x = jax.random.normal(jax.random.key(0), (3, 4))
    _check_all(f, x, 4)
    np.testing.assert_array_equal(divergence(f)(x), 0.0)
    state["W"] = jax.random.normal(jax.random.key(1), (4, 4))
    _check_all(f, x, 4)
    assert np.all(np.abs(divergence(f)(x)) > 0)


class _Centered(nnx.Module):
    """An nnx model with a zero-initialized last layer and a flag that mixes the batch."""

    def __init__(self, rngs: nnx.Rngs):
        f64 = jnp.float64
        self.first = nnx.Linear(4, 8, param_dtype=f64, rngs=rngs)
        self.last = nnx.Linear(8, 4, kernel_init=nnx.initializers.zeros, param_dtype=f64, rngs=rngs)
        self.center = False

    def __call__(self, x):
        h = self.first(x)
        if self.center:
            h = h - h.mean(0)  # a batch mean: samples are mixed
        return self.last(jnp.tanh(h))


@pytest.mark.slow
def test_nnx_in_place_update_and_flag_flip():
    model = _Centered(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (3, 4))
    _check_all(model, x, 4)
    model.last.kernel[...] = jax.random.normal(jax.random.key(3), (8, 4))  # in place
    _check_all(model, x, 4)
    model.center = True
    with pytest.raises(divjac.BatchCouplingError):
        divergence(model)(x)
    np.testing.assert_allclose(
        divergence(model, coupling="exact")(x),
        traces(jax_diagonal_blocks(model, (x,)), (4,)),
        rtol=1e-10,
    )
    model.center = False
    _check_all(model, x, 4)


@pytest.mark.slow
def test_optax_training_loop_detects_once(detections):
    """Steps of an optimizer change the weights, never the program: one detection in all."""
    params = models.init_mlp(jax.random.key(4), (3, 16, 3))
    params = [(jnp.zeros_like(w), b) for w, b in params]  # zero weights: an empty pattern
    x = jax.random.normal(jax.random.key(5), (8, 3))
    div = divergence(models.mlp, 1, method="sparse")
    opt = optax.sgd(0.1)
    opt_state = opt.init(params)

    def loss(p):
        return jnp.mean(div(p, x) ** 2 + jnp.sum(models.mlp(p, x) ** 2, axis=1))

    for step in range(4):
        expected = traces(jax_diagonal_blocks(models.mlp, (params, x), 1), (3,))
        np.testing.assert_allclose(div(params, x), expected, rtol=1e-10, atol=1e-14)
        grads = jax.grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state)
        params = optax.apply_updates(params, updates)
        if step == 0:
            params = [(w + 0.1, b) for w, b in params]  # leave the zero start
    assert len(detections) == 1


def test_fresh_closures_share_one_detection_and_pin_no_weights(detections):
    """An eager loop that closes over updated params at every step (83 ms -> 27 ms a step)."""
    params = models.init_mlp(jax.random.key(6), (3, 8, 3))
    x = jax.random.normal(jax.random.key(7), (4, 3))
    refs = []
    for step in range(6):
        params = jax.tree_util.tree_map(lambda a, s=step: a * (1.0 + 0.1 * s), params)
        refs.append(weakref.ref(params[0][0]))
        got = divergence(lambda x, p=params: models.mlp(p, x), method="sparse")(x)
        expected = traces(jax_diagonal_blocks(models.mlp, (params, x), 1), (3,))
        np.testing.assert_allclose(got, expected, rtol=1e-10)
    assert len(detections) == 1
    assert len(_detect.CACHE._items) == 1
    del params, got
    gc.collect()
    assert sum(r() is not None for r in refs) == 0  # the cache keeps no captured weights


def test_captured_index_array_changed_in_place_is_detected_again():
    """Integer arrays are read by detection (tight patterns), so the key holds their values."""
    perm = np.array([1, 0, 3, 2])
    f = lambda x: jnp.sin(x[:, perm])  # noqa: E731
    x = jax.random.normal(jax.random.key(8), (3, 4))
    _check_all(f, x, 4)
    assert sparsity(f)(x).nnz == 4
    perm[:] = [0, 1, 2, 3]  # the user's NumPy array, changed in place
    _check_all(f, x, 4)
    np.testing.assert_allclose(divergence(f)(x), jnp.sum(jnp.cos(x), axis=1), rtol=1e-12)


def test_detection_under_jit_first_then_eager_with_new_weights():
    state = {"W": jnp.zeros((4, 4))}
    x = jax.random.normal(jax.random.key(9), (3, 4))

    @jax.jit
    def step(W, x):
        return divergence(lambda x: jnp.tanh(x @ W), method="sparse")(x)

    np.testing.assert_array_equal(step(state["W"], x), 0.0)
    W = jax.random.normal(jax.random.key(10), (4, 4))
    expected = traces(jax_diagonal_blocks(lambda x: jnp.tanh(x @ W), (x,)), (4,))
    np.testing.assert_allclose(step(W, x), expected, rtol=1e-10)
    np.testing.assert_allclose(
        divergence(lambda x: jnp.tanh(x @ W), method="sparse")(x), expected, rtol=1e-10
    )


def test_clear_caches():
    x = jnp.ones((2, 3))
    divergence(jnp.sin)(x)
    assert len(_detect.CACHE._items) > 0
    divjac.clear_caches()
    assert len(_detect.CACHE._items) == 0


# --- the caller's keywords reach f ---------------------------------------------------------


class _NoisyMLP(eqx.Module):
    """An Equinox model taking ``key=`` by convention: additive noise from the caller's key."""

    layer: eqx.nn.Linear

    def __init__(self, key):
        self.layer = eqx.nn.Linear(3, 3, key=key)

    def __call__(self, x, *, key):
        noise = jax.random.normal(key, x.shape)
        return jnp.tanh(jax.vmap(self.layer)(x) + noise)


@pytest.mark.parametrize("method", ["auto", "exact", "sparse", "hutchinson", "hutch++"])
def test_f_keyword_key_reaches_f(method):
    model = _NoisyMLP(jax.random.key(11))
    x = jax.random.normal(jax.random.key(12), (4, 3))
    f_key = jax.random.key(13)
    expected = traces(jax_diagonal_blocks(lambda x: model(x, key=f_key), (x,)), (3,))
    value = model(x, key=f_key)
    if method in ("hutchinson", "hutch++"):
        num = 3
        probes = jnp.stack([jnp.eye(3)[i] * jnp.ones((4, 1)) for i in range(3)])
        divs = divergence(model, method=method, num_probes=num)
        if method == "hutchinson":  # a budget of n probes is the exact trace
            np.testing.assert_allclose(divs(probes, x, key=f_key), expected, rtol=1e-10)
        # a divjac key first, f's own key as f's keyword: both used, neither taken
        got = divs(jax.random.key(0), x, key=f_key)
        other = divs(jax.random.key(0), x, key=jax.random.key(14))
        assert not np.allclose(got, other)
        y, _ = value_and_divergence(model, method=method, num_probes=num)(
            jax.random.key(0), x, key=f_key
        )
        np.testing.assert_allclose(y, value, rtol=1e-12)
        return
    np.testing.assert_allclose(divergence(model, method=method)(x, key=f_key), expected, rtol=1e-10)
    y, div = value_and_divergence(model, method=method)(x, key=f_key)
    np.testing.assert_allclose(y, value, rtol=1e-12)
    np.testing.assert_allclose(div, expected, rtol=1e-10)


def test_keywords_named_like_divjac_options_reach_f():
    """``probes=`` and ``generator=`` are f's too (they used to be taken by divjac)."""

    def f(x, *, probes, generator):
        return jnp.sin(x) * probes + generator

    x = jax.random.normal(jax.random.key(15), (3, 2))
    got = divergence(f)(x, probes=2.0, generator=1.0)
    np.testing.assert_allclose(got, jnp.sum(2.0 * jnp.cos(x), axis=1), rtol=1e-12)
    lap = laplacian(lambda x, *, key: jnp.sum(x**2, axis=1) * key)(x, key=3.0)
    np.testing.assert_allclose(lap, 12.0, rtol=1e-12)
    grad = grad_divergence(lambda x, *, key: key * x**3)(x, key=2.0)
    np.testing.assert_allclose(grad, 12.0 * x, rtol=1e-12)


def test_stochastic_randomness_comes_first_everywhere():
    f = lambda x: x**3  # noqa: E731
    x = jax.random.normal(jax.random.key(16), (3, 2))
    probes = jnp.ones((1, 3, 2))
    np.testing.assert_allclose(
        grad_divergence(f, method="hutchinson", num_probes=1)(probes, x), 6.0 * x, rtol=1e-12
    )
    lap = laplacian(lambda x: jnp.sum(x**3, axis=1), method="hutchinson", num_probes=1)
    np.testing.assert_allclose(lap(probes, x), jnp.sum(6.0 * x, axis=1), rtol=1e-12)
    with pytest.raises(divjac.MissingKeyError, match="first argument"):
        lap(x)


# --- messages that name the problem and the fix --------------------------------------------


def test_messages_name_the_fix():
    x = jnp.ones((4, 3))
    center = lambda x: x - x.mean(0)  # noqa: E731
    with pytest.raises(divjac.BatchCouplingError, match="use method='hutchinson' or 'probing'"):
        divergence(center, method="hutch++", num_probes=3, coupling="exact")(jax.random.key(0), x)
    with pytest.raises(divjac.BatchCouplingError, match="pass batch_axis=None"):
        divergence(center)(x)
    with pytest.raises(divjac.ArgnumsError, match=r"sparsity\(f\)\(x\)"):
        sparsity(jnp.sin, x)
    with pytest.raises(divjac.ArgnumsError, match="without positional arguments"):
        sparsity(jnp.sin)()
    with pytest.raises(divjac.BatchAxisError, match="the batch is empty"):
        divergence(jnp.sin)(jnp.ones((0, 3)))
    with pytest.raises(divjac.MissingKeyError, match="got int"):
        divergence(jnp.sin, method="hutchinson")(0, x)


@pytest.mark.slow
def test_memory_guard_on_detection_and_passes(monkeypatch):
    """A clear error (or, in "auto", the dense fallback with a warning) before the machine runs
    out of memory."""
    params = models.init_cnn(jax.random.key(17), channels=4, layers=2, dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(18), (2, 8, 8, 3))
    exact = divergence(models.cnn, 1, method="exact")(params, x)
    clear_caches()
    monkeypatch.setenv("DIVJAC_DETECTION_MEMORY_MB", "0.05")
    with pytest.raises(divjac.DetectionMemoryError, match="DIVJAC_DETECTION_MEMORY_MB"):
        sparsity(models.cnn, argnums=1)(params, x)
    with pytest.raises(MemoryError):  # a DetectionMemoryError is a MemoryError
        divergence(models.cnn, 1, method="sparse")(params, x)
    with pytest.warns(divjac.DenseFallbackWarning, match="192 passes per sample"):
        auto = divergence(models.cnn, 1)(params, x)  # the dense fallback, said
    np.testing.assert_allclose(auto, exact, rtol=1e-10)
    monkeypatch.delenv("DIVJAC_DETECTION_MEMORY_MB")
    monkeypatch.setenv("DIVJAC_MEMORY_LIMIT_MB", "1")
    with pytest.raises(divjac.DetectionMemoryError, match=r"pass chunk_size=\d+ or less"):
        divergence(models.cnn, 1, method="exact", chunk_size=192)(params, x)
    np.testing.assert_allclose(
        divergence(models.cnn, 1, method="exact", chunk_size=4)(params, x), exact, rtol=1e-10
    )


class _TrainMode(nnx.Module):
    """BatchNorm and Dropout: state that nnx mutates in training mode."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)  # float32, as nnx makes its statistics
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.drop(self.norm(self.linear(x))))


@pytest.mark.slow
def test_nnx_training_mode_batch_norm_and_dropout():
    """BatchNorm in training mode is refused as coupled (not an nnx trace error); Dropout gives
    the Jacobian of one forward draw whatever the chunking; the caller's module is unchanged."""
    model = _TrainMode(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(19), (3, 4), jnp.float32)

    def snapshot():
        leaves = jax.tree_util.tree_leaves(nnx.state(model))
        keys = [jnp.issubdtype(v.dtype, jax.dtypes.prng_key) for v in leaves]
        return [
            np.asarray(jax.random.key_data(v) if k else v)
            for v, k in zip(leaves, keys, strict=True)
        ]

    before = snapshot()
    with pytest.raises(divjac.BatchCouplingError):
        divergence(model)(x)
    model.norm.use_running_average = True  # Dropout alone: per sample
    graphdef, state = nnx.split(model)
    one_draw = lambda x: nnx.merge(graphdef, state, copy=True)(x)  # noqa: E731
    blocks = jax_diagonal_blocks(one_draw, (x,))
    assert np.any(blocks == 0) and np.any(blocks != 0)  # some units dropped, some kept
    for chunk in (1, 3, None):
        np.testing.assert_allclose(
            jacobian(model, mode="fwd", chunk_size=chunk)(x), blocks, rtol=1e-6
        )
        np.testing.assert_allclose(
            divergence(model, method="exact", chunk_size=chunk)(x),
            traces(blocks, (4,)),
            rtol=1e-6,
        )
    for a, b in zip(before, snapshot(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_closure_over_an_nnx_module_in_training_mode_names_the_fix():
    """nnx refuses a module's state update inside a JAX transform (its own TraceContextError);
    where ``f`` is a closure calling the module, divjac names the two ways out."""
    model = _TrainMode(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(19), (3, 4), jnp.float32)
    for transform in (divergence(lambda z: model(z)), laplacian(lambda z: model(z).sum(-1))):
        with pytest.raises(divjac.StateUpdateError, match=r"Pass the module itself.*eval mode"):
            transform(x)
    model.eval()  # no update: the closure is fine
    blocks = jax_diagonal_blocks(lambda z: model(z), (x,))
    np.testing.assert_allclose(
        divergence(lambda z: model(z))(x), traces(blocks, (4,)), rtol=1e-5, atol=1e-6
    )


# --- real layers: no fallback warning, no false coupling -----------------------------------


_LAYERS = (
    "stack", "solve", "batched_solve", "inv", "cholesky", "layer_norm", "group_norm",
    "attention", "lstm", "gru", "scan", "resize",
)  # fmt: skip


def _layer(name):
    import flax.linen as nn

    key = jax.random.key(21)
    seq = jax.random.normal(key, (3, 5, 4))  # (B, length, features)
    img = jax.random.normal(key, (2, 4, 4, 4))  # (B, H, W, C)

    def linen(module, x):
        params = module.init(jax.random.key(22), x)
        return (lambda x: module.apply(params, x)), x

    spd = jnp.eye(4) * 3.0 + 0.1

    cases = {
        "stack": ((lambda x: jnp.stack([jnp.sin(x), x**2], axis=1).reshape(x.shape[0], -1)[:, :4]), seq[:, 0]),
        "solve": ((lambda x: jnp.linalg.solve(spd, jnp.sin(x).T).T), seq[:, 0]),  # shared matrix
        "batched_solve": ((lambda x: jnp.linalg.solve(spd[None] + jax.vmap(jnp.diag)(x**2), x[..., None])[..., 0]), seq[:, 0]),
        "inv": ((lambda x: jnp.einsum("bij,bj->bi", jnp.linalg.inv(spd[None] + jax.vmap(jnp.diag)(x**2)), x)), seq[:, 0]),
        "cholesky": ((lambda x: jnp.linalg.cholesky(spd[None] + jax.vmap(jnp.diag)(x**2))[:, :, 0]), seq[:, 0]),
        "layer_norm": linen(nn.LayerNorm(param_dtype=jnp.float64), seq),
        "group_norm": linen(nn.GroupNorm(num_groups=2, param_dtype=jnp.float64), img),
        "attention": linen(nn.MultiHeadDotProductAttention(2, param_dtype=jnp.float64), seq),
        "lstm": linen(nn.RNN(nn.OptimizedLSTMCell(4, param_dtype=jnp.float64)), seq),
        "gru": linen(nn.RNN(nn.GRUCell(4, param_dtype=jnp.float64)), seq),
        "scan": ((lambda x: jax.lax.scan(lambda c, xi: (jnp.tanh(c + xi), c), x[:, 0], jnp.swapaxes(x, 0, 1))[1].swapaxes(0, 1)), seq),
        "resize": ((lambda x: jax.image.resize(x, (x.shape[0], 8, 8, 4), "linear")[:, ::2, ::2]), img),
    }  # fmt: skip
    return cases[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", _LAYERS)
def test_real_layers_are_per_sample_without_fallbacks(name):
    f, x = _layer(name)
    blocks = jax_diagonal_blocks(f, (x,))
    pattern = sparsity(f)(x)  # warnings are errors: no DenseFallbackWarning
    assert pattern.is_batch_independent
    n = int(np.prod(x.shape[1:]))
    dense = np.abs(blocks.reshape(len(x), -1, n)).max(0) > 0
    assert not np.any(dense & ~pattern.csr.toarray())  # the pattern covers every nonzero
    np.testing.assert_allclose(jacobian(f)(x), blocks, rtol=1e-8, atol=1e-10)
    if blocks.shape[1 : 1 + x.ndim - 1] == x.shape[1:]:
        np.testing.assert_allclose(divergence(f)(x), traces(blocks, x.shape[1:]), rtol=1e-8)


@pytest.mark.slow
def test_laplacian_through_upsampling_and_attention():
    """The Laplacian's second-order program (transposed resizes, attention) stays per sample."""
    import flax.linen as nn

    img = jax.random.normal(jax.random.key(23), (2, 4, 4, 2))
    seq = jax.random.normal(jax.random.key(24), (2, 3, 4))
    attention = nn.MultiHeadDotProductAttention(num_heads=2, param_dtype=jnp.float64)
    params = attention.init(jax.random.key(25), seq)

    def upsampled(x):
        up = jax.image.resize(x, (x.shape[0], 8, 8, 2), "linear")
        return jnp.sum(jnp.tanh(up) ** 2, axis=(1, 2, 3))

    def attended(x):
        return jnp.sum(jnp.tanh(attention.apply(params, x)), axis=(1, 2))

    for fn, x in ((upsampled, img), (attended, seq)):
        n = int(np.prod(x.shape[1:]))
        expected = []
        for b in range(len(x)):
            hess = jax.hessian(lambda s, b=b, fn=fn, x=x: fn(x.at[b].set(s))[b])(x[b])
            expected.append(np.trace(np.asarray(hess).reshape(n, n)))
        np.testing.assert_allclose(laplacian(fn)(x), expected, rtol=1e-8)
