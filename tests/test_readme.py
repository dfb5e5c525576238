"""The README's Python examples run as written (in order, in one namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_examples_run():
    pytest.importorskip("flax")
    pytest.importorskip("torch")
    import jax

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 5
    namespace: dict = {}
    with jax.enable_x64(False):  # as a user runs it (the test suite enables float64)
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
    assert namespace["div"].shape == (8,)
    assert namespace["mats"].shape == (2, 3072, 3072)
    assert namespace["J"].shape == (2, 4096, 4096)
    assert namespace["lap"].shape == (128,)
