"""``python -m divjac`` and the ``divjac`` console script: the command of :mod:`divjac.cli`.

Outside :mod:`divjac.cli`, so that a missing ``cli`` extra is reported as one line, without a
traceback.
"""

from __future__ import annotations

import sys

from ._errors import DivjacError


def main() -> None:
    """Run the ``divjac`` command, or say which extra to install (exit code 2)."""
    try:
        from .cli import main as cli_main
    except ImportError as err:
        if not isinstance(err, DivjacError):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    cli_main()


if __name__ == "__main__":
    main()
