"""Attention models in PyTorch: ``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``
(batch first or not), ``nn.TransformerEncoderLayer`` and a diffusers ``UNet2DModel`` score
network. Every method, in either direction, equals brute force (a loop over samples with
``torch.autograd.functional.jacobian``, float64, attention in its math kernel so that the
reference itself can differentiate twice). Attention over the tokens of one sample is
per-sample; attention across the batch is coupling and is refused.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import divjac.torch as dt
from divjac import BatchCouplingError, FastPathWarning
from divjac._core import estimators as est

from ..reference import torch_composed_norms, torch_diagonal_blocks

B, L, D, HEADS = 2, 4, 6, 2


class _SelfAttention(nn.Module):
    """One attention block on ``(B, L, D)`` tokens, by ``F.scaled_dot_product_attention``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], L, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).reshape(x.shape[0], L, D))


class _Mha(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class _AttentionResBlock(nn.Module):
    """A ResNet block with GroupNorm and attention over the pixels, as a diffusion U-Net has:
    the attention's output transposed back to an image is not contiguous."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.attn = nn.MultiheadAttention(c, 2, batch_first=True)
        self.proj = nn.Linear(c, c)
        self.norm = nn.GroupNorm(2, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        h1 = F.silu(self.conv(x))
        tokens = h1.flatten(2).transpose(1, 2)
        a = self.proj(self.attn(tokens, tokens, tokens, need_weights=False)[0])
        image = a.transpose(1, 2).reshape(n, c, h, w)  # channels last, as diffusers' blocks
        return x + self.norm(image)


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(D, HEADS, dim_feedforward=8, dropout=0.0, batch_first=True)
    return layer.eval()


# name: (model, batch_axis, input shape)
MODELS = {
    "sdpa": (_SelfAttention, 0, (B, L, D)),
    "mha_batch_first": (lambda: _Mha(True), 0, (B, L, D)),
    "mha_sequence_first": (lambda: _Mha(False), 1, (L, B, D)),
    "encoder_layer": (_encoder, 0, (B, L, D)),
    "resnet_attention_block": (_AttentionResBlock, 0, (B, 4, 3, 3)),
}


@pytest.fixture(params=sorted(MODELS), scope="module")
def model(request):
    make, axis, shape = MODELS[request.param]
    torch.manual_seed(0)
    m = make().double()
    x = torch.as_tensor(np.random.default_rng(0).normal(size=shape))
    return m, axis, x


def _batch_first(m, axis):
    return m if axis == 0 else (lambda x: m(x.movedim(0, axis)).movedim(axis, 0))


def _blocks(m, axis, x):
    """Brute-force per-sample Jacobians ``(B, n, n)``."""
    with sdpa_kernel(SDPBackend.MATH):
        J = torch_diagonal_blocks(_batch_first(m, axis), (x.movedim(axis, 0),))
    n = int(np.prod(J.shape[1 : 1 + (J.ndim - 1) // 2]))
    return J.reshape(len(J), n, n)


def _per_sample_divergences(m, axis, x):
    """``tr J_b`` per sample on the autograd graph of ``x`` and the parameters (brute force)."""
    g, xs = _batch_first(m, axis), x.movedim(axis, 0)
    traces = []
    for b in range(xs.shape[0]):

        def sample_out(xb, b=b):
            return g(torch.cat([xs[:b], xb[None], xs[b + 1 :]]))[b].reshape(-1)

        J = torch.autograd.functional.jacobian(sample_out, xs[b], create_graph=True)
        traces.append(J.reshape(J.shape[0], -1).trace())
    return torch.stack(traces)


@pytest.mark.parametrize(
    ("method", "mode"),
    [("exact", "fwd"), ("sparse", "rev"), pytest.param("auto", "auto", marks=pytest.mark.slow)],
)
def test_exact_divergence_equals_brute_force(model, method, mode):
    m, axis, x = model
    got = dt.divergence(m, batch_axis=axis, method=method, mode=mode)(x)
    want = np.trace(_blocks(m, axis, x), axis1=1, axis2=2)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("method", "mode"),
    [
        ("hutchinson", "rev"),
        pytest.param("hutch++", "fwd", marks=pytest.mark.slow),
        pytest.param("xtrace", "rev", marks=pytest.mark.slow),
    ],
)
def test_stochastic_divergence_equals_the_estimator_on_the_dense_jacobian(model, method, mode):
    m, axis, x = model
    J = _blocks(m, axis, x)
    n, num = J.shape[1], 6
    k = est.num_random_vectors(method, num, n)
    signs = np.random.default_rng(1).choice([-1.0, 1.0], size=(k, B, n))
    probes = torch.as_tensor(signs).reshape(k, *x.movedim(axis, 0).shape).movedim(1, axis + 1)
    fn = dt.divergence(m, batch_axis=axis, method=method, num_probes=num, mode=mode)
    got = fn(probes, x)
    J = np.swapaxes(J, 1, 2) if mode == "rev" else J
    want, _ = est.estimate_trace(method, lambda V: J @ V, np.moveaxis(signs, 0, -1))
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "mode",
    [
        "fwd",
        pytest.param("rev", marks=pytest.mark.slow),
        pytest.param("auto", marks=pytest.mark.slow),
    ],
)
def test_jacobian_equals_brute_force(model, mode):
    m, axis, x = model
    got = dt.jacobian(m, batch_axis=axis, mode=mode)(x)
    want = _blocks(m, axis, x)
    np.testing.assert_allclose(got.detach().numpy().reshape(want.shape), want, atol=1e-12)


def test_value_and_divergence_and_its_gradients_equal_brute_force(model):
    m, axis, x = model
    x = x.clone().requires_grad_()
    y, div = dt.value_and_divergence(m, batch_axis=axis)(x)
    np.testing.assert_allclose(y.detach().numpy(), m(x).detach().numpy(), atol=1e-13)
    params = [p for p in m.parameters() if p.requires_grad]
    got = torch.autograd.grad(div.sum(), [x, *params], materialize_grads=True)
    with sdpa_kernel(SDPBackend.MATH):
        want_div = _per_sample_divergences(m, axis, x)
        want = torch.autograd.grad(want_div.sum(), [x, *params], materialize_grads=True)
    np.testing.assert_allclose(div.detach().numpy(), want_div.detach().numpy(), rtol=1e-10)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-9, atol=1e-11)


def test_grad_divergence_in_either_direction_equals_brute_force(model):
    m, axis, x = model
    xg = x.clone().requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        (want,) = torch.autograd.grad(_per_sample_divergences(m, axis, xg).sum(), xg)
    for mode in ("fwd", "rev"):
        got = dt.grad_divergence(m, batch_axis=axis, mode=mode)(x)
        np.testing.assert_allclose(got.detach().numpy(), want.numpy(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(
    "norm",
    [
        nn.LayerNorm((4, 3)),
        lambda x: torch.layer_norm(x, (3,), None, None, 1e-5, False),
        nn.InstanceNorm1d(4, affine=True),
        nn.GroupNorm(2, 4),
    ],
    ids=["layer_norm", "torch_layer_norm", "instance_norm", "group_norm"],
)
def test_gradients_through_forward_passes_of_a_normalization_equal_brute_force(norm):
    # torch's layer and instance normalization kernels get the gradient of their forward
    # derivative wrong (torch 2.13): forward passes compose them.
    norm = norm.double() if isinstance(norm, nn.Module) else norm

    def f(x):
        return torch.tanh(norm(x)) * x

    x = torch.as_tensor(np.random.default_rng(0).normal(size=(B, 4, 3)))
    got = dt.grad_divergence(f, mode="fwd")(x)
    xg = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(_per_sample_divergences(f, 0, xg).sum(), xg)
    np.testing.assert_allclose(got.detach().numpy(), want.numpy(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("norm", ["layer_norm", "instance_norm"])
@pytest.mark.parametrize("transform", ["hessian", "grad_divergence", "divergence_then_grad"])
def test_third_derivatives_through_reverse_passes_of_a_normalization(norm, transform):
    """The parameter gradients of a Hessian, of ``grad_divergence`` and of a divergence's own
    input gradient: third derivatives, which torch's layer and instance normalization kernels
    get wrong through their backward (pytorch/pytorch#175754, #186256): reverse passes that
    may be differentiated compose them. Against brute force with composed normalizations."""
    rng = np.random.default_rng(0)
    w = torch.as_tensor(rng.normal(size=(4, 3))).requires_grad_()
    if norm == "layer_norm":
        layer = nn.LayerNorm((3,)).double()
    else:
        layer = nn.InstanceNorm1d(4, affine=True).double()
    params = [w, *layer.parameters()]
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.as_tensor(rng.normal(size=p.shape)) / 3)

    def f(x):
        return torch.tanh(layer(x * w)) * x

    def u(x):
        return torch.sin(f(x)).flatten(1).sum(1)

    x = torch.as_tensor(rng.normal(size=(B, 4, 3)))

    def brute(xs):
        if transform == "hessian":
            hessian = torch.autograd.functional.hessian
            one = lambda b: hessian(lambda z: u(_with(xs, b, z))[b], xs[b], create_graph=True)  # noqa: E731
            return torch.stack([one(b) for b in range(B)])
        xg = xs.clone().requires_grad_()
        (g,) = torch.autograd.grad(_per_sample_divergences(f, 0, xg).sum(), xg, create_graph=True)
        return g

    def divjac(xs):
        if transform == "hessian":
            return dt.hessian(u)(xs)
        if transform == "grad_divergence":
            return dt.grad_divergence(f, mode="rev")(xs)
        xg = xs.clone().requires_grad_()
        (g,) = torch.autograd.grad(dt.divergence(f, mode="rev")(xg).sum(), xg, create_graph=True)
        return g

    got = divjac(x)
    with torch_composed_norms():
        want = brute(x)
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-9, atol=1e-11)
    got_grads = torch.autograd.grad((got**2).sum(), params)
    want_grads = torch.autograd.grad((want**2).sum(), params)
    for g, wg in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g.numpy(), wg.numpy(), rtol=1e-9, atol=1e-10)


def _with(xs, b, xb):
    return torch.cat([xs[:b], xb[None], xs[b + 1 :]])


def test_without_grad_the_fused_kernels_are_not_differentiated(model):
    # Under no_grad, MultiheadAttention and TransformerEncoderLayer in eval mode take their
    # fast path (fused kernels, nested tensors): the passes still differentiate the math form.
    m, axis, x = model
    with torch.no_grad():
        got = dt.divergence(m, batch_axis=axis)(x)
        rev = dt.divergence(m, batch_axis=axis, method="hutchinson", mode="rev")(None, x)
    assert rev.shape == got.shape
    want = np.trace(_blocks(m, axis, x), axis1=1, axis2=2)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def _attend_over_batch(x: torch.Tensor) -> torch.Tensor:
    """Samples ``(B, D)`` as the tokens of one sequence: every sample attends to the others."""
    q = x[None, None]
    return F.scaled_dot_product_attention(q, q, q)[0, 0]


@pytest.mark.parametrize(
    "f",
    [
        _attend_over_batch,
        # A sequence-first MultiheadAttention given batch_axis=0: attention over "the batch".
        _Mha(False).double(),
    ],
    ids=["sdpa_over_batch", "mha_wrong_batch_axis"],
)
def test_attention_across_the_batch_is_refused(f):
    x = torch.as_tensor(np.random.default_rng(0).normal(size=(B, L, D)))
    x = x[:, 0] if f is _attend_over_batch else x
    with pytest.raises(BatchCouplingError):
        dt.divergence(f)(x)
    with pytest.raises(BatchCouplingError):
        dt.divergence(f, method="hutchinson", mode="rev")(None, x)


# --- a diffusers UNet2DModel score network -------------------------------------------------------


def _unet(size: int = 8, channels: tuple[int, int] = (4, 8)):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=size,
        in_channels=1,
        out_channels=1,
        block_out_channels=channels,
        layers_per_block=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=2,
        attention_head_dim=4,
    )
    unet = unet.to(torch.float64)
    x = torch.as_tensor(np.random.default_rng(0).normal(size=(B, 1, size, size)))
    return unet, x


@pytest.mark.slow
def test_unet_score_network_divergence_equals_brute_force():
    unet, x = _unet()

    def score(x):
        return unet(x, 1.0).sample

    J = _blocks(score, 0, x)
    want = np.trace(J, axis1=1, axis2=2)
    for mode in ("fwd", "rev"):
        got = dt.divergence(score, method="exact", mode=mode)(x)
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-10, atol=1e-12)
    jac = dt.jacobian(score, mode="rev")(x).detach().numpy().reshape(J.shape)
    np.testing.assert_allclose(jac, J, atol=1e-12)
    with torch.no_grad():  # the fused kernels' path; VJP probes
        signs = np.random.default_rng(1).choice([-1.0, 1.0], size=(2, *x.shape))
        fn = dt.divergence(score, method="hutchinson", num_probes=2, mode="rev")
        got = fn(torch.as_tensor(signs), x)
    V = signs.reshape(2, B, -1)
    np.testing.assert_allclose(
        got.numpy(), np.einsum("kbi,bij,kbj->b", V, J, V) / 2, rtol=1e-10, atol=1e-12
    )


def test_unet_is_traced_once(traces_made):
    """The walk of a diffusers ``UNet2DModel`` meets values it can neither follow nor hold
    weakly (an ``inspect.Signature`` in a decorator of ``huggingface_hub``, a path among its
    globals): keyed by their values, the trace is reused at every call (it was traced again
    at every call, 0.7-0.9 s, against 30 ms now for the whole divergence)."""
    unet, x = _unet()

    def score(x):
        return unet(x, 1.0).sample

    div = dt.divergence(score, method="exact", mode="rev")
    with torch.no_grad():
        first = div(x)
        for _ in range(2):
            torch.testing.assert_close(div(x), first)
    assert traces_made[0] == 1


@pytest.mark.slow
def test_unet_parameter_gradients_of_a_divergence_loss_equal_brute_force():
    unet, x = _unet()

    def score(x):
        return unet(x, 1.0).sample

    params = [p for p in unet.parameters() if p.requires_grad]
    with sdpa_kernel(SDPBackend.MATH):
        divs = _per_sample_divergences(score, 0, x)
        want = torch.autograd.grad(divs.sum(), params, materialize_grads=True)
    for mode in ("fwd", "rev"):
        div = dt.divergence(score, method="exact", mode=mode)(x)
        got = torch.autograd.grad(div.sum(), params, materialize_grads=True)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-8, atol=1e-11)


@pytest.mark.filterwarnings(
    "ignore:enable_nested_tensor:UserWarning",
    "ignore:The PyTorch API of nested tensors:UserWarning",
)
def test_the_nested_tensor_fast_path_of_an_encoder_is_named_where_it_differs():
    # PyTorch's TransformerEncoder (eval, enable_nested_tensor) runs, without gradients and
    # with a padding mask, a nested-tensor path that returns zeros at padded positions; the
    # path with gradients (the one divjac differentiates) does not: that difference is named.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 12, dropout=0.0, batch_first=True)
    x = torch.randn(B, L, D, dtype=torch.float64)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, -2:] = True  # the last two tokens of sample 0 are padding

    def f(nested: bool):
        encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).double().eval()
        return lambda z: encoder(z, src_key_padding_mask=mask)

    with torch.no_grad():
        fast = f(True)(x)
    assert fast[0, -2:].abs().max() == 0  # PyTorch's own fast path, as the warning says

    nested = f(True)
    want = np.trace(_blocks(nested, 0, x), axis1=1, axis2=2)  # the path with gradients
    with torch.no_grad(), pytest.warns(FastPathWarning, match="enable_nested_tensor=False"):
        got = dt.divergence(nested)(x)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        dt.divergence(nested)(x)  # with gradients: the user's own path, no warning
        with torch.no_grad():
            dt.divergence(f(False))(x)  # no nested-tensor path: no warning
