"""The ``divjac`` command: demo, inspect and bench, and their error messages (exit code 2)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from divjac.cli import app
from divjac.cli._bench import BUILTIN, Suite, find_suite

HAS_TORCH = importlib.util.find_spec("torch") is not None

# torch's forward-mode AD loads its JVP decompositions with torch.jit.script on first use, which
# warns; the warning is torch's own business.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


def _torch_backend() -> bool:
    try:
        import divjac.torch  # noqa: F401
    except Exception:
        return False
    return True


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def flat(text: str) -> str:
    """Output without the line breaks rich adds at the terminal width."""
    return " ".join(text.split())


def assert_usage_error(result, *fragments: str) -> None:
    output = flat(result.output)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert output.startswith("error: "), output
    for fragment in fragments:
        assert fragment in output, (fragment, output)


# --- demo -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_quick_prints_every_method_and_writes_the_plots(tmp_path):
    out = tmp_path / "demo"
    result = invoke("demo", "--quick", "--out", str(out))
    assert result.exit_code == 0, result.output
    text = flat(result.output)
    for method in ("exact", "sparse", "auto", "hutchinson", "hutch++", "xtrace", "probing"):
        assert f"│ {method}" in text, method
    for quantity in ("d/dt", "d/dx", "grad div", "Laplacian", "diagonal colors", "column colors"):
        assert quantity in text, quantity
    assert "jax time" in text
    if _torch_backend():
        assert "torch time" in text and "jax and torch agree" in text
    for name in ("time_per_method.png", "estimator_error.png", "cnn_sparsity.png", "summary.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = json.loads((out / "results.json").read_text())
    assert report["failures"] == []
    methods = {row["label"] for row in report["divergence"] if row["model"] == "cnn"}
    assert methods == {"exact", "sparse", "auto", "hutchinson", "hutch++", "xtrace", "probing"}
    cnn = next(r for r in report["sparsity"] if r["model"] == "cnn")
    assert cnn["n_diagonal_colors"] == 48 and cnn["n_colors"] == 147
    assert {p["method"] for p in report["sweep"]} == {"hutchinson", "hutch++", "xtrace", "probing"}


def test_demo_reports_a_missing_backend_with_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "divjac.torch", None)  # as if torch were not installed
    from divjac.cli._demo import collect
    from divjac.cli._demo_report import QUICK

    report = collect(QUICK, ("torch",))
    assert report.backends == [] and "torch" in report.unavailable
    result = invoke("demo", "--quick", "--framework", "torch", "--out", str(tmp_path))
    assert_usage_error(result, "no backend is installed", "pip install 'divjac[torch]'")
    assert not (tmp_path / "results.json").exists()


def test_demo_rejects_an_unknown_framework(tmp_path):
    result = invoke("demo", "--framework", "tensorflow", "--out", str(tmp_path))
    assert_usage_error(result, "--framework must be one of jax, torch", "'tensorflow'")


# --- inspect ----------------------------------------------------------------------------------

JAX_MODULE = """
import jax
import jax.numpy as jnp

W = jnp.ones((3, 3, 3, 3)) / 27.0

def conv(x):
    w = W.astype(x.dtype)
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.tanh(y)

def dense(x):
    return jnp.tanh(x @ jnp.ones((x.shape[1], x.shape[1]), x.dtype))

def mixes(x):
    return x - jnp.mean(x, axis=0)

def widen(x):
    return jnp.concatenate([x, x], axis=1)

def not_an_array(x):
    return {"y": x}

NOT_A_FUNCTION = 3
"""

TORCH_MODULE = """
import torch

def conv(x):
    w = torch.ones(3, 3, 3, 3) / 27.0
    return torch.tanh(torch.nn.functional.conv2d(x, w, padding=1))
"""


@pytest.fixture
def jax_module(tmp_path: Path) -> Path:
    path = tmp_path / "user_model.py"
    path.write_text(textwrap.dedent(JAX_MODULE))
    return path


def inspect_json(*args: str) -> dict:
    result = invoke("inspect", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_inspect_conv_reports_pattern_colors_and_auto_plans(jax_module, tmp_path):
    spy = tmp_path / "plots" / "spy.png"
    report = inspect_json(f"{jax_module}:conv", "--shape", "4,8,8,3", "--spy", str(spy))
    assert report["framework"] == "jax"
    assert report["input_shape"] == report["output_shape"] == [4, 8, 8, 3]
    assert report["n_in"] == report["n_out"] == 192
    assert 0 < report["density"] < 0.2
    assert report["batch_independent"] is True and report["coupling"] is None
    assert report["column_colors"] == 27 and report["row_colors"] == 27
    assert report["diagonal_colors"] == 12
    assert report["divergence"] == {
        "method": "sparse",
        "passes": 12,
        "dense_passes": 192,
        "note": "one pass per diagonal color",
    }
    assert report["jacobian"]["method"] == "sparse" and report["jacobian"]["passes"] == 27
    assert report["spy"] == str(spy) and spy.read_bytes()[:4] == b"\x89PNG"


def test_a_spy_plot_that_cannot_be_written_is_a_usage_error(jax_module):
    """--spy under a path that is a file: the path and the reason, exit code 2."""
    result = invoke(
        "inspect", f"{jax_module}:conv", "--shape", "4,8,8,3", "--spy", f"{jax_module}/s.png"
    )
    assert_usage_error(result, "cannot write", "File exists")


def test_inspect_nnz_matches_the_dense_pattern(jax_module):
    import jax
    import jax.numpy as jnp
    import numpy as np

    report = inspect_json(f"{jax_module}:conv", "--shape", "2,6,6,3")
    module = _load(jax_module)
    x = jnp.ones((6, 6, 3))
    J = jax.jacfwd(lambda v: module.conv(v[None])[0])(x).reshape(108, 108)
    assert report["nnz"] == int(np.count_nonzero(np.asarray(J)))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("user_model_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inspect_dense_function_chooses_exact(jax_module):
    report = inspect_json(f"{jax_module}:dense", "--shape", "5,4")
    assert report["density"] == 1.0 and report["diagonal_colors"] == 4
    assert report["divergence"]["method"] == "exact" and report["divergence"]["passes"] == 4
    assert report["jacobian"]["method"] in ("fwd", "rev") and report["jacobian"]["passes"] == 4


def test_inspect_times_the_first_call_by_stage(jax_module):
    """The first call of the auto transform, by stage: the conv is detected, the 4-wide dense
    function is not (too few dense passes), and the stages add up to the first call."""
    from divjac._core import timing

    conv = inspect_json(f"{jax_module}:conv", "--shape", "2,8,8,3")["first_call"]
    dense = inspect_json(f"{jax_module}:dense", "--shape", "5,4")
    for call in (conv, dense["first_call"]):
        assert call["transform"] == "divergence(method='auto')" and call["note"] == ""
        assert list(call["stages"]) == [*timing.STAGES, "passes"]
        assert all(s >= 0 for s in call["stages"].values()) and call["second_seconds"] > 0
        assert sum(call["stages"].values()) == pytest.approx(call["first_seconds"])
        assert call["stages"]["trace"] > 0 and call["stages"]["screening"] > 0
    assert conv["stages"]["detection"] > 0 and conv["stages"]["coupling check"] == 0
    assert dense["first_call"]["stages"]["detection"] == 0
    assert dense["first_call"]["stages"]["coupling check"] > 0
    assert "detection skipped: 4 dense passes" in dense["divergence"]["note"]
    widen = inspect_json(f"{jax_module}:widen", "--shape", "4,3")["first_call"]
    assert widen["transform"] == "jacobian(mode='auto')"
    mixes = inspect_json(f"{jax_module}:mixes", "--shape", "4,3")["first_call"]
    assert mixes["first_seconds"] is None and "BatchCouplingError" in mixes["note"]


def test_inspect_reports_batch_coupling(jax_module):
    report = inspect_json(f"{jax_module}:mixes", "--shape", "4,3")
    assert report["batch_independent"] is False
    assert "depends on input sample" in report["coupling"]
    assert report["divergence"]["method"] == "refused"


def test_inspect_non_square_function_has_no_divergence(jax_module):
    report = inspect_json(f"{jax_module}:widen", "--shape", "4,3")
    assert report["n_out"] == 6 and report["n_in"] == 3
    assert report["divergence"] is None and report["diagonal_colors"] is None


def test_inspect_by_module_name_and_human_output(jax_module, monkeypatch):
    monkeypatch.chdir(jax_module.parent)
    result = invoke("inspect", "user_model:conv", "--shape", "2,8,8,3", "--dtype", "float64")
    assert result.exit_code == 0, result.output
    text = flat(result.output)
    assert "diagonal colors (trace)" in text and "12 of 192" in text
    assert "divergence(method='auto')" in text and "sparse: 12 batched passes" in text


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_inspect_torch_function(tmp_path):
    if not _torch_backend():
        pytest.skip("divjac.torch is not importable")
    path = tmp_path / "torch_model.py"
    path.write_text(textwrap.dedent(TORCH_MODULE))
    report = inspect_json(f"{path}:conv", "--shape", "2,3,8,8")
    assert report["framework"] == "torch"
    assert report["n_in"] == 192 and report["diagonal_colors"] == 12
    assert report["column_colors"] == 27
    assert report["divergence"]["method"] == "sparse"


def test_inspect_unknown_module():
    result = invoke("inspect", "no_such_module_xyz:f", "--shape", "2,3")
    assert_usage_error(result, "no module named 'no_such_module_xyz'")


def test_inspect_missing_file():
    result = invoke("inspect", "does/not/exist.py:f", "--shape", "2,3")
    assert_usage_error(result, "no such file", "exist.py")


def test_inspect_target_without_function():
    result = invoke("inspect", "user_model.py", "--shape", "2,3")
    assert_usage_error(result, "expected MODULE:FUNCTION")


def test_inspect_unknown_function_lists_the_callables(jax_module):
    result = invoke("inspect", f"{jax_module}:nope", "--shape", "2,3")
    assert_usage_error(result, "has no function 'nope'", "conv", "dense")


def test_inspect_not_a_function(jax_module):
    result = invoke("inspect", f"{jax_module}:NOT_A_FUNCTION", "--shape", "2,3")
    assert_usage_error(result, "is not a function")


def test_inspect_non_array_output(jax_module):
    result = invoke("inspect", f"{jax_module}:not_an_array", "--shape", "2,3")
    assert_usage_error(result, "returned a dict", "not a jax array")


def test_inspect_shape_that_does_not_fit(jax_module):
    result = invoke("inspect", f"{jax_module}:conv", "--shape", "2,3")
    assert_usage_error(result, "calling", "raised TypeError", "Check --shape")


@pytest.mark.parametrize("shape", ["2,a", "", "2,-3", "0"])
def test_inspect_malformed_shape(jax_module, shape):
    result = invoke("inspect", f"{jax_module}:conv", "--shape", shape)
    assert_usage_error(result, "--shape must be comma-separated positive integers")


def test_inspect_bad_dtype_and_framework(jax_module):
    result = invoke("inspect", f"{jax_module}:conv", "--shape", "2,3", "--dtype", "int8")
    assert_usage_error(result, "--dtype must be one of")
    result = invoke("inspect", f"{jax_module}:conv", "--shape", "2,3", "--framework", "tf")
    assert_usage_error(result, "--framework must be one of jax, torch")


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_inspect_framework_not_installed_names_the_extra(jax_module, monkeypatch, framework):
    monkeypatch.setitem(sys.modules, f"divjac.{framework}", None)
    result = invoke("inspect", f"{jax_module}:conv", "--shape", "2,3", "--framework", framework)
    assert_usage_error(
        result, f"the {framework} backend is not available", f"pip install 'divjac[{framework}]'"
    )


def test_inspect_module_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom at import')\n")
    result = invoke("inspect", f"{path}:f", "--shape", "2,3")
    assert_usage_error(result, "raised RuntimeError: boom at import")


# --- bench ------------------------------------------------------------------------------------

FAKE_BENCH = """
from divjac.cli.bench import Result


def run(quick):
    return [
        Result("P0", "fake case", "ours", "a|b", 1.0, 2.0, target=1.1),
        Result("-", "context", "ours", "theirs", 3.0, 3.0),
    ]
"""

NEEDS_AN_ALTERNATIVE = """
import no_such_alternative_xyz


def run(quick):
    return []
"""


@pytest.fixture
def fake_suite(tmp_path: Path) -> Path:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "bench_fake.py").write_text(textwrap.dedent(FAKE_BENCH))
    (suite / "bench_needs.py").write_text(textwrap.dedent(NEEDS_AN_ALTERNATIVE))
    (suite / "helper.py").write_text("raise RuntimeError('not a benchmark: never imported')\n")
    return suite


def test_bench_runs_the_suite_and_writes_json_markdown_and_png(fake_suite, tmp_path):
    out = tmp_path / "out"
    result = invoke("bench", "--quick", "--suite", str(fake_suite), "--out", str(out))
    assert result.exit_code == 0, result.output
    text = flat(result.output)
    assert "bench_fake: 2 result(s)" in text and "P0" in text and "yes" in text
    assert "bench_needs: skipped (ModuleNotFoundError: No module named" in text
    data = json.loads((out / "results.json").read_text())
    assert [r["id"] for r in data["results"]] == ["P0", "-"]
    assert data["results"][0]["passed"] is True
    assert list(data["meta"]["skipped"]) == ["bench_needs"]
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    rows = (out / "results.md").read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("| id | case |")
    assert rows[2] == (
        "| P0 | fake case | ours | `a\\|b` | 1e+03 ms | 2e+03 ms | 0.5x | <= 1.1x | yes |"
    )


def test_bench_only_selects_modules(fake_suite, tmp_path):
    result = invoke("bench", "--suite", str(fake_suite), "--only", "nothing_matches")
    assert_usage_error(result, "no benchmark modules", "nothing_matches")
    assert Suite(fake_suite).modules(["fake"]) == ["bench_fake"]


def test_bench_suite_that_is_not_a_folder(tmp_path):
    result = invoke("bench", "--suite", str(tmp_path / "missing"))
    assert_usage_error(result, "is not a folder of bench_*.py modules")
    result = invoke("bench", "--suite", str(tmp_path))
    assert_usage_error(result, "no benchmark modules bench_*.py in")


def test_bench_default_is_the_installed_suite_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no checkout here: the suite comes with the package
    assert find_suite(None) == BUILTIN
    modules = Suite(BUILTIN).modules()
    assert "bench_jax_dense" in modules and "bench_torch" in modules
    assert all(callable(Suite(BUILTIN).load(m).run) for m in modules if "jax" in m)
