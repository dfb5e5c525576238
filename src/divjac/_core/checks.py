"""Argument checks and error messages shared by the backends.

Each message names the argument, says what was received and what to do instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._errors import (
    ArgnumsError,
    BatchAxisError,
    BatchCouplingError,
    BatchSizeMismatchError,
    InputDtypeError,
    NonSquareJacobianError,
    OptionError,
    OutputError,
)
from .pattern import Coupling

__all__ = [
    "batch_size_mismatch",
    "check_choice",
    "check_coupling_option",
    "check_square",
    "coupling_error",
    "normalize_argnum",
    "normalize_batch_axis",
    "not_an_array",
    "not_floating",
]

_COUPLING_OPTIONS = ("raise", "exact")


def normalize_argnum(argnums: object, n_args: int, *, fname: str) -> int:
    """``argnums`` as a non-negative position, or :class:`ArgnumsError`."""
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise ArgnumsError(
            f"{fname}: argnums must be an int selecting one positional argument; got "
            f"{argnums!r}. Pass e.g. argnums=0 ({fname} differentiates one argument: for "
            "several, make one transform per argument)."
        )
    if n_args == 0:
        raise ArgnumsError(
            f"{fname}: was called without positional arguments, so argnums={argnums} selects "
            "nothing. Pass the differentiated array positionally: fn(x) (for `sparsity`, call "
            "the function it returns: sparsity(f)(x))."
        )
    if not -n_args <= argnums < n_args:
        raise ArgnumsError(
            f"{fname}: argnums={argnums} is out of range for a call with {n_args} positional "
            f"argument(s); valid values are 0..{n_args - 1} (or -{n_args}..-1). Pass the "
            "differentiated array positionally, or change argnums."
        )
    return argnums % n_args


def normalize_batch_axis(
    batch_axis: int | None, shape: Sequence[int], *, what: str, fname: str
) -> int | None:
    """``batch_axis`` as a non-negative axis of ``shape``, or :class:`BatchAxisError`."""
    if batch_axis is None:
        return None
    if isinstance(batch_axis, bool) or not isinstance(batch_axis, int):
        raise BatchAxisError(f"{fname}: batch_axis must be an int or None; got {batch_axis!r}.")
    ndim = len(shape)
    if not -ndim <= batch_axis < ndim:
        fix = (
            "a scalar has no batch axis: pass batch_axis=None for a single-sample function"
            if ndim == 0
            else f"valid values are 0..{ndim - 1}, or None for a single-sample function"
        )
        raise BatchAxisError(
            f"{fname}: batch_axis={batch_axis} is not an axis of the {what}, of shape "
            f"{tuple(shape)}; {fix}."
        )
    return batch_axis % ndim


def not_floating(dtype: object, *, argnum: int, fname: str, cast_hint: str) -> InputDtypeError:
    return InputDtypeError(
        f"{fname}: the differentiated argument (argnums={argnum}) has dtype {dtype}; derivatives "
        f"need a real floating dtype. Cast it first, e.g. {cast_hint}."
    )


def not_an_array(obj: object, *, what: str, fname: str) -> OutputError:
    return OutputError(
        f"{fname}: the {what} must be a single array; got {type(obj).__name__}. Return one "
        "array (use has_aux=True to return (output, aux)), or wrap the function so that it does."
    )


def batch_size_mismatch(
    in_shape: Sequence[int], in_axis: int, out_shape: Sequence[int], out_axis: int, *, fname: str
) -> BatchSizeMismatchError:
    return BatchSizeMismatchError(
        f"{fname}: the output has batch size {out_shape[out_axis]} (shape {tuple(out_shape)}, "
        f"batch_axis={out_axis}) but the differentiated input has batch size "
        f"{in_shape[in_axis]} (shape {tuple(in_shape)}). Per-sample derivatives need one output "
        "sample per input sample: check batch_axis, or pass batch_axis=None to treat the whole "
        "array as a single sample."
    )


def check_square(in_sample: Sequence[int], out_sample: Sequence[int], *, fname: str) -> None:
    """Raise :class:`NonSquareJacobianError` unless input and output samples have one shape."""
    if tuple(in_sample) != tuple(out_sample):
        hint = (
            "reshape the output to the input's per-sample shape"
            if math.prod(in_sample) == math.prod(out_sample)
            else "a trace or determinant of the Jacobian (divergence, log|det J|) exists only "
            "for functions from a space to itself; use `jacobian` for a rectangular Jacobian"
        )
        raise NonSquareJacobianError(
            f"{fname}: the per-sample Jacobian is not square: the output sample has shape "
            f"{tuple(out_sample)} but the input sample has shape {tuple(in_sample)}; {hint}."
        )


def check_choice(name: str, value: object, options: Sequence[str], *, fname: str) -> None:
    """Raise :class:`OptionError` unless ``value`` is one of ``options`` (a mode, a method, ...)."""
    if value not in options:
        raise OptionError(f"{fname}: {name} must be one of {tuple(options)}; got {value!r}.")


def check_coupling_option(coupling: str, *, fname: str) -> None:
    """Raise :class:`OptionError` unless ``coupling`` is ``"raise"`` or ``"exact"``."""
    if coupling not in _COUPLING_OPTIONS:
        raise OptionError(
            f"{fname}: coupling must be one of {_COUPLING_OPTIONS}; got {coupling!r}."
        )


def coupling_error(
    coupling: Coupling,
    *,
    fname: str,
    fallbacks: frozenset[str] = frozenset(),
    method: str | None = None,
    second_order: bool = False,
) -> BatchCouplingError:
    """The error for a function that mixes samples; ``method``: a stochastic method that cannot
    estimate diagonal blocks (so ``coupling="exact"`` was given and is not the fix): of a
    divergence (a low-rank sketch) or, ``second_order``, of a second-order operator (random
    directions over the whole batch)."""
    if method is not None:
        where = f"output sample {coupling.out_sample} depends on input sample {coupling.in_sample}"
        if second_order:
            return BatchCouplingError(
                f"{fname}: the function mixes samples ({where}), and method={method!r} cannot "
                "estimate per-sample results of such a function: its random directions span "
                "the whole batch, so a sample's terms include its second derivatives with "
                "respect to the other samples' inputs, whose mean is not zero. With "
                "coupling='exact', use an exact method (method='exact' or 'auto': one "
                "direction per sample and element)."
            )
        return BatchCouplingError(
            f"{fname}: the function mixes samples ({where}), and method={method!r} cannot "
            "estimate the traces of per-sample diagonal blocks: its low-rank sketch spans the "
            "whole batch. With coupling='exact', use method='hutchinson' or 'probing' "
            "(unbiased for the diagonal blocks), or an exact method ('exact', 'sparse', 'auto')."
        )
    instead = _BLOCKS_INSTEAD.get(fname)
    exact = (
        "pass coupling='exact' to compute the true per-sample diagonal blocks of the batched "
        "Jacobian at a higher cost (about batch_size times more passes)"
        if instead is None
        else f"compute the true per-sample diagonal blocks with {instead} ({fname} has no "
        "coupling option; about batch_size times more passes)"
    )
    note = ""
    if fallbacks:
        note = (
            f" Note: the operation(s) {', '.join(sorted(fallbacks))} had no sparsity rule and were "
            "assumed to mix all of their inputs, so this coupling may be an over-approximation: "
            "give them a rule with register_rule (docs/rules.md) if they act on each sample "
            "alone; the diagonal blocks are correct either way."
        )
    return BatchCouplingError(
        f"{fname}: the function mixes samples: output sample {coupling.out_sample} depends on "
        f"input sample {coupling.in_sample} ({coupling.n_pairs} cross-sample dependencies "
        "found in the traced program), e.g. a mean over the batch or BatchNorm in training "
        "mode. Per-sample results from the batch trick would be wrong. Either make the "
        f"function per-sample (BatchNorm in eval mode, statistics per sample), or {exact}. If "
        "the input is one sample rather than a batch, pass batch_axis=None." + note
    )


# The transforms without a coupling option, and what computes their per-sample blocks instead.
_BLOCKS_INSTEAD = {
    "hessian": "jacobian(coupling='exact') of the per-sample gradient (or hessian_diagonal, "
    "laplacian with coupling='exact' for its diagonal or trace)",
    "squared_frobenius_norm": "jacobian(f, coupling='exact') and the norms of its blocks",
    "value_divergence_and_frobenius": "divergence(f, coupling='exact'), and jacobian(f, "
    "coupling='exact') for the norms of its blocks",
    "log_abs_det": "jacobian(f, coupling='exact') and slogdet of its blocks",
}
