"""The steady state of every torch transform waits on nothing (issue 43): its third call with
new inputs of the same shapes builds no tensor from host data and reads no value back.

On a GPU each tensor made from host data (``torch.as_tensor`` of a NumPy index array) is a
synchronous copy at every step, and each value read back (``.item()``, ``bool(t)``,
``.tolist()``) a sync. Without a GPU, two checks stand in for ``set_sync_debug_mode("error")``:

- on the CPU, a recorder (:class:`Recorder`) around the third call catches the Python calls that
  make a tensor from host data or read one back, and the aten operations that read a value
  (``_local_scalar_dense``) or whose output's size depends on values (``nonzero``);
- on ``meta`` tensors (no values at all), every transform runs, returns tensors of the CPU
  call's shapes on ``meta``, and in its third call no operation touches a tensor elsewhere
  (an index array kept on the CPU, or made there and copied, is caught).

Every variant of the context matrix's table (:mod:`tests.torch.transforms`) is checked.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import divjac.torch as dj
from divjac.torch import SparsityPattern

from .transforms import SEED, VARIANTS, Variant
from .zoo import ZOO

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor:UserWarning")

_MADE_FROM_DATA = {torch.as_tensor, torch.tensor, torch.asarray, torch.from_numpy}
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
_ATEN = torch.ops.aten
_SYNCING = {_ATEN._local_scalar_dense.default, _ATEN.nonzero.default, _ATEN.masked_select.default}

_INDEXING = {_ATEN.index.Tensor, _ATEN.index_put.default, _ATEN.index_put_.default}


def _masked(indices: Any) -> bool:
    """Whether an index is a boolean mask (its positions found from its values)."""
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class _Functions(TorchFunctionMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _MADE_FROM_DATA and args and not isinstance(args[0], torch.Tensor):
            self.found.append(f"{func.__name__}({type(args[0]).__name__})")
        elif func in _READS:
            self.found.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class _Operations(TorchDispatchMode):
    """The aten operations that read values; on ``device``, those touching another device."""

    def __init__(self, found: list[str], device: str | None) -> None:
        super().__init__()
        self.found, self.device = found, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _SYNCING or (func in _INDEXING and _masked(args[1])):
            self.found.append(str(func))
        out = func(*args, **(kwargs or {}))
        if self.device is not None:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
            elsewhere = {
                t.device.type
                for t in leaves
                if isinstance(t, torch.Tensor) and t.device.type != self.device and t.ndim > 0
            }
            if elsewhere:
                self.found.append(f"{func} on {sorted(elsewhere)}")
        return out


class Recorder:
    """What a block does that waits on the host (see the module's docstring): :attr:`found`."""

    def __init__(self, device: str | None = None) -> None:
        self.found: list[str] = []
        self._modes = (_Functions(self.found), _Operations(self.found, device))

    def __enter__(self) -> Recorder:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _lead(v: Variant, x: torch.Tensor) -> tuple[Any, ...]:
    if v.randomness == "probes":
        g = torch.Generator().manual_seed(SEED)
        signs = torch.randint(0, 2, (v.drawn, *x.shape), generator=g).to(x.device, x.dtype)
        return (2 * signs - 1,)
    if v.randomness == "generator":  # meta has no generator: its global one
        return (None if x.is_meta else torch.Generator().manual_seed(SEED),)
    return ()


def _third_call(v: Variant, model: str, device: str) -> tuple[Any, list[str]]:
    """The third call of the variant's transform of the zoo model on ``device`` (new inputs of
    the same shape at each call), and what its recorder found."""
    zoo = ZOO[model]
    f = zoo.make()
    if isinstance(f, torch.nn.Module):
        f = f.to(device)
    fn = (lambda x: torch.sin(f(x)).flatten(1).sum(1)) if v.scalar else f
    x0 = zoo.input().to(device)
    with torch.device(device):  # a coefficient the variant makes, on the device
        transform = v.build(fn, 0, (x0,))
    for k in range(2):
        x = x0 + 0.1 * k
        transform(*_lead(v, x), x)
    x = x0 - 0.1
    lead = _lead(v, x)
    with Recorder(device if device == "meta" else None) as recorder:
        result = transform(*lead, x)
    return result, recorder.found


def _shapes(result: Any) -> list[Any]:
    if isinstance(result, SparsityPattern):
        return [result.csr.shape, result.n_colors, result.n_diagonal_colors]
    leaves = torch.utils._pytree.tree_leaves(result)
    return [(tuple(t.shape), t.layout) for t in leaves if isinstance(t, torch.Tensor)]


def _devices(result: Any) -> set[str]:
    leaves = torch.utils._pytree.tree_leaves(result)
    return {t.device.type for t in leaves if isinstance(t, torch.Tensor)}


def test_the_recorder_catches_host_data_and_reads() -> None:
    """Each kind the checks below rely on is caught (they would pass vacuously otherwise)."""
    x = torch.ones(3)
    with Recorder() as recorder:
        torch.as_tensor(np.arange(3))
        torch.tensor([1, 2])
        x.sum().item()
        x.tolist()
        bool(x.sum() > 0)
        x[x > 0]
    for kind in ("as_tensor(ndarray)", "tensor(list)", "Tensor.item", "Tensor.tolist"):
        assert kind in recorder.found
    assert "Tensor.__bool__" in recorder.found
    assert sum("_local_scalar_dense" in r for r in recorder.found) == 2  # item, bool
    assert any("aten.index" in r for r in recorder.found)  # a boolean mask: a size from values
    y = torch.ones(3, device="meta")
    with Recorder("meta") as recorder:
        y + torch.ones(3).to("meta")  # made on the CPU, copied
        y + torch.ones((), dtype=y.dtype)  # a 0-d CPU tensor: a scalar argument, allowed
    assert recorder.found == ["aten.ones.default on ['cpu']", "aten._to_copy.default on ['cpu']"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_steady_state_call_waits_on_nothing(variant: str) -> None:
    """Every transform, each method and mode: its third call on the CPU builds no tensor from
    host data and reads nothing back; on ``meta`` it returns meta tensors of the same shapes,
    and touches no tensor off ``meta`` (the index arrays, colorings and masks are kept there).
    ``sparsity`` (a host pattern, by design) is checked on meta for its pattern alone."""
    v = VARIANTS[variant]
    dj.clear_caches()
    result, found = _third_call(v, "mlp", "cpu")
    if variant != "sparsity":
        assert found == []
    on_meta, found = _third_call(v, "mlp", "meta")
    assert _shapes(on_meta) == _shapes(result)
    if variant != "sparsity":
        assert found == []
        assert _devices(on_meta) == {"meta"}
    else:
        assert (on_meta.csr != result.csr).nnz == 0


@pytest.mark.parametrize(
    "variant",
    ["jacobian-sparse", "sparse_jacobian-coo", "sparse_jacobian-csr", "laplacian-exact",
     "divergence-probing", "hessian_diagonal-exact"],
)  # fmt: skip
def test_a_convolution_s_sparse_steady_state_waits_on_nothing(variant: str) -> None:
    """The image case of the issue: a CNN's sparse Jacobian (its index arrays), Laplacian and
    Hessian diagonal (its colorings), on the CPU and on meta."""
    v = VARIANTS[variant]
    dj.clear_caches()
    result, found = _third_call(v, "cnn", "cpu")
    assert found == []
    on_meta, found = _third_call(v, "cnn", "meta")
    assert found == [] and _shapes(on_meta) == _shapes(result)


def test_the_index_arrays_are_kept_per_device() -> None:
    """One transformed function called on the CPU, on meta, on the CPU again: each device's
    call uses its own copy of the plan's index arrays, and the values stay right."""
    W = torch.randn(6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    band = W * (torch.arange(6)[:, None] - torch.arange(6)[None]).abs().le(1)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ band.to(x.device).T)

    jac = dj.sparse_jacobian(f)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = (1 - torch.tanh(x @ band.T) ** 2)[:, :, None] * band
    torch.testing.assert_close(jac(x).to_dense(), want)
    on_meta = jac(x.to("meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == (4, 6, 6)
    with Recorder() as recorder:
        got = jac(x)
    torch.testing.assert_close(got.to_dense(), want)
    assert recorder.found == []


def test_a_sampled_operator_s_steady_state_waits_on_nothing() -> None:
    """``differential_operator``'s stochastic method where it samples (more directions than its
    budget): the draws' probabilities, directions and weights come from the plan's arrays on
    the device, copied once (the estimate finite, of the right shape)."""
    W = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def u(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ W).sum(1)

    terms = [(1.0, (0, 1, 2, 3)), (0.5, (0, 0, 1)), (2.0, (1, 2))]
    op = dj.differential_operator(u, terms, method="stde", num_probes=4)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for k in range(2):
        op(torch.Generator().manual_seed(k), x + 0.1 * k)
    g = torch.Generator().manual_seed(2)
    with Recorder() as recorder:
        got = op(g, x)
    assert recorder.found == []
    assert got.shape == (5,) and bool(torch.isfinite(got).all())
