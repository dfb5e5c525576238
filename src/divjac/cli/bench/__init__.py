"""The side-by-side benchmarks that ``divjac bench`` runs.

Each module ``bench_*.py`` here defines ``run(quick: bool) -> list[Result]`` and measures divjac
and the alternatives (hand-written ``vmap(jacfwd)``, full-batch ``jacfwd``, ``torch.func``,
asdex, FFJORD's code) in the same process, one after the other, so the ratios compare like with
like. A module whose framework or alternative is not installed is skipped with the reason.
``divjac bench --suite DIR`` runs the ``bench_*.py`` modules of another folder the same way; they
import :class:`Result` (and the timers) from here.
"""

from __future__ import annotations

from ._harness import (
    Result as Result,
    best_time as best_time,
    block as block,
    interleaved_best_times as interleaved_best_times,
)

__all__ = ["Result", "best_time", "block", "interleaved_best_times"]
