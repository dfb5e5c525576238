"""The CNF hot path in PyTorch: rows pulled on the autograd tape, and the memo of the guards.

Outside ``torch.func`` transforms, divjac pulls rows as FFJORD's code does (one forward pass,
``autograd.grad`` per probe). These tests compare it with that code, values and gradients to the
parameters, in the grad modes a training loop uses; and they change, between two calls of the
same transform, every kind of state the memo of the guards tells unchanged without walking.
"""

from __future__ import annotations

import functools
import gc
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from divjac import BatchCouplingError, DetectionMemoryError, _divergence
from divjac.models import torch as models
from divjac.torch import _detect, _trace_keys, divergence, jacobian, value_and_divergence
from tests.reference import torch_diagonal_blocks, traces

D = torch.float64


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def _ffjord(f, t, x, probes):
    """FFJORD's Hutchinson code: ``e^T (df/dx) e`` from one VJP per probe."""
    x = x if x.requires_grad else x.detach().requires_grad_()
    y = f(t, x)
    terms = [(torch.autograd.grad(y, x, e, create_graph=True)[0] * e).sum(1) for e in probes]
    return y, torch.stack(terms).mean(0)


def _param_grads(f, y, div):
    f.zero_grad()
    (y.square().mean() + div.square().mean()).backward()
    return [p.grad.clone() for p in f.parameters()]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_hutchinson_equals_ffjords_code_values_and_parameter_gradients(k):
    # d = 8 > k: below n probes divjac estimates as FFJORD does (at k >= n it is exact)
    f = models.ConcatSquashODE(8, hidden=(8, 8)).double()
    t, x = torch.tensor(0.3, dtype=D), _randn(5, 8)
    probes = _randn(k, 5, 8, seed=1)
    y_ref, div_ref = _ffjord(f, t, x, probes)
    grads_ref = _param_grads(f, y_ref, div_ref)
    vd = value_and_divergence(f, 1, method="hutchinson", num_probes=k)
    y, div = vd(probes, t, x)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(div, div_ref)
    for got, ref in zip(_param_grads(f, y, div), grads_ref, strict=True):
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("method", ["hutchinson", "exact"])
def test_a_reused_trace_sees_weights_updated_in_place_and_a_new_dtype(method, traces_made):
    # The steady state of a training loop: the optimizer updates the weights in place, and the
    # next call reuses the trace (values are not part of it) with the new weights; a dtype
    # change through ``.data`` (the same Parameter objects) traces again.
    f = models.ConcatSquashODE(3, hidden=(6,)).double()
    t, x = torch.tensor(0.4, dtype=D), _randn(5, 3)
    probes = _randn(1, 5, 3, seed=2)
    vd = value_and_divergence(f, 1, method=method, num_probes=1 if method == "hutchinson" else None)
    args = (probes, t, x) if method == "hutchinson" else (t, x)

    def expected(*args):
        if method == "hutchinson":
            probes, t, x = args
            return _ffjord(f, t, x, probes)
        t, x = args
        xg = x.detach().requires_grad_()
        y = f(t, xg)
        return y, sum(
            torch.autograd.grad(y[:, i].sum(), xg, create_graph=True)[0][:, i] for i in range(3)
        )

    vd(*args)
    made = traces_made[0]
    with torch.no_grad():
        for p in f.parameters():
            p.mul_(1.5).add_(0.1)
    y, div = vd(*args)
    y_ref, div_ref = expected(*args)
    assert traces_made[0] == made
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(div, div_ref)
    for p in f.parameters():
        p.data = p.data.float()
    args32 = tuple(a.float() for a in args)
    y, div = vd(*args32)
    assert traces_made[0] == made + 1 and div.dtype == torch.float32
    y_ref, div_ref = expected(*args32)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(div, div_ref)


@pytest.mark.parametrize("d", [2, 5])
def test_exact_divergence_equals_the_loop_of_gradients_with_parameter_gradients(d):
    f = models.ConcatSquashODE(d, hidden=(8,)).double()
    t, x = torch.tensor(0.7, dtype=D), _randn(4, d).requires_grad_()
    y_ref = f(t, x)
    div_ref = sum(
        torch.autograd.grad(y_ref[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(d)
    )
    grads_ref = _param_grads(f, y_ref, div_ref)
    y, div = value_and_divergence(f, 1, method="exact")(t, x)
    torch.testing.assert_close(div, div_ref)
    for got, ref in zip(_param_grads(f, y, div), grads_ref, strict=True):
        torch.testing.assert_close(got, ref)


def test_gradient_flows_to_the_input_through_the_divergence():
    f = models.ConcatSquashODE(3, hidden=(6,)).double()
    t = torch.tensor(0.2, dtype=D)
    x0 = _randn(4, 3)
    x = x0.clone().requires_grad_()
    z = 2.0 * x  # a non-leaf input, as inside an ODE solver
    (grad,) = torch.autograd.grad(divergence(f, 1, method="exact")(t, z).sum(), x)

    def per_sample_div(xi):
        J = torch.func.jacrev(lambda v: f(t, v[None])[0])(xi)
        return torch.trace(J)

    expected = 2.0 * torch.func.vmap(torch.func.grad(per_sample_div))(2.0 * x0)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("method", ["exact", "hutchinson"])
def test_no_graph_is_kept_when_nothing_requires_grad(method):
    f = models.ConcatSquashODE(3, hidden=(6,)).double()
    t, x = torch.tensor(0.2, dtype=D), _randn(4, 3)
    vd = value_and_divergence(f, 1, method=method)
    args = (_randn(16, 4, 3, seed=3), t, x) if method == "hutchinson" else (t, x)
    y, div = vd(*args)  # parameters require grad: on the graph
    assert y.requires_grad and div.requires_grad
    with torch.no_grad():
        y, div = vd(*args)
    assert not (y.requires_grad or div.requires_grad)
    f.requires_grad_(False)
    y, div = vd(*args)  # frozen: nothing to differentiate
    assert not (y.requires_grad or div.requires_grad)
    np.testing.assert_allclose(div.numpy(), vd(*args)[1].numpy())


def test_under_torch_func_transforms_the_functional_passes_are_used():
    f = models.ConcatSquashODE(2, hidden=(6,)).double()
    t, x = torch.tensor(0.4, dtype=D), _randn(3, 2)
    div = divergence(lambda x: f(t, x), method="exact")
    per_sample = torch.func.vmap(lambda xi: div(xi[None])[0])(x)
    torch.testing.assert_close(per_sample, div(x))


def test_batch_norm_statistics_move_once_per_call_in_exact_coupling_mode():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh()).double()
    x = _randn(6, 3)
    div = divergence(net, coupling="exact")
    div(x)
    div(x)
    assert int(net[1].num_batches_tracked) == 0  # kept still by every pass, as before


# --- the memo of the guards: every change between two calls is seen ---------------------------


class Gain(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + _randn(n, seed=5))

    def forward(self, x):
        return x * self.weight


def _elementwise_or_mixed(y, x, shift):
    """``y``, plus ``x`` rolled by ``shift`` along the sample (``None``: not). The pattern of the
    elementwise case has one diagonal color: reused for the mixed case, its single pass would
    sum the rolled entries into the divergence."""
    return y if shift is None else y + torch.roll(x, shift, dims=1)


class Shift(nn.Module):
    """Elementwise, or mixed within the sample when its plain attribute ``shift`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = Gain()
        self.shift = None

    def forward(self, x):
        return _elementwise_or_mixed(torch.tanh(self.gain(x)), x, self.shift)


def _sparse_ok(div, net, x):
    expected = traces(torch_diagonal_blocks(net, (x,)), (x.shape[1],))
    np.testing.assert_allclose(div(x).detach(), expected, rtol=1e-10, atol=1e-12)


def _mixing_hook(module, args, out):
    return out + out.mean(0, keepdim=True)


MUTATIONS = {
    "plain attribute": lambda net: setattr(net, "shift", 1),
    "train flag of a submodule": lambda net: net.gain.train(False),
    "replaced submodule": lambda net: setattr(net, "gain", nn.Linear(6, 6).double()),
    "parameter data, same metadata": lambda net: setattr(
        net.gain.weight, "data", 2.0 * net.gain.weight.data
    ),
    "forward hook": lambda net: net.register_forward_hook(_mixing_hook),
    "class method": lambda net: setattr(
        type(net), "forward", lambda self, x: torch.sin(x) + torch.roll(x, 2, dims=1)
    ),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_changes_of_a_module_between_calls_are_seen(name, traces_made):
    cls = type("ShiftCopy", (Shift,), {})  # a class of its own: one test patches it
    net = cls()
    x = _randn(4, 6)
    div = divergence(net, method="sparse")
    _sparse_ok(div, net, x)
    _sparse_ok(div, net, x)
    made = traces_made[0]
    MUTATIONS[name](net)
    if name == "forward hook":
        with pytest.raises(BatchCouplingError):
            div(x)
        return
    _sparse_ok(div, net, x)
    assert (traces_made[0] == made) == (name == "parameter data, same metadata")


def test_checks_see_tensor_metadata_changed_in_place():
    net = Shift()
    checks = _trace_keys.reach(net, [], record=True).checks
    assert checks is not None and checks.hold()
    net.gain.weight.data = net.gain.weight.data.float()  # the same Parameter, another dtype
    assert not checks.hold()


def test_changes_of_closures_defaults_and_partials_are_seen():
    a, b = Shift(), Shift()
    b.shift = 1
    x = _randn(4, 6)
    net = a

    def f(x):
        return net(x)

    div = divergence(f, method="sparse")
    _sparse_ok(div, f, x)
    net = b  # the closure cell now holds another module
    _sparse_ok(div, f, x)

    def g(x, shift=None):
        return _elementwise_or_mixed(torch.sin(x), x, shift)

    div_g = divergence(g, method="sparse")
    _sparse_ok(div_g, g, x)
    g.__defaults__ = (1,)
    _sparse_ok(div_g, g, x)

    part = functools.partial(g, shift=None)
    div_p = divergence(part, method="sparse")
    _sparse_ok(div_p, part, x)
    part.keywords["shift"] = 2
    _sparse_ok(div_p, part, x)


GLOBAL_SHIFT = None


def _uses_a_global(x):
    return _elementwise_or_mixed(torch.sin(x), x, GLOBAL_SHIFT)


def test_a_rebound_global_is_seen():
    global GLOBAL_SHIFT
    x = _randn(3, 5)
    div = divergence(_uses_a_global, method="sparse")
    _sparse_ok(div, _uses_a_global, x)
    GLOBAL_SHIFT = 1
    try:
        _sparse_ok(div, _uses_a_global, x)
    finally:
        GLOBAL_SHIFT = None


def test_grad_mode_is_part_of_the_memo():
    net = Shift()
    x = _randn(4, 6)
    div = divergence(net, method="sparse")
    with torch.no_grad():
        first = div(x)
    second = div(x)
    assert not first.requires_grad and second.requires_grad
    torch.testing.assert_close(first, second.detach())


def test_the_memo_keeps_no_model_alive():
    net = Shift()
    x = _randn(4, 6)
    div = divergence(net, method="sparse")
    div(x)
    div(x)
    assert _detect._MEMOS.get(net) is not None
    ref = weakref.ref(net)
    del net, div
    gc.collect()
    assert ref() is None


def test_a_steady_state_call_plans_nothing_again(monkeypatch):
    # The setup of a call (detection, direction, chunks) is kept with the trace per context:
    # evaluated once for repeated calls, again where the context changes.
    planned = []
    stochastic_plan = _divergence._stochastic_plan
    monkeypatch.setattr(
        _divergence,
        "_stochastic_plan",
        lambda call, ds: planned.append(call.xb.requires_grad) or stochastic_plan(call, ds),
    )
    f = models.ConcatSquashODE(3, hidden=(8,)).double().requires_grad_(False)
    t, x = torch.tensor(0.2, dtype=D), _randn(4, 3)
    probes = _randn(1, 4, 3, seed=1)
    vd = value_and_divergence(f, 1, method="hutchinson", num_probes=1)
    first = [vd(probes, t, x)[1] for _ in range(3)]
    assert planned == [False]
    x = x.requires_grad_()  # the same trace; the passes now go on the autograd graph
    on_graph = [vd(probes, t, x)[1] for _ in range(2)]
    assert planned == [False, True]
    with torch.inference_mode():
        inferred = vd(probes, t, x)[1]
    assert len(planned) == 3
    assert on_graph[0].requires_grad
    for div in (*first[1:], *on_graph, inferred):
        torch.testing.assert_close(div.detach(), first[0])


def test_a_kept_plan_reads_the_memory_settings_again(monkeypatch):
    # A chunk depends on the environment's memory settings: the plan is made again when they
    # change (here a limit no pass fits refuses the call).
    monkeypatch.delenv("DIVJAC_MEMORY_LIMIT_MB", raising=False)
    f = models.ConcatSquashODE(3, hidden=(8,)).double()
    t, x = torch.tensor(0.2, dtype=D), _randn(4, 3)
    div = divergence(f, 1, method="exact")
    expected = div(t, x)
    torch.testing.assert_close(div(t, x), expected)
    monkeypatch.setenv("DIVJAC_MEMORY_LIMIT_MB", "1e-6")
    with pytest.raises(DetectionMemoryError, match="DIVJAC_MEMORY_LIMIT_MB"):
        div(t, x)
    monkeypatch.delenv("DIVJAC_MEMORY_LIMIT_MB")
    torch.testing.assert_close(div(t, x), expected)


def test_a_memo_hit_is_the_cached_trace(traces_made):
    net = models.ConcatSquashODE(2, hidden=(4,)).double()
    t, x = torch.tensor(0.1, dtype=D), _randn(3, 2)
    jac = jacobian(net, 1)
    first = jac(t, x)
    made = traces_made[0]
    for _ in range(3):
        torch.testing.assert_close(jac(t, x), first)
    assert traces_made[0] == made
    memo = _detect._MEMOS[net]
    assert memo.traced() is _detect.CACHE.get(memo.key)


@pytest.mark.parametrize("method", ["hutchinson", "exact"])
def test_cnf_training_through_odeint_adjoint_matches_ffjords_code(method):
    from torchdiffeq import odeint, odeint_adjoint

    f = models.ConcatSquashODE(2, hidden=(8, 8)).double()
    x0 = _randn(6, 2)
    probe = _randn(6, 2, seed=4)
    ours = value_and_divergence(f, 1, method=method, num_probes=1)

    class Field(nn.Module):  # odeint_adjoint takes the parameters of an nn.Module
        def __init__(self, divjac: bool) -> None:
            super().__init__()
            self.f, self.divjac = f, divjac

        def forward(self, t, state):
            x = state[0]
            if self.divjac:
                y, div = ours(probe, t, x) if method == "hutchinson" else ours(t, x)
                return y, -div
            with torch.enable_grad():
                x = x if x.requires_grad else x.requires_grad_()
                y = self.f(t, x)
                if method == "hutchinson":
                    g = torch.autograd.grad(y, x, probe, create_graph=True)[0]
                    div = (g * probe).sum(1)
                else:
                    div = sum(
                        torch.autograd.grad(y[:, i].sum(), x, create_graph=True)[0][:, i]
                        for i in range(2)
                    )
            return y, -div

    def loss_and_grads(field, solve):
        f.zero_grad()
        times = torch.tensor([0.0, 0.5], dtype=D)
        z, dlogp = solve(field, (x0, torch.zeros(6, dtype=D)), times, method="rk4",
                         options={"step_size": 0.125})  # fmt: skip
        loss = (0.5 * z[-1].square().sum(1) - dlogp[-1]).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in f.parameters()]

    ref_loss, ref_grads = loss_and_grads(Field(False), odeint)
    for solve in (odeint, odeint_adjoint):
        loss, grads = loss_and_grads(Field(True), solve)
        torch.testing.assert_close(loss, ref_loss)
        for got, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9)


class _AllEqual:
    """A callable equal to every other one of its class (hashing alike): a memo must still
    tell two of them apart."""

    def __init__(self, shift):
        self.shift = shift

    def __eq__(self, other):
        return isinstance(other, _AllEqual)

    def __hash__(self):
        return 0

    def __call__(self, x):
        return _elementwise_or_mixed(torch.sin(x), x, self.shift)


def test_an_equal_but_other_function_does_not_take_the_memo():
    x = _randn(3, 5)
    a, b = _AllEqual(None), _AllEqual(1)
    div = divergence(a, method="sparse")
    _sparse_ok(div, a, x)
    _sparse_ok(div, a, x)
    _sparse_ok(divergence(b, method="sparse"), b, x)
