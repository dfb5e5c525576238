"""The public transforms are written once (:mod:`divjac._public`): one backend-generic definition
each, bound to each framework; an option is added in one signature."""

from __future__ import annotations

import inspect
import pathlib
import re
from collections.abc import Callable
from typing import Any, Literal

import pytest

from divjac import _docs, _public
from divjac._errors import InternalError

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "divjac"

# Written per framework on purpose: the operations a rule is registered for, each framework's
# caches, and PyTorch's sparse layouts (one more keyword: a second definition).
PER_FRAMEWORK = ("register_rule", "clear_caches")


def _public_names() -> list[str]:
    dj = pytest.importorskip("divjac.jax")
    return [name for name in dj.__all__ if inspect.isfunction(getattr(dj, name))]


def test_each_public_signature_is_written_once():
    # Its one definition takes a framework's Api first; the frameworks' packages define none.
    source = "\n".join(path.read_text() for path in SRC.rglob("*.py"))
    frameworks = "\n".join(
        path.read_text() for folder in ("jax", "torch") for path in (SRC / folder).rglob("*.py")
    )
    for name in _public_names():
        if name in PER_FRAMEWORK:
            continue
        generic = re.findall(rf"^def {name}\(\n    api: Api\[", source, flags=re.MULTILINE)
        assert len(generic) == (2 if name == "sparse_jacobian" else 1), name
        own = re.findall(rf"^def {name}\(", frameworks, flags=re.MULTILINE)
        assert len(own) == (name == "sparse_jacobian"), name


def _neutral(backend: Any, f: Any, argnums: Any, *, flavour: str, chunk_size: Any) -> Any:
    return lambda *args: (backend, f, argnums, flavour, chunk_size, args)


class _Api(_public.Api[list]):
    framework = "Lists"
    module = __name__
    array = "list"
    array_type = list

    def transform(
        self, make: Any, f: Any, *positional: Any, skip: int, cached: bool, **options: Any
    ) -> Callable[..., Any]:
        return make("the backend", f, *positional, **options)

    def detect(self, make: Any, f: Any, *positional: Any, **options: Any) -> Callable[..., Any]:
        raise AssertionError("not a detection")


@pytest.fixture
def documented(monkeypatch):
    """The shared text of the transform ``flavoured`` and of its new option."""
    summary = _docs._Doc("Flavoured.", "A function.", ("OptionError: never.",))
    monkeypatch.setitem(_docs._DOCS, "flavoured", summary)
    monkeypatch.setitem(_docs.ARGS, "flavour", "the new option.")


def test_a_new_option_is_one_edit_of_the_generic_signature(documented):
    # The option ``flavour`` is written in the generic signature only: every framework's
    # function shows it, documents it and passes it on to the neutral transform.
    @_public.transform
    def flavoured(
        api: _public.Api[_public.ArrayT],
        f: Callable[..., Any],
        /,
        argnums: int = 0,
        *,
        flavour: Literal["sweet", "sour"] = "sweet",
        chunk_size: int | None = None,
    ) -> Callable[..., Any]:
        """{flavoured}

        Example (Lists):
            >>> 1
            1
        """
        return _public.forward(_neutral, locals())

    public = _public.bind(_Api(), flavoured)
    assert list(inspect.signature(public).parameters) == ["f", "argnums", "flavour", "chunk_size"]
    assert inspect.signature(public).parameters["flavour"].default == "sweet"
    assert "flavour: the new option." in (public.__doc__ or "")
    assert (public.__doc__ or "").endswith("Example:\n    >>> 1\n    1\n")
    assert public(len, flavour="sour")(3) == ("the backend", len, 0, "sour", None, (3,))


def test_a_parameter_the_transform_does_not_take_is_refused():
    def unknown(api: Any, f: Any, /, *, colour: str = "red") -> Any:
        return _public.forward(_neutral, locals())

    with pytest.raises(InternalError, match="colour"):
        unknown(_Api(), len)


def test_a_generic_transform_needs_its_placeholder_and_examples():
    def undocumented(api: Any, f: Any) -> Any:
        """Example (Lists):
        >>> 1
        """

    with pytest.raises(InternalError, match="placeholder"):
        _public.transform(undocumented)
