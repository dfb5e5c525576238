"""``divjac bench``: run a benchmark suite with a progress bar, print and save the table.

A suite is a folder of ``bench_*.py`` modules, each defining ``run(quick: bool) -> list[Result]``
(:class:`divjac.cli.bench.Result`). The default suite is :mod:`divjac.cli.bench`, installed
with the package; ``--suite DIR`` runs another folder's modules (the folder is put on
``sys.path``, so its modules can import each other). ``--device`` runs the rows that matter on
an accelerator, on it (:mod:`divjac.cli.bench._device`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import pkgutil
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import bench
from ._common import UsageError, writing
from .bench import Result

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["BUILTIN", "Suite", "find_suite", "markdown", "run_bench", "save", "table"]

BUILTIN = Path(bench.__file__).resolve().parent


@dataclass
class Suite:
    """The benchmark modules of one folder, and what running them gave."""

    folder: Path
    results: list[Result] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # module: the import that failed
    failed: dict[str, str] = field(default_factory=dict)  # module: its error (with --device)

    def modules(self, names: Sequence[str] | None = None) -> list[str]:
        """The ``bench_*`` modules, only those whose name contains one of ``names`` if given."""
        found = sorted(
            m.name
            for m in pkgutil.iter_modules([str(self.folder)])
            if m.name.startswith("bench_") and not m.ispkg
        )
        return [m for m in found if any(n in m for n in names)] if names else found

    def load(self, name: str) -> ModuleType:
        if self.folder == BUILTIN:
            return importlib.import_module(f"{bench.__name__}.{name}")
        if str(self.folder) not in sys.path:
            sys.path.insert(0, str(self.folder))
        spec = importlib.util.spec_from_file_location(name, self.folder / f"{name}.py")
        if spec is None or spec.loader is None:
            raise UsageError(f"cannot import {name!r} from {str(self.folder)!r}.")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def run(
        self,
        names: Sequence[str],
        *,
        quick: bool,
        on_start: Callable[[str], object] = lambda _: None,
        on_done: Callable[[str, Sequence[Result] | None], object] = lambda _n, _r: None,
        keep_going: bool = False,
    ) -> None:
        """Run the modules ``names``; one that needs a package not installed is skipped. With
        ``keep_going``, a module that raises is recorded in :attr:`failed` and the next runs."""
        for name in names:
            on_start(name)
            try:
                found = list(self.load(name).run(quick=quick))
            except ImportError as err:  # a framework or an alternative is not installed
                self.skipped[name] = f"{type(err).__name__}: {err}"
                on_done(name, None)
                continue
            except Exception as err:
                if not keep_going:
                    raise
                self.failed[name] = f"{type(err).__name__}: {err}"
                on_done(name, None)
                continue
            self.results.extend(found)
            on_done(name, found)


def find_suite(suite: Path | None) -> Path:
    """``suite`` (a folder of ``bench_*.py`` modules), else the built-in suite."""
    if suite is None:
        return BUILTIN
    if not suite.is_dir():
        raise UsageError(f"--suite {str(suite)!r} is not a folder of bench_*.py modules.")
    return suite.resolve()


def _measured(r: Result, value: float) -> str:
    """A measurement with its unit (times in ms)."""
    return f"{value * 1e3:.3g} ms" if r.unit == "s" else f"{value:.3g} {r.unit}"


def _cells(r: Result) -> tuple[str, ...]:
    return (
        r.id,
        r.case,
        r.ours,
        r.baseline,
        _measured(r, r.ours_value),
        _measured(r, r.baseline_value),
        f"{r.value:.3g}x",
        r.target_text,
    )


def table(results: Sequence[Result]) -> Table:
    """The results as a rich table: both measurements, the ratio or gain, its target."""
    from rich.table import Table

    t = Table(title="divjac benchmarks (ratios measured side by side in one run)")
    for col in ("id", "case", "divjac", "alternative", "ours", "theirs", "value", "target", "ok"):
        t.add_column(col)
    for r in results:
        t.add_row(*_cells(r), {True: "[green]yes", False: "[red]no", None: "-"}[r.passed])
    return t


def markdown(results: Sequence[Result]) -> str:
    """The table as Markdown: times in ms, the ratio or gain, the target and whether it is met."""
    lines = [
        "| id | case | divjac | alternative | divjac | alternative | value | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = list(_cells(r))
        cells[3] = f"`{r.baseline}`"
        cells.append({True: "yes", False: "**no**", None: "-"}[r.passed])
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def save(
    suite: Suite, out: Path, seconds: float, device: dict[str, Any] | None = None
) -> list[Path]:
    """Write ``results.json``, ``results.md`` and (when a result has a target) ``results.png``;
    ``device``: what ``--device`` ran on (its name, the framework versions)."""
    from ._plots import bench_chart

    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        **(device or {}),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "seconds": seconds,
        "suite": str(suite.folder),
        "skipped": suite.skipped,
        "failed": suite.failed,
    }
    results = [r.to_json() for r in suite.results]
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    versions = ", ".join(f"{k} {v}" for k, v in (device or {}).get("versions", {}).items())
    on = f"On {device['device']}: {versions}.\n\n" if device else ""
    (out / "results.md").write_text(on + markdown(suite.results))
    written = [out / "results.json", out / "results.md"]
    if bench_chart(suite.results, out / "results.png"):
        written.append(out / "results.png")
    return written


def run_bench(
    suite: Path | None,
    *,
    quick: bool,
    out: Path,
    only: Sequence[str] | None,
    console: Console,
    device: str | None = None,
) -> Suite:
    """Run the suite, print the table of ratios, write ``results.json``, ``.md`` and ``.png``.

    ``device`` (``cpu``, ``cuda``, ``gpu``, ``tpu``): the built-in suite's modules that matter on
    that device (or those of ``only``), run on it; a module that raises is reported and the
    next one runs, and the files are written after each module (a run stopped by a timeout
    keeps what it measured). Raises :class:`UsageError` where the device is not present.
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from .bench import _device

    on = _device.check(device) if device is not None else None
    ran = Suite(find_suite(suite))
    names = ran.modules(only)
    if device is not None and suite is None and not only:
        names = list(_device.MODULES[device])
    if not names:
        which = f" matching {', '.join(only)}" if only else ""
        raise UsageError(f"no benchmark modules bench_*.py{which} in {str(ran.folder)!r}.")
    with writing(out):  # before minutes of benchmarks, not after
        out.mkdir(parents=True, exist_ok=True)
    where = f" on {on['device']}" if on else ""
    console.print(f"benchmarks from {ran.folder}{where} ({'quick' if quick else 'full'} sizes)")
    start = time.perf_counter()
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("benchmarks", total=len(names))

        def on_start(name: str) -> None:
            progress.update(task, description=f"running {name}")

        def on_done(name: str, results: Sequence[Result] | None) -> None:
            progress.advance(task)
            if name in ran.failed:
                progress.console.print(f"  {name}: FAILED ({ran.failed[name]})", markup=False)
            elif results is None:
                progress.console.print(f"  {name}: skipped ({ran.skipped[name]})", markup=False)
            else:
                progress.console.print(f"  {name}: {len(results)} result(s)")
            if on is not None:
                with writing(out):
                    save(ran, out, time.perf_counter() - start, on)

        with _device.on_device(device) if device is not None else contextlib.nullcontext():
            ran.run(
                names, quick=quick, on_start=on_start, on_done=on_done, keep_going=on is not None
            )
        progress.update(task, description="done")
    seconds = time.perf_counter() - start
    console.print(table(ran.results))
    with writing(out):
        written = save(ran, out, seconds, on)
    missed = [r for r in ran.results if r.passed is False]
    console.print(
        f"{len(ran.results)} results in {seconds:.1f} s"
        + (f", {len(missed)} below target" if missed else "")
        + (f", {len(ran.skipped)} module(s) skipped" if ran.skipped else "")
        + (f", {len(ran.failed)} module(s) FAILED" if ran.failed else "")
        + f"; wrote {', '.join(str(p) for p in written)}"
    )
    return ran
