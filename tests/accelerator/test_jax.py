"""The JAX transforms on each accelerator present (``make test-gpu``): every variant of the
context matrix's table (:mod:`tests.jax.transforms`) (:func:`_cases`: a selection by default,
every variant with ``DIVJAC_ACCELERATOR_TESTS=all``), eager and under ``jit``, against the brute force computed on the same device; and the memory planner
on the device (its free memory read, the host's cache bound off).

float32 products run at ``jax.default_matmul_precision("highest")``: a TPU multiplies float32 in
bfloat16 passes by default. float64 that a device does not implement is skipped with XLA's
reason; a refusal by divjac (a :class:`divjac.DivjacError`) of bfloat16 is skipped with its
message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.accelerator.devices import ALL, jax_platforms, params_of, spied_planner

pytestmark = pytest.mark.accelerator

PLATFORMS = params_of(jax_platforms(), "JAX")
DTYPES = ("float32", "float64", "bfloat16")
TOLERANCES = {  # rtol, atol relative to the largest expected magnitude
    "float32": (2e-4, 2e-5),
    "float64": (1e-9, 1e-11),
    "bfloat16": (6e-2, 6e-2),
}
EMULATED_FLOAT64 = (1e-6, 1e-7)  # float64 on a TPU (emulated in float32 pairs)
WIDE_DTYPES = ("jacobian-auto", "divergence-auto-auto", "laplacian-auto", "sparse_jacobian")
CNN_VARIANTS = ("divergence-sparse-auto", "sparse_jacobian", "laplacian-auto")


def _cases() -> list[tuple[str, str]]:
    """Each transform's first variant in float32; the dense and sparse Jacobian, divergence and
    Laplacian in float64 and bfloat16 too. With ``DIVJAC_ACCELERATOR_TESTS=all``: every variant
    in float32 and float64, each transform's first in bfloat16 (on a TPU each case compiles
    its kernels anew: the full table takes tens of minutes)."""
    if not jax_platforms():  # JAX may not be installed: the table is not imported
        return [("-", "-")]
    from tests.jax.transforms import TABLE

    if ALL:
        return [
            (v.id, dtype)
            for variants in TABLE.values()
            for k, v in enumerate(variants)
            for dtype in (DTYPES if k == 0 else DTYPES[:2])
        ]
    first = [(variants[0].id, "float32") for variants in TABLE.values()]
    return first + [(v, d) for v in WIDE_DTYPES for d in DTYPES[1:]]


@functools.cache
def _device(platform: str) -> Any:
    import jax

    return jax.devices(platform)[0] if platform != "cpu" else jax.devices("cpu")[0]


@functools.cache
def _brute(platform: str, model: str, variant: str, dtype: str) -> Any:
    """The brute force of ``variant`` on ``model`` on the device, under ``jit``, once per
    process; bfloat16's in float32 from the bfloat16 values."""
    import jax
    import jax.numpy as jnp

    from tests.jax.transforms import VARIANTS, Brute

    params, x = _inputs(platform, model, dtype)
    if dtype == "bfloat16":
        params, x = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), (params, x))
    f = _zoo()[model].f
    t = jnp.zeros(x.shape[:1], x.dtype)
    expect = VARIANTS[variant].expect
    return jax.jit(lambda p, x: expect(Brute(lambda p, x, t: f(p, x), p, x, t, ())))(params, x)


def _zoo() -> dict[str, Any]:
    from tests.jax.zoo import ZOO

    return ZOO


def _inputs(platform: str, model: str, dtype: str) -> tuple[Any, Any]:
    import jax

    params, x = _zoo()[model].init(getattr(jax.numpy, dtype))
    return jax.device_put((params, x), _device(platform))


@pytest.fixture
def on_device(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The test's platform as JAX's default device, float32 products at full precision."""
    import jax

    platform = request.node.callspec.params["platform"]
    with jax.default_device(_device(platform)), jax.default_matmul_precision("highest"):
        yield _device(platform)


def _unsupported(err: Exception) -> bool:
    """An XLA error saying the device does not implement an operation or a type."""
    text = str(err)
    return type(err).__name__ in ("XlaRuntimeError", "JaxRuntimeError") and any(
        w in text for w in ("UNIMPLEMENTED", "not supported", "Unsupported", "unsupported")
    )


def _check(platform: str, model: str, variant_id: str, dtype: str, device: Any) -> None:
    import jax
    import jax.numpy as jnp

    import divjac.jax as dj
    from divjac import DivjacError
    from tests.jax.transforms import KEY_SEED, VARIANTS, probes_for

    variant = VARIANTS[variant_id]
    params, x = _inputs(platform, model, dtype)
    f: Callable[..., Any] = _zoo()[model].f
    if variant.scalar:
        inner = f

        def f(p: Any, x: jax.Array) -> jax.Array:
            y = jnp.sin(inner(p, x))
            return jnp.sum(y.reshape(y.shape[0], -1), axis=1)

    if dtype == "bfloat16" and variant.randomness == "key":
        pytest.skip("a key draws other probes in bfloat16 than the float32 brute force's")
    lead: tuple[Any, ...] = ()
    if variant.randomness == "probes":
        lead = (probes_for(x)[: variant.drawn],)
    elif variant.randomness == "key":
        lead = (jax.random.key(KEY_SEED),)
    rtol, atol = TOLERANCES[dtype]
    if dtype == "float64" and platform == "tpu":
        rtol, atol = EMULATED_FLOAT64
    dj.clear_caches()
    try:
        want = _brute(platform, model, variant_id, dtype)
        transformed = variant.build(f, 1, (params, x))
        calls = {"eager": lambda: transformed(*lead, params, x)}
        if variant.traceable:
            calls["jit"] = lambda: jax.jit(lambda *a: transformed(*a))(*lead, params, x)
        for how, call in calls.items():
            got = variant.out(call())
            if variant.compare == "covers":
                assert not bool(jnp.any(want & ~got)), f"{how}: the pattern misses nonzeros"
                continue
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                assert g.dtype == jnp.dtype(dtype), (how, g.dtype)
                assert g.devices() == {device}, (how, g.devices())
                w64 = np.asarray(w, np.float64)
                scale = max(float(np.max(np.abs(w64), initial=0.0)), 1.0)
                g64 = np.asarray(g.astype(jnp.float32) if dtype == "bfloat16" else g, np.float64)
                np.testing.assert_allclose(
                    g64.reshape(w64.shape),  # a sparse Jacobian's todense() is (B, n_out, n_in)
                    w64,
                    rtol=rtol,
                    atol=atol * scale,
                    err_msg=f"{variant_id} on {model}, {dtype}, {how}, on {device}",
                )
    except DivjacError as err:
        if dtype != "bfloat16":
            raise
        pytest.skip(f"divjac refuses bfloat16 here: {type(err).__name__}: {err}")
    except Exception as err:
        if dtype == "float64" and _unsupported(err):
            pytest.skip(f"float64 not implemented on {platform}: {str(err)[:300]}")
        raise


@pytest.mark.parametrize(("variant", "dtype"), _cases())
@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_variant_on_the_device(platform: str, variant: str, dtype: str, on_device: Any):
    _check(platform, "mlp", variant, dtype, on_device)


@pytest.mark.parametrize("variant", CNN_VARIANTS)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_cnn_on_the_device(platform: str, variant: str, on_device: Any) -> None:
    _check(platform, "cnn", variant, "float32", on_device)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_chunks_under_the_device_memory(
    platform: str,
    on_device: Any,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """The planner reads the device's free memory; the exact divergence of a 256-wide MLP
    (256 passes, a few MB) runs in one chunk; a budget of 1 MB (``DIVJAC_MEMORY_BUDGET_MB``)
    splits it into even chunks, with the same values as the brute force. The free memory and
    the chunks are the test's user properties (in a JUnit XML of ``junit_family=xunit1``)."""
    import jax
    import jax.numpy as jnp

    import divjac.jax as dj

    d, B = 256, 8
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32)
    x = jnp.asarray(rng.normal(size=(B, d)), jnp.float32)

    def f(x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ w1) @ w2

    want = jax.vmap(lambda xi: jnp.trace(jax.jacfwd(lambda z: f(z[None])[0])(xi)))(x)
    seen = spied_planner(monkeypatch, on_accelerator=platform != "cpu")
    dj.clear_caches()
    got = dj.divergence(f, method="exact")(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
    free = seen[-1]["available"]
    request.node.user_properties.append(("free_bytes", free))
    request.node.user_properties.append(("chunk_unbounded", seen[-1]["chunk"]))
    if platform != "cpu":
        assert free is not None and free > 64 << 20, f"free memory {free} of {on_device}"
        assert seen[-1]["chunk"] == seen[-1]["n_passes"] == d, seen[-1]
    monkeypatch.setenv("DIVJAC_MEMORY_BUDGET_MB", "1")
    dj.clear_caches()
    got = dj.divergence(f, method="exact")(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
    step = seen[-1]
    request.node.user_properties.append(("chunk_at_1MB", step["chunk"]))
    assert 1 <= step["chunk"] < d and step["chunk"] * step["bytes_per_pass"] <= 1 << 20, step
