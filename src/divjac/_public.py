"""The public transforms written once, bound to each framework (imports no framework).

Each public transform of :mod:`divjac.jax` and :mod:`divjac.torch` is one backend-generic
``def`` (:mod:`divjac._api`, :mod:`divjac._api_second`) taking a framework's :class:`Api` first,
then the public signature (positional-only ``/``, keyword-only options typed by the
``Literal`` types of :mod:`divjac._call`); its docstring holds one example per framework.
:func:`bind` makes each framework's function of it: the same signature less the ``Api`` (as
``inspect.signature`` and type checkers see it), the shared docstring text of :mod:`divjac._docs`
and that framework's example (doctested in the framework's module). The framework-specific
handling of a call (JAX: one cached compiled program per eager call, leaked tracers named;
PyTorch: ``DistributedDataParallel``, ``torch.func``'s refusals named) is the :class:`Api`'s
hooks, called by :func:`forward` for every transform alike.
"""

from __future__ import annotations

import abc
import inspect
import typing
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from . import _docs
from ._core.plan import STOCHASTIC_METHODS
from ._errors import InternalError
from ._functionals import STOCHASTIC_METHODS as NORM_STOCHASTIC
from ._second import SWEEP_STOCHASTIC

__all__ = ["Api", "ArrayT", "bind", "forward", "transform"]

ArrayT = TypeVar("ArrayT")
"""The array type of a framework (``jax.Array``, ``torch.Tensor``)."""

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

_STOCHASTIC = frozenset((*STOCHASTIC_METHODS, *SWEEP_STOCHASTIC, *NORM_STOCHASTIC))
_EXAMPLE = "Example ("


class Api(abc.ABC, Generic[ArrayT]):
    """A framework's binding of the public transforms: how it runs one, with its backend.

    Attributes:
        framework: the name of its example in the docstrings (``"JAX"``, ``"PyTorch"``).
        module: the module its public functions live in (where their examples are doctested).
        array: the annotation of its arrays (``"jax.Array"``), for ``ArrayT`` in signatures.
        array_type: its array class, for ``ArrayT`` in type hints.
    """

    framework: str
    module: str
    array: str
    array_type: type

    @abc.abstractmethod
    def transform(
        self,
        make: Callable[..., Callable[..., Any]],
        f: Any,
        *positional: Any,
        skip: int,
        cached: bool,
        **options: Any,
    ) -> Callable[..., Any]:
        """``make(backend, f, *positional, **options)``, a transform of the backend-neutral
        modules, as the framework runs it. ``skip``: leading arguments of a call that are not
        ``f``'s (a coefficient, a stochastic method's randomness); ``cached``: whether the
        options are constants (a program built from them may be reused)."""

    @abc.abstractmethod
    def detect(
        self, make: Callable[..., Callable[..., Any]], f: Any, *positional: Any, **options: Any
    ) -> Callable[..., Any]:
        """``make(backend, f, *positional, **options)`` for a transform whose results carry no
        derivative (a sparsity pattern): ``f`` is only traced."""


def transform(fn: F) -> F:
    """Mark a backend-generic public transform: its examples (``Example (JAX):``, ...) move from
    its docstring to :func:`bind`, which gives each framework's function its own."""
    doc = inspect.cleandoc(fn.__doc__ or "")
    head, *examples = doc.split(_EXAMPLE)
    if head.strip() != "{" + fn.__name__ + "}" or not examples:
        raise InternalError(f"the docstring of {fn.__name__}: its placeholder, then examples")
    found = {}
    for example in examples:
        framework, _, body = example.partition("):\n")
        found[framework] = "Example:\n" + body.rstrip() + "\n"
    fn.__doc__ = head  # the generic definition is not doctested: each framework's function is
    fn.examples = found  # type: ignore[attr-defined]
    return fn


def bind(api: Api[ArrayT], fn: Callable[Concatenate[Api[ArrayT], P], R]) -> Callable[P, R]:
    """The public function of ``fn`` (a :func:`transform`) in ``api``'s framework: ``fn``'s
    signature less its ``Api``, its docstring with the shared text and ``api``'s example."""

    def public(*args: P.args, **kwargs: P.kwargs) -> R:
        return fn(api, *args, **kwargs)

    signature = inspect.signature(fn)
    parameters = [_framework_annotation(p, api) for p in list(signature.parameters.values())[1:]]
    public.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    hints = typing.get_type_hints(fn)  # as ``typing.get_type_hints`` reads a def's
    del hints[next(iter(signature.parameters))]
    public.__annotations__ = {name: _framework_hint(hint, api) for name, hint in hints.items()}
    public.__name__ = public.__qualname__ = fn.__name__
    public.__module__ = api.module
    examples: dict[str, str] = getattr(fn, "examples", {})
    if api.framework not in examples:
        raise InternalError(f"{fn.__name__} has no example for {api.framework}")
    shared = _docs.text(fn.__name__, [p.name for p in parameters])
    public.__doc__ = shared + "\n\n" + examples[api.framework]
    return public


def _framework_annotation(parameter: inspect.Parameter, api: Api[Any]) -> inspect.Parameter:
    """``parameter`` with ``ArrayT`` in its (string) annotation read as ``api``'s arrays."""
    annotation = parameter.annotation
    if isinstance(annotation, str) and "ArrayT" in annotation:
        return parameter.replace(annotation=annotation.replace("ArrayT", api.array))
    return parameter


def _framework_hint(hint: Any, api: Api[Any]) -> Any:
    """``hint`` with ``ArrayT`` read as ``api``'s array class."""
    return hint[api.array_type] if ArrayT in getattr(hint, "__parameters__", ()) else hint


def forward(
    make: Callable[..., Callable[..., Any]],
    arguments: dict[str, Any],
    *,
    skip: int = 0,
    cached: bool = True,
    traced_only: bool = False,
    drop: tuple[str, ...] = (),
    **replaced: Any,
) -> Callable[..., Any]:
    """The transform ``make`` of a public transform's ``arguments`` (its ``locals()``: the
    ``Api``, the function, then every parameter, each reaching ``make`` under its own name),
    as its framework runs it (:meth:`Api.transform`). ``replaced``: arguments of ``make``
    computed from the public ones, the public ones in ``drop`` not passed on; ``skip``: leading
    call arguments besides a stochastic method's randomness (counted here from ``method``);
    ``traced_only``: the results carry no derivative (:meth:`Api.detect`)."""
    api, f = list(arguments.values())[:2]
    named = {**dict(list(arguments.items())[2:]), **replaced}
    positional_names, keyword_names = _parameters(make)
    unknown = set(named) - set(drop) - positional_names.keys() - keyword_names
    if unknown:
        raise InternalError(f"{make.__name__} takes no {sorted(unknown)}")
    positional = [named[name] for name in positional_names if name in named]
    options = {name: named[name] for name in keyword_names if name in named}
    if traced_only:
        return api.detect(make, f, *positional, **options)
    skip += 1 if options.get("method") in _STOCHASTIC else 0
    return api.transform(make, f, *positional, skip=skip, cached=cached, **options)


def _parameters(make: Callable[..., Any]) -> tuple[dict[str, None], frozenset[str]]:
    """The positional parameters of a neutral transform after its backend and function (in
    order), and its keyword-only ones. Kept in a plain dictionary, not a ``functools`` cache:
    ``torch.compile`` warns on a cache-wrapped call (a transform made in a compiled step)."""
    known = _PARAMETERS.get(make)
    if known is None:
        parameters = list(inspect.signature(make).parameters.values())[2:]
        positional = {p.name: None for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD}
        keyword = frozenset(p.name for p in parameters if p.kind is p.KEYWORD_ONLY)
        known = _PARAMETERS[make] = (positional, keyword)
    return known


_PARAMETERS: dict[Callable[..., Any], tuple[dict[str, None], frozenset[str]]] = {}
