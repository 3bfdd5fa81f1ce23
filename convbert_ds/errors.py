"""The one base class of the errors a user can fix.

Every CLI (training, conversion, fine-tuning, preprocessing) catches ``UserError`` alone
(``convbert_ds.cli.exit_on_user_error``): it prints ``str(error)`` on one line (naming the file or field,
the value and the fix) and exits with ``EXIT_USER_ERROR``. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input: a config value, a path, a flag, a file's content. The message says what and how to fix it."""


def first_line(error: BaseException) -> str:
    """What an error says, in one line (its first), or its type's name when it says nothing: for messages
    that wrap another library's error."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__
