"""``pip install divjac`` with JAX alone: the estimators need no ``array_api_compat`` for JAX."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys

    sys.modules["array_api_compat"] = None  # any import of it now raises ImportError

    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    import divjac.jax as dj

    n = 8
    rng = np.random.default_rng(0)
    u, v = rng.standard_normal((2, n))
    a = jnp.asarray(np.outer(u, v) + np.diag(rng.standard_normal(n)))  # rank 1 plus diagonal
    low_rank = jnp.asarray(np.outer(u, v))
    x = jnp.asarray(rng.standard_normal((3, n)))
    key = jax.random.key(0)
    for method, num_probes, matrix, exact in [
        ("hutchinson", 6, a, False),  # fewer than n: an estimate with its stderr
        ("hutch++", 6, low_rank, True),  # a sketch of 2 columns spans the rank-1 range
        ("xtrace", 6, low_rank, True),  # each leave-one-out basis has 2 columns: exact
        ("xtrace", 6, a, False),  # 6 matvecs: the least that gives a stderr
    ]:
        div = dj.divergence(
            lambda x, m=matrix: x @ m.T, method=method, num_probes=num_probes, return_stderr=True
        )
        estimate, stderr = jax.jit(div)(key, x)
        trace = float(jnp.trace(matrix))
        if exact:
            np.testing.assert_allclose(estimate, trace, rtol=1e-9)
        else:
            assert np.all(np.abs(estimate - trace) < 6 * stderr), (method, estimate, trace)
        print(method, "ok")
    assert sys.modules["array_api_compat"] is None
    """
)


@pytest.mark.slow
def test_stochastic_divergence_runs_without_array_api_compat() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split("\n")[:4] == [
        "hutchinson ok",
        "hutch++ ok",
        "xtrace ok",
        "xtrace ok",
    ]
