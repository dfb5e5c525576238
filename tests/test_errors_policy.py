"""Every error divjac raises is a :class:`divjac.DivjacError` (the promise of ``divjac._errors``).

The source is scanned: no ``raise`` of a built-in exception (``NotImplementedError`` aside, which
marks an abstract method) and no ``assert`` statement (stripped under ``python -O``; internal
invariants raise ``InternalError``).
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import divjac

ALLOWED = {"NotImplementedError", "StopIteration"}
BUILTIN_ERRORS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException) and name not in ALLOWED
}


def _raised_name(node: ast.Raise) -> str | None:
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return exc.id if isinstance(exc, ast.Name) else None


def offences(package: Path) -> list[str]:
    """``file:line what`` for each ``assert`` or ``raise`` of a built-in exception in a package."""
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Assert):
                found.append((where, node.lineno, "assert"))
            elif isinstance(node, ast.Raise) and _raised_name(node) in BUILTIN_ERRORS:
                found.append((where, node.lineno, f"raise {_raised_name(node)}"))
    return [f"{where}:{line} {what}" for where, line, what in sorted(found)]


def test_the_scan_finds_asserts_and_builtin_raises(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        "def f(x):\n"
        "    assert x\n"
        "    if x:\n"
        "        raise ValueError('no')\n"
        "    raise TypeError\n"
        "    raise NotImplementedError\n"
        "    raise MyError('fine')\n"
    )
    assert offences(package) == [
        "pkg/mod.py:2 assert",
        "pkg/mod.py:4 raise ValueError",
        "pkg/mod.py:5 raise TypeError",
    ]


def test_no_builtin_errors_or_asserts_in_divjac() -> None:
    found = offences(Path(divjac.__file__).parent)
    files = sorted({line.split(":", 1)[0] for line in found})
    assert not found, (
        f"{len(found)} raise(s) of a built-in exception or assert statement(s) in "
        f"{', '.join(files)}; raise a divjac._errors class instead (InternalError for an "
        "internal invariant):\n" + "\n".join(found)
    )
