"""The one base class of the errors a user can fix.

Every CLI (training, conversion, fine-tuning, preprocessing) catches ``UserError`` alone: it prints
``str(error)`` on one line (naming the file or field, the value and the fix) and exits with
``EXIT_USER_ERROR``. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input: a config value, a path, a flag, a file's content. The message says what and how to fix it."""


def exit_on_user_error(main: Callable[[], int | None], prefix: str = "error") -> int:
    """Run a CLI's ``main``; a ``UserError`` becomes one line on stderr and exit code 2."""
    try:
        return main() or 0
    except UserError as error:
        print(f"{prefix}: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
