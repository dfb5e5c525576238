"""Every example in ``examples/`` runs at small size and computes what it claims (float64)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HAS_TORCH = importlib.util.find_spec("torch") is not None


def load(name: str) -> ModuleType:
    """The example ``examples/<name>.py`` as a module (registered: Flax modules need it)."""
    module_name = f"divjac_example_{name}"
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def torch_float64():
    torch = pytest.importorskip("torch")
    try:
        import divjac.torch  # noqa: F401
    except Exception as err:  # the backend is optional
        pytest.skip(f"divjac.torch is not importable: {err}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield torch
    torch.set_default_dtype(previous)


def test_every_example_has_a_test():
    tested = {
        "conv_jacobian",
        "cnf_diffrax",
        "cnf_torchdiffeq",
        "ddp_divergence",
        "flow_log_det",
        "jax_sharded",
        "pinn_flax",
        "rnode_jax",
        "rnode_torch",
        "score_matching",
    }
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested
    for path in EXAMPLES.glob("*.py"):
        source = path.read_text()
        assert "def main(small: bool = False)" in source and '__name__ == "__main__"' in source


@pytest.mark.slow
def test_conv_jacobian_pixel_gradient_is_the_flipped_kernel():
    out = load("conv_jacobian").main(small=True)
    kernel = np.asarray(out["kernel"])
    gradient = np.asarray(out["gradient"])
    i, j = out["pixel"]
    assert out["pattern"].n_colors == 121  # 11 x 11 kernel: one color per kernel offset
    assert out["jacobian"].shape == (2, 32 * 32, 32 * 32)
    np.testing.assert_allclose(np.asarray(out["window"]), np.flip(kernel), rtol=1e-12, atol=0)
    outside = gradient.copy()
    outside[i - 5 : i + 6, j - 5 : j + 6] = 0
    assert not outside.any()  # the nonzeros are exactly the window
    np.testing.assert_allclose(np.asarray(out["row"]), gradient, rtol=1e-12, atol=1e-15)


@pytest.mark.slow
def test_cnf_diffrax_exact_matches_a_dense_trace_and_hutchinson_is_reproducible():
    import diffrax
    import jax
    import jax.numpy as jnp

    example = load("cnf_diffrax")
    out = example.main(small=True)
    params, x, steps = out["params"], out["x"], out["steps"]
    assert x.dtype == jnp.float64

    def brute(z: jax.Array, t: jax.Array) -> jax.Array:  # dense per-sample Jacobian trace
        def one(zb: jax.Array) -> jax.Array:
            return example.velocity(params, zb[None], t)[0]

        return jnp.trace(jax.vmap(jax.jacfwd(one))(z), axis1=1, axis2=2)

    def dynamics(t, state, args):
        z, _ = state
        return example.velocity(params, z, t), -brute(z, t)

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(dynamics), diffrax.Tsit5(), 0.0, 1.0, 1.0 / steps,
        (x, jnp.zeros(x.shape[0])), stepsize_controller=diffrax.ConstantStepSize(),
    )  # fmt: skip
    z1, minus = sol.ys[0][-1], sol.ys[1][-1]
    reference = -0.5 * jnp.sum(z1**2, 1) - 0.5 * x.shape[1] * math.log(2 * math.pi) - minus
    np.testing.assert_allclose(out["exact"], reference, rtol=1e-10, atol=1e-10)

    np.testing.assert_array_equal(out["hutchinson"], out["hutchinson_again"])
    assert not np.allclose(out["hutchinson"], out["exact"])  # it is an estimate
    # unbiased: the mean over independent keys is within a few standard errors of the exact value
    gap = np.abs(np.asarray(out["hutchinson_mean"] - out["exact"]))
    assert np.all(gap <= 5 * np.asarray(out["hutchinson_stderr"]) + 1e-9)
    leaves = jax.tree_util.tree_leaves(out["grads"])
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_cnf_torchdiffeq_exact_matches_a_dense_trace_and_hutchinson_is_reproducible(
    torch_float64,
):
    torch = torch_float64
    from torch.func import jacfwd, vmap
    from torchdiffeq import odeint

    example = load("cnf_torchdiffeq")
    out = example.main(small=True)
    params, x, steps = out["params"], out["x"], out["steps"]
    params = [(w.detach(), b.detach()) for w, b in params]
    assert x.dtype == torch.float64

    def dynamics(t, state):
        z, _ = state

        def one(zb):
            return example.velocity(params, zb[None], t)[0]

        trace = torch.diagonal(vmap(jacfwd(one))(z), dim1=1, dim2=2).sum(1)
        return example.velocity(params, z, t), -trace

    with torch.no_grad():
        zs, minus = odeint(
            dynamics, (x, torch.zeros(x.shape[0])), torch.tensor([0.0, 1.0]),
            method="rk4", options={"step_size": 1 / steps},
        )  # fmt: skip
    reference = -0.5 * (zs[-1] ** 2).sum(1) - 0.5 * x.shape[1] * math.log(2 * math.pi) - minus[-1]
    torch.testing.assert_close(out["exact"], reference, rtol=1e-10, atol=1e-10)

    assert torch.equal(out["hutchinson"], out["hutchinson_again"])
    assert not torch.allclose(out["hutchinson"], out["exact"])
    gap = (out["hutchinson_mean"] - out["exact"]).abs()
    assert bool(torch.all(gap <= 5 * out["hutchinson_stderr"] + 1e-9))
    grads = out["grads"]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads[:-1])
    assert max(float(g.abs().max()) for g in grads if g is not None) > 0


@pytest.mark.slow
def test_pinn_derivatives_match_jacfwd_and_training_lowers_the_loss():
    import jax
    import jax.numpy as jnp

    out = load("pinn_flax").main(small=True)
    net, params, x, t = out["net"], out["params"], out["x"], out["t"]
    assert x.dtype == jnp.float64

    def u(xb: jax.Array, tb: jax.Array) -> jax.Array:  # one sample: x (d,), t (1,) -> scalar
        return net.apply(params, xb[None], tb[None])[0, 0]

    u_t = jax.vmap(jax.grad(u, argnums=1))(x, t)[:, 0]
    u_x = jax.vmap(jax.jacfwd(u, argnums=0))(x, t)
    lap = jax.vmap(lambda xb, tb: jnp.trace(jax.hessian(u, argnums=0)(xb, tb)))(x, t)
    np.testing.assert_allclose(out["u_t"], u_t, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["u_x"], u_x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["laplacian"], lap, rtol=1e-10, atol=1e-12)
    losses = out["losses"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.slow
def test_sliced_score_matching_loss_and_gradient():
    import jax
    import jax.numpy as jnp

    example = load("score_matching")
    out = example.main(small=True)
    params, data, key = out["params"], out["data"], out["key"]
    leaves = jax.tree_util.tree_leaves(out["grads"])
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert any(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)

    # the exact loss is tr(ds/dx) + |s|^2 / 2 with a dense per-sample trace
    def one(xb: jax.Array) -> jax.Array:
        return example.score(params, xb[None])[0]

    trace = jnp.trace(jax.vmap(jax.jacfwd(one))(data), axis1=1, axis2=2)
    reference = jnp.mean(trace + 0.5 * jnp.sum(example.score(params, data) ** 2, axis=1))
    np.testing.assert_allclose(out["exact_loss"], reference, rtol=1e-10)
    # the sliced loss is an unbiased estimate of it; with 64 probes on 512 samples it is close
    assert abs(float(out["sliced_loss_many"] - reference)) < 0.05 * abs(float(reference)) + 0.05
    # the same key gives the same probes, hence the same loss
    batch = data[: out["batch"]]
    first = example.sliced_loss(params, batch, key)
    np.testing.assert_array_equal(first, example.sliced_loss(params, batch, key))
    assert float(first) == pytest.approx(float(out["loss"]), rel=1e-12)
    assert all(math.isfinite(v) for v in out["losses"])


@pytest.mark.slow
def test_ddp_divergence_two_gloo_processes_train_as_one_process(torch_float64):
    out = load("ddp_divergence").main(small=True)
    assert out["rank_gap"] == 0.0  # the ranks hold the same parameters
    assert out["one_process_gap"] <= 1e-12  # those of one process on the whole batches
    assert out["losses"][-1] < out["losses"][0]


@pytest.mark.slow
def test_jax_sharded_divergences_equal_one_device_without_collectives():
    jax = pytest.importorskip("jax")
    # With the devices of this process (tests/jax/test_sharding.py forces 8 host devices).
    out = load("jax_sharded").main(small=True)
    assert out["collectives"] == {"sparse": [], "hutchinson": []}
    np.testing.assert_allclose(out["divergence"], out["divergence_one_device"], rtol=1e-12)
    np.testing.assert_allclose(out["estimate"], out["estimate_one_device"], rtol=1e-12)
    np.testing.assert_allclose(
        out["shard_map_divergence"], out["divergence_one_device"], rtol=1e-12
    )
    assert out["shard_map_estimate"].shape == out["estimate"].shape
    images, n = out["images"], math.prod(out["images"].shape[1:])

    def trace(image):  # brute force: the trace of one sample's dense Jacobian
        return jax.numpy.trace(jax.jacfwd(lambda a: out["f"](a[None])[0])(image).reshape(n, n))

    dense = jax.jit(jax.vmap(trace))(images)
    np.testing.assert_allclose(out["divergence_one_device"], dense, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_rnode_jax_penalties_are_the_brute_force_integrands():
    import jax
    import jax.numpy as jnp

    example = load("rnode_jax")
    out = example.main(small=True)
    assert len(out["history"]) == 3 and all(math.isfinite(v) for v in out["history"])
    params = out["params"]
    x = jax.random.normal(jax.random.key(0), (3, 2), jnp.float64)
    t = jnp.float64(0.3)
    field = example.value_divergence_and_frobenius(example.velocity, argnums=1)
    _, div, sq = field(params, x, t)
    J = jax.vmap(jax.jacfwd(lambda z: example.velocity(params, z[None], t)[0]))(x)
    np.testing.assert_allclose(div, jnp.trace(J, axis1=1, axis2=2), rtol=1e-12)
    np.testing.assert_allclose(sq, jnp.sum(J**2, (1, 2)), rtol=1e-12)
    nll, kinetic, jacobian = example.losses(params, x, None, steps=2)
    assert nll.shape == kinetic.shape == jacobian.shape == (3,)
    assert bool(jnp.all(kinetic > 0)) and bool(jnp.all(jacobian > 0))


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_rnode_torch_penalties_are_the_brute_force_integrands(torch_float64):
    torch = torch_float64
    example = load("rnode_torch")
    out = example.main(small=True)
    assert len(out["history"]) == 3 and all(math.isfinite(v) for v in out["history"])
    params = [(w.detach(), b.detach()) for w, b in out["params"]]
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    t = torch.tensor(0.3)
    _, div, sq = example.value_divergence_and_frobenius(example.velocity, argnums=1)(params, x, t)
    J = torch.stack(
        [
            torch.autograd.functional.jacobian(
                lambda z: example.velocity(params, z[None], t)[0], xb
            )
            for xb in x
        ]
    )
    np.testing.assert_allclose(div, J.diagonal(dim1=1, dim2=2).sum(-1), rtol=1e-12)
    np.testing.assert_allclose(sq, (J**2).sum((1, 2)), rtol=1e-12)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_flow_log_det_exact_is_slogdet_and_slq_is_close(torch_float64):
    torch = torch_float64
    example = load("flow_log_det")
    out = example.main(small=True)
    assert len(out["history"]) == 3 and all(math.isfinite(v) for v in out["history"])
    params = [(w.detach(), b.detach()) for w, b in out["params"]]
    x = out["x"]
    J = torch.stack(
        [
            torch.autograd.functional.jacobian(lambda z: example.flow(params, z[None])[0], xb)
            for xb in x
        ]
    )
    np.testing.assert_allclose(out["exact"], torch.linalg.slogdet(J)[1], rtol=1e-10)
    slq, stderr = out["slq"]
    assert bool(torch.all(stderr > 0))
    assert float(((slq - out["exact"]).abs() <= 4 * stderr).double().mean()) >= 0.9
