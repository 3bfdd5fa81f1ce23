"""A full disk, said in one line: how every write site recognises one (an ``OSError``, or the errors torch's and
safetensors' writers raise over it) and what the line says (the path, the space free there, what is kept and
the fix). Also the other ways a disk refuses an output directory (a file in the way, a read-only mount), checked
before work starts. Below ``fsutil``, ``objstore`` and ``cli``, which all use it."""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from convbert_ds.errors import UserError
from convbert_ds.log import EVERY_RANK, get_logger

logger = get_logger(__name__)

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a full filesystem, or the user's quota spent
# How torch's zip writer (torch.save) reports a write that failed: a RuntimeError, not the OSError beneath it
TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed writing")
# How safetensors' writer (save_file) reports one: a SafetensorError ending in Rust's "(os error 28)"
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class DiskFull(UserError):
    """A write found its filesystem full: the line names the path, the space free there and what is kept."""


def human_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def free_space(path) -> str:
    """``"N MB free there"`` for the filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return f"{human_bytes(shutil.disk_usage(path).free)} free there"
    except OSError:
        return "free space unknown"


def is_disk_full(error: BaseException) -> bool:
    """A full filesystem, as an OSError says it or as torch.save's and safetensors' writers do (which hide the
    OSError)."""
    if isinstance(error, OSError):
        return error.errno in DISK_FULL_ERRNOS
    if type(error).__name__ == "SafetensorError":
        return any(int(errno_) in DISK_FULL_ERRNOS for errno_ in _RUST_OS_ERROR.findall(str(error)))
    return isinstance(error, RuntimeError) and any(text in str(error) for text in TORCH_WRITE_FAILED)


_warned: set[Path] = set()  # the directories this process has said are full (once each)


def warn_once(directory: Path, instead: str) -> None:
    """For a cache that goes on without its disk: one warning per ``directory`` and process, naming the space
    free there and what the process does ``instead``."""
    if directory not in _warned:
        _warned.add(directory)
        logger.warning("%s: no space left on device (%s); %s; free some space there, or set data.cache_dir to a "
                       "disk with room", directory, free_space(directory), instead, extra=EVERY_RANK)


def disk_full_line(path, kept: str | None) -> str:
    """The one line for a write to ``path`` that found no room: the space free and what the user keeps."""
    return (f"{path}: no space left on device ({free_space(path)}){'; ' + kept if kept else ''}; "
            f"free some space there (or write elsewhere) and rerun the same command")


@contextmanager
def full_disk_says(path, kept: str) -> Iterator[None]:
    """Turn a full disk inside the block into ``DiskFull`` naming ``path`` and ``kept`` (what is still whole:
    the writes here leave no partial file behind, so a rerun starts from it)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised unless is_disk_full says it is a full disk
        if not is_disk_full(error):
            raise
        raise DiskFull(disk_full_line(path, kept)) from error


def why_no_directory(path) -> str | None:
    """Why ``path`` cannot be (or become) a directory this process writes in, said for a one-line error; None
    when it can. Checked before a run starts, so that ``mkdir`` deep inside it never meets a file there."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        return "is a file, not a directory"
    existing = path
    while not existing.exists():
        if existing.is_symlink():
            return f"cannot be made: {existing} is a link to nothing ({os.readlink(existing)})"
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot be made: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):  # a read-only mount says so even to root
        why = "read-only" if _read_only(existing) else "not writable by this user"
        return f"cannot be written: {existing} is {why}"
    return None


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
