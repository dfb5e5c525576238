"""Issue 43: a steady-state call of every JAX transform makes no host-to-device transfer.

The steady state is the third call of one transformed function, with new arrays of the same
shapes (new parameters, a new input, a new key or new probes, all made on the device before the
call): eager, and under the caller's ``jax.jit``. It runs under
``jax.transfer_guard("disallow")``, which raises at the first host-to-device copy (on a GPU,
a synchronous one at every step): a NumPy index array, colouring or mask, or a Python scalar,
moved to the device at call time. It must give the values the same call gives unguarded.

Every variant of the context matrix's table (:mod:`tests.jax.transforms`: every transform, each
method and mode) runs on the MLP of the zoo, and those that colour, read a pattern or assemble
a sparse Jacobian also on its CNN, whose colourings and index arrays are not trivial. The
default run takes each transform with each method in one mode, ``-m slow`` the other modes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import divjac.jax as dj
from tests.jax.transforms import VARIANTS, Variant, probes_for
from tests.jax.zoo import ZOO

CALLS = 3
COLOURED = ("jacobian-auto", "sparse_jacobian", "jacobian_from_pattern",
            "divergence_from_pattern", "divergence-sparse-auto", "laplacian-sparse",
            "hessian-sparse", "hessian_diagonal-sparse")  # fmt: skip
"""Variants that also run on the CNN, whose colourings and index arrays are not trivial (the
Jacobian's and sparse Jacobian's of issue 43's finding)."""


def _twin(variant: str) -> bool:
    """A mode of a method that runs in another mode by default (its ``-fwd`` or ``-rev``
    twin of an ``-auto`` or ``-fwd`` one): in the slow run only."""
    pairs = (("-rev", "-fwd"), ("-fwd", "-auto"), ("-rev", "-auto"))
    return any(variant.endswith(a) and variant[: -len(a)] + b in VARIANTS for a, b in pairs)


CASES = [
    pytest.param(
        variant,
        model,
        context,
        id=f"{variant}-{model}-{context}",
        marks=[pytest.mark.slow] if _twin(variant) else [],
    )
    for variant in VARIANTS
    for model in ("mlp", "cnn")
    if model == "mlp" or variant in COLOURED
    for context in ("eager", "jit")
    if context == "eager" or VARIANTS[variant].traceable
]
"""Every variant of the table on the MLP and :data:`COLOURED` on the CNN, eager and jitted;
by default each transform with each method in one mode (its other modes: ``-m slow``)."""


def _function(variant: Variant, model: str) -> Any:
    f = ZOO[model].f
    if not variant.scalar:
        return f

    def u(p: Any, x: jax.Array) -> jax.Array:
        y = jnp.sin(f(p, x))
        return jnp.sum(y.reshape(y.shape[0], -1), axis=1)

    return u


def _calls(variant: Variant, model: str) -> list[tuple[Any, ...]]:
    """The arguments of each call, made on the device before any call: new parameters, a new
    input and new randomness (a key split on the device, or probes) every time."""
    found = []
    keys = jax.random.split(jax.random.key(7), CALLS)
    for k in range(CALLS):
        params, x = ZOO[model].init(jnp.float64, seed=k)
        lead: tuple[Any, ...] = ()
        if variant.randomness == "probes":
            lead = ((1.0 + k) * probes_for(x)[: variant.drawn],)
        elif variant.randomness == "key":
            lead = (keys[k],)
        found.append((*lead, params, x))
    return jax.block_until_ready(found)


def _leaves(result: Any, variant: Variant) -> list[np.ndarray]:
    if not variant.traceable:  # a SparsityPattern
        return [result.csr.toarray()]
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(variant.out(result))]


@pytest.mark.parametrize(("variant_id", "model", "context"), CASES)
def test_a_steady_state_call_makes_no_transfer(variant_id: str, model: str, context: str) -> None:
    variant = VARIANTS[variant_id]
    dj.clear_caches()
    calls = _calls(variant, model)
    f = _function(variant, model)
    transformed = variant.build(f, 1, calls[0][-2:])
    if context == "jit":
        transformed = jax.jit(transformed)
    for args in calls[:-1]:
        jax.block_until_ready(_leaves(transformed(*args), variant))
    with jax.transfer_guard("disallow"):
        guarded = transformed(*calls[-1])
        if variant.traceable:
            jax.block_until_ready(guarded)
    unguarded = transformed(*calls[-1])
    for got, want in zip(_leaves(guarded, variant), _leaves(unguarded, variant), strict=True):
        np.testing.assert_array_equal(got, want)
