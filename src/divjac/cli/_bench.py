"""``divjac bench``: run the ``benchmarks/`` suite with a progress bar, print and save the table.

The suite is a folder holding ``run.py`` (the runner: ``discover``, ``run_all``, ``table``,
``save``) and the ``bench_*.py`` modules; ``divjac bench`` imports ``run.py`` by path and calls it.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ._common import UsageError

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["find_suite", "load_runner", "run_bench"]

_RUNNER_FUNCTIONS = ("discover", "run_all", "table", "save")


def find_suite(suite: Path | None) -> Path:
    """``suite``, else ``./benchmarks``, else the ``benchmarks/`` of the source checkout."""
    if suite is not None:
        if not (suite / "run.py").is_file():
            raise UsageError(
                f"--suite {str(suite)!r} is not a benchmark suite: it has no run.py. Pass the "
                "benchmarks/ folder of a divjac checkout."
            )
        return suite
    import divjac

    candidates = [
        Path.cwd() / "benchmarks",
        Path(divjac.__file__).resolve().parents[2] / "benchmarks",
    ]
    for candidate in candidates:
        if (candidate / "run.py").is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise UsageError(
        f"no benchmark suite found (tried {tried}). The benchmarks live in the divjac source "
        "checkout: run `divjac bench` from its root, or pass --suite path/to/benchmarks."
    )


def load_runner(suite: Path) -> ModuleType:
    """The suite's ``run.py`` as a module (it puts its folder on ``sys.path`` itself)."""
    path = suite / "run.py"
    spec = importlib.util.spec_from_file_location("_divjac_bench_runner", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {str(path)!r}.")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise UsageError(f"importing {str(path)!r} raised {type(err).__name__}: {err}") from None
    missing = [name for name in _RUNNER_FUNCTIONS if not hasattr(module, name)]
    if missing:
        raise UsageError(
            f"{str(path)!r} is not a divjac benchmark runner: no {', '.join(missing)}."
        )
    return module


def run_bench(
    suite: Path | None,
    *,
    quick: bool,
    out: Path,
    only: Sequence[str] | None,
    console: Console,
) -> list[Any]:
    """Run the suite, print the table of ratios, write ``results.json``, ``results.md`` and ``results.png``."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    folder = find_suite(suite)
    runner = load_runner(folder)
    names = list(only) if only else None
    modules = runner.discover(names)
    if not modules:
        which = f" matching {', '.join(names)}" if names else ""
        raise UsageError(f"no benchmark modules bench_*.py{which} in {str(folder)!r}.")
    console.print(f"benchmarks from {folder} ({'quick' if quick else 'full'} sizes)")
    start = time.perf_counter()
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("benchmarks", total=len(modules))
        started: list[str] = []

        def on_start(name: str) -> None:
            progress.update(task, description=f"running {name}", completed=len(started))
            started.append(name)

        def on_done(name: str, results: Sequence[Any]) -> None:
            progress.update(task, completed=len(started))
            progress.console.print(f"  {name}: {len(results)} result(s)")

        results = runner.run_all(quick=quick, names=names, on_start=on_start, on_done=on_done)
        progress.update(task, description="done", completed=len(modules))
    seconds = time.perf_counter() - start
    sys.stdout.flush()
    console.print(runner.table(results))
    runner.save(results, out, seconds)
    missed = [r for r in results if getattr(r, "passed", None) is False]
    written = [
        str(p)
        for p in (out / "results.json", out / "results.md", out / "results.png")
        if p.is_file()
    ]
    console.print(
        f"{len(results)} results in {seconds:.1f} s"
        + (f", {len(missed)} below target" if missed else "")
        + f"; wrote {', '.join(written) or 'nothing'}"
    )
    return list(results)
