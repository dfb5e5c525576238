"""PyTorch's own op database swept through divjac: the torch half of the conformance matrix.

For every OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` that supports
autograd in float64, and its first sample inputs, each sample is a single-sample function
``f(x) = op(x, *args, **kwargs)`` of the sample's input (the first tensor of a tensor list; the
floating outputs concatenated when there are several), checked against ``torch.func``:

- ``jacobian`` (``batch_axis=None``, modes ``"auto"`` and ``"sparse"``) equals ``jacrev``;
- the detected pattern (``sparsity``) holds every nonzero of the brute-force Jacobian;
- ``divergence`` equals the trace when the Jacobian is square;
- batched: ``jacobian`` of ``vmap(f)`` on two samples equals each sample's ``jacrev`` (``vmap``
  makes every op per-sample, soundly);
- ``hessian_diagonal`` and ``laplacian`` of the scalar ``u(x) = sum(w * f(x))`` (a fixed random
  ``w``) equal the diagonal and trace of ``torch.func.hessian(u)``.

A check is skipped, with the reason recorded, where the reference cannot be had: the op draws
random numbers, ``jacrev`` fails, ``jacrev`` and ``jacfwd`` disagree (the op is ill-posed at
the sample, as ``max_unpool`` with repeated indices; unless finite differences side with one of
them: ``as_strided_scatter``'s backward is wrong), or the op is nan at the sample (``__rpow__``
of a negative base: its derivative is undefined). A divjac error is a refusal (its class and
message are recorded); any other exception escaping divjac is a crash, a defect.

:func:`render` writes the coverage table of ``docs/conformance-torch.md`` from the ops'
:class:`Row` s; ``python -m tests.torch.opinfo`` sweeps every op and rewrites it. The slow tests
of ``tests/torch/test_conformance.py`` sweep the ops in parts, each part's rows checked against
the committed ones, and check the committed table against its own rows.
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

import divjac.torch as dt
from divjac import DenseFallbackWarning, DivjacError
from divjac._errors import InternalError

__all__ = [
    "CHECKS",
    "DOC",
    "Outcome",
    "Result",
    "Row",
    "differentiable_ops",
    "documented_rows",
    "render",
    "sweep_op",
]

DOC = Path(__file__).resolve().parents[2] / "docs" / "conformance-torch.md"
"""The coverage table this sweep renders."""

SAMPLES = 2
"""Sample inputs checked per op (the first ones of the OpInfo's generator)."""

CHECKS = ("jacobian", "sparse", "pattern", "divergence", "batched", "hessian")
"""The checks of a sample, in the columns of the table."""

# Verdicts of one check, best to worst; a table cell shows the worst over the samples.
_ORDER = ("ok", "n/a", "skip", "refused", "wrong", "missed", "crash")
_RTOL = 1e-7
# Entries of a sample's dense Jacobian beyond which the sample is skipped (80 MB): the checks
# of ``sort``'s first sample (6.4e7) alone took 3 minutes.
_DENSE_LIMIT = 10**7


@dataclass(frozen=True)
class Outcome:
    """The verdict of one check of one sample, and why (empty when ``ok``)."""

    verdict: str
    reason: str = ""


@dataclass
class Result:
    """What one op's samples gave: per check the outcomes, and the ATen operations detection
    had no rule for (handled as dense)."""

    name: str
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)
    fallbacks: set[str] = field(default_factory=set)

    def add(self, check: str, outcome: Outcome) -> None:
        self.outcomes.setdefault(check, []).append(outcome)

    def worst(self, check: str) -> Outcome:
        found = self.outcomes.get(check) or [Outcome("n/a")]
        return max(found, key=lambda o: _ORDER.index(o.verdict))

    @property
    def defects(self) -> list[str]:
        """The checks that found a defect: a wrong value, a missed nonzero, a crash."""
        return [
            f"{check}: {o.verdict} ({o.reason})"
            for check, found in self.outcomes.items()
            for o in found
            if o.verdict in ("wrong", "missed", "crash")
        ]


def differentiable_ops() -> list[Any]:
    """The OpInfos of PyTorch's database that support autograd in float64 on the CPU."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [
        op for op in op_db if op.supports_autograd and torch.float64 in op.supported_dtypes("cpu")
    ]


def op_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


# --- one sample ---------------------------------------------------------------------------------


def _detached(tree: Any) -> Any:
    return pytree.tree_map(lambda a: a.detach() if isinstance(a, torch.Tensor) else a, tree)


def _function(op: Any, sample: Any) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any] | None:
    """The single-sample function of ``sample`` and its input (``None``: nothing floating to
    differentiate)."""
    args, kwargs = _detached(sample.args), _detached(sample.kwargs)
    given = _detached(sample.input)
    if isinstance(given, torch.Tensor):
        x, rest = given, None
    elif isinstance(given, list | tuple) and given and isinstance(given[0], torch.Tensor):
        x, rest = given[0], list(given[1:])
    else:
        return None
    if x.dtype != torch.float64 or any(
        isinstance(t, torch.Tensor) and t.layout != torch.strided
        for t in pytree.tree_leaves((given, args, kwargs))
    ):
        return None
    process = sample.output_process_fn_grad

    def f(x: torch.Tensor) -> torch.Tensor:
        first = x if rest is None else [x, *rest]
        out = process(op(first, *args, **kwargs))
        leaves = [
            t
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        if len(leaves) == 1:
            return leaves[0]
        return torch.cat([t.reshape(-1) for t in leaves])

    return f, x


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = _RTOL) -> bool:
    """Equal to ``rtol`` of the largest reference entry; where one side is computed in a lower
    precision (an op casting to ``bfloat16``), to that precision's rounding."""
    if a.shape != b.shape:
        return False
    if a.dtype != b.dtype:
        inexact = [t for t in (a.dtype, b.dtype) if t.is_floating_point or t.is_complex]
        rtol = max([rtol] + [16 * torch.finfo(t).eps for t in inexact])
        common = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(common), b.to(common)
    scale = max(1.0, float(b[b.isfinite()].abs().max()) if b.isfinite().any() else 1.0)
    return bool(torch.allclose(a, b, rtol=rtol, atol=rtol * scale, equal_nan=True))


def _error(err: BaseException) -> Outcome:
    """A refusal (a divjac error) or a crash (anything else, and divjac's internal errors)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    first = re.sub(r"0x[0-9a-f]+", "0x…", first)[:240]
    verdict = (
        "refused"
        if isinstance(err, DivjacError) and not isinstance(err, InternalError)
        else "crash"
    )
    return Outcome(verdict, f"{type(err).__name__}: {first}")


def _run(result: Result, check: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` (a divjac call), recording a refusal or crash; ``None`` then."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = compute()
    except Exception as err:
        result.add(check, _error(err))
        return None
    for w in caught:
        if issubclass(w.category, DenseFallbackWarning):
            result.fallbacks.update(
                re.findall(r"'?(aten\.[\w.]+|[\w.]+\.default)'?", str(w.message))
            )
    return value


def _quiet(compute: Callable[[], Any]) -> Any:
    """``compute()`` (a reference), its warnings dropped; ``None`` if it raises."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return compute()
    except Exception:
        return None


def _reference(f: Callable[..., Any], x: torch.Tensor, forward: bool) -> tuple[Any, str]:
    """The Jacobian of ``f`` at ``x`` by plain backward passes, one per row (``jacrev``'s
    ``vmap`` of some backward kernels is wrong: ``cdist`` in torch 2.13), or why it cannot
    serve (it fails, ``jacfwd`` disagrees, or the op is nan at the sample: its derivative is
    undefined there, and the nan of every backward pass spreads over its whole row, as
    ``0 * nan``, where the entry is structurally zero). Where ``jacfwd`` cannot ``vmap`` the
    op, plain forward passes, one per column, check the rows; where they disagree, the one
    that central differences confirm is the reference."""
    rev = _quiet(lambda: torch.autograd.functional.jacobian(f, x))
    if rev is None:
        return None, "jacrev fails"
    if rev.isnan().any() and f(x).isnan().any():
        return None, "ill-posed: the op is nan at the sample"
    fwd = _quiet(lambda: torch.func.jacfwd(f)(x)) if forward else None
    if fwd is not None and not _close(fwd, rev, rtol=1e-5):
        return None, "ill-posed: jacrev and jacfwd disagree"
    if forward and fwd is None:  # no batching rule (as_strided_scatter): columns one by one
        fwd = _quiet(lambda: _columns(f, x))
        if fwd is not None and not _close(fwd, rev, rtol=1e-5):
            # torch's reverse or forward derivative is wrong: the one finite differences
            # confirm (as_strided_scatter's backward, torch 2.13), else the op is ill-posed
            fd = _quiet(lambda: _central_differences(f, x))
            for ref in (fwd, rev):
                if fd is not None and _close(ref, fd, rtol=1e-5):
                    return ref, ""
            return None, "ill-posed: jacrev and jacfwd disagree"
    return rev, ""


def _basis(x: torch.Tensor) -> torch.Tensor:
    return torch.eye(x.numel(), dtype=x.dtype).reshape(x.numel(), *x.shape)


def _stacked_columns(columns: list[torch.Tensor], y: torch.Tensor, x: torch.Tensor) -> Any:
    """The Jacobian (``jacrev``'s shape) of its columns, one per element of ``x``."""
    return torch.stack(columns, -1).reshape(*y.shape, *x.shape)


def _columns(f: Callable[..., Any], x: torch.Tensor) -> Any:
    """The Jacobian of ``f`` at ``x`` by plain forward passes, one per column."""
    y = f(x)
    return _stacked_columns([torch.func.jvp(f, (x,), (e,))[1] for e in _basis(x)], y, x)


def _central_differences(f: Callable[..., Any], x: torch.Tensor, eps: float = 1e-6) -> Any:
    y = f(x)
    return _stacked_columns(
        [(f(x + eps * e) - f(x - eps * e)) / (2 * eps) for e in _basis(x)], y, x
    )


def sweep_sample(op: Any, sample: Any, result: Result, seed: int) -> None:
    """Run every check of one sample into ``result``."""
    made = _function(op, sample)
    if made is None:
        for check in CHECKS:
            result.add(check, Outcome("n/a", "no dense floating input"))
        return
    f, x = made
    y = _quiet(lambda: f(x))
    if not isinstance(y, torch.Tensor):
        for check in CHECKS:
            result.add(check, Outcome("skip", "the op fails on its sample"))
        return
    if not y.is_floating_point() or y.layout != torch.strided:
        for check in CHECKS:
            result.add(check, Outcome("n/a", "no dense floating output"))
        return
    if x.numel() * y.numel() > _DENSE_LIMIT:
        for check in CHECKS:
            result.add(check, Outcome("skip", "dense Jacobian too large"))
        return
    again = f(x)
    if not (again.shape == y.shape and torch.equal(again.nan_to_num(), y.nan_to_num())):
        for check in CHECKS:
            result.add(check, Outcome("skip", "random"))
        return
    jac, why = _reference(f, x, op.supports_forward_ad)
    first = (jac, why)
    _first_order(result, f, x, y, jac, why)
    _batched(result, f, x, seed, first)
    _second_order(result, f, x, y, seed, op.supports_fwgrad_bwgrad)


def _first_order(
    result: Result, f: Callable[..., Any], x: torch.Tensor, y: torch.Tensor, jac: Any, why: str
) -> None:
    if jac is None:
        for check in ("jacobian", "sparse", "pattern", "divergence"):
            result.add(check, Outcome("skip", why))
        return
    for check, mode in (("jacobian", "auto"), ("sparse", "sparse")):
        got = _run(result, check, lambda mode=mode: dt.jacobian(f, batch_axis=None, mode=mode)(x))
        if got is not None:
            result.add(
                check, Outcome("ok") if _close(got, jac) else Outcome("wrong", _diff(got, jac))
            )
    pattern = _run(result, "pattern", lambda: dt.sparsity(f, batch_axis=None)(x))
    if pattern is not None:
        dense = jac.reshape(y.numel(), x.numel())
        nonzero = (dense != 0).numpy()
        csr = pattern.csr
        if csr.shape != nonzero.shape:
            result.add(
                "pattern", Outcome("wrong", f"pattern shape {csr.shape} for {nonzero.shape}")
            )
        else:
            missed = int((nonzero & ~csr.toarray().astype(bool)).sum())
            result.add(
                "pattern", Outcome("missed", f"{missed} nonzeros") if missed else Outcome("ok")
            )
    if y.shape != x.shape:
        result.add("divergence", Outcome("n/a", "output and input shapes differ"))
        return
    div = _run(result, "divergence", lambda: dt.divergence(f, batch_axis=None)(x))
    if div is not None:
        trace = jac.reshape(x.numel(), x.numel()).trace()
        result.add(
            "divergence",
            Outcome("ok") if _close(div, trace) else Outcome("wrong", _diff(div, trace)),
        )


def _batched(
    result: Result, f: Callable[..., Any], x: torch.Tensor, seed: int, first: tuple[Any, str]
) -> None:
    """``jacobian`` of ``vmap(f)`` on ``x`` and a relative perturbation of it (zeros, signs and
    symmetry of the sample kept as far as the perturbation allows)."""
    jac, why = first
    if jac is None:
        result.add("batched", Outcome("skip", why))
        return
    gen = torch.Generator().manual_seed(seed)
    x2 = x * (1 + 1e-3 * torch.rand(x.shape, generator=gen, dtype=x.dtype))
    xb = torch.stack([x, x2])
    fb = torch.func.vmap(f)
    yb = _quiet(lambda: fb(xb))
    y2 = _quiet(lambda: f(x2))
    if not isinstance(yb, torch.Tensor) or y2 is None or not _close(yb, torch.stack([f(x), y2])):
        result.add("batched", Outcome("skip", "vmap of the op fails or differs"))
        return
    jac2, why2 = _reference(f, x2, forward=False)
    if jac2 is None:
        result.add("batched", Outcome("skip", why2))
        return
    want = torch.stack([jac, jac2])
    got = _run(result, "batched", lambda: dt.jacobian(fb)(xb))
    if got is not None:
        result.add(
            "batched", Outcome("ok") if _close(got, want) else Outcome("wrong", _diff(got, want))
        )


def _second_order(
    result: Result, f: Callable[..., Any], x: torch.Tensor, y: torch.Tensor, seed: int, fwd: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(y.shape, generator=gen, dtype=y.dtype)

    def u(x: torch.Tensor) -> torch.Tensor:
        return (f(x) * w).sum()

    rev = _quiet(lambda: torch.func.jacrev(torch.func.jacrev(u))(x))
    if rev is None:
        result.add("hessian", Outcome("skip", "jacrev of jacrev fails"))
        return
    ref = _quiet(lambda: torch.func.hessian(u)(x)) if fwd else None
    if ref is not None and not _close(ref, rev, rtol=1e-5):
        result.add("hessian", Outcome("skip", "ill-posed: hessian and jacrev of jacrev disagree"))
        return
    n = x.numel()
    diag = rev.reshape(n, n).diagonal().reshape(x.shape)
    got = _run(result, "hessian", lambda: dt.hessian_diagonal(u, batch_axis=None)(x))
    if got is None:
        return
    if not _close(got, diag, rtol=1e-6):
        result.add("hessian", Outcome("wrong", "hessian_diagonal " + _diff(got, diag)))
        return
    lap = _run(result, "hessian", lambda: dt.laplacian(u, batch_axis=None)(x))
    if lap is None:
        return
    trace = diag.sum()
    result.add(
        "hessian",
        Outcome("ok")
        if _close(lap, trace, rtol=1e-6)
        else Outcome("wrong", "laplacian " + _diff(lap, trace)),
    )


def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} for {tuple(want.shape)}"
    return f"max error {float((got - want).abs().max()):.2e}"


def sweep_op(op: Any, samples: int = SAMPLES) -> Result:
    """Every check of the first ``samples`` sample inputs of ``op``."""
    result = Result(op_name(op))
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():  # the generator's own (a beta-feature warning, once)
            warnings.simplefilter("ignore")
            found = list(
                itertools.islice(
                    op.sample_inputs("cpu", torch.float64, requires_grad=False), samples
                )
            )
    except Exception as err:  # the generator itself fails (not divjac)
        for check in CHECKS:
            result.add(check, Outcome("skip", f"sample inputs fail: {type(err).__name__}"))
        return result
    for i, sample in enumerate(found):
        with warnings.catch_warnings():  # the op's own (deprecations); divjac's are recorded
            warnings.simplefilter("ignore")
            sweep_sample(op, sample, result, seed=i)
    return result


# --- the coverage table -------------------------------------------------------------------------


_SYMBOLS = {"ok": "✓", "n/a": "–"}
"""A table cell's symbol for a verdict (the other verdicts are written as they are)."""


def _rule(result: Result) -> str:
    if any(o.verdict in ("refused",) for found in result.outcomes.values() for o in found) and all(
        o.verdict not in ("ok",) for o in result.outcomes.get("pattern", [])
    ):
        return "refused"
    if result.fallbacks:
        return "dense fallback"
    return "exact rule"


@dataclass(frozen=True)
class Row:
    """One op's row of the table: its detection, its worst verdict per check and the notes. The
    table is a function of its rows (:func:`render`), so that the sweep can be checked in parts:
    each part's rows against the committed ones, and the committed summary against its rows."""

    name: str
    detection: str
    verdicts: tuple[str, ...]
    note: str

    @classmethod
    def of(cls, r: Result) -> Row:
        worst = [r.worst(c) for c in CHECKS]
        notes = sorted({o.reason for o in worst if o.verdict != "ok" and o.reason})
        detection = _rule(r)
        if r.fallbacks:
            detection += " (" + ", ".join(f"`{op}`" for op in sorted(r.fallbacks)) + ")"
        note = "; ".join(n.replace("|", "\\|") for n in notes)
        return cls(r.name, detection, tuple(o.verdict for o in worst), note)

    @classmethod
    def parse(cls, line: str) -> Row:
        """The row of a table line (a note's own ``|`` is escaped: ``\\|``)."""
        name, detection, *cells, note = re.split(r"(?<!\\) ?\| ?", line)[1:-1]
        inverse = {symbol: verdict for verdict, symbol in _SYMBOLS.items()}
        return cls(name.strip("`"), detection, tuple(inverse.get(c, c) for c in cells), note)

    @property
    def rule(self) -> str:
        return self.detection.split(" (")[0]

    def line(self) -> str:
        cells = " | ".join(_SYMBOLS.get(v, v) for v in self.verdicts)
        return f"| `{self.name}` | {self.detection} | {cells} | {self.note} |"


_OPS_HEADER = "| op | detection | " + " | ".join(CHECKS) + " | notes |"


def documented_rows() -> dict[str, Row]:
    """The rows of the committed table, by op name."""
    lines = DOC.read_text().splitlines()
    table = lines[lines.index(_OPS_HEADER) + 2 :]
    return {row.name: row for row in map(Row.parse, table)}


def render(rows: Iterable[Row]) -> str:
    """The Markdown coverage table of the sweep, from its rows (:meth:`Row.of`)."""
    rows = sorted(rows, key=lambda r: r.name)
    rules = Counter(r.rule for r in rows)
    verdicts = {c: Counter(r.verdicts[i] for r in rows) for i, c in enumerate(CHECKS)}
    lines = [
        "# Conformance: PyTorch ops",
        "",
        "<!-- Generated by tests/torch/opinfo.py (`python -m tests.torch.opinfo` rewrites it; the "
        "slow tests of tests/torch/test_conformance.py check it). -->",
        "",
        f"divjac.torch swept over PyTorch {torch.__version__.split('+')[0]}'s own op database "
        f"(`op_db`): {len(rows)} OpInfos that support autograd in float64, the first "
        f"{SAMPLES} sample inputs of each. How each check is made is in "
        "[tests/torch/opinfo.py](../tests/torch/opinfo.py).",
        "",
        "## Summary",
        "",
        "| | " + " | ".join(CHECKS) + " |",
        "|---|" + "---|" * len(CHECKS),
    ]
    for verdict in _ORDER:
        lines.append(
            f"| {verdict} | " + " | ".join(str(verdicts[c][verdict]) for c in CHECKS) + " |"
        )
    lines += [
        "",
        "Detection: "
        + ", ".join(f"{rules[k]} {k}" for k in ("exact rule", "dense fallback", "refused"))
        + ".",
        "",
        "## Ops",
        "",
        "✓: equal to the reference; –: does not apply; skip: no reference (the reason is in the "
        "notes); refused: a divjac error (its message in the notes).",
        "",
        _OPS_HEADER,
        "|---|---|" + "---|" * len(CHECKS) + "---|",
        *(r.line() for r in rows),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:  # pragma: no cover - the slow tests run the same sweep
    DOC.write_text(render(Row.of(sweep_op(op)) for op in differentiable_ops()))


if __name__ == "__main__":  # pragma: no cover
    main()
