"""divjac's torch transforms under ``torch.compile(fullgraph=True)``: the setup (tracing,
detection, planning) is evaluated ahead of dynamo's trace, the passes are compiled; results and
parameter gradients equal eager ones (float64)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import divjac
import divjac.torch as dj

pytestmark = pytest.mark.filterwarnings(
    # torch's own notice when dynamo traces a training step with autograd ops inside.
    "ignore::UserWarning:torch._dynamo"
)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _grads(net: nn.Module) -> list[torch.Tensor]:
    found = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    return found


def _x() -> torch.Tensor:
    return torch.as_tensor(
        [[0.1, -0.4, 0.3, 0.9], [0.5, 0.2, -0.7, 0.0], [-0.3, 0.8, 0.1, -0.2]], dtype=torch.float64
    )


def _losses(net: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    probes = torch.linspace(-1.0, 1.0, 24, dtype=torch.float64).reshape(2, 3, 4)
    many = torch.cos(torch.arange(48, dtype=torch.float64)).reshape(4, 3, 4)

    def value_and_div(x: torch.Tensor) -> torch.Tensor:
        y, div = dj.value_and_divergence(net)(x)
        return (y.sum(1) * div).sum()

    A = torch.eye(4, dtype=torch.float64) + 0.1
    factor = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64).reshape(4, 2)
    return {
        "exact": lambda x: (dj.divergence(net, method="exact")(x) ** 2).sum(),
        "laplacian": lambda x: (dj.laplacian(net)(x) ** 2).sum(),
        "weighted_laplacian": lambda x: (dj.weighted_laplacian(net, A)(x) ** 2).sum(),
        "weighted_laplacian_factor": lambda x: (
            dj.weighted_laplacian(net, factor=factor)(x) ** 2
        ).sum(),
        "sparse": lambda x: (dj.divergence(net, method="sparse")(x) ** 2).sum(),
        "hutchinson": lambda x: (
            dj.divergence(net, method="hutchinson", num_probes=2)(probes, x) ** 2
        ).sum(),
        "value_and_divergence": value_and_div,
        "jacobian": lambda x: (dj.jacobian(net)(x) ** 2).sum(),
        "jacobian_fwd": lambda x: (dj.jacobian(net, mode="fwd")(x) ** 2).sum(),
        "divergence_rev": lambda x: (dj.divergence(net, mode="rev")(x) ** 2).sum(),
        "grad_divergence": lambda x: (dj.grad_divergence(net)(x) ** 2).sum(),
        # num_probes is the matvec budget: 6 takes 4 random vectors (Hutch++), 3 (XTrace)
        "hutch++": lambda x: (
            dj.divergence(net, method="hutch++", num_probes=6)(many[:4], x) ** 2
        ).sum(),
        "xtrace": lambda x: (
            dj.divergence(net, method="xtrace", num_probes=6)(many[:3], x) ** 2
        ).sum(),
        "slq": lambda x: (
            dj.log_abs_det(net, method="slq", lanczos_steps=3)(many[:2], x) ** 2
        ).sum(),
    }


def _check_compiled(
    loss: Callable[[torch.Tensor], torch.Tensor], net: nn.Module, *, backend: str = "aot_eager"
) -> None:
    x = _x()
    expected = loss(x)
    expected.sum().backward()
    want = _grads(net)
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    got = compiled(x)
    got.sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    for g, w in zip(_grads(net), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    # A second call runs the compiled graph with the weights as they are now.
    with torch.no_grad():
        net[0].weight.mul_(0.5)
    torch.testing.assert_close(compiled(x), loss(x), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_compiled_transforms_equal_eager() -> None:
    """Every target in one compiled function (one compilation: dynamo is slow)."""
    net = _mlp()
    losses = _losses(net)
    _check_compiled(lambda x: torch.stack([f(x) for f in losses.values()]), net)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_losses(nn.Identity())))
def test_each_compiled_transform_equals_eager(name: str) -> None:
    net = _mlp()
    _check_compiled(_losses(net)[name], net)


@pytest.mark.parametrize("name", ["grad_divergence", "exact", "laplacian"])
def test_first_call_inside_the_compiled_function(name: str) -> None:
    """No eager call first: the set-up traces the function while dynamo traces the call. Its
    fake trace failed inside dynamo's tracing context (a parameter is a foreign real tensor to
    dynamo's fake mode), so the trace was taken for a value-dependent one, which the gradient
    of a divergence could not use on its transform's inputs (a raw AssertionError)."""
    from divjac.torch import _detect

    _detect.CACHE.clear()
    _detect.clear_memos()
    net = _mlp()
    loss = _losses(net)[name]
    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(_x())
    torch.testing.assert_close(got, loss(_x()), rtol=1e-12, atol=1e-14)


def test_slq_log_abs_det_compiles() -> None:
    """SLQ with the caller's probes: its setup asked a bound method ahead of dynamo's trace,
    which returned a set (raw ``InternalTorchDynamoError``; with ``fullgraph``,
    "assume_constant_result argument conversion failed")."""
    net = _mlp()
    loss = _losses(net)["slq"]
    x = _x()
    expected = loss(x)
    expected.backward()
    want = _grads(net)
    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(x)
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    for g, w in zip(_grads(net), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


_PRODUCT_BY_T = textwrap.dedent(
    """
    import torch, divjac.torch as dj

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, t = torch.randn(8, 2), torch.rand(8, 1)
    u = lambda t, x: torch.tanh(net(x * t)).squeeze(1) * t.squeeze(1)
    for transform in (dj.laplacian(u, argnums=1), dj.hessian_diagonal(u, argnums=1),
                      dj.bilaplacian(u, argnums=1)):
        got = torch.compile(lambda t, x: transform(t, x))(t, x)
        print("ran" if torch.allclose(got, transform(t, x), rtol=1e-4, atol=1e-5) else "wrong")
    """
)


def test_a_product_by_t_compiles_with_inductor() -> None:
    """Compiled second-order transforms of ``net(x * t) * t``, ``t`` a tensor argument
    (docs/scaling.md's recipe for a number ``t``), with inductor: equal to eager. Their
    forward-mode sweeps (``vmap(jvp(jvp))``) made torch 2.13's inductor die with a
    segmentation fault, and divjac refused them; the compiled sweeps are transposed VJPs now.
    In a subprocess, in case it crashes."""
    result = subprocess.run(
        [sys.executable, "-c", _PRODUCT_BY_T],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert result.stdout.split() == ["ran"] * 3, result.stderr[-3000:]


def test_sparse_jacobian_names_the_compiler() -> None:
    sparse = dj.sparse_jacobian(_mlp())
    with pytest.raises(divjac.CompileError, match=r"jacobian\(f, mode='sparse'\)"):
        torch.compile(lambda x: sparse(x), backend="aot_eager")(_x())
    assert sparse(_x()).layout == torch.sparse_coo  # outside it


@pytest.mark.slow
def test_training_step_with_backward_inside() -> None:
    """A whole step (loss and ``backward``) compiled: dynamo traces autograd ops when asked."""
    net = _mlp()
    x = _x()

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = (dj.divergence(net, method="sparse")(x) ** 2).sum()
        loss.backward()
        return loss.detach()

    expected = step(x)
    want = _grads(net)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    for g, w in zip(_grads(net), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_compiled_module_is_unwrapped() -> None:
    """A ``torch.compile``d module gives the numbers of its original module."""
    net = _mlp()
    x = _x()
    compiled = torch.compile(net, backend="aot_eager")
    torch.testing.assert_close(dj.divergence(compiled)(x), dj.divergence(net)(x))
    torch.testing.assert_close(dj.jacobian(compiled)(x), dj.jacobian(net)(x))


def test_a_compiled_module_inside_the_function() -> None:
    """A closure that calls a ``torch.compile``d module: divjac's trace failed (dynamo refuses
    a symbolic trace of it: "Detected that you are using FX to symbolically trace a
    dynamo-optimized function"); it now traces the module's own code, and every transform
    gives the eager module's numbers."""
    net = _mlp()
    x = _x()
    compiled = torch.compile(net, backend="aot_eager")
    torch.testing.assert_close(
        dj.divergence(lambda z: compiled(z).tanh())(x), dj.divergence(lambda z: net(z).tanh())(x)
    )
    for mode in ("fwd", "rev"):
        got = dj.jacobian(lambda z: 2 * compiled(z), mode=mode)(x)
        torch.testing.assert_close(got, dj.jacobian(lambda z: 2 * net(z))(x))
    torch.testing.assert_close(
        dj.laplacian(lambda z: compiled(z).sin().sum(-1))(x),
        dj.laplacian(lambda z: net(z).sin().sum(-1))(x),
    )


@pytest.mark.slow
def test_attention_and_layer_norm_compile() -> None:
    """A transformer block: the math attention kernel and the composed layer norms of the
    passes are entered in a form dynamo traces (an ``ExitStack`` of them was not)."""
    torch.manual_seed(0)
    net = nn.TransformerEncoderLayer(
        d_model=4, nhead=2, dim_feedforward=8, dropout=0.0, batch_first=True
    ).double()
    net.eval()
    x = _x()[:2].reshape(2, 2, 2).repeat(1, 1, 2)  # (samples, tokens, features)
    probes = torch.linspace(-1.0, 1.0, 2 * x.numel(), dtype=torch.float64).reshape(2, *x.shape)

    def loss(x: torch.Tensor) -> torch.Tensor:
        exact = dj.divergence(net, method="exact")(x)
        fwd = dj.divergence(net, method="hutchinson", num_probes=2, mode="fwd")(probes, x)
        return torch.stack([(exact**2).sum(), (fwd**2).sum()])

    expected = loss(x)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.slow
@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
def test_transformer_fast_path_is_off_when_compiled_without_grad(grad: str) -> None:
    """A transformer block in eval mode, its compiled forward passes called under ``no_grad``
    or ``inference_mode``, and its compiled Laplacian sweep: the layer's fused fast path (``_transformer_encoder_layer_fwd``,
    with no forward derivative) is switched off under ``torch.compile`` as in eager (dynamo
    raised "Trying to use forward AD with aten::_transformer_encoder_layer_fwd")."""
    torch.manual_seed(0)
    net = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
    net = net.double().eval()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    jac = dj.jacobian(net, mode="fwd")
    lap = dj.laplacian(lambda x: torch.sin(net(x)).flatten(1).sum(1))  # (the compiled sweep)
    for transform in (jac, lap):
        compiled = torch.compile(lambda x, t=transform: t(x), fullgraph=True, backend="aot_eager")
        with torch.no_grad() if grad == "no_grad" else torch.inference_mode():
            got = compiled(x)
        torch.testing.assert_close(got, transform(x).detach(), rtol=1e-12, atol=1e-13)
    assert torch.backends.mha.get_fastpath_enabled()  # and switched back on


@pytest.mark.parametrize("method", ["sparse", "hutchinson"])
def test_hessian_diagonal_by_hessian_vector_products_compiles(method: str) -> None:
    """``hessian_diagonal`` by Hessian-vector products of the gradient (one per diagonal
    colour, or per probe) under ``torch.compile``: their seeds, direction and chunks are
    planned ahead of dynamo's trace (dynamo raised a raw ``NameError`` keying the seeds'
    cache on the colours' ``id``, and could not guard the gradient's spec nor the trace's
    weak references)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = _x()
    probes = torch.randn(2, *x.shape, dtype=torch.float64)
    diag = dj.hessian_diagonal(lambda x: net(x).sum(1), method=method, num_probes=2)
    lead = (probes,) if method == "hutchinson" else ()
    compiled = torch.compile(lambda x: diag(*lead, x), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), diag(*lead, x), rtol=1e-12, atol=1e-14)


@pytest.mark.slow  # two dynamo traces of a fourth-order sweep: ~20 s on a loaded machine
def test_compiled_hutchinson_bilaplacian_maps_its_probes() -> None:
    """The probes of a compiled Hutchinson ``bilaplacian`` are a batch axis: the program dynamo
    traces is the same at 2 and 4 probes (a Python loop unrolled them: compile time grew
    linearly with ``num_probes``, 61 s at 2 probes, 150 s at 16, against 41 s and 45 s now on a
    loaded 2-core machine), and equals the eager estimate of the same draws."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = _x()[:, :3]
    nodes = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        nodes.append(len(gm.graph.nodes))
        return gm.forward

    for k in (2, 4):
        bl = dj.bilaplacian(lambda x: net(x).sum(1), method="hutchinson", num_probes=k)
        torch._dynamo.reset()
        torch.manual_seed(1)
        got = torch.compile(lambda x, bl=bl: bl(None, x), fullgraph=True, backend=counting)(x)
        torch.manual_seed(1)
        torch.testing.assert_close(got, bl(None, x), rtol=1e-12, atol=1e-12)
    assert nodes[0] == nodes[1], nodes


def test_derivative_compiles_under_inference_mode() -> None:
    """A compiled ``derivative`` called under ``torch.inference_mode``: the transform's
    coefficients reach the passes as a setup's constant (read from its closure, dynamo
    guarded the NumPy array as a tensor, and the guard failed as it was made: "Guard failed
    on the same frame it was created")."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    x = _x()
    d = dj.derivative(lambda x: net(x).sum(1), (0, 1))
    compiled = torch.compile(lambda x: d(x), fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        got = compiled(x)
    torch.testing.assert_close(got, d(x).detach(), rtol=1e-12, atol=1e-14)


def test_train_eval_switch_recompiles() -> None:
    """Dropout in eval mode compiles; in training mode the compiled passes refuse it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Tanh()).double().eval()
    x = _x()
    loss = torch.compile(lambda x: dj.divergence(net)(x).sum(), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(loss(x), dj.divergence(net)(x).sum())
    net.train()
    # dynamo wraps what the setup raised (InternalTorchDynamoError), its message kept
    with pytest.raises(Exception, match=r"CompileError: divjac under torch\.compile.*random"):
        loss(x)


@pytest.mark.slow  # ~50 s of inductor compilation on a loaded 2-core machine
# inductor's own import of TorchScript pieces (torch 2.13)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_matches_eager() -> None:
    net = _mlp()
    loss = _losses(net)["sparse"]
    x = _x()
    expected = loss(x)
    got = torch.compile(loss, fullgraph=True, backend="inductor")(x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_a_python_number_argument_changing_between_compiled_calls() -> None:
    """``t`` as a float, new at each call of a ``fullgraph`` step compiled with
    ``dynamic=False`` (as docs/scaling.md says): each value compiles its own set-up, and every
    result is the eager one (with the default, dynamo makes ``t`` dynamic at the first
    recompile and the set-up cannot take it as a constant)."""
    net = _mlp()

    def u(x: torch.Tensor, t: float) -> torch.Tensor:
        return net(x + torch.full_like(x, t)).sum(1)  # (x * t: see docs/scaling.md)

    lap = dj.laplacian(u)
    step = torch.compile(lambda x, t: lap(x, t), fullgraph=True, dynamic=False, backend="aot_eager")
    x = _x()
    for t in (0.5, 1.5, 2.5):
        torch.testing.assert_close(step(x, t), lap(x, t), rtol=1e-12, atol=1e-14)


def test_batch_norm_in_eval_mode_compiles() -> None:
    """A network with batch normalization in eval mode compiles (its running statistics are not
    updated: nothing to keep still), equal to eager; switched to training mode it is refused,
    naming training mode (it was refused in eval mode too, with advice to use eval mode)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4))
    net = net.double().eval()
    x = _x()
    jac = dj.jacobian(net)
    compiled = torch.compile(lambda x: jac(x), fullgraph=True, backend="aot_eager")
    want = torch.func.vmap(torch.func.jacrev(lambda s: net(s[None])[0]))(x)
    torch.testing.assert_close(compiled(x), want)
    net.train()
    with pytest.raises(Exception, match=r"CompileError: .*batch normalization in training mode"):
        compiled(x)


def test_compile_is_refused_naming_the_release(monkeypatch) -> None:
    """On a torch whose dynamo cannot evaluate divjac's setup ahead of its trace (2.11), a
    compiled transform raises :class:`~divjac.CompileError` naming the release it needs and the
    upstream defect (dynamo wraps it, its message kept), and the transform still runs outside
    the compiled region (:func:`test_compiles_says_where_dynamo_falls_short`: which torch)."""
    from divjac.torch import _backend, _compat

    if _compat.COMPILES:
        monkeypatch.setattr(_backend, "COMPILES", False)
    net = _mlp()
    f = dj.divergence(net)
    needs = r"CompileError: divjac under torch\.compile needs 2\.13.*pytorch/pytorch#173103"
    with pytest.raises(Exception, match=needs):
        torch.compile(lambda x: f(x), fullgraph=True, backend="aot_eager")(_x())
    want = torch.func.vmap(lambda s: torch.func.jacrev(net)(s).trace())(_x())
    torch.testing.assert_close(f(_x()), want)


@dataclasses.dataclass(frozen=True)
class _Frozen:
    scale: torch.Tensor

    def __call__(self, row: torch.Tensor) -> torch.Tensor:
        return row * self.scale


def _module_to_a_constant_function(x: torch.Tensor) -> torch.Tensor:
    """A module passed to a function dynamo evaluates as a constant (pytorch/pytorch#173103)."""
    return x * _width(_LINEAR)


def _truth_of_a_set_off_a_constant(x: torch.Tensor) -> torch.Tensor:
    """A set read off the result of a function dynamo evaluates as a constant, tested."""
    return x + 1 if _kinds().kinds else x


def _frozen_dataclass_inside_vmap(x: torch.Tensor) -> torch.Tensor:
    """A method of a frozen dataclass made in the region, called inside ``vmap``, reading a
    field (pytorch/pytorch#173221)."""
    frozen = _Frozen(x.sum())
    return torch.func.vmap(lambda row: frozen(row))(x)


def _locals_read(x: torch.Tensor) -> torch.Tensor:
    """``locals()``, which divjac's public functions read to make a transform."""
    return x * len(locals())


@torch._dynamo.assume_constant_result
def _width(module: nn.Module) -> int:
    return int(module.in_features)


@torch._dynamo.assume_constant_result
def _kinds() -> Any:
    return types.SimpleNamespace(kinds=frozenset({"layer"}))


_LINEAR = nn.Linear(3, 2)


@pytest.mark.parametrize(
    "gap",
    [
        _module_to_a_constant_function,
        _truth_of_a_set_off_a_constant,
        _frozen_dataclass_inside_vmap,
        _locals_read,
    ],
)
def test_compiles_says_where_dynamo_falls_short(gap: Callable[..., torch.Tensor]) -> None:
    """``COMPILES`` is false exactly on a torch whose dynamo falls short of what divjac's
    compiled transforms need (torch 2.11: each of these fails, a ``CompileError`` is the
    answer there); 2.13 and later compile each of them."""
    from divjac.torch import _compat

    x = torch.ones(2, 3)
    compiled = torch.compile(gap, fullgraph=True, backend="eager")
    if _compat.COMPILES:
        torch.testing.assert_close(compiled(x), gap(x))
    else:
        with pytest.raises(torch._dynamo.exc.TorchDynamoException):
            compiled(x)


class _Gain(nn.Module):
    """A 0-d parameter multiplying the output (as a time-dependent model's gain)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.gain * y


def _fourth_order(net: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    u = lambda x: net(x).squeeze(-1)  # noqa: E731
    op = dj.differential_operator(u, [(1.0, (0, 0, 0)), (2.0, (1, 1, 1, 1))])
    return {
        "bilaplacian": lambda x: (dj.bilaplacian(u)(x) ** 2).sum(),
        "differential_operator": lambda x: (op(x) ** 2).sum(),
    }


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("bilaplacian", "aot_eager"),
        ("bilaplacian", "inductor"),
        ("differential_operator", "aot_eager"),
    ],
)
def test_fourth_order_terms_of_a_function_with_parameters_compile(name: str, backend: str) -> None:
    """A sweep of a sweep (``bilaplacian``, third and fourth orders of ``differential_operator``)
    of a function multiplying by a parameter: four forward-mode levels failed in dynamo's fake
    tensors (torch 2.13 and 2.14.1: an internal assert in ``_fw_primal``); both sweeps are
    transposed VJPs under compile. Values and parameter gradients equal eager ones, also after
    an in-place update of the weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1), _Gain()).double()
    loss = _fourth_order(net)[name]
    x = _x()
    expected = loss(x)
    expected.backward()
    want = _grads(net)
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    got = compiled(x)
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for g, w in zip(_grads(net), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        net[0].weight.mul_(0.5)
        net[3].gain.add_(0.25)
    torch.testing.assert_close(compiled(x), loss(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(
            "fwd",
            marks=pytest.mark.xfail(
                strict=True,
                raises=torch._dynamo.exc.BackendCompilerFailed,
                reason="issue 41, open: torch 2.13 and 2.14.1 fail to compile the gradient of "
                "forward passes of a function multiplying x by a number ('convert all Tensors "
                "to FakeTensors'; a hand-written grad(vmap(jvp(f))) too): mode='rev' compiles",
            ),
        ),
        "rev",
    ],
)
def test_grad_divergence_of_a_scaled_input_compiles(mode: str) -> None:
    """``grad_divergence`` of ``f(x * 1.1)`` with parameters that require grad, compiled:
    equal to eager, with reverse passes (the way out of the open forward-mode defect)."""
    net = _mlp()
    gd = dj.grad_divergence(lambda x: net(x * 1.1), mode=mode)
    _check_compiled(lambda x: (gd(x) ** 2).sum(), net)


def test_differential_operator_of_attention_compiles() -> None:
    """``differential_operator`` of an ``nn.MultiheadAttention`` block, compiled: equal to eager
    (the context matrix's compiled transformer case, smallest form). Issue 41: forward mode,
    ``vmap`` over ONE direction of ``jvp`` of ``jvp``, failed there (torch 2.13 and 2.14.1:
    dynamo runs ``multi_head_attention_forward`` as one node on fake tensors, where ``bmm``'s
    zero tangent is made on device 'meta'); the compiled sweep is a transposed VJP."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(4, 2, batch_first=True).eval()
    op = dj.differential_operator(
        lambda x: attn(x, x, x, need_weights=False)[0].sin().flatten(1).sum(1),
        [(1.0, (0, 0))],
        method="exact",
    )
    x = torch.randn(2, 3, 4)
    compiled = torch.compile(lambda x: op(x), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), op(x))


def test_a_transform_made_inside_the_compiled_step(monkeypatch) -> None:
    """``divergence(lambda z: net(z) * t)`` written in the compiled step, its lambda reading a
    module and a tensor (globals here: closure cells of the step cannot be set up ahead of the
    trace, docs/scaling.md): equal to eager, without a warning (the public API's parameter
    table was a ``functools`` cache, on which dynamo warns: "a call to a
    `functools.lru_cache`-wrapped function")."""
    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())  # dynamo warns once a process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.compile(_step_making_a_transform, fullgraph=True, backend="aot_eager")(_x())
    torch.testing.assert_close(got, _step_making_a_transform(_x()), rtol=1e-12, atol=1e-14)


_STEP_NET, _STEP_T = _mlp(), torch.tensor(0.5, dtype=torch.float64)


def _step_making_a_transform(x: torch.Tensor) -> torch.Tensor:
    return dj.divergence(lambda z: _STEP_NET(z) * _STEP_T)(x)


def _second_order(net: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    u = lambda x: net(x).sum(-1)  # noqa: E731
    op = dj.differential_operator(u, [(1.0, (0, 0)), (1.0, (1, 1)), (0.5, (2,))])
    return {
        "laplacian": lambda x: dj.laplacian(u)(x).sum(),
        "differential_operator": lambda x: op(x).sum(),
    }


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("laplacian", "aot_eager"),
        ("differential_operator", "aot_eager"),
        pytest.param(
            "differential_operator",
            "inductor",
            marks=[
                pytest.mark.slow,
                # inductor's own import of TorchScript pieces (torch 2.13)
                pytest.mark.filterwarnings(
                    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
                ),
            ],
        ),
    ],
)
def test_second_order_terms_of_a_function_with_parameters_compile(name: str, backend: str) -> None:
    """The second-order sweep (``laplacian``, ``differential_operator`` with a first-order
    term) of a function multiplying by a 0-d parameter: the backward of forward-mode sweeps
    failed in AOT autograd (torch 2.13 and 2.14.1, 'convert all Tensors to FakeTensors'; a
    hand-written ``vmap(jvp(jvp(u)))`` too), and a JVP beside a reverse sweep crashed inductor.
    Values and parameter gradients equal eager ones, also after an in-place update of the weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2), _Gain()).double()
    _check_compiled(_second_order(net)[name], net, backend=backend)


@pytest.mark.parametrize("which", ["jacobian", "hessian"])
def test_sparse_decompression_compiles(which: str) -> None:
    """A sparse plan's decompression under ``torch.compile(fullgraph=True)``: ``jacobian`` of a
    convolution network with ``mode="sparse"``, a sparse Hessian of a sum over pairs of
    coordinates. The plan's index arrays (NumPy, made ahead of dynamo's trace) were read inside
    it: raw 'Failed to convert args/kwargs to proxy' (found by the context matrix). Equal to
    eager, also after an in-place update of the weights."""
    torch.manual_seed(0)
    if which == "jacobian":
        net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 1, 3, padding=1))
        transform = dj.jacobian(net.double(), mode="sparse")
        x = torch.randn(2, 1, 6, 6, dtype=torch.float64)
    else:
        net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        transform = dj.hessian(lambda x: net(x.reshape(-1, 3, 2)).sum((1, 2)), mode="sparse")
        x = torch.randn(2, 6, dtype=torch.float64)
    compiled = torch.compile(lambda x: transform(x), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), transform(x), rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        net[0].weight.mul_(0.5)
    torch.testing.assert_close(compiled(x), transform(x), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
def test_compiled_second_order_records_nothing_without_grad(grad: str) -> None:
    """A compiled ``hessian_diagonal`` called under ``no_grad`` / ``inference_mode``: the
    values of eager, and no autograd history (its transposed VJPs run with grad on, through
    the parameters; found by the context matrix)."""
    net = _mlp()
    diagonal = dj.hessian_diagonal(lambda x: net(x).sum(1))
    compiled = torch.compile(lambda x: diagonal(x), fullgraph=True, backend="aot_eager")
    with torch.no_grad() if grad == "no_grad" else torch.inference_mode():
        got, want = compiled(_x()), diagonal(_x())
    assert not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
