"""The errors of the NumPy core: each a :class:`DivjacError` whose message names the problem."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import scipy.sparse as sp

from divjac import _errors
from divjac._core import checks, plan
from divjac._core.pattern import SparsityPattern
from divjac._errors import (
    DetectionMemoryError,
    DivjacError,
    InternalError,
    NonSquareJacobianError,
    OptionError,
)

ERRORS = [
    cls
    for _, cls in inspect.getmembers(_errors, inspect.isclass)
    if issubclass(cls, Exception) and not issubclass(cls, Warning) and cls is not DivjacError
]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_is_a_divjac_error_and_a_builtin(cls: type[BaseException]) -> None:
    assert issubclass(cls, DivjacError)
    builtin = [base for base in cls.__mro__[1:] if base.__module__ == "builtins"]
    assert builtin[0] is not Exception, f"{cls.__name__} subclasses no specific built-in"


def test_internal_error_asks_for_a_report() -> None:
    error = InternalError("the widget lost its frobnicator")
    assert isinstance(error, RuntimeError)
    assert "the widget lost its frobnicator" in str(error)
    assert "please report" in str(error)


def test_check_choice_names_the_option_and_the_choices() -> None:
    with pytest.raises(
        OptionError, match=r"jacobian: mode must be one of \('fwd', 'rev'\); got 'x'"
    ):
        checks.check_choice("mode", "x", ("fwd", "rev"), fname="jacobian")
    checks.check_choice("mode", "fwd", ("fwd", "rev"), fname="jacobian")
    with pytest.raises(
        OptionError, match=r"divergence: coupling must be one of .*'ignore'"
    ) as info:
        checks.check_coupling_option("ignore", fname="divergence")
    assert isinstance(info.value, ValueError) and isinstance(info.value, DivjacError)
    checks.check_coupling_option("exact", fname="divergence")


@pytest.mark.parametrize("chunk_size", [0, -1, 2.5, True, "4"])
def test_chunk_size_must_be_a_positive_int(chunk_size: object) -> None:
    with pytest.raises(
        OptionError, match=r"chunk_size must be a positive int or None; got"
    ) as info:
        plan.choose_chunk_size(10, 8, chunk_size)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert plan.choose_chunk_size(10, 8, 4) == 4


def test_passes_beyond_the_memory_limit_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIVJAC_MEMORY_LIMIT_MB", "1")
    with pytest.raises(DetectionMemoryError, match="pass chunk_size=2 or less"):
        plan.choose_chunk_size(10, 1 << 19, 4)


def test_sparse_plans_without_a_pattern_are_internal_errors() -> None:
    with pytest.raises(InternalError, match="mode='sparse' was planned without a detected"):
        plan.jacobian_plan("sparse", 3, 3, None)
    with pytest.raises(InternalError, match="method='sparse' was planned without a detected"):
        plan.divergence_plan("sparse", 3, None)


def test_diagonal_colors_of_a_rectangular_pattern() -> None:
    pattern = SparsityPattern(sp.csr_array(np.ones((2, 3), bool)), (3,), (2,), batch_size=1)
    assert pattern.n_colors == 3  # the column coloring exists
    with pytest.raises(NonSquareJacobianError, match=r"maps \(3,\) to \(2,\)") as info:
        pattern.diagonal_colors
    assert isinstance(info.value, ValueError) and isinstance(info.value, DivjacError)
