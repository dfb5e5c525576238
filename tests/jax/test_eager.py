"""Eager calls run as one cached compiled program (divjac.jax._eager), never a stale one."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from divjac._core import plan
from divjac._errors import OutputError
from divjac.jax import _eager, clear_caches, divergence, sparse_jacobian, value_and_divergence
from divjac.models import jax as models
from tests.reference import jax_diagonal_blocks, traces


def _expected(params, x):
    return traces(jax_diagonal_blocks(models.mlp, (params, x), 1), (3,))


def test_eager_calls_reuse_one_program_and_read_the_current_weights(monkeypatch):
    compiled = []
    program = _eager._Program

    def counting(*args, **kwargs):
        compiled.append(1)
        return program(*args, **kwargs)

    monkeypatch.setattr(_eager, "_Program", counting)
    clear_caches()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)))
    params = models.init_mlp(jax.random.key(0), (3, 8, 3), dtype=jnp.float64)
    div = divergence(lambda x: models.mlp(params, x), method="sparse")
    for step in range(3):  # the closure reads `params`, rebound at every step
        params = jax.tree_util.tree_map(lambda a, s=step: a * (1.0 + 0.5 * s), params)
        np.testing.assert_allclose(div(x), _expected(params, x), rtol=1e-10)
        fresh = divergence(lambda x, p=params: models.mlp(p, x), method="sparse")
        np.testing.assert_allclose(fresh(x), _expected(params, x), rtol=1e-10)
    assert len(compiled) == 1  # one program: new closures and new weights are its arguments
    key = jax.random.key(1)
    hutch = divergence(lambda x: models.mlp(params, x), method="hutchinson", num_probes=2)
    np.testing.assert_allclose(hutch(key, x), jax.jit(hutch)(key, x), rtol=1e-12)
    np.testing.assert_allclose(
        sparse_jacobian(lambda x: models.mlp(params, x))(x).todense(),
        jax_diagonal_blocks(models.mlp, (params, x), 1).reshape(4, 3, 3),
        rtol=1e-10,
    )
    assert len(compiled) == 3
    clear_caches()
    assert not _eager.CACHE._items


def test_a_changed_index_array_is_a_new_program():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 4)))
    order = np.array([1, 0, 3, 2])
    div = divergence(lambda x: jnp.sin(x[:, order]), method="sparse")
    first = div(x)
    order[:] = [0, 1, 2, 3]  # changed in place: the traced constant differs
    np.testing.assert_allclose(div(x), jnp.sum(jnp.cos(x), axis=1), rtol=1e-12)
    assert not np.allclose(first, div(x))


@pytest.mark.parametrize(("available", "budget"), [(None, 1024 << 20), (8 << 30, 4 << 30)])
def test_the_budget_is_half_the_free_device_memory(monkeypatch, available, budget):
    monkeypatch.delenv("DIVJAC_MEMORY_BUDGET_MB", raising=False)
    assert plan.memory_budget(available) == budget
    fit = budget >> 20  # passes of 1 MiB: the chunks they take, made even
    chunks = -(-(10**6) // fit)
    assert plan.choose_chunk_size(10**6, 1 << 20, None, available=available) == -(
        -(10**6) // chunks
    )
    monkeypatch.setenv("DIVJAC_MEMORY_BUDGET_MB", "16")
    assert plan.memory_budget(available) == 16 << 20  # the setting wins


def _calls(monkeypatch, name: str) -> list[int]:
    """Counts the calls of ``_eager.<name>`` from now on."""
    counted: list[int] = []
    original = getattr(_eager, name)

    def counting(*args, **kwargs):
        counted.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_eager, name, counting)
    return counted


def _programs(monkeypatch) -> list[int]:
    """Counts the programs compiled from now on."""
    return _calls(monkeypatch, "_Program")


def test_value_and_divergence_with_another_aux_structure_is_another_program(monkeypatch):
    compiled = _programs(monkeypatch)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4)))
    auxes = {
        "loss_reg": lambda x: {"loss": jnp.sum(x), "reg": jnp.sum(x**2)},
        "a_b": lambda x: {"a": jnp.sum(x), "b": jnp.sum(x**2)},
        "tuple": lambda x: (jnp.sum(x), jnp.sum(x**2)),
        "list": lambda x: [jnp.sum(x), jnp.sum(x**2)],
    }
    for name, aux in auxes.items():

        def f(x, aux=aux):
            return jnp.sin(x), aux(x)

        transform = value_and_divergence(f, has_aux=True)
        for call in (transform, jax.jit(transform)) if name == "a_b" else (transform,):
            (y, got), div = call(x)
            expected = aux(x)
            assert type(got) is type(expected), name
            assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
            np.testing.assert_allclose(div, jnp.sum(jnp.cos(x), axis=1), rtol=1e-12)
            np.testing.assert_allclose(y, jnp.sin(x), rtol=1e-12)
    assert len(compiled) == len(auxes)  # the same program for the same trace, another for each


def test_an_output_that_is_not_a_pair_names_what_the_function_returned():
    x = jnp.ones((3, 4))
    returned = {
        "one array of shape (3, 4)": lambda x: jnp.sin(x),
        "a tuple of 3 elements": lambda x: (jnp.sin(x), 1, 2),
        "got dict": lambda x: {"y": jnp.sin(x)},
    }
    for said, f in returned.items():
        for call in (value_and_divergence(f, has_aux=True), jax.jit(divergence(f, has_aux=True))):
            with pytest.raises(OutputError, match=re.escape(said)):
                call(x)
    # after a program for a pair, a function returning one array is refused, not served by it
    value_and_divergence(lambda x: (jnp.sin(x), jnp.sum(x)), has_aux=True)(x)
    with pytest.raises(OutputError, match="one array of shape"):
        value_and_divergence(lambda x: jnp.sin(x), has_aux=True)(x)


def test_a_python_scalar_aux_comes_back_as_the_value_of_this_call(monkeypatch):
    compiled = _programs(monkeypatch)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 4)))
    calls = []

    def f(x):
        calls.append(1)
        return jnp.sin(x), {"step": len(calls), "name": "sin", "scale": 0.5 * len(calls)}

    transform = divergence(f, has_aux=True, method="sparse")
    for _ in range(3):
        div, aux = transform(x)
        assert aux == {"step": len(calls), "name": "sin", "scale": 0.5 * len(calls)}
        np.testing.assert_allclose(div, jnp.sum(jnp.cos(x), axis=1), rtol=1e-12)
    assert len(compiled) == 1
    _, aux = jax.jit(divergence(lambda x: (jnp.sin(x), 3), has_aux=True))(x)
    assert int(aux) == 3  # under jit, as jax.jit returns a Python int: an array


def test_a_new_python_float_argument_is_fresh_and_compiles_nothing(monkeypatch):
    compiled = _programs(monkeypatch)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(4, 3)))
    div = divergence(lambda x, t: jnp.sin(t * x) + t, method="sparse")
    for t in (0.1, 0.2, 0.3):
        np.testing.assert_allclose(div(x, t), jnp.sum(t * jnp.cos(t * x), axis=1), rtol=1e-12)
    assert len(compiled) == 1  # the float is a weak-typed argument, as under jax.jit


def test_a_changed_closed_over_float_is_fresh(monkeypatch):
    compiled = _programs(monkeypatch)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 3)))
    scale = 0.5
    div = divergence(lambda x: jnp.sin(scale * x) ** 2.0, method="exact")
    for scale in (0.5, 0.6, 0.7, 0.8):  # the closure reads it
        expected = jnp.sum(scale * jnp.sin(2 * scale * x), axis=1)
        np.testing.assert_allclose(div(x), expected, rtol=1e-12)
    # compiled in first; once it changed, an argument of the program (the 2.0 stays compiled in)
    assert len(compiled) == 2


def test_a_closed_over_time_broadcast_into_the_input_is_fresh_and_compiled_twice(monkeypatch):
    """A CNF's ``t`` concatenated to ``x`` as ``jnp.full((B, 1), t)`` (a Python float literal
    of the program): its value was part of the program's structure key, so every new ``t``
    compiled a new program (5 s per step of an eager loop, 0.08 s once reused)."""
    compiled = _programs(monkeypatch)
    x = jnp.asarray(np.random.default_rng(9).normal(size=(4, 3)))
    w = jnp.asarray(np.random.default_rng(10).normal(size=(4, 3)))

    def f(x, t):
        return jnp.tanh(jnp.concatenate([x, jnp.full((x.shape[0], 1), t)], axis=1) @ w)

    for t in (0.1, 0.2, 0.3, 0.4):
        got = divergence(lambda x, t=t: f(x, t), method="exact")(x)
        jacobians = jax.vmap(jax.jacfwd(lambda xs, t=t: f(xs[None], t)[0]))(x)
        np.testing.assert_allclose(got, jnp.trace(jacobians, axis1=1, axis2=2), rtol=1e-12)
    assert len(compiled) == 2  # compiled in first; an argument of the program once it changed


def test_a_float_that_picks_a_python_branch_is_a_constant():
    x = jnp.asarray(np.random.default_rng(6).normal(size=(4, 3)))

    def f(x, t):
        return jnp.sin(x) * t if t > 0.5 else jnp.cos(x) * t

    div = divergence(f)
    for t in (0.3, 0.4, 0.7, 0.9, 0.3):
        expected = t * jnp.sum(jnp.cos(x) if t > 0.5 else -jnp.sin(x), axis=1)
        np.testing.assert_allclose(div(x, t), expected, rtol=1e-12)
    n_div = divergence(lambda x, n: jnp.tile(x, n)[:, :3] * n, method="sparse")
    for n in (1, 2, 3):  # an int sets a shape
        np.testing.assert_allclose(n_div(x, n), n * np.full(4, 3.0), rtol=1e-12)


def test_an_eager_grad_or_vmap_through_a_transform_runs_one_compiled_program(monkeypatch):
    """Under an eager ``jax.grad`` or ``jax.vmap`` (no ``jit`` around), the transform runs as
    one cached program (op by op it took seconds per call on a small LSTM's Hessian), with the
    outer transformation's tracers as its arguments: fresh values at every call."""
    compiled = _programs(monkeypatch)
    clear_caches()

    def _jnp_traces(p, x):  # brute force that jax.grad goes through
        jacobians = jax.vmap(jax.jacfwd(lambda xs: models.mlp(p, xs[None])[0]))(x)
        return jnp.trace(jacobians, axis1=1, axis2=2)

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(4, 3)))
    params = models.init_mlp(jax.random.key(0), (3, 8, 3), dtype=jnp.float64)

    def loss(p, x):
        return jnp.sum(divergence(models.mlp, 1, method="sparse")(p, x) ** 2)

    for scale in (1.0, 1.5, 2.0):  # an eager training loop: new weights every step
        p = jax.tree_util.tree_map(lambda a, s=scale: a * s, params)
        got = jax.grad(loss)(p, x)
        want = jax.grad(lambda p: jnp.sum(_jnp_traces(p, x) ** 2))(p)
        for g, w in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    xs = jnp.stack([x, 2 * x])
    for _ in range(2):
        got = jax.vmap(lambda x: divergence(models.mlp, 1)(params, x))(xs)
        np.testing.assert_allclose(got[1], _expected(params, xs[1]), rtol=1e-10)
    assert len(compiled) == 2  # one for the grad loop, one for the vmap


def test_an_index_array_traced_by_an_outer_vmap_is_an_argument_not_a_constant():
    """An integer array captured by the function is compiled in when concrete; one that an
    outer eager ``vmap`` traces is an argument of the program (never a leaked tracer)."""
    x = jnp.asarray(np.random.default_rng(8).normal(size=(2, 4)))
    orders = jnp.asarray([[1, 0, 3, 2], [0, 1, 2, 3]])

    def div(order):
        return divergence(lambda x: jnp.sin(x[:, order]), method="sparse")(x)

    for _ in range(2):
        got = jax.vmap(div)(orders)
        want = [div(np.asarray(order)) for order in orders]
        np.testing.assert_allclose(got, np.stack(want), rtol=1e-12)


# --------------------------------------------------------------------------------------------
# The last trace is reused only while everything it read is unchanged (divjac.jax._trace_reuse)
# --------------------------------------------------------------------------------------------

SCALE = jnp.asarray(0.5)
SETTINGS = {"power": 2.0, "weights": [jnp.asarray(1.5)]}
TABLE = np.array([1.0, 2.0, 3.0])


def _activation(x):
    return jnp.sin(x)


def _field(params, x):
    """A user's function: it reads globals (an array, a dict, a NumPy array, a helper)."""
    h = _activation(x * params["w"]) * SCALE + SETTINGS["weights"][0] * x ** SETTINGS["power"]
    return h * TABLE


def _traces(monkeypatch) -> list[int]:
    """Counts the traces of the caller's function from now on."""
    return _calls(monkeypatch, "_trace")


def _brute(f, *args):
    """Per-sample traces of the Jacobian of ``f`` w.r.t. its last argument, by vmap(jacfwd)."""
    *head, x = args
    jacobians = jax.vmap(jax.jacfwd(lambda xs: f(*head, xs[None])[0]))(x)
    return jnp.trace(jacobians, axis1=1, axis2=2)


def test_an_unchanged_function_is_traced_once(monkeypatch):
    traced = _traces(monkeypatch)
    rng = np.random.default_rng(11)
    div = divergence(_field, 1, method="exact")
    for step in range(4):  # new weights and inputs as arguments: nothing the trace read changed
        params = {"w": jnp.asarray(rng.normal(size=3))}
        x = jnp.asarray(rng.normal(size=(4, 3)))
        np.testing.assert_allclose(div(params, x), _brute(_field, params, x), rtol=1e-12)
        assert len(traced) == 1, step
    div(params, x.astype(jnp.float32))  # another dtype: traced again
    div(params, x[:2])  # another shape
    assert len(traced) == 3


def _user_module():
    module = types.ModuleType("user_model")
    module.gain = 2.0
    return module


USER = _user_module()


def _with_module(x):
    return jnp.sin(x) * USER.gain


CHANGES = {
    "a global array rebound": (_field, lambda: globals().update(SCALE=jnp.asarray(0.25))),
    "an entry of a global dict": (_field, lambda: SETTINGS.update(power=3.0)),
    "an array in a global list": (
        _field,
        lambda: SETTINGS["weights"].__setitem__(0, jnp.asarray(-1.0)),
    ),
    "a NumPy array changed in place": (_field, lambda: TABLE.__setitem__(1, -4.0)),
    "a global helper rebound": (_field, lambda: globals().update(_activation=jnp.cos)),
    "an attribute of a user's module": (_with_module, lambda: setattr(USER, "gain", -3.0)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_global_is_seen(monkeypatch, change):
    for name in ("SCALE", "_activation"):
        monkeypatch.setitem(globals(), name, globals()[name])
    monkeypatch.setitem(SETTINGS, "power", 2.0)
    monkeypatch.setitem(SETTINGS, "weights", [jnp.asarray(1.5)])
    monkeypatch.setattr(USER, "gain", 2.0)
    monkeypatch.setitem(globals(), "TABLE", TABLE.copy())
    traced = _traces(monkeypatch)
    f, mutate = CHANGES[change]
    params = {"w": jnp.asarray([0.3, -0.7, 1.1])}
    x = jnp.asarray(np.random.default_rng(12).normal(size=(4, 3)))
    g = f if f is _field else lambda params, x: f(x)
    div = divergence(g, 1, method="exact")
    before = div(params, x)
    np.testing.assert_allclose(div(params, x), before, rtol=1e-12)
    assert len(traced) == 1
    mutate()
    after = div(params, x)
    np.testing.assert_allclose(after, _brute(g, params, x), rtol=1e-12)
    assert not np.allclose(after, before)
    assert len(traced) == 2


class _Config:
    def __init__(self) -> None:
        self.scale = 1.0


def test_state_it_cannot_vouch_for_is_traced_at_every_call(monkeypatch):
    """An object of the user's class, a NumPy random draw, a closure over a list that grows:
    traced again at every call, so always fresh."""
    traced = _traces(monkeypatch)
    x = jnp.asarray(np.random.default_rng(13).normal(size=(4, 3)))
    config = _Config()
    div = divergence(lambda x: jnp.sin(x) * config.scale, method="exact")
    for scale in (1.0, 2.0, 3.0):
        config.scale = scale
        np.testing.assert_allclose(div(x), scale * jnp.sum(jnp.cos(x), axis=1), rtol=1e-12)
    assert len(traced) == 3
    noisy = divergence(lambda x: x * np.random.uniform(), method="exact")  # noqa: NPY002
    assert len({float(noisy(x)[0]) for _ in range(3)}) == 3  # a new draw at every call
    rng = np.random.default_rng(15)
    drawn = divergence(lambda x: x * rng.uniform(), method="exact")
    assert len({float(drawn(x)[0]) for _ in range(3)}) == 3
    assert len(traced) == 9


def test_a_mutable_default_argument_changed_is_seen(monkeypatch):
    traced = _traces(monkeypatch)
    x = jnp.asarray(np.random.default_rng(14).normal(size=(4, 3)))

    def f(x, gains=[1.0]):  # noqa: B006 - the mutable default is the point
        return jnp.sin(x) * gains[0]

    div = divergence(f, method="exact")
    np.testing.assert_allclose(div(x), jnp.sum(jnp.cos(x), axis=1), rtol=1e-12)
    f.__defaults__[0][0] = 5.0
    np.testing.assert_allclose(div(x), 5 * jnp.sum(jnp.cos(x), axis=1), rtol=1e-12)
    div(x)
    assert len(traced) == 2


def test_is_array_known_by_type_agrees_with_jax_and_numpy():
    """``is_array`` remembers its answer per type: it must be the answer for every object of
    the type, concrete arrays, NumPy's, and tracers of every kind alike."""
    from divjac.jax._detect import is_array

    kinds = (jax.Array, np.ndarray, np.generic, jax.core.Tracer)
    seen = []

    def check(*objects):
        for obj in objects:
            seen.append(type(obj))
            assert is_array(obj) == isinstance(obj, kinds), type(obj)
            assert is_array(obj) == isinstance(obj, kinds), type(obj)  # the remembered answer
        return objects[0]

    a = jnp.ones(3)
    check(a, np.ones(2), np.float32(1.0), 1.5, 2, True, None, "s", [a], (a,), {"a": a})
    jax.jit(lambda z: check(z, z * 2))(a)
    jax.grad(lambda z: check(z, z.sum()).sum())(a)
    jax.vmap(lambda z: check(z, z + 1))(a)
    jax.jvp(lambda z: check(z, z), (a,), (a,))
    assert len(set(seen)) >= 12
