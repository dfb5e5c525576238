"""The torch transforms on each accelerator present (``make test-gpu``: ``cuda``, ``mps``): each
transform's first variant of the context matrix's table (:mod:`tests.torch.transforms`) in
float32 and float64 (every variant with ``DIVJAC_ACCELERATOR_TESTS=all``), eager and under
``torch.compile``, against the float64 brute force (:class:`~tests.torch.transforms.Truth`,
loops of ``torch.autograd.functional`` on the CPU); and the memory planner on the device.

Results must stay on the input's device. float64 where the device has none (``mps``) is
skipped with torch's reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.accelerator.devices import ALL, params_of, spied_planner, torch_devices

pytestmark = pytest.mark.accelerator

DEVICES = params_of(torch_devices(), "torch")
TOLERANCES = {"float32": (2e-4, 2e-5), "float64": (1e-9, 1e-11)}  # rtol, atol (of the scale)
COMPILED = ("jacobian-auto", "divergence-auto-auto", "laplacian-auto")


def _cases() -> list[tuple[str, str]]:
    if not torch_devices():  # torch may not be installed: the table is not imported
        return [("-", "-")]
    from tests.torch.transforms import TABLE

    chosen = [v.id for variants in TABLE.values() for v in (variants if ALL else variants[:1])]
    return [(v, dtype) for v in chosen for dtype in TOLERANCES]


@functools.cache
def _truth(variant: str, dtype: str) -> Any:
    """The brute force of ``variant`` on the MLP, float64 on the CPU, once per process."""
    import torch

    from tests.torch.transforms import VARIANTS, Truth
    from tests.torch.zoo import ZOO

    model = ZOO["mlp"]
    with torch.no_grad():
        return VARIANTS[variant].expect(
            Truth(model.make(torch.float64), model.input()), getattr(torch, dtype)
        )


def _check(device: str, variant_id: str, dtype_name: str, compiled: bool) -> None:
    import torch

    import divjac.torch as dj
    from tests.torch.transforms import SEED, VARIANTS, Truth, u_of
    from tests.torch.zoo import ZOO

    variant, model = VARIANTS[variant_id], ZOO["mlp"]
    dtype = getattr(torch, dtype_name)
    try:
        module = model.make(dtype).to(device)
        x = model.input(dtype).to(device)
    except (TypeError, RuntimeError) as err:  # mps has no float64
        pytest.skip(f"{dtype_name} on {device}: {err}")
    fn: Callable[..., Any] = u_of(module) if variant.scalar else module
    lead: tuple[Any, ...] = ()
    if variant.randomness == "probes":
        probes = Truth(model.make(torch.float64), model.input()).probes
        lead = (probes[: variant.drawn].to(device, dtype),)
    elif variant.randomness == "generator":
        lead = (torch.Generator().manual_seed(SEED),)
    dj.clear_caches()
    transformed = variant.build(fn, 0, (x,))
    run = transformed
    if compiled:
        torch._dynamo.reset()
        backend = "aot_eager" if device == "cpu" else "inductor"  # no C++ builds on the host
        run = torch.compile(lambda *a: transformed(*a), fullgraph=True, backend=backend)
    with torch.no_grad():
        got = variant.out(run(*lead, x))
    want = _truth(variant_id, dtype_name)
    if variant.compare == "covers":
        assert not bool((want & ~got.cpu()).any()), "the pattern misses nonzeros"
        return
    rtol, atol = TOLERANCES[dtype_name]
    for g, w in zip(_leaves(got), _leaves(want), strict=True):
        assert g.device.type == device and g.dtype == dtype, (g.device, g.dtype)
        w64 = w.detach().cpu().double().numpy()
        scale = max(float(np.max(np.abs(w64), initial=0.0)), 1.0)
        np.testing.assert_allclose(
            g.detach().cpu().double().numpy().reshape(w64.shape),
            w64,
            rtol=rtol,
            atol=atol * scale,
            err_msg=f"{variant_id}, {dtype_name}, on {device}{', compiled' if compiled else ''}",
        )


def _leaves(tree: Any) -> list[Any]:
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree.to_dense() if tree.is_sparse else tree]
    return [leaf for item in tree for leaf in _leaves(item)]


@pytest.mark.parametrize(("variant", "dtype"), _cases())
@pytest.mark.parametrize("device", DEVICES)
def test_every_transform_on_the_device(device: str, variant: str, dtype: str) -> None:
    _check(device, variant, dtype, compiled=False)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # inductor's
@pytest.mark.parametrize("variant", COMPILED)
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_on_the_device(device: str, variant: str) -> None:
    _check(device, variant, "float32", compiled=True)


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_under_the_device_memory(
    device: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """On CUDA the planner reads ``mem_get_info`` and the host's cache bounds no chunk: the exact
    divergence of a 256-wide MLP runs in one chunk, and in chunks of at most 1 MB under
    ``DIVJAC_MEMORY_BUDGET_MB=1``, with the values of ``vmap(jacfwd)``."""
    import torch

    import divjac.torch as dj

    d = 256
    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(d, d, generator=g).div(d**0.5).to(device) for _ in range(2))
    x = torch.randn(8, d, generator=g).to(device)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w1) @ w2

    jac = torch.func.vmap(torch.func.jacfwd(lambda z: f(z[None])[0]))(x)
    want = jac.diagonal(dim1=1, dim2=2).sum(1)
    seen = spied_planner(monkeypatch, on_accelerator=device == "cuda")
    for budget in (None, "1"):
        if budget is not None:
            monkeypatch.setenv("DIVJAC_MEMORY_BUDGET_MB", budget)
        dj.clear_caches()
        got = dj.divergence(f, method="exact")(x)
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
        step = seen[-1]
        request.node.user_properties.append((f"chunk_at_budget_{budget}", step["chunk"]))
        if budget is None and device == "cuda":
            assert step["available"] is not None and step["available"] > 64 << 20, step
            assert step["chunk"] == step["n_passes"] == d, step
        if budget is not None:
            assert 1 <= step["chunk"] < d, step
            assert step["chunk"] * step["bytes_per_pass"] <= 1 << 20, step
