"""Running a traced function's modules: outside ``torch.func`` transforms, with batch
normalization kept from updating its running statistics, without oneDNN, with the tensors it
reaches restored after a trace that updated them in place, and without fake tensors' logs."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._compat import (
    FAKE_TENSOR_LOGGER,
    BatchNorm,
    is_wrapped,
    kernel_flags,
    module_dicts,
    set_fast_paths,
    version_counter,
)

__all__ = [
    "KeptState",
    "NoFastPaths",
    "plain_kernels",
    "quiet_batch_norm",
    "quiet_fake_tensors",
]


def updates_running_stats(m: nn.Module) -> bool:
    """Whether ``m`` is a batch normalization that updates its running statistics when run."""
    return isinstance(m, BatchNorm) and m.training and m.track_running_stats


@contextlib.contextmanager
def quiet_batch_norm(
    modules: Sequence[nn.Module], ran: list[nn.Module] | None = None
) -> Iterator[None]:
    """Batch normalization in training mode, without updating the running statistics.

    Training-mode outputs use the batch statistics either way; the in-place update of the
    running statistics would be repeated by every pass (and ``torch.func`` transforms refuse
    in-place updates of captured buffers). Applies to ``modules`` (not their submodules: give
    them all); with ``ran``, also to every module this thread calls inside the block, however
    the function reaches it (found by a global forward pre-hook, which slows every module
    call: passes give the modules their trace ran instead), and those are appended to ``ran``.
    """
    thread = threading.get_ident()
    changed: list[BatchNorm] = []

    def quiet(m: nn.Module) -> None:
        if isinstance(m, BatchNorm) and updates_running_stats(m):
            m.track_running_stats = False
            changed.append(m)

    found = ran if ran is not None else []

    def pre_hook(m: nn.Module, args: Any) -> None:
        if threading.get_ident() == thread:
            quiet(m)
            found.append(m)

    for m in modules:
        quiet(m)
    handle = None if ran is None else nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
        for bn in changed:
            bn.track_running_stats = True


@contextlib.contextmanager
def plain_kernels(*, cudnn: bool = False) -> Iterator[None]:
    """oneDNN off, and cuDNN with ``cudnn`` (only these flags: ``torch.backends.*.flags`` also
    reset others)."""
    flags = kernel_flags(cudnn=cudnn)
    before = [get() for get, _ in flags]
    for _, set_flag in flags:
        set_flag(False)
    try:
        yield
    finally:
        for (_, set_flag), value in zip(flags, before, strict=True):
            set_flag(value)


@contextlib.contextmanager
def quiet_fake_tensors() -> Iterator[None]:
    """Fake tensors' logs of the errors they raise dropped: an operation that fails on them
    (the function's own shape error) logs its traceback at ERROR level (about 45 lines, torch
    2.13-2.14) before raising what the trace handles or re-raises."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    quiet = _NoRaisedErrors()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _NoRaisedErrors(logging.Filter):
    """Drops the records that log an exception (``log.exception``: followed by its raise)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None


class NoFastPaths:
    """``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` without their fused fast
    paths, which they take under ``no_grad`` and ``inference_mode`` in eval mode: kernels
    (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``) with no forward
    derivative, nor batching rules for their gradients. A class (dynamo traces its methods,
    and the switch under ``torch.compile`` too)."""

    def __enter__(self) -> None:
        self._before = set_fast_paths(False)

    def __exit__(self, *exc: object) -> None:
        set_fast_paths(self._before)


def _tensor_dicts(m: nn.Module) -> tuple[dict[str, Any], ...]:
    """A module's own parameters and buffers (dicts by name: an assignment replaces one)."""
    return module_dicts(vars(m))[:2]


class KeptState:
    """The values of the tensors a function reaches, and the tensors its modules hold, kept so
    that a trace of it leaves them as they were: a forward that updates a buffer it reads (a
    running statistic, a counter, a power iteration) would otherwise be updated by the trace,
    on top of the call's own run (or left holding a traced tensor, when it assigns one).

    Tensors that require grad (parameters being trained: the function cannot update them in
    place under autograd) are watched by their version counter alone, not copied; tensors
    under a ``torch.func`` transform (not plain data) are skipped.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], modules: Iterable[nn.Module]) -> None:
        # The tensors the modules hold (an assignment ``self.n = self.n + 1`` replaces one).
        self._held: list[tuple[nn.Module, tuple[dict[str, Any], ...]]] = [
            (m, tuple(map(dict, _tensor_dicts(m)))) for m in modules
        ]
        self._kept: list[tuple[torch.Tensor, int | None, torch.Tensor | None]] = []
        for t in tensors:
            if t.device.type == "meta" or is_wrapped(t):
                continue
            inference = t.is_inference()  # no version counter: compared by value
            version = None if inference else version_counter(t)
            copy = None if t.requires_grad and not inference else t.detach().clone()
            self._kept.append((t, version, copy))

    def restore(self) -> list[torch.Tensor]:
        """Restore every tensor modified since (once: the restore bumps their versions), and
        return them."""
        written: list[torch.Tensor] = []
        for m, kept_dicts in self._held:
            for held, kept in zip(_tensor_dicts(m), kept_dicts, strict=True):
                if held.keys() != kept.keys() or any(held[k] is not v for k, v in kept.items()):
                    written.extend(
                        v for k, v in kept.items() if v is not None and held.get(k) is not v
                    )
                    held.clear()
                    held.update(kept)
        for t, version, copy in self._kept:
            if version is not None and version_counter(t) == version:
                continue
            if version is None and copy is not None and torch.equal(t, copy):
                continue
            written.append(t)
            if copy is not None:
                with torch.no_grad(), torch.inference_mode(t.is_inference()):
                    t.copy_(copy)
        return written
