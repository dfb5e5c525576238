"""The environment variables divjac reads, read in this module alone.

========================== ==================================================================
``DIVJAC_MEMORY_BUDGET_MB`` megabytes the passes of one call may use at once (default: half of
                           the device's free memory where the framework reports it, else
                           1024); set, it also turns off the host's cache-sized chunks
                           (:func:`divjac._core.plan.choose_chunk_size`)
``DIVJAC_MEMORY_LIMIT_MB``  megabytes beyond which passes are refused (default: the device's
                           free memory, else 80 % of the machine's memory)
``DIVJAC_DETECTION_MEMORY_MB`` megabytes the dependency sets of one sparsity detection may
                           hold (default: a quarter of the machine's memory, at most 4096)
``DIVJAC_DEBUG``            the ``divjac`` command shows the traceback of an unexpected error
========================== ==================================================================

:func:`read` reads them all, once per call of a transform (:attr:`divjac._call.Call.settings`)
or of the command; the planning functions take the :class:`Settings` they were given and read
them here only when called alone.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .._errors import OptionError

__all__ = ["Settings", "read"]

_MB = 1 << 20


@dataclass(frozen=True)
class Settings:
    """divjac's settings from the environment (``None``: unset, the default applies).

    Attributes:
        memory_budget: bytes, from ``DIVJAC_MEMORY_BUDGET_MB``.
        memory_limit: bytes, from ``DIVJAC_MEMORY_LIMIT_MB``.
        detection_memory: bytes, from ``DIVJAC_DETECTION_MEMORY_MB``.
        debug: ``DIVJAC_DEBUG`` is set (non-empty).
    """

    memory_budget: int | None = None
    memory_limit: int | None = None
    detection_memory: int | None = None
    debug: bool = False


def _bytes(name: str) -> int | None:
    """``name``'s megabytes in bytes; unset or empty: ``None`` (the default applies)."""
    configured = os.environ.get(name, "").strip()
    if not configured:
        return None
    try:
        megabytes = float(configured)
    except ValueError:
        megabytes = math.nan
    if not megabytes > 0 or math.isinf(megabytes):
        raise OptionError(
            f"{name}={configured!r} is not a positive number of megabytes: set it to one "
            f"(e.g. {name}=2048) or unset it for the default."
        )
    return int(megabytes * _MB)


def read() -> Settings:
    """The settings the environment gives now."""
    return Settings(
        memory_budget=_bytes("DIVJAC_MEMORY_BUDGET_MB"),
        memory_limit=_bytes("DIVJAC_MEMORY_LIMIT_MB"),
        detection_memory=_bytes("DIVJAC_DETECTION_MEMORY_MB"),
        debug=bool(os.environ.get("DIVJAC_DEBUG")),
    )
