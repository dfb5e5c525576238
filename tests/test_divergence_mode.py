"""``mode=`` of the divergence transforms, in both frameworks: the passes go the way asked
(JVPs for ``"fwd"``, VJPs for ``"rev"``) and the numbers equal brute force (float64).

A stochastic method run on the caller's probes ``V`` is a deterministic function of the
per-sample matvec: forward passes estimate ``tr J_b`` from ``J_b V``, reverse passes estimate
``tr J_b^T`` from ``J_b^T V``, so each equals the core estimator run on the dense per-sample
Jacobian (or its transpose) with the same probes.
"""

from __future__ import annotations

import numpy as np
import pytest

from divjac import OptionError
from divjac._core import estimators as est

from .reference import jax_diagonal_blocks, torch_diagonal_blocks

B, N = 3, 6
STOCHASTIC = ("hutchinson", "hutch++", "xtrace")
W = np.random.default_rng(0).normal(size=(N, N)) / N**0.5


def _jax():
    import jax.numpy as jnp

    import divjac.jax as dj
    from divjac.jax import _backend

    def f(x):  # a non-symmetric Jacobian: tr(J) = tr(J^T), the estimates differ
        return jnp.tanh(x @ jnp.asarray(W)) * x[:, ::-1]

    def blocks(x):
        return jax_diagonal_blocks(f, (x,))

    def grad_div(x):  # per sample: jax.grad of the trace of jax.jacfwd
        import jax

        def div(xb):
            return jnp.trace(jax.jacfwd(lambda v: f(v[None])[0])(xb))

        return np.stack([np.asarray(jax.grad(div)(xb)) for xb in x])

    return dj, _backend.JaxBackend, f, jnp.asarray, blocks, grad_div


def _torch():
    import torch

    import divjac.torch as dt
    from divjac.torch import _backend

    Wt = torch.as_tensor(W)

    def f(x):
        return torch.tanh(x @ Wt) * x.flip(1)

    def blocks(x):
        return torch_diagonal_blocks(f, (x,))

    def grad_div(x):  # per sample: autograd of the trace of a double-backward Jacobian
        rows = []
        for xb in x:
            xb = xb.clone().requires_grad_()
            J = torch.autograd.functional.jacobian(lambda v: f(v[None])[0], xb, create_graph=True)
            rows.append(torch.autograd.grad(J.trace(), xb)[0].detach().numpy())
        return np.stack(rows)

    return dt, _backend.TorchBackend, f, torch.as_tensor, blocks, grad_div


FRAMEWORKS = {"jax": _jax, "torch": _torch}


@pytest.fixture(params=sorted(FRAMEWORKS))
def framework(request):
    pytest.importorskip(request.param)
    return FRAMEWORKS[request.param]()


@pytest.fixture
def directions(framework, monkeypatch):
    """The direction of every linearization a transform makes (True: VJPs)."""
    backend_type = framework[1]
    seen: list[bool] = []
    original = backend_type.linearize

    def recording(self, point, *, reverse):
        seen.append(reverse)
        return original(self, point, reverse=reverse)

    monkeypatch.setattr(backend_type, "linearize", recording)
    return seen


def _x(framework):
    return framework[3](np.random.default_rng(1).normal(size=(B, N)))


@pytest.mark.parametrize("mode", ["fwd", "rev"])
@pytest.mark.parametrize("method", ["exact", "sparse", "auto"])
def test_exact_divergence_in_either_direction_equals_brute_force(
    framework, directions, method, mode
):
    lib, _, f, _, blocks, _ = framework
    x = _x(framework)
    got = lib.divergence(f, method=method, mode=mode)(x)
    np.testing.assert_allclose(np.asarray(got), np.trace(blocks(x), axis1=1, axis2=2))
    assert directions == [mode == "rev"]
    y, div = lib.value_and_divergence(f, method=method, mode=mode)(x)
    np.testing.assert_allclose(np.asarray(div), np.asarray(got))
    np.testing.assert_allclose(np.asarray(y), np.asarray(f(x)))


@pytest.mark.parametrize("mode", ["fwd", "rev"])
@pytest.mark.parametrize("method", STOCHASTIC)
def test_stochastic_divergence_with_vjp_probes_equals_the_estimator_on_the_dense_jacobian(
    framework, directions, method, mode
):
    lib, _, f, asarray, blocks, _ = framework
    x = _x(framework)
    num = 6
    k = est.num_random_vectors(method, num, N)
    probes = np.random.default_rng(2).choice([-1.0, 1.0], size=(k, B, N))
    got = lib.divergence(f, method=method, mode=mode, num_probes=num)(asarray(probes), x)
    J = blocks(x)
    J = np.swapaxes(J, 1, 2) if mode == "rev" else J
    want, _ = est.estimate_trace(method, lambda V: J @ V, np.moveaxis(probes, 0, -1))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12)
    assert directions == [mode == "rev"]


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_grad_divergence_in_either_direction_equals_brute_force(framework, mode):
    lib, _, f, _, _, grad_div = framework
    x = _x(framework)
    got = lib.grad_divergence(f, method="exact", mode=mode)(x)
    np.testing.assert_allclose(np.asarray(got), grad_div(x), rtol=1e-10, atol=1e-12)


def test_an_unknown_mode_is_refused(framework):
    lib, f = framework[0], framework[2]
    with pytest.raises(OptionError, match="mode must be one of"):
        lib.divergence(f, mode="sparse")
