"""ATen-graph sparsity detection: sound (never misses a nonzero), exact where it should be."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import divjac
from divjac.models import torch as models
from divjac.torch import divergence, jacobian, sparse_jacobian, sparsity
from tests.reference import torch_diagonal_blocks, traces

D = torch.float64


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def true_pattern(f: Callable, x: torch.Tensor, trials: int = 2) -> tuple[np.ndarray, bool]:
    """Union over random inputs of the per-sample nonzeros, and whether samples interact."""
    B = x.shape[0]
    n_in = x[0].numel()
    pattern, coupled = None, False
    for seed in range(trials):
        xx = _randn(*x.shape, seed=100 + seed)
        J = torch.autograd.functional.jacobian(f, xx, vectorize=True)
        J = J.reshape(B, -1, B, n_in).detach()
        eye = torch.eye(B, dtype=torch.bool)[:, None, :, None]
        blocks = torch.stack([J[b, :, b] for b in range(B)]) != 0
        coupled |= bool((J.masked_fill(eye, 0) != 0).any())
        found = blocks.any(0).numpy()
        pattern = found if pattern is None else pattern | found
    assert pattern is not None
    return pattern, coupled


def assert_sound(f: Callable, x: torch.Tensor, *, exact: bool = False) -> None:
    detected = sparsity(f)(x)
    truth, coupled = true_pattern(f, x)
    missed = truth & ~detected.csr.toarray()
    assert not missed.any(), f"the pattern misses {int(missed.sum())} true nonzeros"
    assert detected.is_batch_independent == (not coupled)
    if exact:
        assert detected.nnz == int(truth.sum())


def _m(module: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return module.to(D)


X3 = (2, 4, 6)
X4 = (2, 3, 6, 6)

CASES: dict[str, tuple[Callable[[], Callable], tuple[int, ...], bool]] = {
    "unbind_reversed": (
        lambda: lambda x: torch.sin(torch.stack(torch.unbind(x, 2)[::-1], 1)),
        X3,
        True,
    ),
    "conv_stride_dilation_groups": (
        lambda: _m(nn.Conv2d(3, 6, 3, stride=2, dilation=2, padding=1, groups=3)),
        X4,
        True,
    ),
    "conv_same_even_kernel": (lambda: _m(nn.Conv2d(3, 2, 4, padding="same")), X4, True),
    "conv_reflect": (lambda: _m(nn.Conv2d(3, 2, 3, padding=1, padding_mode="reflect")), X4, True),
    "conv_circular": (lambda: _m(nn.Conv2d(3, 2, 3, padding=1, padding_mode="circular")), X4, True),
    "conv_transpose": (
        lambda: _m(nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1)),
        X4,
        True,
    ),
    "conv_transpose_groups": (
        lambda: _m(nn.ConvTranspose2d(3, 6, 3, stride=2, padding=2, dilation=2, groups=3)),
        X4,
        True,
    ),
    "conv1d": (lambda: _m(nn.Conv1d(4, 2, 3, padding=1, stride=2)), X3, True),
    "conv_transpose1d": (lambda: _m(nn.ConvTranspose1d(4, 2, 3, stride=3)), X3, True),
    "linear": (lambda: _m(nn.Linear(6, 5)), X3, True),
    "bilinear": (lambda: _called_with(_m(nn.Bilinear(6, 6, 2)), twice=True), X3, True),
    "einsum_bmm": (lambda: lambda x: torch.einsum("bij,bkj->bik", x, x), X3, True),
    "views": (
        lambda: lambda x: x.permute(0, 2, 1).flatten(1).unflatten(1, (2, 12)).transpose(1, 2).sin(),
        X3,
        True,
    ),
    "cat_stack_slice_select": (
        lambda: lambda x: torch.cat([x[:, 1:3, ::2], torch.stack([x[:, 0], x[:, 2]], 1)], 2),
        X3,
        True,
    ),
    "index_select_gather": (
        lambda: (
            lambda x: (
                torch.index_select(x, 2, torch.tensor([0, 5, 2]))
                * torch.gather(x, 1, torch.tensor([[[3, 0, 1]]]).expand(2, 1, 3))
            )
        ),
        X3,
        True,
    ),
    "pad_flip_roll": (
        lambda: (
            lambda x: (
                F.pad(x, (1, 2), mode="reflect")
                + F.pad(x, (1, 2), mode="replicate")
                + F.pad(torch.roll(x.flip(1), 2, dims=2), (1, 2))
            )
        ),
        X3,
        True,
    ),
    "activations": (
        lambda: (
            lambda x: F.gelu(x) + F.silu(x) + F.elu(x) + F.softplus(x) + torch.sigmoid(x) * x.relu()
        ),
        X3,
        True,
    ),
    "reductions": (
        lambda: (
            lambda x: (
                x.sum(1, keepdim=True)
                + x.mean(2, keepdim=True)
                + x.amax(1, keepdim=True)
                + x.std(2, keepdim=True)
                + torch.logsumexp(x, 1, keepdim=True)
            )
        ),
        X3,
        True,
    ),
    "softmax": (lambda: lambda x: F.softmax(x, -1) + F.log_softmax(x, 1), X3, True),
    "layer_norm": (lambda: _m(nn.LayerNorm(6)), X3, True),
    "group_norm": (lambda: _m(nn.GroupNorm(3, 3)), X4, True),
    "batch_norm_eval": (lambda: _m(nn.BatchNorm2d(3)).eval(), X4, True),
    "batch_norm_train": (lambda: _m(nn.BatchNorm2d(3)).train(), X4, True),
    "max_pool_ceil": (lambda: _m(nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)), X4, False),
    "avg_pool": (lambda: _m(nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True)), X4, True),
    "adaptive_avg_pool": (lambda: _m(nn.AdaptiveAvgPool2d((4, 5))), X4, True),
    "adaptive_max_pool": (lambda: _m(nn.AdaptiveMaxPool2d((4, 5))), X4, False),
    "upsample_nearest": (lambda: _m(nn.Upsample(scale_factor=2)), X4, True),
    "upsample_bilinear": (lambda: _m(nn.Upsample(scale_factor=2, mode="bilinear")), X4, False),
    "causal_mask": (
        lambda: (
            lambda x: (
                (x @ x.transpose(1, 2))
                .masked_fill(torch.triu(torch.ones(4, 4, dtype=torch.bool), 1), 0.0)
                .tanh()
            )
        ),
        X3,
        False,
    ),
    "where_constant_mask": (
        lambda: lambda x: torch.where(torch.tril(torch.ones(4, 6, dtype=torch.bool)), x, 0.0),
        X3,
        True,
    ),
    "cumsum_sort": (lambda: lambda x: torch.cumsum(x, 2) + torch.sort(x, 1).values, X3, False),
    "unfold_fold": (
        lambda: lambda x: F.fold(F.unfold(x, 3, padding=1), (6, 6), 3, padding=1),
        X4,
        True,
    ),
    "setitem_inplace": (lambda: _setitem, X3, True),
    "attention": (lambda: _m(nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0)).eval(), X3, True),
    "gru": (lambda: _called_with(_m(nn.GRU(6, 3, batch_first=True)), first=True), X3, True),
    "mean_over_batch": (lambda: lambda x: x - x.mean(0), X3, True),
}


def _called_with(module: nn.Module, *, twice: bool = False, first: bool = False) -> Callable:
    def f(x: torch.Tensor) -> torch.Tensor:
        out = module(x, x) if twice else module(x)
        return out[0] if first else out

    return f


def _setitem(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[:, 0] = y[:, 1] * 2
    view = y[:, 2:]
    view.mul_(3)
    y[:, :, 4:] = 0
    return torch.tanh(y)


@pytest.mark.parametrize("case", sorted(CASES))
def test_detected_pattern_is_sound(case):
    make, shape, exact = CASES[case]
    assert_sound(make(), _randn(*shape), exact=exact)


@settings(max_examples=12, deadline=None)
@given(
    c=st.integers(1, 3),
    h=st.integers(3, 6),
    w=st.integers(3, 6),
    kinds=st.lists(
        st.sampled_from(
            ["conv", "convT", "act", "pool", "avg", "adaptive", "norm", "up", "pad", "bn"]
        ),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 100),
)
def test_random_sequential_stacks_are_sound(c, h, w, kinds, seed):
    """Random ``nn.Sequential`` image models (shapes tracked so that every layer fits)."""
    gen = np.random.default_rng(seed)
    x_shape = shape = (c, h, w)
    layers: list[nn.Module] = []
    for kind in kinds:
        c, h, w = shape
        if kind == "conv":
            out, k = int(gen.integers(1, 4)), int(gen.integers(1, 4))
            layers.append(nn.Conv2d(c, out, k, padding="same", dilation=int(gen.integers(1, 3))))
            shape = (out, h, w)
        elif kind == "convT":
            stride = int(gen.integers(1, 3))
            layers.append(nn.ConvTranspose2d(c, c, 2, stride=stride))
            shape = (c, (h - 1) * stride + 2, (w - 1) * stride + 2)
        elif kind == "act":
            layers.append([nn.Tanh(), nn.GELU(), nn.Softplus(), nn.ELU()][int(gen.integers(4))])
        elif kind == "pool":
            layers.append(nn.MaxPool2d(2, ceil_mode=True))
            shape = (c, -(-h // 2), -(-w // 2))
        elif kind == "avg":
            layers.append(nn.AvgPool2d(3, stride=1, padding=1))
        elif kind == "adaptive":
            size = (int(gen.integers(1, h + 1)), int(gen.integers(1, w + 1)))
            layers.append(nn.AdaptiveAvgPool2d(size))
            shape = (c, *size)
        elif kind == "norm":
            layers.append(nn.GroupNorm(1, c))
        elif kind == "up" and h * w <= 20:
            layers.append(nn.Upsample(scale_factor=2, mode="nearest"))
            shape = (c, 2 * h, 2 * w)
        elif kind == "pad":
            layers.append(nn.ReflectionPad2d(1) if min(h, w) >= 2 else nn.ZeroPad2d(1))
            shape = (c, h + 2, w + 2)
        elif kind == "bn":
            layers.append(nn.BatchNorm2d(c))
    torch.manual_seed(seed)
    net = nn.Sequential(*layers).to(D).eval()
    assert_sound(net, _randn(2, *x_shape))


# --- exactness of the sparse methods -----------------------------------------------------------


def test_cnn_color_counts_match_the_design():
    """A 3-layer 3x3 'same' conv stack on 32x32x3: 48 diagonal and 147 column colors."""
    params = models.init_cnn(0)
    pattern = sparsity(models.cnn, argnums=1)(params, torch.zeros(2, 3, 32, 32))
    assert pattern.is_batch_independent
    assert pattern.n_diagonal_colors == 48
    assert pattern.n_colors == 147


@pytest.mark.parametrize(
    "f",
    [
        # weights made once, outside f: torch 2.11 cannot trace f drawing them from a
        # torch.Generator (refused, test_floor.py)
        functools.partial(models.cnn, models.init_cnn(0, channels=3, layers=2, dtype=D)),
        lambda x: F.avg_pool2d(torch.tanh(F.interpolate(x, scale_factor=2, mode="bilinear")), 2),
        lambda x: F.max_pool2d(torch.tanh(x), 3, stride=1, padding=1) * x,
    ],
    ids=["cnn", "upsample_pool", "maxpool"],
)
def test_sparse_jacobian_and_divergence_are_exact(f):
    x = _randn(2, 3, 6, 6)
    blocks = torch_diagonal_blocks(f, (x,))
    for mode in ("sparse", "auto"):
        np.testing.assert_allclose(jacobian(f, mode=mode)(x), blocks, rtol=1e-10, atol=1e-12)
    expected = traces(blocks, (3, 6, 6))
    np.testing.assert_allclose(divergence(f, method="sparse")(x), expected, rtol=1e-10)
    coo = sparse_jacobian(f)(x)
    csr = sparse_jacobian(f, layout=torch.sparse_csr)(x)
    assert coo.layout == torch.sparse_coo and csr.layout == torch.sparse_csr
    flat = blocks.reshape(2, 108, 108)
    np.testing.assert_allclose(coo.to_dense(), flat, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(csr.to_dense(), flat, rtol=1e-10, atol=1e-12)
    assert coo._nnz() == 2 * sparsity(f)(x).nnz


def test_sparse_jacobian_single_sample():
    f = lambda x: torch.cumsum(torch.sin(x), 0)  # noqa: E731
    x = _randn(5)
    expected = torch.autograd.functional.jacobian(f, x)
    for layout in (torch.sparse_coo, torch.sparse_csr):
        J = sparse_jacobian(f, batch_axis=None, layout=layout)(x)
        assert tuple(J.shape) == (5, 5)
        np.testing.assert_allclose(J.to_dense(), expected, rtol=1e-12)


def test_parameters_are_not_folded_into_the_pattern():
    """A mask computed from a parameter may change in training: the pattern must not use it."""
    weight = nn.Parameter(torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=D))

    def f(x):
        return torch.where(weight > 0, x, 0.0)

    pattern = sparsity(f)(_randn(2, 6))
    assert pattern.nnz == 6  # every diagonal entry, whatever the current signs


def test_detection_is_cached_per_shape():
    calls = []

    def f(x):
        calls.append(1)
        return torch.tanh(x)

    div = divergence(f)
    div(_randn(3, 4))
    traced = len(calls)
    div(_randn(3, 4, seed=1))
    div(_randn(3, 4, seed=2))
    assert len(calls) - traced == 2 * 1  # one forward each, no new trace
    div(_randn(5, 4))
    assert len(calls) > traced + 3  # a new shape is traced again


# Named like an ATen operation (flip) that it is not: the ATen rule must not be used for it.
@torch.library.custom_op("divjac_test::flip", mutates_args=())
def _flipadd(x: torch.Tensor) -> torch.Tensor:
    return x + torch.flip(x, [-1])


@_flipadd.register_fake
def _(x):
    return torch.empty_like(x)


def test_registered_rule_makes_the_pattern_exact_and_replaces_cached_ones():
    from divjac import rules
    from divjac.torch import register_rule

    f = lambda x: torch.tanh(_flipadd(x))  # noqa: E731
    x = _randn(3, 5)
    with pytest.warns(divjac.DenseFallbackWarning, match="divjac_test.flip"):
        assert sparsity(f)(x).nnz == 25  # no rule: dense within each sample

    def flip_add(op: rules.Op) -> list[rules.Deps]:
        (x,) = op.ins
        return [rules.union(x, rules.rev(x, [len(x.shape) - 1]))]

    with pytest.raises(rules.RuleError, match="torch operator"):
        register_rule(3, flip_add)
    for typo in ("divjac_test::flipp", "flipp"):  # a rule that would never be used
        with pytest.raises(rules.RuleError, match="no operator named"):
            register_rule(typo, flip_add)
    register_rule(_flipadd, flip_add)
    pattern = sparsity(f)(x)  # the cached dense pattern is not reused
    assert pattern.dense_fallbacks == frozenset()
    eye = np.eye(5, dtype=bool)
    np.testing.assert_array_equal(pattern.csr.toarray(), eye | eye[::-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_seeds_detect_what_full_seeds_detect(case, monkeypatch):
    """Seeded in full instead of shared (one matrix for all samples), every case gives the
    same pattern and the same coupling."""
    make, shape, _ = CASES[case]
    f, x = make(), _randn(*shape)
    shared = sparsity(f)(x)
    seed = divjac._core.detection.P.seed

    def full_seed(layout, *, per_sample):
        s = seed(layout, per_sample=per_sample)
        return type(s)(s.shape, s.n_labels, s.csr)

    monkeypatch.setattr(divjac._core.detection.P, "seed", full_seed)
    divjac.torch._detect.CACHE.clear()
    full = sparsity(f)(x)
    assert (shared.csr != full.csr).nnz == 0
    assert shared.coupling == full.coupling
