"""The one error type users see, and the wrapper that turns it into one line and an exit code."""

from __future__ import annotations

import sys
from collections.abc import Callable


class PreprocessingError(Exception):
    """A problem with the user's input, settings or output directory, worded for the user."""


def run_cli(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> int:
    """Run a CLI ``main``; a ``PreprocessingError`` becomes one line on stderr and exit code 2."""
    try:
        main(argv)
    except PreprocessingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (rerun the same command to resume)", file=sys.stderr)
        return 130
    return 0
