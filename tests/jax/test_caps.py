"""Every internal cap of detection and coloring, set low: a pattern past it still gives the
dense Jacobian and the dense divergence (more colors or passes at most, never a wrong or
infeasible answer). The budgets set in the environment (``DIVJAC_*``) have their own tests:
tests/jax/test_detection_budget.py, tests/jax/test_reliability.py, tests/core/test_chunks.py;
the loops' (``SCAN_ENTRY_BUDGET``, ``MAX_FIXPOINT_ROUNDS``) are in tests/jax/test_loops.py."""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.signal import convolve2d

import divjac.jax as dj
from divjac._core import plan
from divjac._core.coloring import _box, _graph, _jacobian
from divjac._core.rules import _deps, _op
from divjac.jax import _backend, _trace_reuse

jax.config.update("jax_enable_x64", True)

SHAPE = (3, 12, 10)  # a batch of 3 images of 12 x 10
N = SHAPE[1] * SHAPE[2]


def blur(x, k):
    """A stencil: its colorings come from the box of the kernel."""
    return jax.vmap(lambda im: convolve2d(im, k, mode="same"))(x)


def mixed(x, k):
    """No stencil: the blur plus a permutation of the pixels whose indices are computed in
    the program (constant folding), so that the greedy colorings and the gather rule run."""
    perm = (jnp.arange(N) * 7 + 3) % N  # 7 and N = 120 are coprime: a permutation
    flat = x.reshape(x.shape[0], N)
    return blur(x, k) + jnp.sin(flat[:, perm]).reshape(x.shape)


# (module, name, low value): every cap of detection, coloring and the chunk plan
CAPS: list[tuple[ModuleType, str, int]] = [
    (_jacobian, "MAX_CONFLICT_PAIRS", 0),  # no conflict graph: the distance-2 greedy
    (_jacobian, "_GREEDY_COLUMNS", 1),  # which reads one column at a time
    (_graph, "SMALLEST_LAST_MAX_EDGES", 0),  # no smallest-last order
    (_box, "_CHUNK_ENTRIES", 1),  # a box read one row at a time
    (_box, "_MAX_CLIQUE_CHECK", 1),  # no stencil recognized: the greedy diagonal coloring
    (_op, "FOLD_LIMIT", 0),  # nothing folded: gather indices unknown, dense dependence
    (_deps, "_GATHER_CHUNK", 1),  # rows gathered one at a time
    (_trace_reuse, "_LIMIT", 0),  # no trace reused: traced again every call
    (plan, "_HOST_MIN_CHUNK", 1),
    (_backend, "SEED_MATRIX_ELEMENTS", 0),  # seeds computed from the pass index
]


@pytest.mark.parametrize("f", [blur, mixed], ids=["stencil", "mixed"])
@pytest.mark.parametrize(("module", "name", "low"), CAPS, ids=[c[1] for c in CAPS])
def test_past_every_cap_the_sparse_results_are_the_dense_ones(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str, low: int, f
) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=SHAPE))
    k = jnp.asarray(rng.uniform(0.5, 1.0, size=(5, 3)))
    dense = jax.vmap(jax.jacfwd(lambda s: f(s[None], k)[0]))
    want, want_at_2x = (dense(v).reshape(SHAPE[0], N, N) for v in (x, 2 * x))
    monkeypatch.setattr(module, name, low)
    dj.clear_caches()
    try:
        for v, dense_jac in ((x, want), (2 * x, want_at_2x)):  # the second call: a cache hit
            got = dj.sparse_jacobian(f)(v, k).todense().reshape(dense_jac.shape)
            np.testing.assert_allclose(got, dense_jac, rtol=1e-12, atol=1e-14)
        div = dj.divergence(f, method="sparse")(x, k)
        np.testing.assert_allclose(div, jnp.trace(want, axis1=1, axis2=2), rtol=1e-12)
    finally:
        dj.clear_caches()
