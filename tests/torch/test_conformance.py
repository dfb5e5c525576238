"""Conformance on PyTorch's own op samples (issue 22, defects 5 and 11), and the OpInfo sweep.

The scenario tests run by default; :func:`test_opinfo_sweep` (slow) sweeps the whole database
in parts and keeps ``docs/conformance-torch.md`` in step (``python -m tests.torch.opinfo``
rewrites it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from divjac import (
    DenseFallbackWarning,
    OptionError,
    StateUpdateError,
    UnsupportedOperationError,
)
from divjac.torch import _compat, divergence, hessian, jacobian, laplacian, sparsity

D = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check(f, x, modes=("auto", "sparse")):
    """``jacobian`` equals the Jacobian of plain backward passes; the pattern holds its
    nonzeros."""
    want = torch.autograd.functional.jacobian(f, x)
    for mode in modes:
        got = jacobian(f, batch_axis=None, mode=mode)(x)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    dense = (want.reshape(-1, max(x.numel(), 1)) != 0).numpy()
    pattern = sparsity(f, batch_axis=None)(x).csr.toarray().astype(bool)
    assert not (dense & ~pattern).any()


def test_movedim_with_dims_in_a_captured_list_is_traced_per_permutation():
    """Defect 5: lists count by their numbers in the cache key (dimensions change the program):
    a second permutation of the same shape missed 22 nonzeros and failed a shape check."""
    x = torch.randn(4, 3, 2, 1, dtype=D, generator=_gen())

    def make(source, destination):
        return lambda x: torch.movedim(x, source, destination)

    for destination in ([3, 2, 1, 0], [1, 2, 3, 0], [0, 3, 1, 2]):
        _check(make([0, 1, 2, 3], destination), x)


def test_a_list_the_caller_changes_in_place_retraces():
    dims = [1, 0]

    def f(x):
        return x.permute(*dims).sin()

    x = torch.randn(3, 2, dtype=D, generator=_gen())
    _check(f, x)
    dims[:] = [0, 1]
    _check(f, torch.randn(2, 3, dtype=D, generator=_gen(1)).T.contiguous().T.contiguous())


def test_a_log_the_function_appends_to_keeps_its_trace(traces_made):
    log = []

    def f(x):
        log.append(len(log))
        return torch.tanh(x)

    div = divergence(f)
    for seed in range(4):
        div(torch.randn(3, 4, dtype=D, generator=_gen(seed)))
    assert traces_made[0] == 1


@pytest.mark.parametrize(
    "op",
    [
        torch.cumsum,
        torch.cumprod,
        torch.logcumsumexp,
        lambda x, dim: torch.index_add(x, dim, torch.tensor([0]), torch.tensor(2.0, dtype=D)),
        lambda x, dim: torch.index_copy(x, dim, torch.tensor([0]), torch.tensor(2.0, dtype=D)),
    ],
    ids=["cumsum", "cumprod", "logcumsumexp", "index_add", "index_copy"],
)
@pytest.mark.parametrize("dim", [0, -1])
def test_cumulative_and_index_ops_of_a_0d_tensor(op, dim):
    """Defect 11: the axis of a 0-d tensor (0 or -1, of length one) divided by zero."""
    _check(lambda x: op(x, dim), torch.tensor(-1.5, dtype=D))


def _batch_norm_stats():
    return torch.zeros(3, dtype=D), torch.ones(3, dtype=D)


@pytest.mark.parametrize(
    "scenario", ["cosine_similarity", "batch_norm_training", "instance_norm_stats"]
)
def test_a_traced_value_written_into_a_captured_tensor(scenario):
    """Defect 11: functionalization refused (INTERNAL ASSERT) where a traced value is written
    into a tensor computed from captured ones: the graph is functionalized with its constants
    made inputs. Detection leaves the caller's running statistics alone."""
    x = torch.randn(4, 3, 5, dtype=D, generator=_gen())
    other = torch.randn(4, 3, 5, dtype=D, generator=_gen(1))
    mean, var = _batch_norm_stats()
    if scenario == "cosine_similarity":

        def f(x):
            return torch.cosine_similarity(x, other, dim=1)

    elif scenario == "batch_norm_training":

        def f(x):
            return torch.nn.functional.batch_norm(x, mean, var, training=True, momentum=0.5)

    else:

        def f(x):
            return torch.nn.functional.instance_norm(x, mean, var, momentum=0.5)

        # It updates the running statistics it is given: refused before any update (defect 4),
        # as every evaluation of f (the trace, the passes) would update them again.
        with pytest.raises(StateUpdateError, match="updates a tensor it reads"):
            sparsity(f, batch_axis=None)(x)
        assert torch.equal(mean, torch.zeros(3, dtype=D)) and torch.equal(
            var, torch.ones(3, dtype=D)
        )
        return

    pattern = sparsity(f, batch_axis=None)(x)
    assert torch.equal(mean, torch.zeros(3, dtype=D)) and torch.equal(var, torch.ones(3, dtype=D))
    want = torch.func.jacrev(f)(x).reshape(-1, x.numel())
    assert not ((want != 0).numpy() & ~pattern.csr.toarray().astype(bool)).any()
    got = jacobian(f, batch_axis=None)(x).reshape(-1, x.numel())
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_no_forward_derivative_pushes_rows():
    """Defect 11: ``pdist`` (as ``cdist``) has no forward derivative in PyTorch: auto and sparse
    push rows (columns would be fewer), an explicit ``mode="fwd"`` names the op."""
    x = torch.randn(6, 2, dtype=D, generator=_gen())
    with pytest.warns(DenseFallbackWarning, match="_pdist_forward") as got:
        _check(torch.pdist, x, modes=("auto", "sparse", "rev"))
    # at the caller's line, not divjac's
    assert {w.filename for w in got if w.category is DenseFallbackWarning} == {__file__}
    with pytest.raises(OptionError, match=r"aten\._pdist_forward"):
        jacobian(torch.pdist, batch_axis=None, mode="fwd")(x)


def test_cdist_refuses_forward_passes():
    other = torch.randn(9, 2, dtype=D, generator=_gen(1))
    x = torch.randn(6, 2, dtype=D, generator=_gen())
    with pytest.raises(OptionError, match=r"aten\._cdist_forward"):
        jacobian(lambda x: torch.cdist(x, other), batch_axis=None, mode="fwd")(x)


@pytest.mark.parametrize("mode", ["auto", "sparse"])
def test_cdist_jacobian(mode):
    """torch 2.13: cdist's backward under vmap is wrong (jacrev is too): the rows of a graph
    with an operation without forward derivative are pulled one by one."""
    other = torch.randn(9, 2, dtype=D, generator=_gen(1))
    _check(lambda x: torch.cdist(x, other), torch.randn(6, 2, dtype=D, generator=_gen()), (mode,))


# --- the OpInfo sweep ---------------------------------------------------------------------------

# Representative ops (elementwise, reductions, movement, indexing, linear algebra, convolution,
# normalization, distance) and the defect ops of issue 22.
FAST = [
    "sin",
    "sum",
    "matmul",
    "movedim",
    "index_add",
    "nn.functional.conv2d",
    "softmax",
    "nn.functional.cosine_similarity",
    pytest.param(
        "nn.functional.instance_norm",
        marks=pytest.mark.xfail(
            strict=True,
            reason="the sample's running statistics: StateUpdateError on every check (main, 2026-12-02)",
        ),
    ),
    "nn.functional.batch_norm",
    "native_batch_norm",
    "native_layer_norm",
    "native_group_norm",
    "bernoulli",
    "cdist",
]


@pytest.fixture(scope="module")
def op_db():
    pytest.importorskip("expecttest")
    from tests.torch import opinfo

    return {opinfo.op_name(op): op for op in opinfo.differentiable_ops()}


@pytest.mark.parametrize("name", FAST)
def test_opinfo_samples(op_db, name):
    from tests.torch import opinfo

    if name not in op_db:  # native_group_norm's OpInfo came with torch 2.13
        pytest.skip(f"torch {torch.__version__}'s OpInfo database has no {name}")
    result = opinfo.sweep_op(op_db[name])
    assert not result.defects, result.defects
    assert any(o.verdict == "ok" for o in result.outcomes["jacobian"])


# The ops the sweep still finds a defect in (a wrong value, a missed nonzero, a crash), with
# why: the test fails when this set differs from the sweep's, so a fix must remove its op and
# any new defect is seen (a strict xfail per op). None since the full sweep of 2026-12-02.
KNOWN_DEFECTS: dict[str, str] = {}


PARTS = 8
"""The sweep's parts (every ``PARTS``-th op by name): about 40 s each, so that the workers of
``pytest -n`` share them (one test of 540 ops, 5-7 minutes, left one worker running alone)."""


@pytest.mark.slow
@pytest.mark.parametrize("part", range(PARTS))
def test_opinfo_sweep(op_db, part):
    """Every differentiable float64 op: no wrong value, no missed nonzero, no crash (an error
    escaping divjac that is not a divjac error) beyond :data:`KNOWN_DEFECTS`; ill-posed samples
    (``jacrev`` and ``jacfwd`` disagree) are skipped with their reason. Each op's row of the
    committed table is the one its sweep gives."""
    from tests.torch import opinfo

    names = sorted(op_db)[part::PARTS]
    results = [opinfo.sweep_op(op_db[name]) for name in names]
    found = {r.name: r.defects for r in results if r.defects}
    new = {name: defects for name, defects in found.items() if name not in KNOWN_DEFECTS}
    fixed = sorted(set(KNOWN_DEFECTS).intersection(names) - set(found))
    assert not new, f"defects: {new}"
    assert not fixed, f"no longer defective, remove from KNOWN_DEFECTS: {fixed}"
    documented = opinfo.documented_rows()
    stale = [r.name for r in results if documented.get(r.name) != opinfo.Row.of(r)]
    assert not stale, (
        f"docs/conformance-torch.md's rows of {stale} are not what the sweep gives: rewrite it "
        "with python -m tests.torch.opinfo and commit it"
    )


@pytest.mark.slow
def test_opinfo_table_is_its_rows(op_db):
    """The committed table names every op of this torch's database, once, and its header and
    summary are those of its rows (each row is checked by its part of the sweep)."""
    from tests.torch import opinfo

    rows = opinfo.documented_rows()
    assert sorted(rows) == sorted(op_db)
    assert opinfo.DOC.read_text() == opinfo.render(rows.values())


# --- second order on OpInfo-shaped cases ----------------------------------------------------------


@pytest.mark.parametrize("scenario", ["addmm_added_term", "var_mean_of_all", "aminmax"])
def test_second_order_sweep_of_op_samples(scenario):
    """``addmm`` whose product is constant and views of terms lifted to fewer axes crashed
    (TypeError, IndexError) in the second-order sweep."""
    from divjac.torch import hessian_diagonal, laplacian

    m1 = torch.randn(3, 4, dtype=D, generator=_gen(1))
    m2 = torch.randn(4, 3, dtype=D, generator=_gen(2))
    ops = {
        "addmm_added_term": lambda x: torch.addmm(x, m1, m2, alpha=0.5).sin(),
        "var_mean_of_all": lambda x: torch.stack(torch.var_mean(x)).exp(),
        "aminmax": lambda x: torch.stack(torch.aminmax(x)).sin(),
    }

    def u(x):
        return ops[scenario](x).square().sum()

    x = torch.randn(3, 3, dtype=D, generator=_gen())
    if scenario == "aminmax" and _compat.release() < (2, 13):
        # no derivative of aminmax before torch 2.13 (pytorch/pytorch#148808): refused, naming
        # the way out
        with pytest.raises(UnsupportedOperationError, match=r"torch\.amin and torch\.amax"):
            hessian_diagonal(u, batch_axis=None)(x)
        return
    want = torch.func.hessian(u)(x).reshape(9, 9).diagonal().reshape(3, 3)
    torch.testing.assert_close(hessian_diagonal(u, batch_axis=None)(x), want)
    torch.testing.assert_close(laplacian(u, batch_axis=None)(x), want.sum())


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # the reference
def test_second_order_sweep_names_an_op_without_forward_derivative():
    """``ormqr`` has a reverse derivative and no forward one (torch 2.13 and 2.14; 2.14 removed
    ``torch.cholesky``, the operation this test used before)."""
    from divjac.torch import hessian, laplacian

    tau = torch.tensor([0.3, -0.2, 0.1], dtype=D)

    def u(x):
        a = x @ x.T + torch.eye(3, dtype=D)
        return torch.ormqr(a, tau, a).sin().sum()

    x = torch.randn(3, 3, dtype=D, generator=_gen())
    with pytest.raises(OptionError, match=r"aten\.ormqr"):
        laplacian(u, batch_axis=None)(x)
    want = torch.func.jacrev(torch.func.jacrev(u))(x)
    torch.testing.assert_close(hessian(u, batch_axis=None)(x), want)


# --- second order: hessian_diagonal and laplacian of OpInfo defects -------------------------------


def _hessian_by_rows(u, x):
    """The Hessian of a scalar ``u`` by plain backward passes of its gradient (no vmap)."""
    return torch.autograd.functional.hessian(u, x).reshape(x.numel(), x.numel())


def _assert_second_order(u, x, rtol=1e-10, laplacian_too=True):
    from divjac.torch import hessian_diagonal, laplacian

    h = _hessian_by_rows(u, x)
    got = hessian_diagonal(u, batch_axis=None)(x)
    torch.testing.assert_close(got.reshape(-1), h.diagonal(), rtol=rtol, atol=rtol)
    if laplacian_too:
        torch.testing.assert_close(
            laplacian(u, batch_axis=None)(x), h.trace(), rtol=rtol, atol=rtol
        )


def test_scatter_reduce_prod_without_forward_derivative_is_pulled_or_refused():
    """torch's forward derivative of scatter_reduce(reduce="prod") silently gives no tangent:
    hessian_diagonal was wrong (1.97), laplacian and jacobian(mode="fwd") too. Its Hessian rows
    are now pulled (VJPs of the gradient); the forward sweeps name the op."""
    from divjac.torch import laplacian

    index = torch.tensor([[0, 1], [0, 1]])
    src = torch.randn(2, 2, dtype=D, generator=_gen(1))
    w = torch.randn(4, 2, dtype=D, generator=_gen(2))

    def f(x):
        return x.sin().scatter_reduce(0, index, src, "prod", include_self=True)

    def u(x):
        return (f(x) * w).sum()

    x = torch.randn(4, 2, dtype=D, generator=_gen())
    _assert_second_order(u, x, laplacian_too=False)
    with pytest.raises(OptionError, match=r"aten\.scatter_reduce"):
        laplacian(u, batch_axis=None)(x)
    with pytest.raises(OptionError, match=r"scatter_reduce"):
        jacobian(f, batch_axis=None, mode="fwd")(x)
    _check(f, x, modes=("auto",))


def test_forward_derivative_probe_is_per_reduction():
    """The probe of scatter_reduce's forward derivative was cached by the operation alone: after
    reduce="prod" (no tangent), laplacian refused amin and amax, which have one."""
    from divjac.torch import laplacian

    index = torch.tensor([[0, 1], [0, 1]])
    src = torch.randn(2, 2, dtype=D, generator=_gen(1))

    def u(reduce):
        return lambda x: x.sin().scatter_reduce(0, index, src, reduce).square().sum()

    x = torch.randn(4, 2, dtype=D, generator=_gen())
    with pytest.raises(OptionError, match=r"aten\.scatter_reduce"):
        laplacian(u("prod"), batch_axis=None)(x)
    for reduce in ("amin", "amax"):
        want = torch.func.hessian(u(reduce))(x).reshape(8, 8).trace()
        torch.testing.assert_close(laplacian(u(reduce), batch_axis=None)(x), want)


def test_native_dropout_backward_without_forward_derivative_is_pulled_or_refused():
    """hessian_diagonal let torch's NotImplementedError (no forward AD for
    native_dropout_backward) escape from its forward-over-reverse rows."""
    from divjac.torch import laplacian

    mask = torch.tensor([[True, False, True], [False, True, True]])
    w = torch.randn(2, 3, dtype=D, generator=_gen(1))

    def u(x):
        return (torch.ops.aten.native_dropout_backward(x.sin(), mask, 2.0) * w).sum()

    x = torch.randn(2, 3, dtype=D, generator=_gen())
    _assert_second_order(u, x, laplacian_too=False)
    with pytest.raises(OptionError, match=r"aten\.native_dropout_backward"):
        laplacian(u, batch_axis=None)(x)


def test_abs_of_complex_eigenvalues_second_order():
    """The abs rule of the sweep took |z|' = sgn(z) z' and |z|'' = 0, right only for real z:
    linalg.eig's eigenvalue moduli were off by 2.2."""
    w = torch.randn(4, dtype=D, generator=_gen(1))

    def u(x):
        return (torch.linalg.eigvals(x).abs() * w).sum()

    _assert_second_order(u, torch.randn(4, 4, dtype=D, generator=_gen()), rtol=1e-8)


def test_logaddexp_of_masked_entries_second_order():
    """masked.logaddexp fills masked entries with -inf: torch's forward derivative of
    logaddexp(-inf, -inf) is nan, times their zero tangent nan (reverse passes give 0)."""
    mask = torch.tensor([True, True, False, True, False])
    other = torch.randn(5, dtype=D, generator=_gen(1))
    other_mask = torch.tensor([False, False, True, True, True])
    w = torch.randn(5, dtype=D, generator=_gen(2))

    def u(x):
        a = torch.where(mask, x, -torch.inf)
        b = torch.where(other_mask, other, -torch.inf)
        return ((torch.logaddexp(a, b) + torch.logaddexp2(a, b)) * w).sum()

    _assert_second_order(u, torch.randn(5, dtype=D, generator=_gen()))


def test_entr_of_a_negative_input_second_order():
    """special.entr at x < 0: its first derivative is nan but its second finite (torch's
    formulas); the sweep multiplied the nan by a zero second-order tangent."""

    def u(x):
        return (torch.special.entr(x) * 1.3).sum()

    _assert_second_order(u, torch.tensor([-4.8, 0.5, 2.0], dtype=D))


def test_logcumsumexp_before_a_large_entry_second_order():
    """torch's forward derivative of logcumsumexp normalizes by the axis maximum and adds 1e-13
    to the denominator: 1.7e-6 off before an entry of 1e4. Against the exact Hessian,
    sum_i w_i (p_ij - p_ij^2) with p_ij the prefix softmax."""
    from divjac.torch import hessian_diagonal, laplacian

    x = torch.randn(3, 6, dtype=D, generator=_gen())
    x[:, 4] = 1e4
    w = torch.randn(3, 6, dtype=D, generator=_gen(1))

    def u(x):
        return (torch.logcumsumexp(x, 1) * w).sum()

    mask = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    p = torch.softmax(torch.where(mask, x[:, None, :], -torch.inf), -1)  # [row, i, j]
    want = (w[:, :, None] * (p - p * p)).sum(1)
    torch.testing.assert_close(
        hessian_diagonal(u, batch_axis=None)(x), want, rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(laplacian(u, batch_axis=None)(x), want.sum(), rtol=1e-10, atol=1e-12)

    def v(x):  # a dependent second-order term into it
        return (torch.logcumsumexp(3 * x.sin(), 0) * w).sum()

    _assert_second_order(v, torch.randn(3, 6, dtype=D, generator=_gen(2)))


def test_dist_second_order():
    """torch.dist records norm.Scalar, whose forward derivative has the input's rank and fails
    (RuntimeError: a forward gradient of another size)."""
    other = torch.randn(3, 4, dtype=D, generator=_gen(1))
    for p in (2, 3):
        _assert_second_order(
            lambda x, p=p: torch.dist(x, other, p) * 0.7,
            torch.randn(3, 4, dtype=D, generator=_gen()),
        )


@pytest.mark.filterwarnings("ignore::divjac.DenseFallbackWarning")  # rrelu's kernel
@pytest.mark.parametrize("kernel", ["rrelu", "feature_alpha_dropout"])
def test_random_kernels_vmap_cannot_batch_second_order(kernel):
    """rrelu's kernel has no batching rule, alpha dropout's jvp of jvp writes into a zero tensor
    under vmap (RuntimeErrors escaped): such functions are swept one direction at a time, each
    from the same draws."""
    import torch.nn.functional as F

    w = torch.randn(2, 3, 2, dtype=D, generator=_gen(1))

    def u(x):
        torch.manual_seed(7)  # the same draws at every call, as the OpInfo samples
        if kernel == "rrelu":
            y = F.rrelu(x, 0.1, 0.9, training=True)
        else:
            y = F.feature_alpha_dropout(x, p=0.5, training=True)
        return (y.sin() * w).sum()

    _assert_second_order(u, torch.randn(2, 3, 2, dtype=D, generator=_gen()))


# --- memory layouts in the second-order sweep -----------------------------------------------------


def _second_order_matches(u, x, reference=None):
    """``hessian_diagonal`` and ``laplacian`` equal the diagonal and trace of the Hessian of
    ``u`` (or of ``reference``, the same function in other operations) by plain double
    backward passes, one per row."""
    from divjac.torch import hessian_diagonal, laplacian

    n = x.numel()
    want = torch.autograd.functional.hessian(reference or u, x)
    want = want.reshape(n, n).diagonal().reshape(x.shape)
    torch.testing.assert_close(hessian_diagonal(u, batch_axis=None)(x), want)
    torch.testing.assert_close(laplacian(u, batch_axis=None)(x), want.sum())


def test_second_order_sweep_pushes_an_expanded_value_through_an_op():
    """cartesian_prod: stack of an expanded (stride-0) value, pushed by jvp, which writes its
    tangent into a tensor of the primal's layout."""
    other = torch.randn(3, dtype=D, generator=_gen(1))

    def u(x):
        return torch.cartesian_prod(x.sin(), other).square().sum()

    _second_order_matches(u, torch.randn(2, dtype=D, generator=_gen()))


@pytest.mark.parametrize(
    ("size", "stride", "offset"),
    [((2, 2), (1, 2), 0), ((3, 2), (2, 3), 1), ((2, 3), (0, 1), 2)],
    ids=["partial", "offset", "overlapping"],
)
def test_second_order_sweep_gathers_an_as_strided_view(size, stride, offset):
    """as_strided.partial_views: a strided view of a value with jets (vmap refuses to view a
    batched tensor so), of the input's elements, a nonzero offset, elements read twice."""

    def u(x):
        return torch.as_strided(x.sin(), size, stride, offset).exp().sum()

    _second_order_matches(u, torch.randn(10, dtype=D, generator=_gen()))


@pytest.mark.filterwarnings("ignore::divjac.DenseFallbackWarning")
def test_second_order_sweep_refuses_an_as_strided_view_outside_its_input():
    from divjac.torch import laplacian

    def u(x):
        return torch.as_strided(x[2:], (2,), (1,), 0).exp().sum()

    with pytest.raises(OptionError, match=r"aten\.as_strided"):
        laplacian(u, batch_axis=None)(torch.randn(4, dtype=D, generator=_gen()))


@pytest.mark.parametrize("dependent", ["input", "src", "both"])
def test_second_order_sweep_scatters_into_an_as_strided_view(dependent):
    """as_strided_scatter (no batching rule): the input's terms, those of the view's elements
    replaced by src's. The reference writes by index_put: torch's derivative of
    as_strided_scatter w.r.t. its input is wrong (torch 2.13: one on the overwritten elements,
    zero on the others)."""
    base = torch.randn(3, 3, dtype=D, generator=_gen(1))
    src = torch.randn(2, 2, dtype=D, generator=_gen(2))
    written = torch.tensor([1, 4, 2, 5])  # the storage positions of the view's elements

    def parts(x):
        into = x.sin() if dependent != "src" else base
        put = (x[:2, :2] * x[1:, 1:]) if dependent != "input" else src
        return into, put

    def scattered(x):
        return torch.as_strided_scatter(*parts(x), (2, 2), (1, 3), 1)

    def by_index(x):
        into, put = parts(x)
        return into.reshape(-1).index_put((written,), put.reshape(-1)).reshape(3, 3)

    x = torch.randn(3, 3, dtype=D, generator=_gen())
    torch.testing.assert_close(scattered(x), by_index(x))
    _second_order_matches(
        lambda x: scattered(x).square().sum(), x, lambda x: by_index(x).square().sum()
    )


def test_a_channels_last_batch_through_group_norm():
    """A ``channels_last`` (or transposed) batch through a convolution and GroupNorm: torch's
    forward derivative of the group norm views its (then channels_last) input and fails, so
    the passes copy it contiguous where the graph, traced at the call's own layout, shows it
    (traced contiguous, forward passes raised torch's "view size is not compatible")."""
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv2d(4, 2, 3, padding=1)
    ).double()
    x = torch.randn(3, 2, 4, 4, dtype=D, generator=_gen(2))
    want = torch.func.vmap(torch.func.jacrev(lambda s: net(s[None])[0]))(x)
    trace = want.reshape(3, 32, 32).diagonal(dim1=1, dim2=2).sum(-1)
    probes = torch.randn(2, *x.shape, dtype=D, generator=_gen(3))
    estimate = (
        torch.einsum(
            "kbi,bij,kbj->b", probes.flatten(2), want.reshape(3, 32, 32), probes.flatten(2)
        )
        / 2
    )
    for laid in (
        x.contiguous(memory_format=torch.channels_last),
        x.transpose(2, 3).contiguous().transpose(2, 3),
    ):
        for mode in ("fwd", "rev", "sparse"):
            torch.testing.assert_close(jacobian(net, mode=mode)(laid), want)
        for mode in ("fwd", "rev"):
            torch.testing.assert_close(divergence(net, mode=mode)(laid), trace)
            torch.testing.assert_close(divergence(net, method="sparse", mode=mode)(laid), trace)
        hutchinson = divergence(net, method="hutchinson", num_probes=2)
        torch.testing.assert_close(hutchinson(probes, laid), estimate)


@pytest.mark.parametrize(
    "relayout",
    [
        lambda x: x.to(torch.float64, memory_format=torch.channels_last),
        lambda x: x.contiguous(memory_format=torch.channels_last),
        lambda x: x.clone(memory_format=torch.channels_last),
    ],
    ids=["to", "contiguous", "clone"],
)
def test_passes_run_a_channels_last_layout_under_vmap(relayout):
    """to (memory_format=channels_last): the passes run the function under vmap, on tensors
    with one more axis, which channels_last does not fit; the layout changes no value."""
    from divjac.torch import hessian_diagonal, laplacian

    w = torch.randn(2, 3, 2, 2, dtype=D, generator=_gen(1))

    def f(x):
        return relayout(x.sin()) * w

    def u(x):
        return f(x).exp().sum()

    x = torch.randn(2, 3, 2, 2, dtype=D, generator=_gen())
    _second_order_matches(u, x)
    hess = torch.autograd.functional.hessian(u, x).reshape(24, 24)
    for method in ("exact", "sparse"):
        torch.testing.assert_close(
            hessian_diagonal(u, batch_axis=None, method=method)(x),
            hess.diagonal().reshape(x.shape),
        )
    torch.testing.assert_close(laplacian(u, batch_axis=None, method="exact")(x), hess.trace())
    want = torch.autograd.functional.jacobian(f, x)
    for mode in ("fwd", "rev", "sparse"):
        torch.testing.assert_close(jacobian(f, batch_axis=None, mode=mode)(x), want)
    torch.testing.assert_close(
        divergence(f, batch_axis=None, mode="fwd")(x), want.reshape(24, 24).trace()
    )


# --- operations without forward derivative: decomposed, custom, batched backward ---------------


def test_a_decomposed_op_without_forward_derivative_pushes_rows():
    """``grid_sampler_2d`` is decomposed by the trace (its graph has no node of it) and has no
    forward derivative: auto and sparse crashed (NotImplementedError) pushing columns; they
    pull rows, and ``mode="fwd"`` names the op."""
    grid = torch.rand(2, 5, 4, 2, dtype=D, generator=_gen(1)) * 2 - 1

    def f(x):
        return torch.grid_sampler_2d(x, grid, 0, 0, False)

    _check(f, torch.randn(2, 3, 5, 6, dtype=D, generator=_gen()))
    with pytest.raises(OptionError, match=r"aten\.grid_sampler_2d"):
        jacobian(f, batch_axis=None, mode="fwd")(torch.randn(2, 3, 5, 6, dtype=D))


def _chunked_cross_entropy(reduction):
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        pytest.skip(f"torch {torch.__version__} has no chunked linear_cross_entropy (2.13 on)")
    weight = torch.randn(4, 3, dtype=D, generator=_gen(1))
    target = torch.tensor([0, 3, 1, 2, 2, 0, 1, 3])
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)

    def f(x):
        return torch.nn.functional.linear_cross_entropy(
            x, weight, target, reduction=reduction, options=options
        )

    return f


@pytest.mark.filterwarnings("ignore::divjac.DenseFallbackWarning")
def test_a_custom_op_without_forward_derivative_pulls_rows_one_by_one():
    """The chunked ``linear_cross_entropy`` (a ``torch.library`` custom operation) has no
    forward derivative (its autograd.Function no jvp: "forward mode AD" in torch's message) and
    its backward no batching rule (vmap: in-place arithmetic escaped): its rows are pulled one
    by one, and ``mode="fwd"`` names it."""
    f = _chunked_cross_entropy("none")
    x = torch.randn(8, 3, dtype=D, generator=_gen())
    _check(f, x)
    with pytest.raises(OptionError, match=r"_linear_cross_entropy_batch_chunked_no_reduction"):
        jacobian(f, batch_axis=None, mode="fwd")(x)


@pytest.mark.filterwarnings("ignore::divjac.DenseFallbackWarning")
def test_chunked_linear_cross_entropy_under_inference_mode_is_refused_naming_it():
    """Under ``torch.inference_mode`` divjac differentiates with ``torch.func``, which cannot
    run the chunked ``linear_cross_entropy``'s generated ``autograd.Function`` (raw torch
    ``RuntimeError`` before): a divjac error names the custom operation, first and second
    order, eagerly or not; under ``torch.no_grad`` the same calls are exact."""
    f = _chunked_cross_entropy("none")
    x = torch.randn(8, 3, dtype=D, generator=_gen())
    square = lambda x: x * f(x)[:, None]  # noqa: E731
    name = r"_linear_cross_entropy_batch_chunked_no_reduction"
    calls = {
        "jacobian": (jacobian(f, batch_axis=None), torch.autograd.functional.jacobian(f, x)),
        "divergence": (
            divergence(square, batch_axis=None),
            torch.autograd.functional.jacobian(square, x).reshape(24, 24).trace(),
        ),
    }
    for transform, want in calls.values():
        with torch.inference_mode(), pytest.raises(UnsupportedOperationError, match=name):
            transform(x)
        with torch.no_grad():
            torch.testing.assert_close(transform(x), want)
    # second order: torch's own double backward of it is zero, divjac refuses (any mode)
    u = lambda x: f(x).sum()  # noqa: E731
    for transform in (laplacian(u, batch_axis=None), hessian(u, batch_axis=None)):
        with pytest.raises(UnsupportedOperationError, match=name):
            transform(x)


class _CubeWithoutSetupContext(torch.autograd.Function):
    """An ``autograd.Function`` in the old style (``forward(ctx, x)``): no ``setup_context``."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


def test_autograd_function_without_setup_context_under_inference_mode_is_refused_naming_it():
    """The same for a hand-written ``autograd.Function`` without ``setup_context``: named by
    its class under ``inference_mode``; exact (``3 x^2`` on the diagonal) under ``no_grad``."""
    x = torch.randn(4, 3, dtype=D, generator=_gen())
    f = _CubeWithoutSetupContext.apply
    with (
        torch.inference_mode(),
        pytest.raises(UnsupportedOperationError, match="_CubeWithoutSetupContext"),
    ):
        jacobian(f)(x)
    with torch.no_grad():
        torch.testing.assert_close(jacobian(f)(x), torch.diag_embed(3 * x**2))


def test_cdist_rows_under_inference_mode():
    """The torch.func passes (inference mode) pull cdist's rows one by one too."""
    other = torch.randn(9, 2, dtype=D, generator=_gen(1))
    x = torch.randn(6, 2, dtype=D, generator=_gen())

    def f(x):
        return torch.cdist(x, other)

    want = torch.autograd.functional.jacobian(f, x)
    with torch.inference_mode():
        got = jacobian(f, batch_axis=None)(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _slogdet_flat(x):
    return torch.cat([t.reshape(-1) for t in torch.linalg.slogdet(x)])


@pytest.mark.parametrize(
    "scenario", ["det", "vecdot", "slogdet_reshaped"], ids=["det", "vecdot", "slogdet_reshaped"]
)
def test_an_empty_sample_runs_no_vmap_over_no_passes(scenario):
    """An empty sample needs no pass: ``vmap`` over none crashed in ``linalg.det``'s kernel
    (IndexError) and in the function's ``reshape(-1)`` of an empty value (RuntimeError)."""
    empty = torch.zeros(0, dtype=D)
    f, x = {
        "det": (torch.linalg.det, torch.zeros(0, 0, dtype=D)),
        "vecdot": (lambda x: torch.linalg.vecdot(x, empty), empty),
        "slogdet_reshaped": (_slogdet_flat, torch.zeros(0, 0, dtype=D)),
    }[scenario]
    want = torch.autograd.functional.jacobian(f, x)
    for mode in ("auto", "sparse", "fwd", "rev"):
        torch.testing.assert_close(jacobian(f, batch_axis=None, mode=mode)(x), want)
    assert sparsity(f, batch_axis=None)(x).csr.shape == (f(x).numel(), 0)
    xb = torch.stack([x, x])
    got = jacobian(torch.func.vmap(f))(xb)
    torch.testing.assert_close(got, torch.stack([want, want]))


def test_rpow_of_a_negative_base_is_ill_posed_at_the_sample():
    """``__rpow__`` of a negative 0-d base is nan: every backward (and forward) pass spreads
    its nan over the whole row (``0 * nan``), where divjac's sparse passes keep the structural
    zeros. The sweep classifies such samples as ill-posed; a positive base is checked."""
    from tests.torch import opinfo

    x = torch.randn(5, dtype=D, generator=_gen())
    negative = torch.tensor(-4.1, dtype=D)
    jac, why = opinfo._reference(lambda x: negative**x, x, forward=True)
    assert jac is None and why == "ill-posed: the op is nan at the sample"
    got = jacobian(lambda x: negative**x, batch_axis=None, mode="sparse")(x)
    assert got.diagonal().isnan().all() and not got.fill_diagonal_(0.0).any()
    positive = torch.tensor(4.1, dtype=D)
    _check(lambda x: positive**x, x)


@pytest.mark.filterwarnings("ignore::divjac.DenseFallbackWarning")
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_a_sparse_intermediate_pulls_rows_one_by_one():
    """``to_sparse`` (and ``to_dense`` of its result) have no forward derivative, and the
    backward of a sparse intermediate cannot run under vmap ("Could not run 'aten::view' with
    arguments from the 'SparseCPU' backend" escaped jacobian and divergence): rows one by one."""

    def f(x):
        return x.to_sparse().to_dense().sin()

    x = torch.randn(5, 5, dtype=D, generator=_gen())
    _check(f, x, modes=("auto", "sparse", "rev"))
    want = torch.autograd.functional.jacobian(f, x).reshape(25, 25).trace()
    torch.testing.assert_close(divergence(f, batch_axis=None)(x), want)
    with pytest.raises(OptionError, match=r"aten\._to_sparse"):
        jacobian(f, batch_axis=None, mode="fwd")(x)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("scenario", ["overwritten", "strided"])
def test_as_strided_scatter_against_forward_passes_and_differences(scenario):
    """torch 2.13's backward of ``as_strided_scatter`` passes the gradient of the elements
    ``src`` overwrites and drops the others' (its forward derivative and finite differences
    agree); it has no batching rule either. Its passes run it composed of a gather and a
    ``where``: every mode equals plain forward passes, one per column."""
    from tests.torch import opinfo

    if scenario == "overwritten":  # the OpInfo sample: the whole input overwritten
        x = torch.tensor([3.0], dtype=D)
        src = torch.tensor(2.0, dtype=D)
        view = ((), (), 0)
    else:
        x = torch.randn(7, dtype=D, generator=_gen())
        src = torch.randn(3, dtype=D, generator=_gen(1))
        view = ((3,), (2,), 1)

    def f(x):
        return torch.as_strided_scatter(x.sin(), src, *view)

    want = opinfo._columns(f, x)
    torch.testing.assert_close(want, opinfo._central_differences(f, x), rtol=1e-6, atol=1e-8)
    assert not torch.allclose(torch.autograd.functional.jacobian(f, x), want)  # torch's rows
    for mode in ("auto", "sparse", "rev", "fwd"):
        torch.testing.assert_close(jacobian(f, batch_axis=None, mode=mode)(x), want)
    pattern = sparsity(f, batch_axis=None)(x).csr.toarray().astype(bool)
    assert not ((want.reshape(x.numel(), x.numel()) != 0).numpy() & ~pattern).any()
    torch.testing.assert_close(divergence(f, batch_axis=None)(x), want.trace())
    torch.testing.assert_close(opinfo._reference(f, x, forward=True)[0], want)


@pytest.mark.filterwarnings("ignore::divjac.DenseFallbackWarning")
def test_a_custom_op_that_drops_the_gradient_under_vmap_is_refused():
    """Under ``torch.func.vmap`` batched tensors report ``requires_grad=False``: the chunked
    ``linear_cross_entropy`` (mean) then computes no input gradient, so torch's own Jacobian of
    ``vmap(f)`` is zero (divjac's was too, silently: 4.9e-01 off). divjac refuses, naming the
    op; ``f`` itself (no vmap) is right."""
    f = _chunked_cross_entropy("mean")
    x = torch.randn(8, 3, dtype=D, generator=_gen())
    xb = torch.stack([x, 1.1 * x])
    want = torch.stack([torch.autograd.functional.jacobian(f, s) for s in xb])
    wrong = torch.autograd.functional.jacobian(torch.func.vmap(f), xb)
    assert not wrong.any() and want.any()  # torch's own
    with pytest.raises(OptionError, match=r"_linear_cross_entropy_batch_chunked"):
        jacobian(torch.func.vmap(f))(xb)
    _check(f, x)


# --- per-sample kernels under vmap: no false coupling -------------------------------------------


def _per_sample_kernels():
    g = _gen(3)
    points = torch.randn(6, 2, dtype=D, generator=g)
    grid2 = torch.rand(1, 3, 4, 2, dtype=D, generator=g) * 2 - 1
    grid3 = torch.rand(1, 2, 2, 3, 3, dtype=D, generator=g) * 2 - 1
    rhs = torch.randn(4, 2, dtype=D, generator=g)
    pivots = torch.tensor([2, 3, 3], dtype=torch.int32)
    mask = torch.rand(3, 4, generator=g) > 0.5
    return {
        # the fill value 10 read as position 10 (of another sample) by the index maps
        "masked_fill": (lambda x: x.masked_fill(mask, 10), (3, 4)),
        "where": (lambda x: torch.where(mask, x, torch.tensor(7)), (3, 4)),
        # leading axes broadcast: a vmapped x1 against a shared x2
        "cdist": (lambda x: torch.cdist(x, points), (5, 2)),
        # vmap folds the samples into the channels (a shared grid): per-channel, not dense
        "grid_sample": (
            lambda x: torch.nn.functional.grid_sample(x, grid2, align_corners=False),
            (1, 2, 4, 5),
        ),
        "grid_sampler_3d": (
            lambda x: torch.nn.functional.grid_sample(x, grid3, align_corners=False),
            (1, 2, 3, 3, 4),
        ),
        "linalg.lstsq": (lambda a: torch.linalg.lstsq(a, rhs).solution, (4, 3)),
        "lu_unpack": (
            lambda lu: torch.cat([t.flatten() for t in torch.lu_unpack(lu, pivots)[1:]]),
            (3, 3),
        ),
        "_upsample_bilinear2d_aa": (
            lambda x: torch.ops.aten._upsample_bilinear2d_aa(x, [3, 4], False),
            (1, 2, 7, 9),
        ),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")  # vmap's batching-rule fallback notice
@pytest.mark.parametrize("name", sorted(_per_sample_kernels()))
def test_vmapped_per_sample_kernel_is_not_a_false_batch_coupling(name):
    """``jacobian`` of ``vmap(f)`` for a per-sample ``f`` of one of these kernels raised a false
    ``BatchCouplingError`` (the OpInfo sweep's batched column): it equals every sample's own
    Jacobian, and the batched pattern holds every nonzero of the dense batched Jacobian."""
    f, shape = _per_sample_kernels()[name]
    g = _gen(4)
    xb = torch.randn(2, *shape, dtype=D, generator=g)
    if name == "lu_unpack":
        xb = xb + 3 * torch.eye(3, dtype=D)
    fb = torch.func.vmap(f)
    # plain backward passes (torch 2.13's vmapped backward of cdist is wrong: no jacrev)
    want = torch.stack([torch.autograd.functional.jacobian(f, s) for s in xb])
    torch.testing.assert_close(jacobian(fb)(xb), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jacobian(fb, mode="sparse")(xb), want, rtol=1e-10, atol=1e-12)
    dense = torch.autograd.functional.jacobian(fb, xb)  # (2, *out, 2, *in): zero across samples
    n_out, n_in = want[0].numel() // xb[0].numel(), xb[0].numel()
    blocks = dense.reshape(2, n_out, 2, n_in)
    assert not blocks[0, :, 1].any() and not blocks[1, :, 0].any()
    pattern = sparsity(fb)(xb).csr.toarray().astype(bool)  # per sample (n_out, n_in)
    nonzero = (want.reshape(2, n_out, n_in) != 0).any(0).numpy()
    assert not (nonzero & ~pattern).any()


def test_masked_fill_pattern_has_no_false_dependence_on_the_fill_value():
    """``masked_fill(x, mask, 10)``: the filled elements depend on nothing (they read as
    position 10 before), the others on themselves: the pattern is exactly the Jacobian's."""
    f, shape = _per_sample_kernels()["masked_fill"]
    x = torch.randn(*shape, dtype=D, generator=_gen(5))
    want = torch.autograd.functional.jacobian(f, x).reshape(x.numel(), x.numel()) != 0
    pattern = sparsity(f, batch_axis=None)(x).csr.toarray().astype(bool)
    assert (pattern == want.numpy()).all()


# --- regressions found by the full sweep of 2026-12-02 ---------------------------------------------


def test_second_order_through_an_in_place_zero_of_an_intermediate():
    """Forward AD of ``zero_`` writes into its tangent: the sweep's tangents must not be tensors
    the transform captured (torch.func raised 'mutate a captured Tensor')."""
    from divjac.torch import hessian_diagonal, laplacian

    def u(x):
        return ((x * x).zero_() + x.sin() * x).sum()

    x = torch.randn(3, 2, dtype=D, generator=_gen())
    want = torch.autograd.functional.hessian(u, x).reshape(6, 6).diagonal().reshape(3, 2)
    torch.testing.assert_close(hessian_diagonal(u, batch_axis=None)(x), want)
    torch.testing.assert_close(laplacian(u, batch_axis=None)(x), want.sum())


def test_hessian_diagonal_of_an_empty_sample_through_circular_padding():
    """An op without forward passes on an empty sample: no colours to count (``max`` of none)."""
    from divjac.torch import hessian_diagonal, laplacian

    def u(x):
        return torch.nn.functional.pad(x, (1, 2), mode="circular").sin().sum()

    x = torch.randn(0, 3, 3, dtype=D)
    assert hessian_diagonal(u, batch_axis=None)(x).shape == (0, 3, 3)
    assert float(laplacian(u, batch_axis=None)(x)) == 0.0
