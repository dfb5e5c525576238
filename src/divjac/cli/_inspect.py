"""``divjac inspect MODULE:FUNCTION --shape B,...``: what divjac sees in the user's function.

The function is called as ``f(x)`` with one array ``x`` of the given shape, the batch on axis 0
(functions of several arguments: wrap them, e.g. ``def f(x): return net(params, x)``). The report
gives the per-sample Jacobian pattern, its colorings, batch independence and the plans that
``jacobian(mode="auto")`` and ``divergence(method="auto")`` follow, with their pass counts (and,
where ``"auto"`` skips the detection, why: :mod:`divjac._core.detection_gate`). It times the first call
of the ``auto`` transform (the divergence of a square Jacobian, else the Jacobian) with fresh
caches, by stage (trace, coupling check, screening, detection, coloring, passes), against its
second call.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core import detection_gate, plan, timing
from .._errors import DivjacError
from ._common import (
    FRAMEWORKS,
    UsageError,
    backend_or_none,
    format_count,
    format_seconds,
    require_backend,
    writing,
)
from .bench._harness import block

if TYPE_CHECKING:
    from rich.console import Console

    from .._core.pattern import SparsityPattern

__all__ = [
    "DTYPES",
    "FirstCall",
    "Inspection",
    "inspect_function",
    "load_function",
    "parse_shape",
    "render",
]

DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass
class Plan:
    """What an ``auto`` transform would do: its method and passes versus the dense method."""

    method: str
    passes: int | None
    dense_passes: int
    note: str = ""


@dataclass
class FirstCall:
    """The first call of an ``auto`` transform (fresh caches) against its second call.

    Attributes:
        transform: the transform timed.
        first_seconds: wall time of the first call (``None``: refused).
        second_seconds: wall time of the second call (every cache warm).
        stages: seconds of the first call in each stage of :data:`divjac._core.timing.STAGES`
            (0 for a stage it skipped), and ``"passes"``: the rest (planning the seeds, the
            passes, and in JAX compiling them).
        note: why the call was refused, if it was.
    """

    transform: str
    first_seconds: float | None
    second_seconds: float | None
    stages: dict[str, float] = field(default_factory=dict)
    note: str = ""


@dataclass
class Inspection:
    """The report of ``divjac inspect`` (``--json`` prints :meth:`to_json`)."""

    target: str
    framework: str
    input_shape: list[int]
    output_shape: list[int]
    dtype: str
    n_in: int
    n_out: int
    nnz: int
    density: float
    batch_independent: bool
    coupling: str | None
    column_colors: int
    row_colors: int
    diagonal_colors: int | None
    jacobian: Plan
    divergence: Plan | None
    dense_fallbacks: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    detect_seconds: float = 0.0
    first_call: FirstCall | None = None
    spy: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --- command-line arguments -------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,32,32,3"`` (or ``8x32x32x3``) as a tuple of positive ints, batch first."""
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise UsageError(
            f"--shape must be comma-separated positive integers with the batch first, "
            f"e.g. --shape 8,32,32,3; got {text!r}."
        )
    return shape


def load_function(target: str) -> Callable[..., Any]:
    """The function ``FUNCTION`` of ``MODULE:FUNCTION`` (a ``.py`` file path or a module name)."""
    module_part, sep, name = target.rpartition(":")
    if not sep or not module_part or not name:
        raise UsageError(
            f"expected MODULE:FUNCTION, e.g. my_model.py:f or my_package.models:f; got {target!r}."
        )
    path = Path(module_part)
    if module_part.endswith(".py") or path.is_file():
        module = _import_path(path)
    else:
        module = _import_name(module_part)
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            defined = sorted(
                k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
            )
            listing = ", ".join(defined[:20]) or "none"
            raise UsageError(
                f"{module_part!r} has no function {name!r}. Callables it defines: {listing}."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{target!r} is not a function (its type is {type(obj).__name__}).")
    return obj


def _import_path(path: Path) -> ModuleType:
    if not path.is_file():
        raise UsageError(f"no such file: {str(path)!r} (from MODULE:FUNCTION).")
    resolved = path.resolve()
    name = f"_divjac_inspect_{resolved.stem}_{abs(hash(str(resolved)))}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {str(path)!r} as a Python module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(resolved.parent))  # sibling imports work as with `python file.py`
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(name, None)
        raise UsageError(f"importing {str(path)!r} raised {type(err).__name__}: {err}") from None
    finally:
        sys.path.remove(str(resolved.parent))
    return module


def _import_name(name: str) -> ModuleType:
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)  # as `python -m` does
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            raise UsageError(
                f"no module named {name!r} (looked in the current directory and on sys.path). "
                "Pass a module name that Python can import, or a file path such as "
                "path/to/model.py:f."
            ) from None
        raise UsageError(f"importing {name!r} failed: {err}") from None
    except Exception as err:
        raise UsageError(f"importing {name!r} raised {type(err).__name__}: {err}") from None
    finally:
        if added:
            sys.path.remove(cwd)


def guess_framework(fn: Callable[..., Any]) -> str:
    """The framework ``fn``'s module imports (JAX when both or neither, if installed)."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    roots = set()
    for value in vars(module).values() if module is not None else ():
        origin = (
            value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", "")
        )
        if isinstance(origin, str):
            roots.add(origin.split(".")[0])
    if "torch" in roots and "jax" not in roots:
        return "torch"
    if "jax" in roots or backend_or_none("jax")[0] is not None:
        return "jax"
    return "torch"


# --- the inspection ---------------------------------------------------------------------------


def _make_input(framework: str, shape: tuple[int, ...], dtype: str) -> Any:
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}.")
    data = np.random.default_rng(0).standard_normal(shape)
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        if dtype == "float64" and not jax.config.read("jax_enable_x64"):
            jax.config.update("jax_enable_x64", True)
        return jnp.asarray(data, getattr(jnp, dtype))
    import torch

    return torch.as_tensor(data, dtype=getattr(torch, dtype))


def _is_array(framework: str, value: Any) -> bool:
    if framework == "jax":
        import jax

        return isinstance(value, jax.Array)
    import torch

    return isinstance(value, torch.Tensor)


def inspect_function(
    target: str, shape_text: str, *, framework: str | None = None, dtype: str = "float32"
) -> tuple[Inspection, SparsityPattern]:
    """Import, call and analyze ``MODULE:FUNCTION``; every bad input is a :class:`UsageError`."""
    shape = parse_shape(shape_text)
    if framework is not None and framework not in FRAMEWORKS:
        raise UsageError(f"--framework must be one of {', '.join(FRAMEWORKS)}; got {framework!r}.")
    fn = load_function(target)
    framework = framework or guess_framework(fn)
    api = require_backend(framework)
    x = _make_input(framework, shape, dtype)
    described = f"an input of shape {shape} ({dtype}, {framework})"
    try:
        y = fn(x)
    except Exception as err:
        raise UsageError(
            f"calling {target} on {described} raised {type(err).__name__}: "
            f"{str(err).strip().rstrip('.')}. Check --shape (batch first; the function is "
            "called as f(x)), --dtype and --framework."
        ) from None
    if not _is_array(framework, y):
        raise UsageError(
            f"{target} returned a {type(y).__name__} on {described}, not a {framework} array. "
            "inspect needs f(x) -> array with the batch on axis 0 (return the array, not a "
            "tuple or a dict)."
        )
    out_shape = tuple(int(s) for s in y.shape)
    if not out_shape or out_shape[0] != shape[0]:
        raise UsageError(
            f"{target} maps {described} to shape {out_shape}: the output's first axis must be "
            f"the batch ({shape[0]}). Check --shape, or return one output row per sample."
        )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pattern: SparsityPattern = api.sparsity(fn)(x)
            colors = (pattern.n_colors, pattern.n_row_colors)
            diagonal = pattern.n_diagonal_colors if pattern.is_square else None
        except DivjacError as err:
            raise UsageError(str(err)) from None
    seconds = time.perf_counter() - start
    n_out, n_in = pattern.shape
    with warnings.catch_warnings(record=True) as timed:
        warnings.simplefilter("always")
        first_call = _time_first_call(api, fn, x, square=pattern.is_square)
        traced = importlib.import_module(f"divjac.{framework}._backend").BACKEND.trace(
            fn, (x,), {}, argnum=0, batch_axis=0, has_aux=False
        )
        jacobian_verdict = detection_gate.screen(traced, min(n_in, n_out))
        divergence_verdict = detection_gate.screen(traced, n_in)
    coupling = None
    if pattern.coupling is not None:
        c = pattern.coupling
        coupling = f"output sample {c.out_sample} depends on input sample {c.in_sample}"
    report = Inspection(
        target=target,
        framework=framework,
        input_shape=list(shape),
        output_shape=list(out_shape),
        dtype=dtype,
        n_in=n_in,
        n_out=n_out,
        nnz=pattern.nnz,
        density=pattern.density,
        batch_independent=pattern.is_batch_independent,
        coupling=coupling,
        column_colors=colors[0],
        row_colors=colors[1],
        diagonal_colors=diagonal,
        jacobian=_jacobian_plan(pattern, jacobian_verdict),
        divergence=_divergence_plan(pattern, divergence_verdict),
        dense_fallbacks=sorted(pattern.dense_fallbacks),
        warnings=sorted({str(w.message) for w in [*caught, *timed] if not _framework_notice(w)}),
        detect_seconds=seconds,
        first_call=first_call,
    )
    return report, pattern


def _time_first_call(api: ModuleType, fn: Callable[..., Any], x: Any, *, square: bool) -> FirstCall:
    """The first call of ``divergence(fn)`` (``jacobian(fn)`` when not ``square``) with fresh
    caches, by stage, and its second call."""
    name = "divergence(method='auto')" if square else "jacobian(mode='auto')"
    transform = api.divergence(fn) if square else api.jacobian(fn)
    api.clear_caches()
    try:
        with timing.recording() as stages:
            start = time.perf_counter()
            block(transform(x))
            first = time.perf_counter() - start
        start = time.perf_counter()
        block(transform(x))
        second = time.perf_counter() - start
    except DivjacError as err:
        return FirstCall(name, None, None, note=f"refused ({type(err).__name__})")
    breakdown = {stage: stages.get(stage, 0.0) for stage in timing.STAGES}
    breakdown["passes"] = max(first - sum(breakdown.values()), 0.0)
    return FirstCall(name, first, second, breakdown)


_REFUSED = (
    "refused with BatchCouplingError (the function mixes samples); coupling='exact' computes "
    "the true per-sample blocks with B x more passes"
)


def _jacobian_plan(pattern: SparsityPattern, verdict: detection_gate.Verdict) -> Plan:
    n_out, n_in = pattern.shape
    dense = min(n_in, n_out)
    if not pattern.is_batch_independent:
        return Plan("refused", None, dense, _REFUSED)
    chosen = plan.jacobian_plan("auto", n_in, n_out, pattern if verdict.detect else None)
    direction = "reverse: one VJP per row" if chosen.reverse else "forward: one JVP per column"
    if chosen.is_sparse:
        direction = "reverse, by row colors" if chosen.reverse else "forward, by column colors"
    elif not verdict.detect:
        direction += f"; detection skipped: {verdict.reason}"
    method = "sparse" if chosen.is_sparse else ("rev" if chosen.reverse else "fwd")
    return Plan(method, chosen.n_passes, dense, direction)


def _divergence_plan(pattern: SparsityPattern, verdict: detection_gate.Verdict) -> Plan | None:
    if not pattern.is_square:
        return None
    n = pattern.shape[1]
    if not pattern.is_batch_independent:
        return Plan("refused", None, n, _REFUSED)
    chosen = plan.divergence_plan("auto", n, pattern if verdict.detect else None)
    method = "sparse" if chosen.is_sparse else "exact"
    if chosen.is_sparse:
        note = "one pass per diagonal color"
    elif not verdict.detect:
        note = f"detection skipped: {verdict.reason}"
    else:
        note = f"{pattern.n_diagonal_colors} diagonal colors would save too little"
    return Plan(method, chosen.n_passes, n, note)


# --- output -----------------------------------------------------------------------------------


def _passes(p: Plan) -> str:
    if p.passes is None:
        return p.note
    if p.method != "sparse":
        return f"{p.method}: {format_count(p.passes)} batched passes, dense ({p.note})"
    gain = p.dense_passes / max(p.passes, 1)
    return (
        f"sparse: {format_count(p.passes)} batched passes instead of "
        f"{format_count(p.dense_passes)} dense ({gain:.1f}x fewer; {p.note})"
    )


def _first_call(call: FirstCall) -> str:
    if call.first_seconds is None:
        return call.note
    parts = ", ".join(
        f"{name} {format_seconds(seconds)}" for name, seconds in call.stages.items() if seconds
    )
    return (
        f"{format_seconds(call.first_seconds)} ({parts}); second call "
        f"{format_seconds(call.second_seconds)}"
    )


def render(report: Inspection, console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"divjac inspect {report.target}"), show_header=False)
    table.add_column(style="bold")
    table.add_column()
    dims = f"{report.input_shape} -> {report.output_shape}"
    table.add_row("call", f"f(x), x {dims}, {report.dtype}, {report.framework}")
    n_in, n_out = report.n_in, report.n_out
    table.add_row("per-sample Jacobian", f"{format_count(n_out)} x {format_count(n_in)}")
    table.add_row(
        "pattern density",
        f"{report.density:.4%} ({format_count(report.nnz)} structural nonzeros)",
    )
    table.add_row(
        "batch independent",
        "yes" if report.batch_independent else f"[red]no[/]: {escape(str(report.coupling))}",
    )
    table.add_row("column colors (forward)", f"{report.column_colors} of {format_count(n_in)}")
    table.add_row("row colors (reverse)", f"{report.row_colors} of {format_count(n_out)}")
    if report.diagonal_colors is not None:
        table.add_row(
            "diagonal colors (trace)", f"{report.diagonal_colors} of {format_count(n_in)}"
        )
    table.add_row("jacobian(mode='auto')", _passes(report.jacobian))
    if report.divergence is not None:
        table.add_row("divergence(method='auto')", _passes(report.divergence))
    else:
        table.add_row("divergence", "not defined: the per-sample Jacobian is not square")
    if report.dense_fallbacks:
        table.add_row(
            "[yellow]assumed dense",
            escape(", ".join(report.dense_fallbacks))
            + " (no sparsity rule; the pattern is still safe)",
        )
    table.add_row("detection + coloring", f"{report.detect_seconds:.2f} s")
    if report.first_call is not None:
        table.add_row(f"first call, {report.first_call.transform}", _first_call(report.first_call))
    if report.spy:
        table.add_row("spy plot", escape(report.spy))
    console.print(table, soft_wrap=False)
    for message in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)


def write_spy(pattern: SparsityPattern, path: Path, title: str) -> str:
    from . import _plots

    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UsageError(f"--spy needs a .png (or .pdf, .svg) file name; got {str(path)!r}.")
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        _plots.spy(pattern.csr, path, title)
    return str(path)


def _framework_notice(w: warnings.WarningMessage) -> bool:
    """A deprecation notice of the framework's own internals (torch scripting its forward-AD
    decompositions on first use): not about the user's function."""
    return issubclass(w.category, DeprecationWarning) and any(
        f"{os.sep}{name}{os.sep}" in w.filename for name in ("torch", "jax", "jaxlib")
    )
