"""Exceptions and warnings raised by divjac.

Every error subclasses both :class:`DivjacError` (catch everything divjac raises) and the built-in
exception a user would expect (``ValueError`` for a bad value, ``TypeError`` for a bad type).
Messages name the argument, say what was received and what to do instead.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path


class DivjacError(Exception):
    """Base class of every error raised by divjac."""


class InternalError(DivjacError, RuntimeError):
    """An internal invariant of divjac failed: a bug in divjac, never in the caller's code."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"divjac internal error: {what}. This is a bug in divjac, not in your code; please "
            "report it at https://github.com/divjac/divjac/issues with the call that raised it."
        )


class BatchCouplingError(DivjacError, ValueError):
    """The function mixes samples, so per-sample results from the batch trick would be wrong."""


class NonSquareJacobianError(DivjacError, ValueError):
    """A trace or determinant (divergence, log|det J|) was asked of a per-sample Jacobian that is
    not square."""


class BatchSizeMismatchError(DivjacError, ValueError):
    """The output's batch size differs from the differentiated input's batch size."""


class InputDtypeError(DivjacError, TypeError):
    """The differentiated input, the output or the probes do not have a real floating dtype."""


class ArgnumsError(DivjacError, ValueError):
    """``argnums`` does not select a positional argument of the call."""


class BatchAxisError(DivjacError, ValueError):
    """``batch_axis`` is not a valid axis of the differentiated input or of the output."""


class NotCallableError(DivjacError, TypeError):
    """The function given to a transform is not callable."""


class OutputError(DivjacError, TypeError):
    """The function's output is not what the transform needs (an array, a scalar per sample, ...)."""


class OptionError(DivjacError, ValueError):
    """An option of a transform (``mode``, ``method``, ``coupling``, ``chunk_size``, ...) has a
    value divjac does not accept."""


class PatternError(DivjacError, ValueError):
    """A sparsity pattern, a coloring or a probing distance does not fit: wrong shape, negative
    or missing colors, an unknown vertex order."""


class PatternTypeError(DivjacError, TypeError):
    """A sparsity pattern is not a scipy sparse matrix, or colors do not hold integers."""


class CoefficientError(DivjacError, ValueError):
    """The coefficient matrix of a second-order operator (``A`` or its factor) does not fit."""


class MultiIndexError(DivjacError, ValueError):
    """A derivative's multi-index ``alpha``, or an operator's terms, do not fit the input."""


class NumProbesError(DivjacError, ValueError):
    """``num_probes`` (or the given probes) does not fit the stochastic method."""


class MissingKeyError(DivjacError, TypeError):
    """A stochastic method was called without its randomness (a key, generator or probes) first."""


class UnexpectedRandomnessError(DivjacError, TypeError):
    """A key, generator or probes came first in the call of a transform that takes none (an
    exact method), where the function does not take it."""


class DetectionMemoryError(DivjacError, MemoryError):
    """Sparsity detection (or the passes) would need more memory than its budget allows."""


class RuleError(DivjacError, ValueError):
    """A registered sparsity rule is not a callable, or returned what does not fit the outputs."""


class MissingExtraError(DivjacError, ImportError):
    """A package of an optional extra (``divjac[cli]``) is not installed."""


class RetraceWarning(UserWarning):
    """A function is traced again at every call (results stay correct, calls are slow)."""


class FastPathWarning(UserWarning):
    """The function takes a path without gradients under ``no_grad``/``inference_mode`` whose
    results differ from those divjac differentiates (still the derivatives of the other path)."""


class DenseFallbackWarning(UserWarning):
    """Sparsity detection met an operation it has no rule for and assumed it dense, or, in
    ``"auto"``, stopped past its memory budget and the dense method runs instead (still
    correct; the message gives the passes and the memory)."""


class DDPError(DivjacError, ValueError):
    """A transform of a ``DistributedDataParallel`` model (or of the module it wraps) would leave
    gradients unsynchronized across processes."""


class StateUpdateError(DivjacError, RuntimeError):
    """The function updates in place a tensor it reads (a buffer, a captured tensor): a call,
    which evaluates it more than once, would apply the update several times."""


class UnsupportedOperationError(DivjacError, RuntimeError):
    """The function runs an operation that the framework itself cannot differentiate the way the
    transform needs (a ``torch.library`` custom operation under ``torch.func`` transforms, a JAX
    ``custom_jvp`` rule that cannot be differentiated again); the message names it."""


class CompileError(DivjacError, RuntimeError):
    """A transform was called under a framework's compiler (``torch.compile``) on a function
    its compiled passes do not support."""


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """Warn at the caller's line: the first frame outside divjac (and the decorators of
    ``contextlib`` it runs in), however deep in divjac the warning is found."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)


_INSIDE = (str(Path(__file__).resolve().parent), contextlib.__file__)
