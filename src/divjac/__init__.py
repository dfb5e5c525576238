"""divjac: per-sample Jacobians and divergences of neural networks, in JAX and PyTorch.

The framework backends live in :mod:`divjac.jax` and :mod:`divjac.torch`; importing this
package imports neither framework.
"""

from ._errors import (
    ArgnumsError as ArgnumsError,
    BatchAxisError as BatchAxisError,
    BatchCouplingError as BatchCouplingError,
    BatchSizeMismatchError as BatchSizeMismatchError,
    CoefficientError as CoefficientError,
    CompileError as CompileError,
    DDPError as DDPError,
    DenseFallbackWarning as DenseFallbackWarning,
    DetectionMemoryError as DetectionMemoryError,
    DivjacError as DivjacError,
    FastPathWarning as FastPathWarning,
    InputDtypeError as InputDtypeError,
    InternalError as InternalError,
    MissingExtraError as MissingExtraError,
    MissingKeyError as MissingKeyError,
    MultiIndexError as MultiIndexError,
    NonSquareJacobianError as NonSquareJacobianError,
    NotCallableError as NotCallableError,
    NumProbesError as NumProbesError,
    OptionError as OptionError,
    OutputError as OutputError,
    PatternError as PatternError,
    PatternTypeError as PatternTypeError,
    RetraceWarning as RetraceWarning,
    RuleError as RuleError,
    StateUpdateError as StateUpdateError,
    UnexpectedRandomnessError as UnexpectedRandomnessError,
    UnsupportedOperationError as UnsupportedOperationError,
)

__version__ = "0.1.0"


def clear_caches() -> None:
    """Drop the cached traces and detections of every divjac backend already imported.

    Imports no framework: a backend that was never imported has nothing cached.
    """
    import sys

    for name in ("divjac.jax", "divjac.torch"):
        backend = sys.modules.get(name)
        if backend is not None:
            backend.clear_caches()


__all__ = [
    "ArgnumsError",
    "BatchAxisError",
    "BatchCouplingError",
    "BatchSizeMismatchError",
    "CoefficientError",
    "CompileError",
    "DDPError",
    "DenseFallbackWarning",
    "DetectionMemoryError",
    "DivjacError",
    "FastPathWarning",
    "InputDtypeError",
    "InternalError",
    "MissingExtraError",
    "MissingKeyError",
    "MultiIndexError",
    "NonSquareJacobianError",
    "NotCallableError",
    "NumProbesError",
    "OptionError",
    "OutputError",
    "PatternError",
    "PatternTypeError",
    "RetraceWarning",
    "RuleError",
    "StateUpdateError",
    "UnexpectedRandomnessError",
    "UnsupportedOperationError",
    "__version__",
    "clear_caches",
]
