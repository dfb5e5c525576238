"""What each part of divjac imports: the library never needs the ``cli`` extra, the CLI needs it.

Each check runs in a fresh interpreter in which the packages that are "not installed" are
blocked (``sys.modules[name] = None`` makes ``import name`` raise ``ImportError``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import divjac

CLI_EXTRA = ("typer", "rich", "matplotlib")
FRAMEWORKS_AND_ALTERNATIVES = ("jax", "torch", "flax", "optax", "asdex", "diffrax", "torchdiffeq")
SRC = str(Path(divjac.__file__).resolve().parents[1])


def run_python(code: str, blocked: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with the ``blocked`` packages missing."""
    prelude = f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
def test_the_library_never_imports_the_cli_extra():
    frameworks = [f for f in ("jax", "torch") if _installed(f)]
    code = f"""
    import importlib, pkgutil
    import divjac, divjac._core, divjac.models
    names = [m.name for m in pkgutil.walk_packages(divjac._core.__path__, "divjac._core.")]
    for framework in {frameworks!r}:
        names += [f"divjac.{{framework}}", f"divjac.models.{{framework}}"]
    for name in names:
        importlib.import_module(name)
    print(len(names), "modules")
    """
    result = run_python(code, CLI_EXTRA)
    assert result.returncode == 0, result.stderr
    assert "modules" in result.stdout


def test_the_cli_imports_only_its_extra():
    # Every module of divjac.cli imports with the frameworks and the alternatives missing (they
    # are imported when a command needs them); the help lists the commands.
    code = """
    import importlib, pkgutil
    import divjac.cli
    for m in pkgutil.iter_modules(divjac.cli.__path__, "divjac.cli."):
        importlib.import_module(m.name)
    importlib.import_module("divjac.cli.bench._harness")
    divjac.cli.main()
    """
    result = run_python(code, FRAMEWORKS_AND_ALTERNATIVES, "--help")
    assert result.returncode == 0, result.stderr
    for command in ("demo", "inspect", "bench"):
        assert command in result.stdout


@pytest.mark.slow
def test_bench_without_any_framework_skips_every_module(tmp_path):
    code = """
    from divjac.cli._bench import BUILTIN, Suite
    suite = Suite(BUILTIN)
    suite.run(suite.modules(), quick=True)
    print(sorted(suite.skipped))
    print(sorted({r.id for r in suite.results}))
    """
    result = run_python(code, FRAMEWORKS_AND_ALTERNATIVES)
    assert result.returncode == 0, result.stderr
    skipped, ids = result.stdout.strip().splitlines()[-2:]
    assert "'bench_jax_dense'" in skipped and "'bench_torch'" in skipped
    # Only the framework-free rows run: the core estimators' calibration table (P15).
    assert ids == "['P15']"


@pytest.mark.parametrize("missing", [CLI_EXTRA, ("rich",)])
def test_without_the_extra_the_cli_says_what_to_install(missing):
    result = run_python("import divjac.cli", missing)
    assert result.returncode != 0
    assert "MissingExtraError" in result.stderr and "pip install 'divjac[cli]'" in result.stderr
    assert ", ".join(missing) in result.stderr
    # The console script (divjac.__main__) says it in one line, without a traceback.
    result = run_python("from divjac.__main__ import main; main()", missing, "demo")
    assert result.returncode == 2
    assert result.stderr.startswith("error: the divjac command needs the 'cli' extra")
    assert "Traceback" not in result.stderr


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
