"""The ``divjac`` command: ``divjac demo`` (and more, see ``divjac --help``)."""

from __future__ import annotations

from ._app import app, main

__all__ = ["app", "main"]
