"""Command-line entry points (typer): ``divjac demo``, ``divjac inspect``, ``divjac bench``.

Bad input (an unknown module or function, a shape that does not fit, a framework that is not
installed, ...) is reported as one clear message with exit code 2, never a traceback. Set
``DIVJAC_DEBUG=1`` to see the traceback of an unexpected error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from .._core import settings
from ._common import FRAMEWORKS, UsageError

app = typer.Typer(
    name="divjac",
    help="Per-sample Jacobians and divergences of neural networks, in JAX and PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

T = TypeVar("T")


def _console() -> Console:
    return Console()


def _guarded(body: Callable[[], T]) -> T:
    """Run a command body: a usage error exits with 2, anything unexpected with 1."""
    errors = Console(stderr=True)
    try:
        return body()
    except UsageError as err:
        errors.print(f"error: {err}", style="red", markup=False, highlight=False)
        raise typer.Exit(2) from None
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as err:
        if settings.read().debug:
            raise
        errors.print(
            f"error: {type(err).__name__}: {err}\n(unexpected; set DIVJAC_DEBUG=1 for the "
            "traceback and please report it)",
            style="red",
            markup=False,
            highlight=False,
        )
        raise typer.Exit(1) from None


def _frameworks(framework: str | None) -> tuple[str, ...]:
    if framework is None:
        return FRAMEWORKS
    if framework not in FRAMEWORKS:
        raise UsageError(f"--framework must be one of {', '.join(FRAMEWORKS)}; got {framework!r}.")
    return (framework,)


@app.callback()
def _root() -> None:
    """Per-sample Jacobians and divergences of neural networks, in JAX and PyTorch."""


@app.command()
def demo(
    out: Annotated[
        Path, typer.Option("--out", help="Folder for the PNG plots and results.json.")
    ] = Path("divjac-demo"),
    framework: Annotated[
        str | None,
        typer.Option("--framework", help="Run only this backend (jax or torch); default: all."),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", hidden=True)] = False,
) -> None:
    """Divergences by every method, d/dt, grad div and sparse Jacobians on built-in models.

    Runs in every installed backend on the net(x, t) MLP, a CNN on [8, 32, 32, 3] and a 64x64 Gaussian blur; prints the tables and writes time_per_method.png, estimator_error.png, cnn_sparsity.png, summary.png and results.json to --out.
    """

    def body() -> None:
        from ._demo import run_demo

        report = run_demo(out, quick=quick, frameworks=_frameworks(framework), console=_console())
        if report.failures:
            raise typer.Exit(1)

    _guarded(body)


@app.command()
def inspect(
    target: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:FUNCTION",
            help="The function: path/to/file.py:f or package.module:f, called as f(x).",
        ),
    ],
    shape: Annotated[str, typer.Option("--shape", help="Shape of x, batch first, e.g. 8,32,32,3.")],
    framework: Annotated[
        str | None,
        typer.Option("--framework", help="jax or torch; default: the one the module imports."),
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="dtype of x.")] = "float32",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON (machine-readable).")
    ] = False,
    spy: Annotated[
        Path | None, typer.Option("--spy", help="Write a spy plot of the pattern (PNG).")
    ] = None,
) -> None:
    """Per-sample sparsity, colors, batch independence and the auto plan of YOUR function.

    The function is called as f(x) with one array x of --shape (batch on axis 0, random normal values); wrap a function of several arguments first: def f(x): return net(params, x). --framework defaults to the framework the module imports (jax when both or neither).
    """

    def body() -> None:
        from ._inspect import inspect_function, render, write_spy

        report, pattern = inspect_function(target, shape, framework=framework, dtype=dtype)
        if spy is not None:
            report.spy = write_spy(pattern, spy, f"{target}  x {tuple(report.input_shape)}")
        if as_json:
            typer.echo(json.dumps(report.to_json(), indent=2))
        else:
            render(report, _console())

    _guarded(body)


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="Smaller sizes, fewer repeats.")] = False,
    out: Annotated[
        Path, typer.Option("--out", help="Folder for results.json, results.md and results.png.")
    ] = Path("bench-results"),
    suite: Annotated[
        Path | None,
        typer.Option(
            "--suite", help="A folder of bench_*.py modules to run instead of the built-in suite."
        ),
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option("--only", help="Run only modules whose name contains this (repeatable)."),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="Run the rows that matter on an accelerator, on it: gpu or tpu (JAX), cuda "
            "(torch), or cpu. An absent device is an error.",
        ),
    ] = None,
) -> None:
    """Run the side-by-side benchmarks: ratio table, results.json, results.md and a PNG chart.

    The built-in suite (divjac.cli.bench) compares divjac with hand-written vmap(jacfwd), full-batch jacfwd, torch.func, asdex and FFJORD's code; a module whose framework or alternative is not installed is skipped, with the reason.
    """

    def body() -> Any:
        from ._bench import run_bench

        return run_bench(suite, quick=quick, out=out, only=only, console=_console(), device=device)

    _guarded(body)


def main() -> None:
    """Console-script entry point."""
    app()
