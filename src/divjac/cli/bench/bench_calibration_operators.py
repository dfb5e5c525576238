"""The calibration of ``differential_operator``'s stochastic standard error (P15).

Each cell is ``estimate ± 2·stderr`` over the 2000 samples of one batch (each sample draws
its own directions) against the exact value, for an operator × function × budget. The
functions are the calibration set's PINNs ``u(x) = w2 · tanh(W1 x + b1)`` (d = 2, 5 and 10),
whose partials of every order are known in closed form: ``d^alpha u = sum_j w2_j
tanh^(|alpha|)(z_j) prod_{i in alpha} W1[j, i]``. The operators: ``sum_i d^4u/dx_i^4`` (the
coordinates drawn: the case where ``laplacian(method="stde")``'s terms take few values),
Kuramoto-Sivashinsky's linear part in ``x_0`` with a mixed third-order term (one sampled
order among exact ones), and a sum of every order with mixed fourth-order terms. A budget
below the one that computes every order exactly refuses the error bar (``NumProbesError``)
and is no cell.
``python -m divjac.cli.bench.bench_calibration_operators [jax] [torch]`` prints the table.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..._call import OperatorMethod
from ..._errors import NumProbesError
from ._harness import Result
from .bench_calibration import Cell, lib_array, markdown, pinn_weights, score, summary_rows

Terms = list[tuple[float, tuple[int, ...]]]

OPERATORS: dict[str, Callable[[int], Terms]] = {
    "sum_i d4u/dx_i^4": lambda d: [(1.0, (i,) * 4) for i in range(d)],
    "u_0 + u_00 + u_0000 + u_001": lambda d: [
        (1.0, (0,)),
        (1.0, (0, 0)),
        (1.0, (0, 0, 0, 0)),
        (1.0, (0, 0, d - 1)),
    ],
    "every order, mixed": lambda d: [
        (0.5, (d - 1,)),
        *[(1.0, (i, i)) for i in range(d)],
        (-2.0, (0, 1, d - 1)),
        *[(1.0, (i, i, i, i)) for i in range(d)],
        (3.0, (0, 0, 1, 1)),
    ],
}
"""The operators calibrated, as ``terms`` of ``d`` inputs."""

DIMENSIONS = (2, 5, 10)
BUDGETS = (2, 4, 8, 16, 32)
METHODS: tuple[OperatorMethod, ...] = ("stde", "hutchinson")
"""(The two names draw the same directions today: both are calibrated, under their names.)"""

_TANH_DERIVATIVES: list[Callable[[np.ndarray], np.ndarray]] = [
    lambda t: 1 - t * t,
    lambda t: -2 * t * (1 - t * t),
    lambda t: -2 * (1 - t * t) * (1 - 3 * t * t),
    lambda t: 8 * t * (1 - t * t) * (2 - 3 * t * t),
]
"""``tanh^(k)`` as a function of ``t = tanh(z)``, ``k = 1 .. 4``."""


def exact(weights: tuple[np.ndarray, ...], x: np.ndarray, terms: Terms) -> float:
    """``sum_k c_k d^{alpha_k} u(x)`` for the PINN ``u = w2 · tanh(W1 x + b1)``."""
    w1, b1, w2 = weights
    t = np.tanh(w1 @ x + b1)
    return float(
        sum(
            c * w2 @ (_TANH_DERIVATIVES[len(a) - 1](t) * np.prod(w1[:, list(a)], axis=1))
            for c, a in terms
        )
    )


def _pinn(lib: Any, weights: tuple[np.ndarray, ...]) -> Callable[[Any], Any]:
    w1, b1, w2 = (lib_array(lib, a) for a in weights)
    if lib.__name__.endswith("jax"):
        import jax.numpy as jnp

        return lambda x: jnp.tanh(x @ w1.T + b1) @ w2
    import torch

    return lambda x: torch.tanh(x @ w1.T + b1) @ w2


def operator_cells(
    framework: str,
    draws: int = 2000,
    *,
    dimensions: tuple[int, ...] = DIMENSIONS,
    budgets: tuple[int, ...] = BUDGETS,
    methods: tuple[OperatorMethod, ...] = METHODS,
) -> Iterator[Cell]:
    """Every method × operator × PINN × budget of ``"jax"`` or ``"torch"``, ``draws`` samples
    (the samples of one batch, each drawing its own directions)."""
    lib: Any
    randomness: Any
    if framework == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
        from ... import jax as dj

        lib, randomness = dj, jax.random.key(0)
    else:
        import torch

        from ... import torch as dt

        lib, randomness = dt, torch.Generator().manual_seed(0)
    for d in dimensions:
        weights = pinn_weights(d)
        x = np.random.default_rng(d).uniform(-1, 1, d)
        u = _pinn(lib, weights)
        xb = lib_array(lib, np.tile(x, (draws, 1)))
        for name, make in OPERATORS.items():
            terms = make(d)
            truth = exact(weights, x, terms)
            for method in methods:
                for budget in budgets:
                    op = lib.differential_operator(
                        u, terms, method=method, num_probes=budget, return_stderr=True
                    )
                    try:
                        estimate, stderr = op(randomness, xb)
                    except NumProbesError:  # a budget the method refuses here
                        continue
                    estimate, stderr = np.asarray(estimate), np.asarray(stderr)
                    coverage, beyond, count = score(
                        estimate, stderr, np.full(estimate.shape, truth)
                    )
                    yield Cell(
                        f"differential_operator {method}",
                        framework,
                        f"PINN (d={d}): {name}",
                        budget,
                        count,
                        coverage,
                        beyond,
                        float("nan"),
                    )


def run(quick: bool) -> list[Result]:
    cells: list[Cell] = []
    for framework in ("jax", "torch"):
        try:
            cells += list(operator_cells(framework))
        except ImportError:
            continue
    return summary_rows(cells)


if __name__ == "__main__":  # pragma: no cover
    print(markdown([c for fw in sys.argv[1:] for c in operator_cells(fw)]))
