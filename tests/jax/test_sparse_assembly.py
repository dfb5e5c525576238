"""Assembly of sparse Jacobians (JAX): constant seeds, the decompression gather, the dense
scatter and the BCOO result, against dense ``jax.jacfwd`` in float64, on the benchmark cases of
asdex and sparsejac, single (``batch_axis=None``) and batched."""

from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from jax import lax
from jax.scipy.signal import convolve2d

from divjac._backend import Entries
from divjac._core.nonzero_codes import BLOCK
from divjac.jax import _backend, jacobian, sparse_jacobian
from tests.core.test_nonzero_codes import box, stencils


def _heat(u):
    left = -2 * u[0:1] + u[1:2]
    interior = u[:-2] - 2 * u[1:-1] + u[2:]
    right = u[-2:-1] - 2 * u[-1:]
    return jnp.concatenate([left, interior, right])


def _convnet_params(rng):
    shapes = [(5, 1, 8), (3, 8, 4), (3, 4, 2)]
    return [(jnp.asarray(rng.normal(size=s)), jnp.asarray(rng.normal(size=s[2]))) for s in shapes]


def _convnet(params, x):
    h = x[None, :, None]
    for w, b in params:
        h = lax.conv_general_dilated(h, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
        h = jnp.tanh(h + b)
    return h.reshape(-1)


def _rosenbrock(x):
    return jnp.sum((1 - x[:-1]) ** 2 + 100 * (x[1:] - x[:-1] ** 2) ** 2)


def _conv2d_squared(x):
    side = int(np.sqrt(x.size))
    image = x.reshape(side, side)
    return jax.scipy.signal.convolve2d(image, jnp.ones((3, 3)), mode="valid").reshape(-1) ** 2


def _rows_win(x):
    """A dense last row: the column coloring needs every column, the row coloring 4 colors."""
    return jnp.concatenate([x[:-1] * x[1:], jnp.sum(jnp.sin(x))[None]])


def _strided(x):
    """Strided slices and a concatenation: on a shared tangent they stay unbroadcast."""
    return jnp.concatenate([2.0 * x[::2], x[1::3] - x[: x.size // 3]])


def _cases(rng):
    params = _convnet_params(rng)
    return {
        "heat": _heat,
        "convnet": lambda x: _convnet(params, x),
        "rosenbrock_hessian": jax.grad(_rosenbrock),
        "square": lambda x: x**2,
        "conv2d_squared": _conv2d_squared,
        "rows_win": _rows_win,
        "strided": _strided,
    }


CASES = ["heat", "convnet", "rosenbrock_hessian", "square", "conv2d_squared", "rows_win", "strided"]


def _size(name, n):
    return n * n if name == "conv2d_squared" else n


@pytest.mark.parametrize("n", [7, 16])
@pytest.mark.parametrize("name", CASES)
def test_single_function_sparse_and_dense_results_equal_jacfwd(name, n, rng):
    f = _cases(rng)[name]
    x = jnp.asarray(rng.normal(size=_size(name, n)))
    expected = np.asarray(jax.jacfwd(f)(x))
    sparse = jax.jit(sparse_jacobian(f, batch_axis=None))(x)
    assert sparse.data.dtype == jnp.float64
    assert sparse.indices_sorted and sparse.unique_indices
    np.testing.assert_allclose(np.asarray(sparse.todense()), expected, rtol=1e-12, atol=1e-12)
    # the flags hold: the indices are the row-major nonzeros, each once
    flat = np.asarray(sparse.indices[:, 0]) * expected.shape[1] + np.asarray(sparse.indices[:, 1])
    assert np.all(np.diff(flat) > 0)
    dense = jax.jit(jacobian(f, batch_axis=None, mode="sparse"))(x)
    np.testing.assert_allclose(np.asarray(dense), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("name", CASES)
def test_batched_and_vmapped_results_equal_a_loop_of_jacfwd(name, batch, rng):
    f = _cases(rng)[name]
    xs = jnp.asarray(rng.normal(size=(batch, _size(name, 9))))
    expected = np.stack([np.asarray(jax.jacfwd(f)(x)) for x in xs])
    batched = jax.jit(sparse_jacobian(jax.vmap(f)))(xs)
    assert batched.indices_sorted and batched.unique_indices
    np.testing.assert_allclose(np.asarray(batched.todense()), expected, rtol=1e-12, atol=1e-12)
    dense = jax.jit(jacobian(jax.vmap(f), mode="sparse"))(xs)
    np.testing.assert_allclose(np.asarray(dense), expected, rtol=1e-12, atol=1e-12)
    vmapped = jax.jit(jax.vmap(sparse_jacobian(f, batch_axis=None)))(xs)
    np.testing.assert_allclose(np.asarray(vmapped.todense()), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [1, 2])
@pytest.mark.parametrize("seed_matrix_elements", [0, _backend.SEED_MATRIX_ELEMENTS])
def test_chunked_passes_and_indexed_seeds_give_the_same_jacobian(
    chunk_size, seed_matrix_elements, rng, monkeypatch
):
    # constant seed rows (the default for small plans) and seeds from the pass index, each with
    # the passes split into chunks (lax.map over the rows), dense and sparse results
    monkeypatch.setattr(_backend, "SEED_MATRIX_ELEMENTS", seed_matrix_elements)
    f = _cases(rng)["convnet"]
    xs = jnp.asarray(rng.normal(size=(3, 12)))
    expected = np.stack([np.asarray(jax.jacfwd(f)(x)) for x in xs])
    for mode in ("sparse", "fwd", "rev"):
        got = jacobian(jax.vmap(f), mode=mode, chunk_size=chunk_size)(xs)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-12, atol=1e-12)
    got = sparse_jacobian(jax.vmap(f), chunk_size=chunk_size)(xs)
    np.testing.assert_allclose(np.asarray(got.todense()), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_gradients_flow_through_the_gather_and_the_scatter(rng):
    # d/dp of sum(w * J) through the decompression gather (sparse) and the scatter (dense)
    params = _convnet_params(rng)
    xs = jnp.asarray(rng.normal(size=(2, 10)))
    weights = jnp.asarray(rng.normal(size=(2, 20, 10)))

    def loss(params, sparse):
        f = jax.vmap(lambda x: _convnet(params, x))
        if sparse:
            return jnp.sum(weights * sparse_jacobian(f)(xs).todense())
        return jnp.sum(weights * jacobian(f, mode="sparse")(xs))

    def reference(params):
        jac = jnp.stack([jax.jacfwd(lambda x: _convnet(params, x))(x) for x in xs])
        return jnp.sum(weights * jac)

    expected = jax.grad(reference)(params)
    for sparse in (True, False):
        got = jax.grad(loss)(params, sparse)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-10, atol=1e-12)


def test_the_compiled_jacobian_of_a_linear_function_is_a_constant(rng):
    # constant seeds let XLA fold all passes of a linear function: the compiled program reads
    # nothing of its input (as asdex's does)
    x = jnp.asarray(rng.normal(size=30))
    compiled = jax.jit(sparse_jacobian(_heat, batch_axis=None)).lower(x).compile()
    text = compiled.as_text()
    entry = text[text.index("ENTRY") :]
    assert "parameter(" not in entry


def test_a_batched_blur_convolves_one_samples_seeds_not_a_copy_per_sample(rng):
    # The seeds, the same in every sample, reach convolve2d's convolution through reshapes to
    # and from a batch of one image: the convolution runs on one sample's seeds (25 colours of
    # a 5x5 kernel), its result broadcast over the batch, not on a copy per sample (4 x 25).
    kernel = jnp.asarray(rng.uniform(size=(5, 5)))
    blurs = jax.vmap(lambda img, k: convolve2d(img, k, mode="same"), in_axes=(0, None))
    x = jnp.asarray(rng.normal(size=(4, 16, 16)))
    fn = sparse_jacobian(blurs)
    text = jax.jit(fn).lower(x, kernel).as_text()
    batches = [int(n) for n in re.findall(r"stablehlo\.convolution\(.*: \(tensor<(\d+)x", text)]
    assert batches and max(batches) == 25
    dense = jax.vmap(jax.jacfwd(lambda img: blurs(img[None], kernel)[0].reshape(-1)))(x)
    got = fn(x, kernel).todense()
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense.reshape(4, 256, 256)), atol=1e-12)


@given(stencils())
def test_a_stencils_nonzeros_are_made_from_its_grid_alone(case):
    # a box stencil's rows and columns, made in the program from the rows' pointers and the
    # stencil (no constant the size of the nonzeros), are its CSR's, in CSR order
    shape, lo, hi = case
    pattern = box(shape, lo, hi)
    assume(pattern.nnz > 0)
    indptr, cols = pattern.indptr.astype(np.int32), pattern.indices.astype(np.int32)
    entries = Entries(indptr, cols, None, reverse=False, grid=shape)
    with (  # any number of nonzeros, and of rows a block
        mock.patch.object(_backend, "STENCIL_MIN_NONZEROS", 0),
        mock.patch.object(_backend, "MAX_STENCIL_SPAN", BLOCK),
    ):
        assert isinstance(_backend._encoded(entries), _backend._OnStencil)
    rows, got = jax.jit(lambda: _backend._nonzeros(entries))()
    np.testing.assert_array_equal(np.asarray(rows), np.repeat(np.arange(len(indptr) - 1),
                                                              np.diff(indptr)))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got), cols)


def _conv_hwc(w, x):
    """A 'SAME' 3x3 convolution of one ``(H, W, C)`` image mixing its channels, then tanh."""
    dims = ("NHWC", "HWIO", "NHWC")
    return jnp.tanh(lax.conv_general_dilated(x[None], w, (1, 1), "SAME", dimension_numbers=dims)[0])


def test_a_convolutions_jacobian_is_made_as_a_stencil_without_per_nonzero_constants(
    rng, monkeypatch
):
    # a blur and a channel-mixing convolution: their patterns are stencils on the image's grid
    # (H, W) / (H, W, C), so the compiled program holds no constant the size of the nonzeros
    # (seeds made from the pass index; per-pixel tables at most: colours, rows' pointers); the
    # Jacobians equal jacfwd's, single and batched
    monkeypatch.setattr(_backend, "SEED_MATRIX_ELEMENTS", 0)
    monkeypatch.setattr(_backend, "STENCIL_MIN_NONZEROS", 0)
    kernel = jnp.asarray(rng.uniform(size=(5, 5)))
    w = jnp.asarray(rng.normal(size=(3, 3, 2, 2)))
    cases = [
        (lambda img, k: convolve2d(img, k, mode="same"), (12, 16), kernel),
        (lambda img, w: _conv_hwc(w, img), (7, 6, 2), w),
    ]
    for single, shape, extra in cases:
        x = jnp.asarray(rng.normal(size=shape))
        fn = jax.jit(sparse_jacobian(single, batch_axis=None))
        text = fn.lower(x, extra).as_text()
        sizes = [
            int(np.prod([int(d) for d in dims.split("x")[:-1]]))
            for dims in re.findall(r"stablehlo\.constant dense<.*?> : tensor<([^>]*)>", text)
        ]
        got = fn(x, extra)
        assert max(sizes, default=0) <= x.size + 1 < got.nse  # the rows' pointers
        expected = jax.jacfwd(single)(x, extra).reshape(x.size, x.size)
        np.testing.assert_allclose(np.asarray(got.todense()).reshape(x.size, -1), expected,
                                   atol=1e-12)  # fmt: skip
        xs = jnp.stack([x, 2 * x + 1])
        batched = jax.jit(sparse_jacobian(jax.vmap(single, in_axes=(0, None))))(xs, extra)
        loop = np.stack([np.asarray(jax.jacfwd(single)(z, extra)).reshape(x.size, -1) for z in xs])
        np.testing.assert_allclose(np.asarray(batched.todense()).reshape(loop.shape), loop,
                                   atol=1e-12)  # fmt: skip
