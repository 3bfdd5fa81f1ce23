"""What every command line shares: its parser (a bad option is one line, exit 2), the valid range of a
numeric option declared at the parser (``bounded``), and ``exit_on_user_error`` around its ``main``."""

from __future__ import annotations

import argparse
import errno
import math
import sys
from collections.abc import Callable

from convbert_ds.disk_full import disk_full_line, is_disk_full, why_no_directory
from convbert_ds.errors import EXIT_USER_ERROR, UserError


PATH_REFUSED = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS)


def exit_on_user_error(main: Callable[[], int | None], prefix: str = "error") -> int:
    """Run a CLI's ``main``; a ``UserError`` becomes one line on stderr and exit code 2. So does a full disk
    that no write site named (``disk_full.full_disk_says`` is the better line: it says what is kept), and a
    path the disk refused (a file where a directory goes, a read-only mount, no permission)."""
    try:
        return main() or 0
    except UserError as error:
        print(f"{prefix}: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as error:
        if error.errno in PATH_REFUSED and error.filename:
            # a path no check named: a file in the way, a read-only disk, another user's directory
            said = error.strerror
            if error.errno in (errno.ENOTDIR, errno.EEXIST):  # a file where a directory goes: say which
                said = why_no_directory(error.filename) or said
            print(f"{prefix}: {error.filename}: {said}; use another path (or fix its permissions) and rerun",
                  file=sys.stderr)
            return EXIT_USER_ERROR
        if not is_disk_full(error):
            raise
        said = disk_full_line(error.filename, None) if error.filename else \
            "a write found no space left on device; free some space (or write elsewhere) and rerun the same command"
        print(f"{prefix}: {said}", file=sys.stderr)
        return EXIT_USER_ERROR


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks; every option's help shows its default, unless it is required
    or its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        said = action.required or "default" in (action.help or "")
        return action.help if said else super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """Every CLI's parser: a bad option is a ``UserError`` (one line, exit 2, not usage + message)."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is not None and spec.name.split(".")[0] in ("convbert_ds", "preprocessing"):
            # started as ``python -m MODULE``: say so in usage and errors, not "__main__.py"
            kwargs.setdefault("prog", f"python -m {spec.name.removesuffix('.__main__')}")
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}")


def bounded(kind: type = int, min: float | None = None, max: float | None = None, *, above: float | None = None,
            below: float | None = None):
    """An ``add_argument(type=...)`` that takes a ``kind`` (int or float) in range (``min``/``max`` inclusive,
    ``above``/``below`` exclusive) and refuses anything else (non-numeric, out of range, not finite) as one
    line naming the option: the valid range of an option lives on its parser, once. ``.check(value)`` says
    what is wrong with a value that is already a number (None if nothing), for the same range in an API."""
    limits = " and ".join(f"{sign} {bound:g}" for sign, bound in ((">=", min), ("<=", max), (">", above), ("<", below))
                          if bound is not None)
    noun = "an integer" if kind is int else "a number"
    must = f"must be {noun}{' ' + limits if limits else ''}"

    def check(value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                kind is int and value != int(value)):
            return must
        inside = ((min is None or value >= min) and (max is None or value <= max) and (above is None or value > above)
                  and (below is None or value < below))
        return None if inside else must

    def parse(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if check(value):
            raise argparse.ArgumentTypeError(f"{text!r}: {must}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    parse.check, parse.bounds = check, {"min": min, "max": max, "above": above, "below": below, "kind": kind}
    return parse
