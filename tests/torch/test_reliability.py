"""divjac.torch in training loops: cached traces never give a stale result.

Every case compares, after each change of the state a function reaches, against a fresh
brute-force float64 reference (a loop over samples of ``torch.autograd.functional.jacobian``).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from divjac import BatchCouplingError, RetraceWarning
from divjac.torch import _detect, _trace_keys, divergence, jacobian, laplacian, sparsity
from divjac.torch._backend import BACKEND
from tests.reference import torch_diagonal_blocks, traces

D = torch.float64


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = D) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _close(got: torch.Tensor, f, args: tuple, rtol: float = 1e-10) -> None:
    np.testing.assert_allclose(
        got.detach(), torch_diagonal_blocks(f, args), rtol=rtol, atol=rtol * 1e-2
    )


def _hessian_traces(u, x: torch.Tensor) -> np.ndarray:
    """Per-sample Laplacians of ``u: [B, ...] -> [B]`` by dense Hessians."""
    out = []
    for b in range(x.shape[0]):

        def ub(xb, b=b):
            return u(torch.cat([x[:b], xb[None], x[b + 1 :]]))[b]

        h = torch.autograd.functional.hessian(ub, x[b])
        out.append(float(torch.trace(h.reshape(x[b].numel(), -1))))
    return np.array(out)


# --- 1. captured tensors: floats are never read, integers and booleans are guarded -----------


def test_captured_float_tensor_is_never_read():
    """A zero weight now (a zero-initialized output layer) is trained later: its zeros must not
    make an empty pattern."""
    W = torch.zeros(4, 4, dtype=D)

    def f(x):
        return torch.tanh(x @ W)

    x = _randn(3, 4)
    assert sparsity(f)(x).nnz == 16
    _close(jacobian(f)(x), f, (x,))
    W.copy_(_randn(4, 4, seed=1))
    _close(jacobian(f)(x), f, (x,))
    np.testing.assert_allclose(
        divergence(f, method="sparse")(x), traces(torch_diagonal_blocks(f, (x,)), (4,))
    )


def test_float_attribute_of_a_module_is_never_read():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4).double()
            self.gate = torch.zeros(4, 4, dtype=D)  # a plain tensor attribute, not a buffer

        def forward(self, x):
            return x + torch.tanh(self.lin(x) @ self.gate)

    net = Gate()
    x = _randn(3, 4)
    _close(jacobian(net)(x), net, (x,))
    net.gate.fill_(0.5)
    _close(jacobian(net)(x), net, (x,))
    assert sparsity(net)(x).nnz == 16


def test_captured_index_and_mask_modified_in_place_are_seen(traces_made):
    perm = torch.tensor([1, 0, 3, 2])
    mask = torch.tensor([True, True, False, False])

    def f(x):
        return torch.where(mask, x[:, perm] * x, 0.0)

    x = _randn(3, 4)
    assert sparsity(f)(x).nnz == 4  # read: the pattern is exact
    _close(jacobian(f, mode="sparse")(x), f, (x,))
    traced = traces_made[0]
    _close(jacobian(f, mode="sparse")(x), f, (x,))
    assert traces_made[0] == traced  # nothing changed: the trace is reused
    perm.copy_(torch.tensor([3, 2, 1, 0]))
    _close(jacobian(f, mode="sparse")(x), f, (x,))
    mask[2:] = True
    _close(jacobian(f, mode="sparse")(x), f, (x,))
    assert sparsity(f)(x).nnz == 8
    assert traces_made[0] == traced + 2


def test_captured_index_changed_without_a_new_version_is_seen(traces_made):
    """The pattern read an index's values: a new ``.data``, a write through ``.data`` and a
    write through a NumPy array sharing its memory change them without bumping the tensor's
    version counter (the sparse divergence returned the old pattern's wrong numbers); an
    in-place write of the same values keeps the trace."""
    shared = np.array([1, 0, 3, 2])
    perm = torch.from_numpy(shared)

    def f(x):
        return torch.sin(x[:, perm]) * x

    x = _randn(3, 4)
    want = lambda: traces(torch_diagonal_blocks(f, (x,)), (4,))  # noqa: E731
    np.testing.assert_allclose(divergence(f, method="sparse")(x), want())
    traced = traces_made[0]
    perm.copy_(torch.tensor([1, 0, 3, 2]))  # a new version, the same values
    np.testing.assert_allclose(divergence(f, method="sparse")(x), want())
    assert traces_made[0] == traced
    for change in (  # the NumPy array first: a new .data no longer shares its memory
        lambda: shared.__setitem__(slice(None), [2, 3, 0, 1]),
        lambda: perm.data.copy_(torch.tensor([3, 2, 1, 0])),
        lambda: setattr(perm, "data", torch.tensor([0, 1, 2, 3])),
    ):
        change()
        np.testing.assert_allclose(divergence(f, method="sparse")(x), want())
    assert traces_made[0] == traced + 3


def test_readable_constants_are_the_callers_own_integer_tensors():
    perm = torch.tensor([2, 0, 1])
    W = _randn(3, 3)

    def f(x):
        return x[:, perm] @ W + x * torch.tensor([1.0, 0.0, 2.0], dtype=D)

    traced = BACKEND.trace(f, (_randn(2, 3),), {}, argnum=0, batch_axis=0, has_aux=False)
    readable = list(traced.readable.values())
    assert any(c is perm for c in readable)  # the caller's tensor, whose values are guarded
    assert all(c is not W for c in readable)
    assert {name for name, c in traced.readable.items() if c is perm} == set(traced.versioned)


def test_rebinding_a_captured_index_is_seen():
    state = {"perm": torch.tensor([1, 0, 2])}

    def f(x):
        return x[:, state["perm"]] ** 2

    x = _randn(2, 3)
    _close(jacobian(f, mode="sparse")(x), f, (x,))
    state["perm"] = torch.tensor([2, 1, 0])
    _close(jacobian(f, mode="sparse")(x), f, (x,))


# --- 2. module state -----------------------------------------------------------------------


class FlagNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.use_batch_mean = False

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        return y - y.mean(0) if self.use_batch_mean else y


def test_attribute_flip_retraces():
    torch.manual_seed(0)
    net = FlagNet().double()
    x = _randn(4, 3)
    jac = jacobian(net)
    _close(jac(x), net, (x,))
    net.use_batch_mean = True
    with pytest.raises(BatchCouplingError):
        jac(x)
    _close(jacobian(net, coupling="exact")(x), net, (x,))
    net.use_batch_mean = False
    _close(jac(x), net, (x,))


def test_train_eval_flips():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh()).double()
    x = _randn(6, 3)
    div = divergence(net)
    net.eval()
    expected = traces(torch_diagonal_blocks(net, (x,)), (3,))
    np.testing.assert_allclose(div(x).detach(), expected, rtol=1e-10)
    net.train()
    with pytest.raises(BatchCouplingError, match="BatchNorm in training"):
        div(x)
    net.eval()
    np.testing.assert_allclose(div(x).detach(), expected, rtol=1e-10)
    assert int(net[1].num_batches_tracked) == 0


def test_optimizer_steps_and_load_state_dict_do_not_retrace(traces_made):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    nn.init.zeros_(net[2].weight)  # zero now, trained below
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    x = _randn(5, 4)
    div = divergence(net)
    for step in range(3):
        expected = traces(torch_diagonal_blocks(net, (x,)), (4,))
        got = div(x)
        np.testing.assert_allclose(got.detach(), expected, rtol=1e-10, atol=1e-14)
        opt.zero_grad()
        (net(x).pow(2).sum() + got.sum()).backward()
        opt.step()
        if step == 0:
            traced = traces_made[0]
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    net.load_state_dict(other.state_dict())
    np.testing.assert_allclose(
        div(x).detach(), traces(torch_diagonal_blocks(net, (x,)), (4,)), rtol=1e-10
    )
    assert traces_made[0] == traced


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_randn(4, 4))
        self.register_buffer("mask", torch.tensor([True, False, True, False]))

    def forward(self, x):
        return torch.where(self.mask, torch.tanh(x @ self.weight.T), 0.0)


def test_replaced_parameters_and_buffers_retrace(traces_made):
    net = Masked()
    x = _randn(3, 4)
    assert sparsity(net)(x).nnz == 8
    _close(jacobian(net)(x), net, (x,))
    before = traces_made[0]
    net.register_buffer("mask", torch.ones(4, dtype=torch.bool))
    assert sparsity(net)(x).nnz == 16
    _close(jacobian(net)(x), net, (x,))
    net.weight = nn.Parameter(_randn(6, 4, seed=2))  # another shape: another output
    net.mask = torch.ones(6, dtype=torch.bool)
    J = jacobian(net)(x)
    assert tuple(J.shape) == (3, 6, 4)
    _close(J, net, (x,))
    assert traces_made[0] >= before + 2


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # a plain attribute: part of the cache key
        return torch.tanh(self.lin(x))


def test_a_module_that_changes_its_attributes_is_traced_every_call_and_warned(traces_made):
    torch.manual_seed(0)
    net = Counting()
    x = _randn(4, 3)
    with pytest.warns(RetraceWarning, match="changes the state it reaches"):
        for _ in range(3):
            _close(jacobian(net)(x), net, (x,))
    assert traces_made[0] == 3


def test_a_python_number_argument_that_changes_is_fresh_and_warned(traces_made):
    """``t`` as a Python float (an eager ODE loop): each new value is a new trace (numbers
    are constants of the graph), with fresh results, and the third in a row warns at the
    caller's line, naming the fix; a repeated value reuses its trace, and ``t`` as a tensor
    traces once."""
    lin = nn.Linear(3, 3).double()

    def g(t, x):
        return torch.tanh(lin(x) * t) + t * x

    x = _randn(4, 3)
    for t in (0.1, 0.2, 0.1, 0.2):
        _close(jacobian(g, argnums=1)(t, x), lambda x, t=t: g(t, x), (x,))
    assert traces_made[0] == 2
    with pytest.warns(RetraceWarning, match=r"Python number took a new value \(an argument") as got:
        for t in (0.3, 0.4, 0.5):
            _close(jacobian(g, argnums=1)(t, x), lambda x, t=t: g(t, x), (x,))
    assert traces_made[0] == 5
    assert [w.filename for w in got] == [__file__]  # the caller's line, not divjac's
    for t in (0.6, 0.7):
        jacobian(g, argnums=1)(torch.tensor(t, dtype=D), x)
    assert traces_made[0] == 6


def test_a_closed_over_number_that_changes_is_fresh_and_warned(traces_made):
    """A number the function closes over (or a module attribute the caller sets), changed
    between calls by the caller: fresh results at every call and, at the third new trace in a
    row, the same warning as for a number argument. A counter the function changes itself
    warns as its own change, never as a number the caller changes."""
    lin = nn.Linear(3, 3).double()
    x = _randn(4, 3)

    def field(t: float):
        return lambda x: torch.tanh(lin(x) * t) + t * x  # t: a closure cell

    with pytest.warns(RetraceWarning, match=r"Python number took a new value") as got:
        for t in (0.1, 0.2, 0.3):
            _close(jacobian(field(t))(x), field(t), (x,))
    assert traces_made[0] == 3
    assert [w.filename for w in got if w.category is RetraceWarning] == [__file__]
    net = Counting()
    with pytest.warns(RetraceWarning) as got:
        for _ in range(4):
            _close(jacobian(net)(x), net, (x,))
    warned = [str(w.message) for w in got if w.category is RetraceWarning]
    assert len(warned) == 1 and "running Counting" in warned[0], warned


# --- 3. modules reached through objects, containers, closures, globals ------------------------


def _bn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh()).double()


class Trainer:
    def __init__(self) -> None:
        self.model = _bn()
        self.steps = 0  # a counter the step never reads: no re-trace when it changes

    def velocity(self, x):
        return self.model(x)


MODELS = {"a": _bn()}


def _global_model(x):
    return MODELS["a"](x)


def test_batch_norm_reached_anywhere_is_coupled():
    trainer = Trainer()
    listed = [_bn()]
    closed = _bn()

    def from_list(x):
        return listed[0](x)

    def from_closure(x):
        return closed(x)

    x = _randn(6, 3)
    cases = [
        (trainer.velocity, trainer.model),
        (from_list, listed[0]),
        (from_closure, closed),
        (_global_model, MODELS["a"]),
    ]
    for f, model in cases:
        model.train()
        with pytest.raises(BatchCouplingError, match="BatchNorm in training"):
            divergence(f)(x)
        assert int(model[1].num_batches_tracked) == 0
        model.eval()
        expected = traces(torch_diagonal_blocks(f, (x,)), (3,))
        np.testing.assert_allclose(divergence(f)(x).detach(), expected, rtol=1e-10)
        model.train()  # flipped back: detected again
        with pytest.raises(BatchCouplingError):
            divergence(f)(x)
        model.eval()


def test_plain_counters_of_objects_do_not_retrace(traces_made):
    trainer = Trainer()
    trainer.model.eval()
    x = _randn(4, 3)
    div = divergence(trainer.velocity)
    div(x)
    traced = traces_made[0]
    for _ in range(3):
        trainer.steps += 1
        np.testing.assert_allclose(
            div(x).detach(), traces(torch_diagonal_blocks(trainer.velocity, (x,)), (3,))
        )
    assert traces_made[0] == traced


def _calling(model):
    return lambda x: model(x)


def test_fresh_closures_over_the_same_model_reuse_the_trace(traces_made):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).double()
    x = _randn(4, 3)
    divergence(_calling(net))(x)
    traced = traces_made[0]
    for _ in range(3):
        divergence(_calling(net))(x)  # a new function object every time
    assert traces_made[0] == traced
    for other in (nn.Sequential(nn.Linear(3, 3), nn.Softmax(1)).double(), _bn().train()):
        f = _calling(other)  # the same code, another model
        if isinstance(other[1], nn.BatchNorm1d):
            with pytest.raises(BatchCouplingError):
                divergence(f)(x)
            continue
        np.testing.assert_allclose(
            divergence(f)(x).detach(), traces(torch_diagonal_blocks(f, (x,)), (3,))
        )


# --- 4. the cost of a cache hit --------------------------------------------------------------


def test_guard_cost_grows_with_tensors_not_their_elements():
    def mlp(width: int) -> nn.Module:
        layers = [nn.Linear(width // 2, width), nn.Tanh()]
        for _ in range(3):
            layers += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(width, width // 2))

    small, large = mlp(8), mlp(2048)
    assert sum(p.numel() for p in large.parameters()) > 10_000_000
    sig_small = _trace_keys.reach(small, []).signature
    sig_large = _trace_keys.reach(large, []).signature
    assert len(sig_small) == len(sig_large)


# --- 5. random operations draw once per call ---------------------------------------------------


def _dropout_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Dropout(0.5), nn.Conv2d(3, 2, 3, padding=1)
    ).double()


@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_dropout_draws_once_per_call_whatever_the_chunking(chunk_size):
    cnn = _dropout_cnn().train()
    x = _randn(2, 2, 4, 4)

    def seeded(x):
        torch.manual_seed(123)
        return cnn(x)

    expected = torch_diagonal_blocks(seeded, (x,))
    seeded(x)
    after_one_forward = torch.get_rng_state()
    for mode in ("fwd", "rev"):
        torch.manual_seed(123)
        got = jacobian(cnn, mode=mode, chunk_size=chunk_size)(x)
        np.testing.assert_allclose(got.detach(), expected, rtol=1e-12, atol=1e-15)
        assert torch.equal(torch.get_rng_state(), after_one_forward)
    for method in ("exact", "sparse"):
        torch.manual_seed(123)
        div = divergence(cnn, method=method, chunk_size=chunk_size)(x)
        np.testing.assert_allclose(div.detach(), traces(expected, (2, 4, 4)), rtol=1e-12)


# --- 6. rules: no false coupling, no dense fallback (warnings are errors) ---------------------


def _f32_vs_f64(make, x64, transform, reference, rtol=2e-4):
    """``transform`` of the float32 module against ``reference`` of its float64 copy."""
    m32 = make().float()
    m64 = copy.deepcopy(m32).double()
    got = transform(m32, x64.float())
    np.testing.assert_allclose(got.detach().double(), reference(m64, x64), rtol=rtol, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recurrent_layers_are_per_sample(cls, dtype):
    """oneDNN's LSTM kernel (float32 on CPU) has no rule nor forward derivative: traced and
    differentiated without it."""
    torch.manual_seed(0)
    x = _randn(2, 4, 3)

    def make():
        torch.manual_seed(0)
        return cls(3, 3, num_layers=2, batch_first=True)

    def out(m):
        return lambda x: m(x)[0]

    def energy(m):
        return lambda x: m(x)[0].pow(2).sum((1, 2))

    if dtype == torch.float64:
        m = make().double()
        assert sparsity(out(m))(x).is_batch_independent
        _close(jacobian(out(m))(x), out(m), (x,))
        np.testing.assert_allclose(
            divergence(out(m))(x).detach(), traces(torch_diagonal_blocks(out(m), (x,)), (4, 3))
        )
        np.testing.assert_allclose(laplacian(energy(m))(x).detach(), _hessian_traces(energy(m), x))
        return
    _f32_vs_f64(
        make, x, lambda m, x: jacobian(out(m))(x), lambda m, x: torch_diagonal_blocks(out(m), (x,))
    )
    _f32_vs_f64(
        make,
        x,
        lambda m, x: divergence(out(m))(x),
        lambda m, x: traces(torch_diagonal_blocks(out(m), (x,)), (4, 3)),
    )
    _f32_vs_f64(
        make,
        x,
        lambda m, x: laplacian(energy(m))(x),
        lambda m, x: _hessian_traces(energy(m), x),
        rtol=1e-3,
    )


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_laplacian_through_upsampling(mode):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1), nn.Upsample(scale_factor=2, mode=mode), nn.Tanh()
    ).double()

    def u(x):
        return net(x).pow(2).sum((1, 2, 3))

    x = _randn(2, 2, 3, 3)
    expected = _hessian_traces(u, x)
    for method in ("exact", "sparse"):
        np.testing.assert_allclose(laplacian(u, method=method)(x).detach(), expected, rtol=1e-9)


def _attention_cases():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    return {
        "sdpa": lambda x: F.scaled_dot_product_attention(x, x, x),
        "sdpa_causal": lambda x: F.scaled_dot_product_attention(x, x.flip(1), x, is_causal=True),
        "mha": lambda x: mha(x, x, x, need_weights=False)[0],
        "mha_weights": lambda x: mha(x, x, x)[0],
        "encoder": enc,
    }


@pytest.mark.parametrize("case", list(_attention_cases()))
def test_attention_is_per_sample(case):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = _attention_cases()[case]
    x = _randn(2, 3, 8)
    assert sparsity(f)(x).is_batch_independent
    for mode in ("rev", "fwd"):  # the fused kernels have no forward derivative: divjac's
        _close(jacobian(f, mode=mode)(x), f, (x,))  # passes use the math one

    def u(x):
        return f(x).pow(2).sum((1, 2))

    with sdpa_kernel(SDPBackend.MATH):  # the reference's second derivatives
        expected = _hessian_traces(u, x)
    np.testing.assert_allclose(laplacian(u)(x).detach(), expected, rtol=1e-9)


@pytest.mark.parametrize("norm", ["group", "layer"])
def test_normalization_layers(norm):
    torch.manual_seed(0)
    layer = (nn.GroupNorm(2, 4) if norm == "group" else nn.LayerNorm((4, 3, 3))).double()
    x = _randn(2, 4, 3, 3)
    _close(jacobian(layer)(x), layer, (x,))

    def u(x):
        return torch.tanh(layer(x)).sum((1, 2, 3))

    np.testing.assert_allclose(laplacian(u)(x).detach(), _hessian_traces(u, x), rtol=1e-9)


def _linalg_cases():
    A = _randn(4, 4, seed=5) + 4 * torch.eye(4, dtype=D)
    L = torch.linalg.cholesky(A @ A.T)
    return {
        "solve_columns": lambda x: torch.linalg.solve(A, x.unsqueeze(-1)).squeeze(-1),
        "solve_transposed": lambda x: torch.linalg.solve(A, x.T).T,
        "solve_left_false": lambda x: torch.linalg.solve(A, x, left=False),
        "solve_batched_matrix": lambda x: torch.linalg.solve(
            x.reshape(-1, 2, 2) + 3 * torch.eye(2, dtype=D), torch.ones(x.shape[0], 2, dtype=D)
        ),
        "inv": lambda x: torch.linalg.inv(x.reshape(-1, 2, 2) + 3 * torch.eye(2, dtype=D)).reshape(
            -1, 4
        ),
        "inv_constant": lambda x: x @ torch.linalg.inv(A),
        "cholesky_solve": lambda x: torch.cholesky_solve(x.unsqueeze(-1), L).squeeze(-1),
    }


@pytest.mark.parametrize("case", list(_linalg_cases()))
def test_linear_algebra(case):
    f = _linalg_cases()[case]
    x = _randn(3, 4)
    assert sparsity(f)(x).is_batch_independent
    for mode in ("auto", "fwd", "rev") if case != "solve_columns" else ("auto", "fwd"):
        _close(jacobian(f, mode=mode)(x), f, (x,))
    if case != "solve_batched_matrix":  # (3, 4) -> (3, 2)
        np.testing.assert_allclose(
            divergence(f)(x).detach(), traces(torch_diagonal_blocks(f, (x,)), (4,)), rtol=1e-10
        )


def test_expanded_input():
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 3, 3)).double()
    x = _randn(1, 3, 5, 5).expand(4, 3, 5, 5)
    expected = torch_diagonal_blocks(cnn, (x.contiguous(),))
    for mode in ("fwd", "rev"):
        np.testing.assert_allclose(jacobian(cnn, mode=mode)(x).detach(), expected, rtol=1e-10)
    same = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Tanh()).double()
    np.testing.assert_allclose(
        divergence(same)(x).detach(),
        traces(torch_diagonal_blocks(same, (x.contiguous(),)), (3, 5, 5)),
        rtol=1e-10,
    )


def test_subgraph_operations_are_dense_not_empty():
    """``torch.cond`` is traced as a higher-order operation without a rule: assumed dense,
    never empty (the pattern must cover the truth)."""
    from divjac import DenseFallbackWarning

    def f(x):
        return torch.cond(x.sum() > 0, lambda x: torch.sin(x), lambda x: torch.cos(x), (x,))

    x = _randn(3, 4)
    with pytest.warns(DenseFallbackWarning, match="cond"):
        pattern = sparsity(f)(x)
    assert pattern.nnz == 16


# --- 7. value-dependent control flow ----------------------------------------------------------


def test_value_dependent_branches_are_traced_once_each(traces_made):
    W = _randn(3, 3)

    def f(x):
        if (x @ W).sum() > 0:
            return torch.tanh(x @ W)
        return torch.cumsum(x, 1) * 2.0

    x = _randn(4, 3, seed=13)
    xs = [x, -x, x * 2, -x * 3, x]
    first = None
    for xi in xs:
        _close(jacobian(f)(xi), f, (xi,))
        first = traces_made[0] if first is None else first
    assert traces_made[0] == first + 1  # the other branch, once
    W.copy_(-W)  # the condition reads W: its values select the branch
    for xi in xs[:2]:
        _close(jacobian(f)(xi), f, (xi,))
    assert traces_made[0] == first + 1


def test_values_that_change_every_call_are_traced_every_call_and_warned():
    def f(x):
        return x * torch.tanh(x).abs().max().item()  # a new constant in every trace

    with pytest.warns(RetraceWarning, match="control flow depends on values"):
        for seed in range(2 * _detect._MAX_BRANCHES):
            x = _randn(2, 3, seed=seed)
            np.testing.assert_allclose(
                divergence(f)(x), traces(torch_diagonal_blocks(f, (x,)), (3,))
            )


class _Slotted:
    """An object with ``__slots__`` and no ``__weakref__`` (as OpInfo's ``SampleInput``): the
    walk can neither follow its attributes nor hold it by identity."""

    __slots__ = ("dim",)

    def __init__(self, dim: int) -> None:
        self.dim = dim


class _SlottedValue:
    """An immutable value with ``__slots__`` and no ``__weakref__`` (as ``inspect.Signature``
    or a path, which decorators and module globals hold): equal by its contents."""

    __slots__ = ("_dim",)

    def __init__(self, dim: int) -> None:
        object.__setattr__(self, "_dim", dim)

    @property
    def dim(self) -> int:
        return self._dim

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SlottedValue) and other._dim == self._dim

    def __hash__(self) -> int:
        return hash(self._dim)


def test_a_value_the_walk_cannot_follow_is_keyed_by_its_value(traces_made):
    """``f`` reads its option from a value that the walk can neither follow nor hold weakly:
    the trace is reused while the value is equal (a diffusers UNet2DModel reaches an
    ``inspect.Signature`` and a path through its methods' globals: traced at every call,
    0.7-0.9 s each, before), and a different value is differentiated anew."""
    x = _randn(5, 5, 5)
    options = _SlottedValue(0)

    def f(x):
        return torch.logcumsumexp(x, options.dim)

    for _ in range(3):
        got = jacobian(f, batch_axis=None, mode="sparse")(x)
        torch.testing.assert_close(got, torch.func.jacrev(f)(x), rtol=1e-12, atol=1e-12)
    assert traces_made[0] == 1
    options = _SlottedValue(0)  # rebound to an equal value: the same trace
    jacobian(f, batch_axis=None, mode="sparse")(x)
    assert traces_made[0] == 1
    options = _SlottedValue(2)  # a different value: traced again, fresh
    got = jacobian(f, batch_axis=None, mode="sparse")(x)
    torch.testing.assert_close(got, torch.func.jacrev(f)(x), rtol=1e-12, atol=1e-12)
    assert traces_made[0] == 2


_MISSING = object()  # a sentinel, as libraries keep them (transformers' configurations)


def test_a_sentinel_is_keyed_by_identity(traces_made):
    """A bare ``object()`` (stateless; no weak reference) among what ``f`` reaches: the trace
    is reused (a transformers ``BertModel`` reaches one through its configuration's
    ``__getattribute__``: traced at every call, 170 ms each against 3.5 ms), and a changed
    option next to it is seen."""
    x = _randn(4, 5)
    options = {"dim": 1, "unset": _MISSING}

    def f(x):
        dim = options.get("dim", _MISSING)
        return torch.logcumsumexp(x, 0 if dim is _MISSING else dim)

    for _ in range(3):
        got = jacobian(f, batch_axis=None, mode="sparse")(x)
        torch.testing.assert_close(got, torch.func.jacrev(f)(x), rtol=1e-12, atol=1e-12)
    assert traces_made[0] == 1
    options["dim"] = 0
    got = jacobian(f, batch_axis=None, mode="sparse")(x)
    torch.testing.assert_close(got, torch.func.jacrev(f)(x), rtol=1e-12, atol=1e-12)
    assert traces_made[0] == 2


def test_an_object_the_walk_cannot_tell_apart_is_traced_at_every_call():
    """``f`` reads its option from a ``__slots__`` object: changed in place or rebound, the
    next call differentiates the new ``f`` (the trace was reused: dim 0's Jacobian for dim 1,
    error 1.0, in the OpInfo sweep's pattern of a lambda over a global sample)."""
    x = _randn(5, 5, 5)
    options = _Slotted(0)

    def f(x):
        return torch.logcumsumexp(x, options.dim)

    for change in (lambda: setattr(options, "dim", 1), lambda: setattr(options, "dim", 2)):
        got = jacobian(f, batch_axis=None, mode="sparse")(x)
        torch.testing.assert_close(got, torch.func.jacrev(f)(x), rtol=1e-12, atol=1e-12)
        change()
    options = _Slotted(0)  # rebound
    # The third uncached trace says why the calls are slow, naming the object's type.
    with pytest.warns(RetraceWarning, match=r"object of type .*_Slotted .* traced again"):
        got = jacobian(f, batch_axis=None, mode="sparse")(x)
    torch.testing.assert_close(got, torch.func.jacrev(f)(x), rtol=1e-12, atol=1e-12)
