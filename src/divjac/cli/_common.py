"""Shared pieces of the commands: the usage error, backend lookup and number formatting."""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from .._errors import DivjacError

__all__ = [
    "FRAMEWORKS",
    "UsageError",
    "backend_or_none",
    "format_count",
    "format_error",
    "format_seconds",
    "require_backend",
    "writing",
]

FRAMEWORKS = ("jax", "torch")


class UsageError(DivjacError, ValueError):
    """Bad input on the command line: reported as a message with exit code 2, no traceback."""


@contextlib.contextmanager
def writing(where: Path) -> Iterator[None]:
    """Writing files at ``where`` (a folder or file, its parents made): a file system error
    (a file where a folder goes, no permission) is a :class:`UsageError` naming the path."""
    try:
        yield
    except OSError as err:
        raise UsageError(f"cannot write {str(where)!r}: {err.strerror or err}.") from None


def backend_or_none(framework: str) -> tuple[ModuleType | None, str]:
    """``divjac.<framework>`` and ``""``, or ``None`` and why it cannot be imported."""
    try:
        return importlib.import_module(f"divjac.{framework}"), ""
    except ImportError as err:
        return None, f"{type(err).__name__}: {err}"
    except Exception as err:  # a backend that fails to import is reported, not fatal
        return None, f"importing divjac.{framework} raised {type(err).__name__}: {err}"


def require_backend(framework: str) -> ModuleType:
    """``divjac.<framework>``, or :class:`UsageError` naming the extra to install."""
    if framework not in FRAMEWORKS:
        raise UsageError(f"--framework must be one of {', '.join(FRAMEWORKS)}; got {framework!r}.")
    module, why = backend_or_none(framework)
    if module is None:
        raise UsageError(
            f"the {framework} backend is not available ({why}). Install it with "
            f"`pip install 'divjac[{framework}]'`, or choose another --framework."
        )
    return module


def format_seconds(seconds: float | None) -> str:
    """``0.42 ms``, ``12.3 ms``, ``1.23 s``; ``-`` for ``None``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 1e-2:
        return f"{seconds * 1e3:.2f} ms"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def format_error(error: float | None) -> str:
    """A relative error as ``3.1e-07`` (``0`` when exactly zero, ``-`` for ``None``)."""
    if error is None:
        return "-"
    if error == 0.0:
        return "0"
    return f"{error:.1e}"


def format_count(count: int) -> str:
    """``3072`` as ``3,072``."""
    return f"{count:,}"
