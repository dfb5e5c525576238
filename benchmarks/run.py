"""Run the side-by-side benchmarks: ``python benchmarks/run.py [--quick] [--out DIR]``.

Prints the table of ratios against the alternatives, and writes ``results.json``,
``results.md`` (the table in Markdown, as in the README) and ``results.png`` to ``--out``
(default ``bench-results/``). ``divjac bench`` calls this.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import Result  # noqa: E402


def discover(names: Sequence[str] | None = None) -> list[Path]:
    """The benchmark modules ``bench_*.py`` (optionally only those whose name contains one of ``names``)."""
    paths = sorted(HERE.glob("bench_*.py"))
    if names:
        paths = [p for p in paths if any(n in p.stem for n in names)]
    return paths


def load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_all(
    *,
    quick: bool,
    names: Sequence[str] | None = None,
    on_start: Callable[[str], None] | None = None,
    on_done: Callable[[str, list[Result]], None] | None = None,
) -> list[Result]:
    """Run every benchmark module; a module that fails to import (missing extra) is skipped."""
    results: list[Result] = []
    for path in discover(names):
        if on_start:
            on_start(path.stem)
        try:
            module = load(path)
        except ImportError as err:
            print(f"skipping {path.stem}: {err}", file=sys.stderr)
            continue
        found = module.run(quick=quick)
        results.extend(found)
        if on_done:
            on_done(path.stem, found)
    return results


def _measured(r: Result, value: float) -> str:
    """A measurement with its unit (times in ms)."""
    return f"{value * 1e3:.3g} ms" if r.unit == "s" else f"{value:.3g} {r.unit}"


def table(results: Sequence[Result]) -> Any:
    from rich.table import Table

    t = Table(title="divjac benchmarks (ratios measured side by side in one run)")
    for col in ("id", "case", "divjac", "alternative", "ours", "theirs", "value", "target", "ok"):
        t.add_column(col)
    for r in results:
        ok = {True: "[green]yes", False: "[red]no", None: "-"}[r.passed]
        t.add_row(
            r.id, r.case, r.ours, r.baseline, _measured(r, r.ours_value),
            _measured(r, r.baseline_value),
            f"{r.value:.3g}x", r.target_text, ok,
        )  # fmt: skip
    return t


def markdown(results: Sequence[Result]) -> str:
    """The table as Markdown: times in ms, the ratio or gain, the target and whether it is met."""
    lines = [
        "| id | case | divjac | alternative | divjac | alternative | value | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        met = {True: "yes", False: "**no**", None: "-"}[r.passed]
        cells = (
            r.id, r.case, r.ours, f"`{r.baseline}`", _measured(r, r.ours_value),
            _measured(r, r.baseline_value),
            f"{r.value:.3g}x", r.target_text, met,
        )  # fmt: skip
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: Sequence[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.target is not None]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    labels = [f"{r.id} {r.case}" for r in rows]
    # Normalized so that 1 is the target and larger is better, whatever the kind.
    score = [
        (r.target / r.value if r.kind == "ratio" else r.value / r.target) if r.value else 0.0
        for r in rows
    ]
    colors = ["tab:green" if r.passed else "tab:red" for r in rows]
    ax.barh(labels, score, color=colors)
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("margin over target (>1 meets the target)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(results: Sequence[Result], out: Path, seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "seconds": seconds,
    }
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "results": [r.to_json() for r in results]}, indent=2)
    )
    (out / "results.md").write_text(markdown(results))
    plot(results, out / "results.png")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--only", nargs="*", help="run only modules whose name contains these")
    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console()
    start = time.perf_counter()
    results = run_all(
        quick=args.quick,
        names=args.only,
        on_start=lambda name: console.print(f"running {name} ..."),
    )
    console.print(table(results))
    save(results, args.out, time.perf_counter() - start)
    console.print(f"wrote {args.out / 'results.json'} and {args.out / 'results.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
