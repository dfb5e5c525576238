""":mod:`divjac.torch`'s binding of the public transforms (:mod:`divjac._public`): PyTorch's
backend, and how PyTorch runs a transform.

``f`` may be a function or an ``nn.Module``; results stay on the autograd graph of the module
parameters. A transform of a ``DistributedDataParallel`` wrapper runs each call inside the
wrapper's forward machinery (:mod:`divjac.torch._ddp`); ``torch.func``'s refusals of an
``autograd.Function`` are named. ``sparse_jacobian`` takes one more keyword than JAX's:
``layout``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _transforms as T
from .._call import Coupling
from .._core import stochastic
from .._public import Api, forward, transform
from . import _ddp, _detect
from ._backend import BACKEND

__all__ = ["API", "clear_caches", "sparse_jacobian"]


class TorchApi(Api[torch.Tensor]):
    """The public transforms on torch tensors."""

    framework = "PyTorch"
    module = "divjac.torch"
    array = "torch.Tensor"
    array_type = torch.Tensor

    def transform(
        self,
        make: Callable[..., Callable[..., Any]],
        f: Any,
        *positional: Any,
        skip: int,
        cached: bool,
        **options: Any,
    ) -> Callable[..., Any]:
        return _ddp.transform(make, BACKEND, f, *positional, **options)

    def detect(
        self, make: Callable[..., Callable[..., Any]], f: Any, *positional: Any, **options: Any
    ) -> Callable[..., Any]:
        return make(BACKEND, _ddp.unwrapped(f), *positional, **options)


API = TorchApi()


@transform
def sparse_jacobian(
    api: Api[torch.Tensor],
    f: Callable[..., Any],
    /,
    argnums: int | Sequence[int] = 0,
    *,
    batch_axis: int | None = 0,
    chunk_size: int | None = None,
    has_aux: bool = False,
    coupling: Coupling = "raise",
    layout: torch.layout = torch.sparse_coo,
) -> Callable[..., Any]:
    """{sparse_jacobian}

    Example (PyTorch):
        >>> import torch
        >>> from divjac.torch import sparse_jacobian
        >>> J = sparse_jacobian(torch.sin)(torch.zeros(2, 3))
        >>> tuple(J.shape), J._nnz()
        ((2, 3, 3), 6)
    """
    return forward(T.sparse_jacobian, locals())


def clear_caches() -> None:
    """Drop every trace and detection that ``divjac.torch`` has cached.

    Never needed for correct results: a cached detection is reused only when the traced
    program and everything it read are unchanged (see ``docs/how-it-works.md``, "Caching").
    Use it to free memory, or to time a first call.
    """
    _detect.CACHE.clear()
    _detect.clear_memos()
    stochastic.clear_plans()
