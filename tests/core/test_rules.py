"""Every shared sparsity rule against the dense Jacobian of a NumPy function, on random shapes.

Each input element gets its own label, so the dependency sets a rule gives its outputs are the
rule's Jacobian pattern ``(n_out, n_in)``. The true Jacobian is taken by central differences of
a NumPy function doing the same operation at a random point (exact for the linear ones). A rule
must contain every true nonzero; where it is exact (index maps, linear maps with random weights)
it must equal it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings, strategies as st

from divjac._core import rules as R
from divjac._core.rules import Deps, Op

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
small = st.integers(1, 4)
shapes = st.lists(small, min_size=1, max_size=3).map(tuple)


def _seeds(*shapes_):
    """Dependency sets of the inputs, each element its own label (labels run over all)."""
    n = sum(math.prod(s) for s in shapes_)
    deps, offset = [], 0
    for s in shapes_:
        size = math.prod(s)
        deps.append(R.from_labels(s, np.arange(offset, offset + size), n))
        offset += size
    return deps, n


def _jacobian(f, xs, k=0):
    """Dense Jacobian of output ``k`` of ``f`` w.r.t. all inputs stacked (central differences)."""
    flat = np.concatenate([x.ravel() for x in xs])
    sizes = [x.size for x in xs]

    def call(v):
        parts = np.split(v, np.cumsum(sizes)[:-1])
        out = f(*(p.reshape(x.shape) for p, x in zip(parts, xs, strict=True)))
        return np.asarray(out[k] if isinstance(out, tuple | list) else out, float).ravel()

    eps = 1e-6
    cols = []
    for j in range(flat.size):
        e = np.zeros_like(flat)
        e[j] = eps
        cols.append((call(flat + e) - call(flat - e)) / (2 * eps))
    return np.stack(cols, axis=1) if cols else np.zeros((call(flat).size, 0))


def check(rule, f, xs, *, params=None, exact=True, values=None, n_out=1):
    """The rule's pattern contains (``exact``: equals) the true one, for every output."""
    deps, n = _seeds(*(x.shape for x in xs))
    probe = f(*xs)
    outs = list(probe) if isinstance(probe, tuple | list) else [probe]
    shapes_ = [np.shape(o) for o in outs]
    op = Op(
        "test",
        deps if values is None else [R.empty(x.shape, n) if v is not None else d
                                     for d, x, v in zip(deps, xs, values, strict=True)],
        shapes_,
        n,
        params=params or {},
        values=(lambda i: values[i]) if values is not None else (lambda i: None),
    )  # fmt: skip
    got = rule(op)
    assert len(got) == len(shapes_)
    for k, (d, s) in enumerate(zip(got, shapes_, strict=True)):
        assert d.shape == tuple(s)
        pattern = d.matrix().toarray()
        true = np.abs(_jacobian(f, xs, k)) > 1e-7
        if values is not None:  # constant inputs: their columns are not labels of interest
            keep = np.concatenate(
                [np.full(x.size, v is None) for x, v in zip(xs, values, strict=True)]
            )
            true = true & keep[None, :]
        assert not (true & ~pattern).any(), f"output {k}: the rule misses a dependency"
        if exact:
            np.testing.assert_array_equal(pattern, true, err_msg=f"output {k}")
    return got


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape) + 2.0


# --- movement -------------------------------------------------------------------------------


@SETTINGS
@given(shapes, st.randoms())
def test_transpose_reshape_rev(shape, rnd):
    perm = list(range(len(shape)))
    rnd.shuffle(perm)
    x = _x(shape)
    check(R.transpose_rule, lambda a: np.transpose(a, perm), [x], params={"permutation": perm})
    check(R.reshape_rule, lambda a: np.transpose(a, perm).reshape(-1), [x],
          params={"permutation": perm})  # fmt: skip
    axes = [a for a in range(len(shape)) if rnd.random() < 0.5]
    check(R.rev_rule, lambda a: np.flip(a, axes), [x], params={"axes": axes})


@SETTINGS
@given(shapes, small)
def test_broadcast_in_dim_tile(shape, extra):
    x = _x(shape)
    out = (extra, *shape)
    check(R.broadcast_in_dim_rule, lambda a: np.broadcast_to(a, out), [x],
          params={"dimensions": list(range(1, len(shape) + 1))})  # fmt: skip
    reps = [extra] + [1] * (len(shape) - 1)
    check(R.tile_rule, lambda a: np.tile(a, reps), [x], params={"reps": reps})


@SETTINGS
@given(shapes, st.data())
def test_slice_pad(shape, data):
    x = _x(shape)
    start = [data.draw(st.integers(0, s - 1)) for s in shape]
    limit = [data.draw(st.integers(b + 1, s)) for b, s in zip(start, shape, strict=True)]
    strides = [data.draw(st.integers(1, 2)) for _ in shape]
    window = tuple(slice(a, b, c) for a, b, c in zip(start, limit, strides, strict=True))
    check(R.slice_rule, lambda a: a[window], [x],
          params={"start": start, "limit": limit, "strides": strides})  # fmt: skip
    config = [(data.draw(st.integers(-1, 2)), data.draw(st.integers(0, 2)),
               data.draw(st.integers(0, 1))) for _ in shape]  # fmt: skip
    config = [(max(lo, -s + 1), hi, i) for (lo, hi, i), s in zip(config, shape, strict=True)]

    def padded(a, v):
        grown = [max(lo, 0) + s + max(s - 1, 0) * i + hi for s, (lo, hi, i) in
                 zip(shape, config, strict=True)]  # fmt: skip
        out = np.full(grown, v[()] * 1.0)
        placed = tuple(slice(max(lo, 0), None, i + 1) for lo, _, i in config)
        out[placed][tuple(slice(0, s) for s in shape)] = a
        return out[tuple(slice(max(-lo, 0), None) for lo, _, _ in config)]

    check(R.pad_rule, padded, [x, np.array(0.5)], params={"config": config})


@SETTINGS
@given(shapes, small, st.integers(0, 2))
def test_concatenate_stack_split(shape, n, axis):
    axis = axis % len(shape)
    xs = [_x(shape, seed) for seed in range(n)]
    check(R.concatenate_rule, lambda *a: np.concatenate(a, axis), xs, params={"axis": axis})
    check(R.stack_rule, lambda *a: np.stack(a, axis), xs, params={"axis": axis})
    big = np.concatenate(xs, axis)
    sizes = [shape[axis]] * n
    check(R.split_rule, lambda a: tuple(np.split(a, np.cumsum(sizes)[:-1], axis)), [big],
          params={"axis": axis, "sizes": sizes})  # fmt: skip
    check(R.unstack_rule, lambda a: tuple(np.moveaxis(a, axis, 0)), [big], params={"axis": axis})


@SETTINGS
@given(shapes, st.data())
def test_elementwise_identity_nothing(shape, data):
    lower = tuple(s if data.draw(st.booleans()) else 1 for s in shape)
    x, y = _x(shape), _x(lower, 1)
    check(R.elementwise_rule, lambda a, b: np.sin(a) * b, [x, y])
    check(R.identity_rule, lambda a: np.tanh(a), [x])
    check(R.nothing_rule, lambda a: np.floor(a * 0) + 1.0, [x])


# --- reductions, cumulative, sorts --------------------------------------------------------------


@SETTINGS
@given(shapes, st.data())
def test_reduce_cumulative_sort(shape, data):
    x = _x(shape)
    axes = sorted({data.draw(st.integers(0, len(shape) - 1)) for _ in range(2)})
    check(R.reduce_rule, lambda a: np.sum(a**2, tuple(axes)), [x], params={"axes": axes})
    axis = axes[0]
    reverse = data.draw(st.booleans())

    def cumsum(a):
        flipped = np.flip(a, axis) if reverse else a
        out = np.cumsum(flipped, axis)
        return np.flip(out, axis) if reverse else out

    check(R.cumulative_rule, cumsum, [x], params={"axis": axis, "reverse": reverse})
    # A sort of distinct values moves each along its line: exact only where the line is one.
    x = np.random.default_rng(1).permutation(x.size).reshape(shape) * 1.0
    check(R.sort_rule, lambda a: np.sort(a, axis), [x], params={"axis": axis}, exact=False)
    k = data.draw(st.integers(1, shape[axis]))
    check(R.sort_rule, lambda a: -np.sort(-a, axis).take(range(k), axis), [x],
          params={"axis": axis}, exact=False)  # fmt: skip
    # softmax: the whole line, exactly
    soft = lambda a: np.exp(a) / np.exp(a).sum(axis, keepdims=True)  # noqa: E731
    check(R.sort_rule, soft, [x / 10], params={"axis": axis}, exact=shape[axis] > 1)


# --- gathers and scatters -----------------------------------------------------------------------


@SETTINGS
@given(shapes, st.data())
def test_gather_known_and_unknown(shape, data):
    x = _x(shape)
    n = x.size
    src = np.array(data.draw(st.lists(st.integers(-1, n - 1), min_size=1, max_size=6)))
    gathered = lambda a: np.where(src >= 0, a.ravel()[np.maximum(src, 0)], 0.0)  # noqa: E731
    check(R.gather_rule, gathered, [x], params={"src": [src]})
    # Unknown indices along an axis: any element of that axis may be read.
    axis = data.draw(st.integers(0, len(shape) - 1))
    pick = data.draw(st.integers(0, shape[axis] - 1))
    at_zero = np.take(np.arange(n).reshape(shape), [0], axis)
    check(R.gather_rule, lambda a: np.take(a, [pick], axis), [x],
          params={"src": [at_zero], "unknown": {0: [axis]}}, exact=shape[axis] == 1)  # fmt: skip


@SETTINGS
@given(shapes, st.data())
def test_select(shape, data):
    x, y = _x(shape), _x(shape, 1)
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=x.size, max_size=x.size)))
    mask = mask.reshape(shape)
    n = x.size
    src = np.where(mask, np.arange(n).reshape(shape), np.arange(n).reshape(shape) + n)
    check(R.select_rule, lambda a, b: np.where(mask, a, b), [x, y], params={"src": [src]})
    check(R.select_rule, lambda a, b: np.where(mask, a, b), [x, y], params={"src": None},
          exact=False)  # fmt: skip


@SETTINGS
@given(shapes, st.data(), st.booleans())
def test_scatter(shape, data, overwrite):
    base = _x(shape)
    n = base.size
    target = np.array(data.draw(st.lists(st.integers(-1, n - 1), min_size=1, max_size=6)))
    if overwrite:  # distinct targets: a write is defined
        target = np.where(target >= 0, target, -1)
        seen = set()
        target = np.array(
            [t if t < 0 or (t not in seen and not seen.add(t)) else -1 for t in target]
        )
    updates = _x(target.shape, 1)

    def scattered(b, u):
        out = b.ravel().copy()
        for k, t in enumerate(target):
            if t >= 0:
                out[t] = u[k] if overwrite else out[t] + u[k]
        return out.reshape(shape)

    check(R.scatter_rule, scattered, [base, updates],
          params={"target": target, "overwrite": overwrite})  # fmt: skip
    # Unknown positions along every axis: an update may land anywhere.
    check(R.scatter_rule, scattered, [base, updates],
          params={"target": target, "overwrite": False, "unknown_axes": list(range(len(shape)))},
          exact=False)  # fmt: skip


# --- contractions, linear algebra, FFT ----------------------------------------------------------


@SETTINGS
@given(small, small, small, small, st.booleans())
def test_dot(b, i, j, k, constant):
    lhs, rhs = _x((b, i, j)), _x((b, j, k), 1)
    params = {"contracting": ([2], [1]), "batch": ([0], [0])}
    einsum = lambda u, v: np.einsum("bij,bjk->bik", u, v)  # noqa: E731
    if not constant:
        check(R.dot_rule, einsum, [lhs, rhs], params=params)
        bias = _x((i, k), 2)
        check(R.dot_rule, lambda u, v, c: einsum(u, v) + c, [lhs, rhs, bias], params=params)
        return
    rhs = rhs * (np.random.default_rng(3).random(rhs.shape) < 0.3)  # a constant with zeros
    sparse = np.count_nonzero(rhs) <= rhs.size / 2  # its zeros are used (else: structural)
    check(R.dot_rule, einsum, [lhs, rhs], params=params, values=[None, rhs], exact=sparse)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 3), min_size=0, max_size=1).map(tuple), st.integers(1, 3))
def test_batched_linalg_solves(lead, n):
    a = _x((*lead, n, n)) + 4 * np.eye(n)
    check(R.batched_rule, np.linalg.inv, [a], exact=False)
    b = _x((*lead, n, 2), 1)
    check(R.solve_rule, lambda u, v: np.linalg.solve(u, v), [a, b], params={"left": True},
          exact=False)  # fmt: skip
    tri = np.tril(a)

    def triangular(u, v):
        flat_u, flat_v = u.reshape(-1, n, n), v.reshape(-1, n, 2)
        x = [scipy.linalg.solve_triangular(np.tril(p), q, lower=True) for p, q in
             zip(flat_u, flat_v, strict=True)]  # fmt: skip
        return np.stack(x).reshape(v.shape)

    check(R.triangular_solve_rule, triangular, [tri, b], params={"lower": True, "left": True},
          exact=False)  # fmt: skip


@SETTINGS
@given(shapes, st.data())
def test_fft(shape, data):
    x = _x(shape)
    axes = sorted({data.draw(st.integers(0, len(shape) - 1)) for _ in range(2)})
    check(R.fft_rule, lambda a: np.fft.fftn(a, axes=axes).real, [x], params={"axes": axes},
          exact=False)  # fmt: skip


# --- convolutions and windows -------------------------------------------------------------------


@SETTINGS
@given(st.integers(3, 6), st.integers(1, 3), st.integers(1, 2), st.integers(0, 1))
def test_window_and_transposed(length, k, stride, pad):
    k = min(k, length)
    x = _x((2, length))
    geometry = {"window_dimensions": [1, k], "window_strides": [1, stride],
                "padding": [(0, 0), (pad, pad)]}  # fmt: skip

    def pooled(a):
        padded = np.pad(a, [(0, 0), (pad, pad)])
        starts = range(0, padded.shape[1] - k + 1, stride)
        return np.stack([padded[:, s : s + k].sum(1) for s in starts], 1)

    out = check(R.window_rule, pooled, [x], params=geometry)[0]
    grads = _x(out.shape, 1)
    transposed = lambda g: _jacobian(pooled, [x]).T @ g.ravel()  # noqa: E731
    check(R.window_transposed_rule, lambda g: transposed(g).reshape(x.shape), [grads],
          params=geometry)  # fmt: skip


@SETTINGS
@given(st.integers(3, 5), st.integers(1, 3), st.integers(1, 2), st.integers(1, 2))
def test_conv(length, k, c_in, c_out):
    k = min(k, length)
    x, w = _x((2, c_in, length)), _x((c_out, c_in, k), 1)

    def conv(a, b):
        return np.stack([[sum(np.correlate(a[n, ci], b[co, ci], "valid") for ci in range(c_in))
                          for co in range(c_out)] for n in range(2)])  # fmt: skip

    spec = (0, 1, 2)
    params = {"lhs_spec": spec, "rhs_spec": spec, "out_spec": spec, "window_strides": [1],
              "padding": [(0, 0)]}  # fmt: skip
    check(R.conv_rule, conv, [x, w], params=params, values=[None, w])
    check(R.conv_rule, conv, [x, w], params=params, exact=False)


@SETTINGS
@given(shapes, st.data())
def test_axis_maps(shape, data):
    x = _x(shape)
    axis = data.draw(st.integers(0, len(shape) - 1))
    size = data.draw(st.integers(1, 4))
    pairs = data.draw(st.lists(st.tuples(st.integers(0, size - 1),
                                         st.integers(0, shape[axis] - 1)), max_size=6))  # fmt: skip
    rows = np.array([r for r, _ in pairs], int)
    cols = np.array([c for _, c in pairs], int)

    def mapped(a):
        moved = np.moveaxis(a, axis, 0)
        out = np.zeros((size, *moved.shape[1:]))
        for r, c in pairs:
            out[r] = out[r] + moved[c] * (1.5 + c)
        return np.moveaxis(out, 0, axis)

    check(R.axis_maps_rule, mapped, [x], params={"maps": [(axis, size, rows, cols)]})


# --- control flow -------------------------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 20))
def test_loops(n, steps):
    x = _x((n,))
    shift = lambda a: np.roll(a, 1) * 0.5 + a  # noqa: E731

    def loop(a):
        for _ in range(steps):
            a = shift(a)
        return a

    def body(ins):
        (carry,) = ins
        return [R.union(carry, R.gather(carry, np.roll(np.arange(n), 1)))]

    # A while loop's fixpoint holds for any number of steps.
    check(R.while_rule, loop, [x], params={"body": body, "n_cond": 0, "n_body": 0},
          exact=steps >= n - 1)  # fmt: skip
    check(R.scan_rule, loop, [x], params={"body": body, "n_consts": 0, "n_carry": 1,
          "length": steps, "reverse": False}, exact=True)  # fmt: skip
    check(
        R.cond_rule,
        lambda p, a: a * 2,
        [np.array(0.0), x],
        params={"branches": [lambda ins: [R.elementwise(ins[0].shape, ins[0])]]},
    )


def test_fixpoint_of_a_rotation_is_dense():
    deps, _ = _seeds((3,))
    grow = lambda c: [R.gather(c[0], np.array([1, 2, 0]))]  # noqa: E731
    assert R.same(R.fixpoint(grow, deps, [])[0], R.dense((3,), deps[0]))


def test_rule_error_names_the_operation():
    registry = R.Registry("test operation")
    with pytest.raises(R.RuleError, match="callable"):
        registry.register("op", 3)  # type: ignore[arg-type]
    deps, n = _seeds((2,))
    op = Op("myop", deps, [(2,)], n)
    with pytest.raises(R.RuleError, match="myop"):
        registry.apply(lambda op: [R.empty((3,), n)], op)
    # a bare Deps, None, a list of arrays: named, not a TypeError from inside
    for wrong, said in (
        (R.empty((2,), n), r"\(2,\) \(not a list\)"),
        (None, "NoneType"),
        ([np.zeros(2)], r"\['ndarray'\]"),
    ):
        with pytest.raises(R.RuleError, match=rf"myop returned {said}"):
            registry.apply(lambda op, wrong=wrong: wrong, op)


def test_dense_fallback_is_recorded():
    deps, n = _seeds((2,), (3,))
    op = Op("unknown", deps, [(4,)], n)
    (out,) = R.dense_rule(op)
    assert op.fallbacks == {"unknown"}
    assert out.matrix().toarray().all()


def test_value_of_an_input_with_dependencies_is_unknown():
    deps, n = _seeds((2,))
    op = Op("x", [deps[0], R.empty((2,), n)], [(2,)], n, values=lambda i: np.ones(2))
    assert op.value(0) is None
    np.testing.assert_array_equal(op.value(1), np.ones(2))
    assert isinstance(op.ins[0], Deps)
