"""Files and directories that are whole or absent, and outputs that are never replaced by accident.

Every write that a crash could leave half-done goes through here: a file is written under a temporary
name in the same directory, fsync-ed and renamed onto its name; a directory is filled under a temporary
name and swapped in by renames, so at every instant the old whole directory or the new whole one exists.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from convbert_ds.errors import UserError
from convbert_ds.log import EVERY_RANK, get_logger

logger = get_logger(__name__)

FORCE_FLAG = "--force"  # the one name, across CLIs, for "replace my non-empty output"


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path, error: type[Exception], fix: str, needs: tuple[str, ...] = ()):
    """A UTF-8 JSON file's value; one that does not parse raises ``error`` naming the file, why, and ``fix``.
    With ``needs``, the value must be an object holding those keys (a record this project wrote, read back)."""
    try:
        value = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as reason:
        raise error(f"{path}: not valid JSON ({reason}); {fix}") from None
    if needs and not (isinstance(value, dict) and all(key in value for key in needs)):
        raise error(f"{path}: not the record expected there (an object with {', '.join(needs)}); {fix}")
    return value


def write_bytes_atomically(path, data: bytes) -> None:
    """Temporary name, fsync, rename: a crash leaves the old file or the new one, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomically(path, text: str) -> None:
    write_bytes_atomically(path, text.encode())


def write_json_atomically(path, obj, indent: int = 2) -> None:
    write_text_atomically(path, json.dumps(obj, indent=indent, default=str) + "\n")


def _share_like_umask(directory: Path) -> None:
    """``mkdtemp`` makes a private (0700) directory; give the result the modes the umask asks for."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def file_sha256(path: str | os.PathLike) -> str:
    """The hex sha256 of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_dir_atomically(directory, fill: Callable[[Path], None]) -> Path:
    """Create or replace ``directory`` with what ``fill(tmp_dir)`` writes.

    The old directory is renamed aside before the new one is renamed in and only then deleted, so a crash
    at any point leaves a whole directory on disk (the old one under ``.NAME.old-PID`` in the worst case).
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        fill(tmp)
        _share_like_umask(tmp)
        old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def refuse_non_empty(path, force: bool, error: type[UserError] = UserError) -> None:
    """Stop before touching a non-empty output directory unless the user passed ``--force``."""
    path = Path(path)
    if path.is_file():
        raise error(f"{path} is a file; --out needs a directory")
    if not force and path.is_dir() and any(path.iterdir()):
        raise error(f"{path} exists and is not empty; pass {FORCE_FLAG} to replace it")


def truncate_jsonl(path: Path, step: int) -> list[dict]:
    """Keep the JSON lines whose ``step`` is at most ``step``: a run resumed from that step logs the rest
    again, so its log ends up as an uninterrupted run's. Returns the rows dropped."""
    if not path.is_file():
        return []
    text = path.read_text()
    # A last line without its newline was cut short (a full disk, a kill mid-write): it is no row, and dropped.
    rows = [(line, json.loads(line)) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]
    path.write_text("".join(line + "\n" for line, row in rows if row.get("step", 0) <= step))
    return [row for _, row in rows if row.get("step", 0) > step]


def file_name_part(text: str) -> str:
    """``text`` as one field of a file or directory name: runs of anything but letters, digits and dots
    become one ``_`` (so ``-`` stays free to separate the fields)."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", text)


@contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[bool]:
    """Hold an exclusive flock on ``lock_path`` (made if absent), so that one process of many builds or fetches
    something while the others wait; yields False (no lock held) where the filesystem has no locks."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for %s, which another process holds", lock_path.name)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            logger.warning("no file locks on %s (%s): every process does the work itself", lock_path.parent, e,
                           extra=EVERY_RANK)
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock
