"""The public signatures: the same in divjac.jax and divjac.torch, their option types complete.

(mypy checks ``tests/typing/user_code.py`` against them; these tests check them at run time.)
"""

from __future__ import annotations

import inspect
import pathlib
import re
import typing

import pytest

from divjac import _call, _second
from divjac._core import estimators, plan

dj = pytest.importorskip("divjac.jax")
dt = pytest.importorskip("divjac.torch")


def test_the_option_types_are_the_options_divjac_takes():
    assert typing.get_args(_call.Mode) == plan.JACOBIAN_MODES
    assert set(typing.get_args(_call.Direction)) == set(plan.JACOBIAN_MODES) - {"sparse"}
    assert typing.get_args(_call.Method) == plan.DIVERGENCE_METHODS
    laplacian = set(typing.get_args(_call.LaplacianMethod))
    assert laplacian == set(plan.EXACT_METHODS) | set(plan.STOCHASTIC_METHODS) | {"stde"}
    assert set(_second.SWEEP_STOCHASTIC) == {"hutchinson", "stde"}
    assert set(typing.get_args(_call.DiagonalMethod)) == set(plan.EXACT_METHODS) | {"hutchinson"}
    assert typing.get_args(_call.WeightedMethod) == ("auto", "exact", "hutchinson")
    assert set(typing.get_args(_call.Distribution)) == set(estimators.DISTRIBUTIONS)


def test_both_frameworks_expose_the_same_functions_with_the_same_signatures():
    assert dj.__all__ == dt.__all__
    for name in dj.__all__:
        jax_fn, torch_fn = getattr(dj, name), getattr(dt, name)
        if not inspect.isfunction(jax_fn) or name == "clear_caches":
            continue
        jax_params = dict(inspect.signature(jax_fn).parameters)
        torch_params = dict(inspect.signature(torch_fn).parameters)
        if name == "sparse_jacobian":  # PyTorch's sparse layouts: one more keyword
            del torch_params["layout"]
        if name == "register_rule":  # a JAX primitive or a torch operator: the same parameter
            jax_params["op"] = jax_params["op"].replace(annotation=None)
            torch_params["op"] = torch_params["op"].replace(annotation=None)
        if name == "weighted_laplacian":  # A and its factor: a jax.Array or a torch.Tensor
            for arg, array in (("A", "jax.Array"), ("factor", "jax.Array")):
                assert jax_params[arg].annotation == f"{array} | None"
                assert torch_params[arg].annotation == "torch.Tensor | None"
                jax_params[arg] = jax_params[arg].replace(annotation=None)
                torch_params[arg] = torch_params[arg].replace(annotation=None)
        assert jax_params == torch_params, name
        assert inspect.signature(jax_fn).return_annotation == (
            inspect.signature(torch_fn).return_annotation
        )
        # The shared text, then each framework's example (the sparse layouts and the operations
        # a rule is registered for are each framework's own).
        if name not in ("sparse_jacobian", "register_rule"):
            shared = [(fn.__doc__ or "").split("Example:")[0] for fn in (jax_fn, torch_fn)]
            assert shared[0] == shared[1], name


def test_every_transform_is_documented_and_positional_only_in_its_function():
    for name in dj.__all__:
        fn = getattr(dj, name)
        if not inspect.isfunction(fn) or name == "clear_caches":
            continue
        first = next(iter(inspect.signature(fn).parameters.values()))
        assert first.kind is inspect.Parameter.POSITIONAL_ONLY, name
        doc = fn.__doc__ or ""
        for section in ("Args:", "Returns:", "Raises:", "Example:", ">>>"):
            assert section in doc, (name, section)
        assert "{" + name + "}" not in doc


def test_every_transform_documents_its_parameters_in_the_order_of_its_signature():
    for module in (dj, dt):
        for name in module.__all__:
            fn = getattr(module, name)
            if not inspect.isfunction(fn) or name in ("clear_caches", "register_rule"):
                continue
            args = (fn.__doc__ or "").split("Args:\n")[1].split("\n\n")[0]
            documented = re.findall(r"^    (\w+): ", args, flags=re.MULTILINE)
            assert documented == list(inspect.signature(fn).parameters), (module, name)


def test_every_public_function_has_type_hints_of_its_framework():
    for module, array in ((dj, "jax"), (dt, "torch")):
        for name in module.__all__:
            fn = getattr(module, name)
            if inspect.isfunction(fn):
                assert typing.get_type_hints(fn)["return"] is not None, name
        hint = typing.get_type_hints(module.weighted_laplacian)["A"]
        assert [arg.__module__.split(".")[0] for arg in typing.get_args(hint)] == [
            array,
            "builtins",
        ]


def _signatures() -> str:
    lines = []
    for module in (dj, dt):
        for name in module.__all__:
            fn = getattr(module, name)
            if inspect.isfunction(fn):
                lines.append(f"{module.__name__}.{name}{inspect.signature(fn)}")
    return "\n".join(lines) + "\n"


def test_the_public_signatures_are_the_recorded_ones():
    # A change of the public API (a name, a parameter, its kind, default or annotation) is
    # deliberate: it updates tests/typing/signatures.txt.
    recorded = (pathlib.Path(__file__).parent / "signatures.txt").read_text()
    assert _signatures() == recorded
