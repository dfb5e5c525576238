"""``divjac bench --device``: the rows that matter on an accelerator, run on it.

``--device gpu`` or ``tpu`` runs the JAX modules of :data:`MODULES` with that platform's first
device as JAX's default device (every array a row makes lives there; timings wait with
``block_until_ready``); ``--device cuda`` runs the torch modules with ``cuda`` as torch's
default device (timings wait with ``torch.cuda.synchronize``); ``--device cpu`` runs the JAX
and torch modules on the host, as the plain ``divjac bench`` does. A device that is not present
is refused with a :class:`~divjac.cli._common.UsageError` naming the devices that are.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import platform
from collections.abc import Iterator
from typing import Any

from .._common import UsageError

DEVICES = ("cpu", "cuda", "gpu", "tpu")
JAX_MODULES = (  # in this order: the targets first
    "bench_jax_dense",  # P1: per-sample Jacobian vs vmap(jacfwd / jacrev)
    "bench_laplacian",  # P9: Laplacian vs folx (where installed) and vmap(hessian)
    "bench_ffjord_jax",  # P17 in JAX: one-probe Hutchinson vs the hand-written JVP
    "bench_jax_sparse",  # P3: sparse CNN divergence vs dense
    "bench_estimators",  # Hutchinson on a U-Net
    "bench_first_call",  # detection and compile time: the first call against the next
)
TORCH_MODULES = (
    "bench_torch",  # P1 and P3 in torch (P7), the U-Net's divergence
    "bench_laplacian_torch",  # P9 in torch
    "bench_ffjord",  # P17: one-probe Hutchinson training step vs FFJORD's VJP
    "bench_first_call",  # detection and compile time
    "bench_compile",  # torch.compile'd step vs eager
)
MODULES = {"gpu": JAX_MODULES, "tpu": JAX_MODULES, "cuda": TORCH_MODULES}
MODULES["cpu"] = tuple(dict.fromkeys((*JAX_MODULES, *TORCH_MODULES)))


def _versions() -> dict[str, str]:
    from ... import __version__

    found = {"python": platform.python_version(), "divjac": __version__}
    for name in ("jax", "jaxlib", "libtpu", "torch", "folx", "asdex", "diffrax"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def _jax_device(name: str) -> Any:
    if importlib.util.find_spec("jax") is None:
        raise UsageError(f"--device {name} runs the JAX benchmarks, and JAX is not installed.")
    import jax

    present = {d.platform for d in jax.devices()} | {"cpu"}
    if name not in present:
        raise UsageError(
            f"--device {name}: JAX sees no {name} device (its devices: "
            f"{', '.join(str(d) for d in jax.devices())}). Run on a machine with one, or "
            f"choose --device {' or '.join(sorted(present))}."
        )
    return jax.devices(name)[0]


def _cuda() -> None:
    if importlib.util.find_spec("torch") is None:
        raise UsageError("--device cuda runs the torch benchmarks, and torch is not installed.")
    import torch

    if not torch.cuda.is_available():
        raise UsageError(
            f"--device cuda: torch {torch.__version__} sees no CUDA device (torch.version.cuda: "
            f"{torch.version.cuda}). Run on a machine with one, or choose --device cpu."
        )


def check(name: str) -> dict[str, Any]:
    """What ``--device name`` runs on (the device, the framework versions), or
    :class:`UsageError` where the device is not present."""
    if name not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}; got {name!r}.")
    if name in ("gpu", "tpu"):
        device = _jax_device(name)
        described = f"{device} ({getattr(device, 'device_kind', name)})"
    elif name == "cuda":
        _cuda()
        import torch

        described = f"cuda:0 ({torch.cuda.get_device_name(0)})"
    else:
        described = f"cpu ({platform.processor() or platform.machine()})"
    return {"device": described, "versions": _versions()}


@contextlib.contextmanager
def on_device(name: str) -> Iterator[None]:
    """``name``'s device as the framework's default device while the benchmarks run."""
    with contextlib.ExitStack() as stack:
        if name in ("gpu", "tpu"):
            import jax

            stack.enter_context(jax.default_device(_jax_device(name)))
        elif name == "cuda":
            import torch

            _cuda()
            stack.enter_context(torch.device("cuda"))
        yield
