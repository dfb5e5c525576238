"""Dependency sets held once for all samples (``Shared``) are exactly the full ones.

Every primitive is applied twice, to the shared form and to the same sets held in full, and
the two results must be the same matrix: the shared form is an exact compression, never an
approximation. The index maps are drawn so that some act alike on every sample (the shared
form is kept) and some do not (it falls back to the full form).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from divjac._core import rules as D
from divjac._core.detection import detect
from divjac._core.rules._deps import Deps


def full(d: Deps) -> Deps:
    """The same dependency sets, held in full."""
    return Deps(d.shape, d.n_labels, d.csr)


def same(a: Deps, b: Deps) -> None:
    assert a.shape == b.shape
    ma, mb = a.matrix(), b.matrix()
    assert ma.shape == mb.shape
    assert (ma != mb).nnz == 0


def per_sample_src(rng, batch, n_in, n_out, *, fill=True):
    """Flat indices into ``(batch, n_in)`` for ``(batch, n_out)``: the same map in every sample."""
    one = rng.integers(-1 if fill else 0, n_in, n_out)
    shift = np.arange(batch)[:, None] * n_in
    return np.where(one >= 0, one + shift, -1)


@st.composite
def programs(draw):
    batch = draw(st.integers(1, 5))
    sample = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 2**31 - 1))
    steps = draw(
        st.lists(
            st.sampled_from(
                [
                    "gather",
                    "gather_mixed",
                    "compose",
                    "compose_mixed",
                    "union",
                    "transpose",
                    "reshape",
                    "reduce",
                    "dense",
                    "stack",
                    "per_sample",
                    "roll_batch",
                ]
            ),
            min_size=1,
            max_size=6,
        )
    )
    positions = draw(st.booleans())
    return batch, sample, seed, steps, positions


@settings(max_examples=150, deadline=None)
@given(programs())
def test_every_primitive_keeps_the_shared_form_exact(program):
    batch, sample, seed, steps, positions = program
    rng = np.random.default_rng(seed)
    n = math.prod(sample)
    x = D.from_samples((batch, *sample), batch, np.arange(n) if positions else None, n * positions)
    assert x.shared is not None
    a, b = x, full(x)
    same(a, b)
    for step in steps:
        n = a.size // batch
        # Whole samples of n elements (not after a transpose then a reduction took the batch)
        whole = n > 0 and a.size % batch == 0
        if step == "gather" and whole:
            src = per_sample_src(rng, batch, n, int(rng.integers(1, 7))).reshape(batch, -1)
            a, b = D.gather(a, src), D.gather(b, src)
        elif step == "gather_mixed":  # reads any element: may mix or permute samples
            src = rng.integers(-1, a.size, (batch, int(rng.integers(1, 5))))
            a, b = D.gather(a, src), D.gather(b, src)
        elif step == "compose_mixed" or (step == "compose" and whole):
            n_out = int(rng.integers(1, 6))
            k = int(rng.integers(1, 10))
            if step == "compose":
                q, p = rng.integers(0, n_out, k), rng.integers(0, n, k)
                rows = (np.arange(batch)[:, None] * n_out + q).ravel()
                cols = (np.arange(batch)[:, None] * n + p).ravel()
                if rng.random() < 0.5:  # the same pairs in another order
                    order = rng.permutation(len(rows))
                    rows, cols = rows[order], cols[order]
            else:
                rows = rng.integers(0, batch * n_out, k)
                cols = rng.integers(0, a.size, k)
            a = D.compose((batch, n_out), rows, cols, a)
            b = D.compose((batch, n_out), rows, cols, b)
        elif step == "union" and whole:
            other = per_sample_src(rng, batch, n, n, fill=True).reshape(a.shape)
            a, b = D.union(a, D.gather(a, other)), D.union(b, D.gather(b, other))
        elif step == "transpose" and len(a.shape) > 1:
            perm = tuple(rng.permutation(len(a.shape)))
            a, b = D.transpose(a, perm), D.transpose(b, perm)
        elif step == "reshape" and whole:
            a, b = D.reshape(a, (a.size,)), D.reshape(b, (b.size,))
            a, b = D.reshape(a, (batch, n)), D.reshape(b, (batch, n))
        elif step == "reduce" and len(a.shape) > 1:
            axes = [int(rng.integers(1, len(a.shape)))]
            a, b = D.reduce(a, axes), D.reduce(b, axes)
        elif step == "dense":
            a, b = D.dense((batch, 2), a), D.dense((batch, 2), b)
        elif step == "stack":
            a, b = D.concatenate([a, a], 0), D.concatenate([b, b], 0)
            a, b = (
                D.slice_(a, [0] * len(a.shape), [batch, *a.shape[1:]]),
                D.slice_(b, [0] * len(b.shape), [batch, *b.shape[1:]]),
            )
        elif step == "per_sample" and a.shape[0] == batch:
            rule = lambda one: D.reduce(one, range(1, len(one.shape)), keepdims=True)  # noqa: E731
            found = D.per_sample(rule, a, (batch, *([1] * (len(a.shape) - 1))))
            if found is not None:
                a = found
                b = D.reduce(b, range(1, len(b.shape)), keepdims=True)
        elif step == "roll_batch" and a.shape[0] == batch:
            a, b = D.rev(a, [0]), D.rev(b, [0])
        same(a, b)
        assert D.equal(a, b)


def test_a_per_sample_program_holds_one_sample():
    """The entries held do not grow with the batch (the point of the shared form)."""

    def held(batch):
        x = D.from_samples((batch, 6, 6, 2), batch, np.arange(72), 72)
        y = D.window(x, [1, 3, 3, 1], [1, 1, 1, 1], [(0, 0), (1, 1), (1, 1), (0, 0)])
        y = D.reduce(D.transpose(y, (0, 3, 1, 2)), [1])
        assert y.shared is not None
        return y.stored, y.nnz

    (s2, n2), (s64, n64) = held(2), held(64)
    assert s2 == s64
    assert n64 == 32 * n2


def test_a_batch_reversal_is_held_in_full_and_read_as_coupling():
    x = D.from_samples((3, 4), 3, np.arange(4), 4)
    y = D.rev(x, [0])
    assert y.shared is None
    found = detect(
        (3, 4), (3, 4), lambda seeded, limit: _propagated(D.rev(seeded, [0])), per_sample=True
    )
    assert found is not None and found.coupling is not None


def _propagated(out):
    from divjac._core.detection import Propagated

    return Propagated(out, frozenset())


@pytest.mark.parametrize("batch", [1, 4])
def test_read_out_of_the_shared_form_is_the_per_sample_pattern(batch):
    n = 5
    pairs = [(0, 0), (1, 1), (1, 2), (4, 0)]

    def propagate(seeded, limit):
        q = np.array([p[0] for p in pairs])
        p = np.array([p[1] for p in pairs])
        rows = (np.arange(batch)[:, None] * n + q).ravel()
        cols = (np.arange(batch)[:, None] * n + p).ravel()
        out = D.compose((batch, n), rows, cols, seeded)
        assert out.shared is not None
        return _propagated(out)

    found = detect((batch, n), (batch, n), propagate, per_sample=True)
    assert found is not None and found.coupling is None and found.pattern is not None
    expected = np.zeros((n, n), bool)
    for i, j in pairs:
        expected[i, j] = True
    assert (found.pattern.csr.toarray() == expected).all()
    assert math.prod(found.pattern.shape) == n * n
