"""The ``divjac`` command: ``divjac demo`` (and more, see ``divjac --help``).

It needs the ``cli`` extra (typer, rich, matplotlib): ``pip install 'divjac[cli]'``. Without it,
importing this package raises :class:`MissingExtraError` saying so; the library itself
(:mod:`divjac.jax`, :mod:`divjac.torch`) never imports this package.
"""

from __future__ import annotations

import importlib.util

from .._errors import MissingExtraError

EXTRA = ("typer", "rich", "matplotlib")

_missing = [name for name in EXTRA if importlib.util.find_spec(name) is None]
if _missing:
    raise MissingExtraError(
        f"the divjac command needs the 'cli' extra, and {', '.join(_missing)} "
        f"{'is' if len(_missing) == 1 else 'are'} not installed: pip install 'divjac[cli]'"
    )

from ._app import app, main  # noqa: E402  (after the check, for its message)

__all__ = ["EXTRA", "MissingExtraError", "app", "main"]
