"""Command-line entry points (typer)."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="divjac",
    help="Per-sample Jacobians and divergences of neural networks, in JAX and PyTorch.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Per-sample Jacobians and divergences of neural networks, in JAX and PyTorch."""


@app.command()
def demo() -> None:
    """Run the main user stories on built-in models and print results and timings."""
    from ._demo import run_demo

    run_demo()


def main() -> None:
    """Console-script entry point."""
    app()
