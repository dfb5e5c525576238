"""Where the time of a call goes: its stages, recorded only while someone asks.

``divjac inspect`` and the benchmarks time a first call by stage (trace, coupling check,
screening, detection, coloring; the rest is the passes). The transforms mark their stages with
:class:`stage`; outside :func:`recording` a stage costs one list lookup.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from types import TracebackType

__all__ = ["STAGES", "recording", "stage"]

STAGES = ("trace", "coupling check", "screening", "detection", "coloring")
"""The stages a transform marks, in the order a first call meets them."""

_records: list[dict[str, float]] = []


class stage:
    """``with stage("trace"): ...``: adds the block's wall time to the open recordings."""

    __slots__ = ("_start", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._start: float | None = None

    def __enter__(self) -> None:
        self._start = time.perf_counter() if _records else None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._start is None:
            return
        elapsed = time.perf_counter() - self._start
        for record in _records:
            record[self.name] = record.get(self.name, 0.0) + elapsed


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Seconds spent in each stage while the block runs, by stage name (stages not met are
    absent)."""
    record: dict[str, float] = {}
    _records.append(record)
    try:
        yield record
    finally:
        del _records[next(i for i, r in enumerate(_records) if r is record)]
