"""docs/pinn.md's "Any linear differential operator" examples run as written (in order, in one
namespace, as a user runs them: float32), and their residuals are nested ``jacfwd``'s."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .reference import jax_partials, torch_partials

DOC = Path(__file__).resolve().parents[1] / "docs" / "pinn.md"
SECTION = "## Any linear differential operator"
ALPHAS = [(0,), (1,), (0, 0), (1, 1), (0, 0, 0), (0, 0, 0, 0), (1, 1, 1, 1)]
CHECKED = 4  # samples checked against the brute force (a Python loop over samples)


def section_blocks() -> list[str]:
    """The Python blocks of the section (up to the next ``## `` heading)."""
    text = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _residuals(u: np.ndarray, p: list[np.ndarray], z: np.ndarray, k: np.ndarray) -> dict:
    """The section's residuals from ``u`` and its partials ``ALPHAS`` at ``z = (x, t)``."""
    u_x, u_t, u_xx, u_tt, u_xxx, u_xxxx, u_tttt = p
    a = 1 + z[:, 0] ** 2 + z[:, 1] ** 2
    return {
        "kdv": u_t + 6 * u * u_x + u_xxx,
        "ks": u_t + u * u_x + u_xx + u_xxxx,
        "conduction": a * (u_xx + u_tt) + 2 * z[:, 0] * u_x + 2 * z[:, 1] * u_t,
        "plate": k * u_xxxx + u_tttt,
    }


def _close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, np.float64)[:CHECKED]
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.slow  # trains two networks for 3 steps, nested jacfwd to fourth order (about 45 s)
def test_the_operator_examples_run_and_are_nested_jacfwd() -> None:
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    blocks = section_blocks()
    assert len(blocks) == 3
    ns: dict[str, Any] = {}
    with jax.enable_x64(False):
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), ns)
        assert len(ns["kdv_losses"]) == 3 and np.all(np.isfinite(ns["kdv_losses"]))
        assert len(ns["t_kdv_losses"]) == 3 and np.all(np.isfinite(ns["t_kdv_losses"]))
        got = {
            "kdv": ns["kdv"](ns["wave_params"], ns["z"]),
            "ks": ns["ks_residual"],
            "conduction": ns["div_a_grad"],
            "plate": ns["plate_stiff"],
        }
    # the brute force in float64 at the float32 weights and points
    params = tuple(np.asarray(a, np.float64) for a in ns["wave_params"])
    z = np.asarray(ns["z"], np.float64)[:CHECKED]
    jnp = jax.numpy
    args = (tuple(jnp.asarray(a) for a in params), jnp.asarray(z))
    partials = jax_partials(ns["wave"], args, ALPHAS, argnum=1)
    u = np.asarray(ns["wave"](*args))
    want = _residuals(u, partials, z, np.asarray(ns["stiffness"], np.float64)[:CHECKED])
    for name, value in got.items():
        _close(value, want[name])

    net = ns["wave_net"]
    zs = ns["zs"][:CHECKED].double()
    double = type(net)().double()
    double.load_state_dict(net.state_dict())
    with torch.no_grad():
        partials = torch_partials(double, (zs,), ALPHAS)
        u = double(zs).numpy()
    want = _residuals(u, partials, zs.numpy(), ns["t_stiffness"][:CHECKED].double().numpy())
    got = {
        "ks": ns["t_ks_residual"],
        "conduction": ns["t_div_a_grad"],
        "plate": ns["t_plate_stiff"],
    }
    for name, value in got.items():
        _close(value.detach(), want[name])
    with torch.no_grad():
        t_kdv = ns["t_kdv_linear"](ns["zs"]) + 6 * net(ns["zs"]) * ns["t_u_x"](ns["zs"])
    _close(t_kdv, want["kdv"])
