"""The framework-specific part of ``divjac demo``: models, timing and brute-force references.

Each adapter only builds the built-in models in its framework, times a function the way the
framework should be timed (JAX: ``jax.jit``, compiled ahead of the timed runs; PyTorch: eager,
after a warm-up call) and computes references with the framework's own dense transforms
(``vmap(jacfwd)``, ``hessian``). Everything else is shared in :mod:`._demo`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from ._demo_report import Case, Sizes, make_data

__all__ = ["Backend", "JaxBackend", "TorchBackend", "make_backend"]

_LAYOUTS = {"mlp": "x: (B, d)", "cnn": "NHWC", "blur": "(B, H, W)"}


class Backend(Protocol):
    """What the shared driver needs from a framework."""

    name: str
    api: ModuleType

    def layout(self, key: str) -> str: ...
    def cases(self, sizes: Sizes) -> list[Case]: ...
    def timed(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        *,
        repeat: int,
    ) -> tuple[Any, float]: ...
    def timed_param_grad(
        self, loss: Callable[..., Any], args: tuple[Any, ...], *, repeat: int
    ) -> tuple[Any, float]: ...
    def numpy(self, value: Any) -> np.ndarray: ...
    def randomness(self, seed: int) -> Any: ...
    def nnz(self, matrix: Any) -> int: ...
    def ref_jacobian(self, case: Case, argnum: int) -> np.ndarray: ...
    def ref_grad_div(self, case: Case) -> np.ndarray: ...
    def ref_laplacian(self, case: Case, u: Callable[..., Any]) -> np.ndarray: ...


def make_backend(framework: str, api: ModuleType) -> Backend:
    return JaxBackend(api) if framework == "jax" else TorchBackend(api)


def _per_sample(case: Case, fn: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``fn`` on one sample (to be vmapped) and the vmap axes of ``case.args``."""

    def one(*args: Any) -> Any:
        return fn(*(a[None] if i in case.batched else a for i, a in enumerate(args)))[0]

    axes = tuple(0 if i in case.batched else None for i in range(len(case.args)))
    return one, axes


def _best(run: Callable[[], Any], repeat: int, enough: float = 0.25) -> tuple[Any, float]:
    """Result and best time of up to ``repeat`` runs; a run longer than ``enough`` s is not
    repeated (its timer noise is small already)."""
    out, best = None, math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
        if best > enough:
            break
    return out, best


class JaxBackend:
    """JAX: functions are jitted and compiled before the timed runs."""

    name = "jax"

    def __init__(self, api: ModuleType) -> None:
        self.api = api

    def layout(self, key: str) -> str:
        return _LAYOUTS[key]

    def cases(self, sizes: Sizes) -> list[Case]:
        import jax.numpy as jnp

        from ..models import jax as models

        data = make_data(sizes)

        def tree(params: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[Any, Any]]:
            return [(jnp.asarray(w), jnp.asarray(b)) for w, b in params]

        kernel = models.gaussian_kernel(sizes.blur_kernel, sizes.blur_sigma)

        def blur(x: Any) -> Any:
            return models.blur(x, kernel)

        x, t, images, gray = (jnp.asarray(data[k]) for k in ("x", "t", "images", "blur_images"))
        return [
            Case("mlp", models.mlp_xt, (tree(data["mlp"]), x, t), 1, (1, 2), x.shape, jnp.asarray),
            Case(
                "cnn", models.cnn, (tree(data["cnn"]), images), 1, (1,), images.shape, jnp.asarray
            ),
            Case("blur", blur, (gray,), 0, (0,), gray.shape, jnp.asarray),
        ]

    def timed(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        *,
        repeat: int,
    ) -> tuple[Any, float]:
        import jax

        kwargs = kwargs or {}
        if repeat == 0:
            return jax.block_until_ready(jax.jit(fn)(*args, **kwargs)), math.nan
        compiled = jax.jit(fn).lower(*args, **kwargs).compile()  # the warm-up
        return _best(lambda: jax.block_until_ready(compiled(*args, **kwargs)), repeat)

    def timed_param_grad(
        self, loss: Callable[..., Any], args: tuple[Any, ...], *, repeat: int
    ) -> tuple[Any, float]:
        import jax

        return self.timed(jax.grad(loss), args, repeat=repeat)

    def numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def randomness(self, seed: int) -> Any:
        import jax

        return jax.random.key(seed)

    def nnz(self, matrix: Any) -> int:
        return int(matrix.data.size)

    def ref_jacobian(self, case: Case, argnum: int) -> np.ndarray:
        import jax

        one, axes = _per_sample(case, case.fn)
        return np.asarray(jax.jit(jax.vmap(jax.jacfwd(one, argnum), axes))(*case.args))

    def ref_grad_div(self, case: Case) -> np.ndarray:
        import jax
        import jax.numpy as jnp

        one, axes = _per_sample(case, case.fn)

        def div(*args: Any) -> Any:
            return jnp.trace(jax.jacfwd(one, case.argnum)(*args))

        return np.asarray(jax.jit(jax.vmap(jax.grad(div, case.argnum), axes))(*case.args))

    def ref_laplacian(self, case: Case, u: Callable[..., Any]) -> np.ndarray:
        import jax
        import jax.numpy as jnp

        one, axes = _per_sample(case, u)

        def lap(*args: Any) -> Any:
            return jnp.trace(jax.hessian(one, case.argnum)(*args))

        return np.asarray(jax.jit(jax.vmap(lap, axes))(*case.args))


class TorchBackend:
    """PyTorch: eager calls, timed after one warm-up call (tracing and detection)."""

    name = "torch"

    def __init__(self, api: ModuleType) -> None:
        self.api = api

    def layout(self, key: str) -> str:
        return "NCHW" if key == "cnn" else _LAYOUTS[key]

    def cases(self, sizes: Sizes) -> list[Case]:
        import torch

        from ..models import torch as models

        data = make_data(sizes)
        kernel = models.gaussian_kernel(sizes.blur_kernel, sizes.blur_sigma)

        def blur(x: Any) -> Any:
            return models.blur(x, kernel)

        def nchw(a: np.ndarray) -> Any:  # (..., H, W, C) -> (..., C, H, W)
            return torch.as_tensor(np.ascontiguousarray(np.moveaxis(a, -1, -3)))

        x, t, gray = (torch.as_tensor(data[k]) for k in ("x", "t", "blur_images"))
        mlp_args = (models.from_jax(data["mlp"]), x, t)
        cnn_args = (models.cnn_params_from_jax(data["cnn"]), nchw(data["images"]))
        return [
            Case("mlp", models.mlp_xt, mlp_args, 1, (1, 2), tuple(x.shape), torch.as_tensor),
            Case("cnn", models.cnn, cnn_args, 1, (1,), data["images"].shape, nchw),
            Case("blur", blur, (gray,), 0, (0,), tuple(gray.shape), torch.as_tensor),
        ]

    def timed(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        *,
        repeat: int,
    ) -> tuple[Any, float]:
        kwargs = kwargs or {}
        if repeat == 0:
            return fn(*args, **kwargs), math.nan
        if repeat > 1:
            fn(*args, **kwargs)  # warm-up; a single (expensive) run is timed cold
        return _best(lambda: fn(*args, **kwargs), repeat)

    def timed_param_grad(
        self, loss: Callable[..., Any], args: tuple[Any, ...], *, repeat: int
    ) -> tuple[Any, float]:
        import torch

        params = [(w.detach().requires_grad_(), b.detach().requires_grad_()) for w, b in args[0]]
        leaves = [t for pair in params for t in pair]

        def grads(*rest: Any) -> Any:
            # The last bias does not change the Jacobian: its gradient is zero, not missing.
            return torch.autograd.grad(
                loss(params, *rest), leaves, allow_unused=True, materialize_grads=True
            )

        return self.timed(grads, args[1:], repeat=repeat)

    def numpy(self, value: Any) -> np.ndarray:
        return value.detach().cpu().numpy()

    def randomness(self, seed: int) -> Any:
        import torch

        return torch.Generator().manual_seed(seed)

    def nnz(self, matrix: Any) -> int:
        return int(matrix.values().numel())

    def ref_jacobian(self, case: Case, argnum: int) -> np.ndarray:
        from torch.func import jacfwd, vmap

        one, axes = _per_sample(case, case.fn)
        return self.numpy(vmap(jacfwd(one, argnums=argnum), in_dims=axes)(*case.args))

    def ref_grad_div(self, case: Case) -> np.ndarray:
        import torch
        from torch.func import grad, jacfwd, vmap

        one, axes = _per_sample(case, case.fn)

        def div(*args: Any) -> Any:
            return torch.trace(jacfwd(one, argnums=case.argnum)(*args))

        return self.numpy(vmap(grad(div, argnums=case.argnum), in_dims=axes)(*case.args))

    def ref_laplacian(self, case: Case, u: Callable[..., Any]) -> np.ndarray:
        import torch
        from torch.func import hessian, vmap

        one, axes = _per_sample(case, u)

        def lap(*args: Any) -> Any:
            return torch.trace(hessian(one, argnums=case.argnum)(*args))

        return self.numpy(vmap(lap, in_dims=axes)(*case.args))
