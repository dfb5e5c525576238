"""``torch.func``'s refusal of an ``autograd.Function`` it cannot transform, as a divjac error.

``torch.func`` transforms run an ``autograd.Function`` only if it defines ``setup_context``;
the ``Function`` that ``torch.library`` generates for a custom operation's registered autograd
does not (torch 2.13: the chunked ``linear_cross_entropy``), nor do many written by hand. divjac
differentiates with ``torch.func`` where torch's autograd tape cannot: under
``torch.inference_mode`` (no tape records there), inside the caller's own ``torch.func``
transforms, and for second-order results. There torch raises a ``RuntimeError`` that names no
operation; :func:`functorch_refusals` raises :class:`~divjac.UnsupportedOperationError` naming
the custom operation (or the ``Function``) from the frame that applied it.

An operation torch has no derivative of at all (``aminmax`` before torch 2.13) is named the
same way, with the way out (:func:`~divjac.torch._compat.missing_derivative`).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import torch

from .._errors import UnsupportedOperationError
from ._compat import custom_operation_applied, function_applied, missing_derivative

__all__ = ["functorch_refusals"]

_REFUSAL = "autograd.Function with functorch transforms"


@contextlib.contextmanager
def functorch_refusals(fname: str) -> Iterator[None]:
    """Re-raise ``torch.func``'s refusal of an ``autograd.Function`` without ``setup_context``
    as :class:`UnsupportedOperationError` naming it, and torch's refusal of an operation it
    has no derivative of; any other error passes unchanged."""
    try:
        yield
    except RuntimeError as err:
        missing = missing_derivative(err)
        if missing is not None:
            op, way_out = missing
            raise UnsupportedOperationError(
                f"{fname}: the function runs {op}, which torch {torch.__version__} has no "
                f"derivative of: {way_out}."
            ) from err
        if _REFUSAL not in str(err):
            raise
        raise UnsupportedOperationError(
            f"{fname}: the function runs {_applied(err)}, an autograd.Function that "
            "torch.func transforms cannot run (it has no setup_context; torch.library "
            "generates such a Function for a custom operation's autograd). divjac "
            "differentiates with torch.func under torch.inference_mode, inside torch.func "
            "transforms and for second-order results (laplacian, hessian and the like). For "
            "first-order results, call it outside inference_mode (torch.no_grad() gives the "
            "same results without a graph) and outside torch.func; or use a path of the "
            "operation without the custom operation (linear_cross_entropy: options=None)."
        ) from err


def _applied(err: BaseException) -> str:
    """The innermost custom operation (else ``autograd.Function``) applied where ``err`` was
    raised."""
    op = function = None
    for frame, _ in traceback.walk_tb(err.__traceback__):
        custom = custom_operation_applied(frame)
        if custom is not None:
            op = str(custom)
        cls = function_applied(frame)
        if cls is not None:
            function = f"{cls.__module__}.{cls.__qualname__}"
    return op or function or "an operation"
