"""The error type of preprocessing, and its CLIs' wrapper that turns any user error into one line."""

from __future__ import annotations

import sys
from collections.abc import Callable

from convbert_ds.cli import exit_on_user_error
from convbert_ds.errors import UserError


class PreprocessingError(UserError):
    """A problem with the user's input, settings or output directory, worded for the user."""


def run_cli(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> int:
    """Run a CLI ``main``: a ``UserError`` is one line on stderr and exit code 2; Ctrl-C says how to resume."""
    try:
        return exit_on_user_error(lambda: main(argv))
    except KeyboardInterrupt:
        print("interrupted (rerun the same command to resume)", file=sys.stderr)
        return 130
