"""Every error of ``divjac.jax`` and ``divjac.torch`` is raised with a message that names the
problem and the fix: one suite, run on both backends (framework-specific checks stay in
``tests/jax/test_errors.py`` and ``tests/torch/test_errors.py``)."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import divjac
from divjac._errors import OptionError
from tests.reference import jax_diagonal_blocks, torch_diagonal_blocks, traces


@dataclass(frozen=True)
class Backend:
    """A divjac backend and the few framework calls the tests need (einops-style)."""

    dj: types.ModuleType
    ones: Callable[..., Any]  # ones(shape) in the framework's default floating dtype
    ones_int32: Callable[..., Any]
    array: Callable[[np.ndarray], Any]  # a float64 array from NumPy
    to_numpy: Callable[[Any], np.ndarray]
    concat: Callable[[list[Any], int], Any]
    mean: Callable[[Any, int], Any]
    to_int32: Callable[[Any], Any]
    randomness: Callable[[], Any]  # a key (JAX) or a generator (torch)
    diagonal_blocks: Callable[..., np.ndarray]
    cast_hint: str  # what the message on an integer input suggests
    randomness_hint: str  # how the message on a missing key / generator says to pass it
    argnums_type_hint: str  # the message when argnums selects a dict


def _jax() -> Backend:
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    import divjac.jax

    return Backend(
        dj=divjac.jax,
        ones=jnp.ones,
        ones_int32=lambda shape: jnp.ones(shape, jnp.int32),
        array=jnp.asarray,
        to_numpy=np.asarray,
        concat=lambda xs, axis: jnp.concatenate(xs, axis=axis),
        mean=lambda x, axis: jnp.mean(x, axis=axis),
        to_int32=lambda x: x.astype(jnp.int32),
        randomness=lambda: jax.random.key(0),
        diagonal_blocks=jax_diagonal_blocks,
        cast_hint=r"int32.*astype\(jnp.float32\)",
        randomness_hint=r"fn\(jax.random.key\(0\), \*args",
        argnums_type_hint="selects an argument of type dict",
    )


def _torch() -> Backend:
    pytest.importorskip("torch")
    import torch

    import divjac.torch

    return Backend(
        dj=divjac.torch,
        ones=lambda shape: torch.ones(shape),
        ones_int32=lambda shape: torch.ones(shape, dtype=torch.int32),
        array=torch.from_numpy,
        to_numpy=lambda x: x.detach().numpy(),
        concat=lambda xs, axis: torch.cat(xs, dim=axis),
        mean=lambda x, axis: torch.mean(x, dim=axis),
        to_int32=lambda x: x.int(),
        randomness=lambda: torch.Generator().manual_seed(0),
        diagonal_blocks=torch_diagonal_blocks,
        cast_hint=r"torch.int32.*x\.float\(\)",
        randomness_hint=r"fn\(torch.Generator\(\).manual_seed\(0\), \*args",
        argnums_type_hint=r"type dict.*\.backward\(\)",
    )


@pytest.fixture(params=["jax", "torch"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return _jax() if request.param == "jax" else _torch()


def test_divergence_of_nonsquare_jacobian_names_both_shapes(backend: Backend) -> None:
    x = backend.ones((4, 3))
    f = lambda x: backend.concat([x, x], 1)  # noqa: E731
    with pytest.raises(divjac.NonSquareJacobianError, match=r"\(6,\).*\(3,\)"):
        backend.dj.divergence(f)(x)
    same_size = lambda x: x.reshape(4, 3, 1) * 2.0  # noqa: E731
    with pytest.raises(divjac.NonSquareJacobianError, match="reshape the output"):
        backend.dj.divergence(same_size)(x)
    assert issubclass(divjac.NonSquareJacobianError, ValueError)


def test_output_batch_size_must_match(backend: Backend) -> None:
    with pytest.raises(divjac.BatchSizeMismatchError, match=r"batch size 2 .* batch size 4"):
        backend.dj.jacobian(lambda x: x[:2])(backend.ones((4, 3)))


def test_integer_input_is_refused_with_a_cast_hint(backend: Backend) -> None:
    ints = backend.ones_int32((4, 3))
    for transform in (backend.dj.divergence, backend.dj.grad_divergence):  # (a gradient first)
        with pytest.raises(divjac.InputDtypeError, match=backend.cast_hint):
            transform(lambda x: x * 2)(ints)
    with pytest.raises(divjac.InputDtypeError, match=backend.cast_hint):
        backend.dj.grad_divergence(lambda x: x * 2, method="hutchinson")(backend.randomness(), ints)
    assert issubclass(divjac.InputDtypeError, TypeError)


def test_integer_output_is_refused(backend: Backend) -> None:
    with pytest.raises(divjac.OutputError, match="floating output"):
        backend.dj.jacobian(lambda x: backend.to_int32(x > 0))(backend.ones((4, 3)))


def test_argnums_out_of_range(backend: Backend) -> None:
    x = backend.ones((4, 3))
    with pytest.raises(divjac.ArgnumsError, match=r"argnums=2 is out of range .* 2 positional"):
        backend.dj.jacobian(lambda x, y: x * y, 2)(x, x)
    with pytest.raises(divjac.ArgnumsError, match="must be an int"):
        backend.dj.divergence(lambda x: x, argnums="x")(x)


def test_argnums_must_select_an_array(backend: Backend) -> None:
    with pytest.raises(divjac.ArgnumsError, match=backend.argnums_type_hint):
        backend.dj.jacobian(lambda p, x: p["w"] * x, 0)({"w": 1.0}, backend.ones((4, 3)))


def test_batch_axis_out_of_range(backend: Backend) -> None:
    x = backend.ones((4, 3))
    with pytest.raises(divjac.BatchAxisError, match=r"batch_axis=2 .* shape \(4, 3\)"):
        backend.dj.jacobian(lambda x: x, batch_axis=2)(x)
    with pytest.raises(divjac.BatchAxisError, match="batch_axis=None for a single-sample"):
        backend.dj.divergence(lambda x: x)(backend.ones(()))
    with pytest.raises(divjac.BatchAxisError, match="function's output"):
        backend.dj.jacobian(lambda x: x.sum(), batch_axis=0)(x)
    # A scalar per sample with the batch on axis 1 is (1, B), not (B,): the message says so.
    column = lambda x: (x**3).sum(0)  # noqa: E731  ((3, 4) -> (4,))
    with pytest.raises(divjac.BatchAxisError, match=r"shape \(1, B\)"):
        backend.dj.laplacian(column, batch_axis=1)(backend.ones((3, 4)))
    laplacians = backend.dj.laplacian(lambda x: column(x)[None], batch_axis=1)(backend.ones((3, 4)))
    assert tuple(laplacians.shape) == (1, 4)


def test_output_must_be_one_array(backend: Backend) -> None:
    x = backend.ones((4, 3))
    with pytest.raises(divjac.OutputError, match="single array; got tuple"):
        backend.dj.jacobian(lambda x: (x, x))(x)
    with pytest.raises(divjac.OutputError, match="has_aux=True needs"):
        backend.dj.jacobian(lambda x: x, has_aux=True)(x)


def test_hessians_need_a_scalar_per_sample(backend: Backend) -> None:
    """The Laplacian of a vector output is per component; the Hessian needs a scalar."""
    x = backend.ones((4, 3))
    assert tuple(backend.dj.laplacian(lambda x: x**2)(x).shape) == (4, 3)
    for transform in (backend.dj.hessian, backend.dj.hessian_diagonal):
        with pytest.raises(divjac.OutputError, match="one scalar per sample"):
            transform(lambda x: x**2)(x)


def test_bad_options(backend: Backend) -> None:
    dj = backend.dj
    with pytest.raises(OptionError, match="mode must be one of") as info:
        dj.jacobian(lambda x: x, mode="forward")
    assert isinstance(info.value, ValueError) and isinstance(info.value, divjac.DivjacError)
    with pytest.raises(OptionError, match="method must be one of"):
        dj.divergence(lambda x: x, method="hutch")
    with pytest.raises(OptionError, match="distribution must be one of"):
        dj.divergence(lambda x: x, method="hutchinson", distribution="uniform")
    with pytest.raises(OptionError, match="coupling must be one of"):
        dj.divergence(lambda x: x, coupling="ignore")
    with pytest.raises(OptionError, match="chunk_size must be a positive int"):
        dj.divergence(lambda x: x, chunk_size=0)(backend.ones((4, 3)))


def test_stochastic_method_without_randomness(backend: Backend) -> None:
    x = backend.ones((4, 3))
    hutchinson = backend.dj.divergence(lambda x: x, method="hutchinson")
    with pytest.raises(divjac.MissingKeyError, match=backend.randomness_hint):
        hutchinson(x)
    with pytest.raises(divjac.MissingKeyError, match="got int"):
        hutchinson(0, x)
    assert issubclass(divjac.MissingKeyError, TypeError)


def test_randomness_after_the_input_names_its_place(backend: Backend) -> None:
    """A key or generator passed after ``x`` (the probes' place): its place is first."""
    x = backend.ones((4, 3))
    hutchinson = backend.dj.divergence(lambda x: x * x, method="hutchinson", num_probes=2)
    with pytest.raises(divjac.ArgnumsError, match=r"source of randomness .* first argument"):
        hutchinson(x, backend.randomness())


def test_a_function_that_is_not_callable_is_refused_when_transformed(backend: Backend) -> None:
    for name in ("jacobian", "divergence", "laplacian", "log_abs_det", "sparsity"):
        with pytest.raises(
            divjac.NotCallableError, match=rf"{name}: the function .* not callable \(got int\)"
        ):
            getattr(backend.dj, name)(3)


def test_num_probes_errors(backend: Backend) -> None:
    dj, x = backend.dj, backend.ones((4, 3))
    with pytest.raises(divjac.NumProbesError, match="multiple of 3"):
        dj.divergence(lambda x: x, method="hutch++", num_probes=4)(backend.randomness(), x)
    with pytest.raises(divjac.NumProbesError, match="even"):
        dj.divergence(lambda x: x, method="xtrace", num_probes=3)(backend.randomness(), x)
    with pytest.raises(divjac.NumProbesError, match="method='exact' costs n=3"):
        dj.divergence(lambda x: x, method="xtrace", num_probes=8)(backend.randomness(), x)
    with pytest.raises(divjac.NumProbesError, match="needs 4 random vectors"):
        dj.divergence(lambda x: x, method="hutchinson", num_probes=4)(backend.ones((2, 4, 3)), x)
    with pytest.raises(divjac.NumProbesError, match="shape of the differentiated input"):
        dj.divergence(lambda x: x, method="hutchinson")(backend.ones((16, 3, 4)), x)


def test_num_probes_zero_is_refused_not_the_default(backend: Backend) -> None:
    dj = backend.dj
    for num_probes, said in ((0, "got 0"), (-2, "got -2"), (2.0, "of type float")):
        for transform in (
            dj.divergence,
            dj.laplacian,
            dj.hessian_diagonal,
            dj.grad_divergence,
            dj.squared_frobenius_norm,
            dj.value_divergence_and_frobenius,
            dj.bilaplacian,
        ):
            with pytest.raises(divjac.NumProbesError, match=said):
                transform(lambda x: x, method="hutchinson", num_probes=num_probes)
        with pytest.raises(divjac.NumProbesError, match=said):
            dj.log_abs_det(lambda x: x, method="slq", num_probes=num_probes)
    for steps in (0, -1, 2.0):
        with pytest.raises(divjac.NumProbesError, match="lanczos_steps must be a positive"):
            dj.log_abs_det(lambda x: x, method="slq", lanczos_steps=steps)
    with pytest.raises(divjac.NumProbesError, match=r"lanczos_steps=5 exceeds .* n = 3"):
        dj.log_abs_det(lambda x: 2 * x, method="slq", lanczos_steps=5)(
            backend.randomness(), backend.ones((4, 3))
        )


def test_probes_passed_to_method_exact_are_a_divjac_error_not_fs(backend: Backend) -> None:
    dj, x = backend.dj, backend.ones((4, 3))
    probes = backend.ones((2, 4, 3))
    calls = [
        (dj.divergence(lambda x: x**2, method="exact"), probes),
        (dj.divergence(lambda x: x**2), backend.randomness()),
        (dj.value_and_divergence(lambda x: x**2, method="sparse"), probes),
        (dj.laplacian(lambda x: (x**3).sum(1), method="exact"), probes),
        (dj.jacobian(lambda x: x**2), backend.randomness()),
    ]
    for call, randomness in calls:
        with pytest.raises(
            divjac.UnexpectedRandomnessError, match="Only a stochastic method"
        ) as info:
            call(randomness, x)
        assert isinstance(info.value, TypeError)
    # a function that does take two arrays is called with both
    jac = dj.jacobian(lambda v, x: v.sum(0) * x, argnums=1)(probes, x)
    np.testing.assert_allclose(backend.to_numpy(jac)[0], 2 * np.eye(3))
    with pytest.raises(TypeError, match="positional argument") as wrong:  # f's own error
        dj.divergence(lambda x: x, method="exact")(x, x, x)
    assert not isinstance(wrong.value, divjac.DivjacError)


def test_an_int_aux_comes_back_as_the_int(backend: Backend) -> None:
    x = backend.ones((4, 3))
    for transform in (backend.dj.divergence, backend.dj.value_and_divergence):
        result = transform(lambda x: (x**2, 3), has_aux=True)(x)
        aux = result[0][1] if transform is backend.dj.value_and_divergence else result[1]
        assert aux == 3 and type(aux) is int
    for transform in (backend.dj.laplacian, backend.dj.grad_divergence):
        _, aux = transform(lambda x: (x**3, 7), has_aux=True)(x)
        assert aux == 7 and type(aux) is int


# --- batch coupling -------------------------------------------------------------------------


def test_coupled_functions_raise_everywhere(backend: Backend) -> None:
    dj = backend.dj
    x = backend.array(np.random.default_rng(0).standard_normal((5, 3)))
    center = lambda x: x - backend.mean(x, 0)  # noqa: E731
    for fn in [
        dj.jacobian(center),
        dj.divergence(center),
        dj.value_and_divergence(center),
        dj.sparse_jacobian(center),
    ]:
        with pytest.raises(divjac.BatchCouplingError, match="output sample 0 depends on input"):
            fn(x)
    stochastic = dj.divergence(center, method="hutchinson")
    with pytest.raises(divjac.BatchCouplingError, match="output sample 0 depends on input"):
        stochastic(backend.randomness(), x)


def test_coupled_functions_of_transforms_without_coupling_name_what_has_it(
    backend: Backend,
) -> None:
    """The transforms without a coupling option do not tell the user to pass one (a
    TypeError followed): they name the transforms that compute the diagonal blocks."""
    dj = backend.dj
    x = backend.array(np.random.default_rng(0).standard_normal((5, 3)))
    center = lambda x: x - backend.mean(x, 0)  # noqa: E731
    w = backend.array(np.ones(3))
    energy = lambda x: (center(x) ** 2) @ w  # noqa: E731
    for fn, said in [
        (dj.hessian(energy), "hessian has no coupling option"),
        (dj.squared_frobenius_norm(center), r"jacobian\(f, coupling='exact'\)"),
        (dj.value_divergence_and_frobenius(center), r"divergence\(f, coupling='exact'\)"),
        (dj.log_abs_det(center), "slogdet of its blocks"),
    ]:
        with pytest.raises(divjac.BatchCouplingError, match=said) as info:
            fn(x)
        assert "or pass coupling='exact'" not in str(info.value)


@pytest.mark.parametrize("method", ["exact", "sparse", "auto"])
def test_coupling_exact_gives_true_diagonal_blocks(backend: Backend, method: str) -> None:
    dj = backend.dj
    x = backend.array(np.random.default_rng(3).standard_normal((5, 3)))
    center = lambda x: x - backend.mean(x, 0)  # noqa: E731
    blocks = backend.diagonal_blocks(center, (x,))
    jacobian = backend.to_numpy(dj.jacobian(center, coupling="exact")(x))
    np.testing.assert_allclose(jacobian, blocks, rtol=1e-12)
    reverse = backend.to_numpy(dj.jacobian(center, coupling="exact", mode="rev")(x))
    np.testing.assert_allclose(reverse, blocks, rtol=1e-12)
    got = backend.to_numpy(dj.divergence(center, coupling="exact", method=method)(x))
    np.testing.assert_allclose(got, traces(blocks, (3,)), rtol=1e-12)


_PROBING = [  # every transform taking the caller's probes, with a stochastic method
    ("divergence", "hutchinson"),
    ("divergence", "xtrace"),
    ("value_and_divergence", "hutchinson"),
    ("grad_divergence", "hutchinson"),
    ("laplacian", "hutchinson"),
    ("laplacian", "xtrace"),
    ("weighted_laplacian", "hutchinson"),
    ("hessian_diagonal", "hutchinson"),
    ("squared_frobenius_norm", "hutchinson"),
    ("value_divergence_and_frobenius", "hutchinson"),
    ("log_abs_det", "slq"),
]
_SECOND_ORDER = ("laplacian", "weighted_laplacian", "hessian_diagonal")


@pytest.mark.parametrize(("name", "method"), _PROBING)
def test_transposed_probes_are_refused_naming_the_shape(
    backend: Backend, name: str, method: str
) -> None:
    """Probes ``(d, B)`` for ``x`` ``(B, d)`` (transposed) are no ``d`` probes: every transform
    that takes probes refuses them with the one check, naming the expected shape (the
    Frobenius norms and the Laplacian's Hutchinson once read a leading size ``>= n`` as a
    budget paying for the exact answer, and returned it)."""
    x = backend.array(np.linspace(0.5, 1.5, 12).reshape(4, 3))
    transposed = backend.array(np.ones((3, 4)))
    f = (lambda x: (x**3).sum(1)) if name in _SECOND_ORDER else (lambda x: x**3 + 2 * x)
    coefficient = (backend.array(np.eye(3)),) if name == "weighted_laplacian" else ()
    transform = getattr(backend.dj, name)(f, *coefficient, method=method)
    with pytest.raises(divjac.NumProbesError, match=r"probes must have shape \(k, 4, 3\)"):
        transform(transposed, x)
