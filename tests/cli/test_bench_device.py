"""``divjac bench --device``: an absent device is a usage error naming the devices present; a
present one runs the rows that matter there, a module that fails is reported and the next runs."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest

from divjac.cli._bench import BUILTIN, Suite
from divjac.cli.bench import _device
from tests.cli.test_cli import assert_usage_error, fake_suite, flat, invoke

__all__ = ["fake_suite"]  # the fixture, for the tests below

FAILING_BENCH = """
def run(quick):
    raise RuntimeError("this row broke on the device")
"""


def _present(device: str) -> bool:
    if device == "cuda":
        if importlib.util.find_spec("torch") is None:
            return False
        import torch

        return torch.cuda.is_available()
    if importlib.util.find_spec("jax") is None:
        return False
    import jax

    return device in {d.platform for d in jax.devices()}


@pytest.mark.parametrize("device", ["cuda", "gpu", "tpu"])
def test_an_absent_device_is_a_usage_error(device, tmp_path):
    if _present(device):
        pytest.skip(f"{device} is present here")
    result = invoke("bench", "--device", device, "--out", str(tmp_path / "out"))
    assert_usage_error(result, f"--device {device}")
    assert not (tmp_path / "out").exists()  # refused before anything runs


def test_an_unknown_device_is_a_usage_error(tmp_path):
    result = invoke("bench", "--device", "xpu", "--out", str(tmp_path / "out"))
    assert_usage_error(result, "--device must be one of cpu, cuda, gpu, tpu", "'xpu'")


def test_the_device_rows_are_modules_of_the_builtin_suite():
    modules = Suite(BUILTIN).modules()
    for device, names in _device.MODULES.items():
        assert names and set(names) <= set(modules), device


def test_on_the_cpu_a_failing_module_is_reported_and_the_next_runs(fake_suite, tmp_path):
    (fake_suite / "bench_broken.py").write_text(textwrap.dedent(FAILING_BENCH))
    out = tmp_path / "out"
    result = invoke("bench", "--device", "cpu", "--suite", str(fake_suite), "--out", str(out))
    assert result.exit_code == 0, result.output
    text = flat(result.output)
    assert "bench_broken: FAILED (RuntimeError: this row broke on the device)" in text
    assert "bench_fake: 2 result(s)" in text and "1 module(s) FAILED" in text
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["device"].startswith("cpu") and meta["versions"]["divjac"]
    assert meta["failed"] == {"bench_broken": "RuntimeError: this row broke on the device"}
    assert (out / "results.md").read_text().startswith("On cpu")


def test_without_device_a_failing_module_stops_the_run(fake_suite, tmp_path):
    (fake_suite / "bench_broken.py").write_text(textwrap.dedent(FAILING_BENCH))
    result = invoke("bench", "--suite", str(fake_suite), "--out", str(tmp_path / "out"))
    assert result.exit_code == 1 and "this row broke on the device" in result.output
