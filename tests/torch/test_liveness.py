"""The ATen interpreter releases dependency sets after their last use; views are reshapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from divjac._core import rules as D
from divjac._errors import InternalError
from divjac.torch import _interpret, sparsity
from tests.torch.test_sparsity import _randn, assert_sound


def _chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(40):
        x = torch.sin(x) * 1.1
    return x


def _skips(x: torch.Tensor) -> torch.Tensor:
    """Skip connections: early values read again at the end (a U-Net's)."""
    a = torch.tanh(x)
    b = torch.roll(a, 1, dims=-1) * a
    c = torch.sin(b).cumsum(-1)
    return c + a.flip(-1) + x


@pytest.fixture
def live_counts(monkeypatch):
    """The number of nodes holding dependency sets after each node the interpreter ran."""
    counts: list[int] = []
    original = _interpret.Interpreter._call

    def counting(self, node):
        original(self, node)
        counts.append(len(self._deps))

    monkeypatch.setattr(_interpret.Interpreter, "_call", counting)
    return counts


def test_a_chain_holds_a_bounded_number_of_dependency_sets(live_counts):
    x = _randn(2, 5)
    pattern = sparsity(_chain)(x)
    assert pattern.nnz == 5  # element-wise
    assert len(live_counts) >= 80
    assert max(live_counts) <= 3  # without release: one per node


def test_skip_connections_keep_what_is_read_later(live_counts):
    assert_sound(_skips, _randn(2, 3, 6), exact=True)
    assert max(live_counts) < len(live_counts)


def test_every_node_is_released_once_after_its_last_reader():
    gm = torch.fx.symbolic_trace(_skips)
    nodes = list(gm.graph.nodes)
    done = _interpret.last_uses(nodes)
    released = [n for group in done for n in group]
    assert sorted(released, key=nodes.index) == nodes
    at = {n: i for i, group in enumerate(done) for n in group}
    for node in nodes:
        assert all(nodes.index(user) <= at[node] for user in node.users)
        if node.users:
            assert at[node] == max(nodes.index(user) for user in node.users)


def test_reading_released_dependency_sets_raises():
    node = next(iter(torch.fx.symbolic_trace(_skips).graph.nodes))
    interp = _interpret.Interpreter(3)
    interp._deps[node] = D.from_labels((2,), np.array([0, 1]), 3)
    interp.release(node)
    assert interp.has_deps(node)  # a released node depended on the labels: it never folds
    with pytest.raises(InternalError, match="after their last use"):
        interp.deps(node)


@pytest.mark.parametrize(
    "f",
    [
        lambda x: x.permute(0, 1, 2).sin(),  # the identity permutation
        lambda x: x.transpose(1, 2).reshape(x.shape[0], -1).cumsum(-1),
        lambda x: x.transpose(-1, -2).contiguous().view(x.shape[0], -1).cumsum(-1),
        lambda x: x.unsqueeze(1).squeeze(1).permute(0, 2, 1).cumsum(1),
        lambda x: torch.stack([x[i].t() for i in range(x.shape[0])]).cumsum(-1),
        lambda x: x.transpose(0, 1).cumsum(0).transpose(0, 1),  # the batch moved inside
    ],
)
def test_views_and_permutations_are_exact(f):
    assert_sound(f, _randn(3, 4, 5), exact=True)


def test_a_permutation_that_mixes_samples_is_coupled():
    assert_sound(lambda x: x.transpose(0, 1).reshape(x.shape).cumsum(-1), _randn(2, 3, 4))


def test_complex_is_kept_whole():
    """Its decomposition writes into views of an empty tensor, which detection cannot follow:
    the pattern missed every nonzero."""
    f = lambda x: torch.view_as_real(torch.complex(x, x.flip(-1))).flatten(2).cumsum(-1)  # noqa: E731
    assert_sound(f, _randn(3, 4, 5))
