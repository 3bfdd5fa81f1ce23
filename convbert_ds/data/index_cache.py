"""Index files that are built once, shared by every rank and never read half-written.

A cache file holds one 1-D numpy structured array behind a fixed-size header::

    bytes 0 .. 8         magic b"CBDSIDX\\x01"
    bytes 8 .. 4096      JSON (utf-8, space padded): key, dtype, count, crc32 of the records, meta
    bytes 4096 ..        the records, back to back

Why it is safe when hundreds of ranks start at once:

* A writer streams records into a temporary file in the same directory and
  ``os.replace``-s it onto the final name, so a reader sees no file or a whole one.
* An exclusive ``flock`` on ``<name>.lock`` makes one process build while the
  others wait and then load its result. Where the filesystem has no working
  ``flock`` every process builds, and the rename still keeps the file whole.
* A file that fails any check (magic, key, dtype, size, crc32) is rebuilt, so a
  truncated copy or a flipped byte never reaches training.

A cache is an optimisation, so a full disk does not stop the run: the temporary file is deleted, the
process says so once per directory (one line: the path, the space free there, that the index is kept in
memory instead, and the fix) and builds the index again into memory. Such an index costs its size in
RAM in each process that builds it and travels whole when its dataset is pickled (spawned DataLoader
workers); the next start tries the disk again.
"""

from __future__ import annotations

import io
import json
import os
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from convbert_ds.disk_full import is_disk_full, warn_once
from convbert_ds.errors import UserError
from convbert_ds.fsutil import exclusive_lock
from convbert_ds.log import EVERY_RANK, get_logger

logger = get_logger(__name__)

MAGIC = b"CBDSIDX\x01"
HEADER_BYTES = 4096


class CacheFileError(UserError, ValueError):
    """A cache file exists but cannot be used (wrong key, truncated, corrupt)."""


class RecordWriter:
    """Appends record arrays to a cache file being built; the caller never sees the header."""

    def __init__(self, stream, dtype: np.dtype):
        self._stream, self.dtype = stream, dtype
        self.count = self.crc32 = 0

    def append(self, records: np.ndarray) -> None:
        if records.dtype != self.dtype:
            raise TypeError(f"records have dtype {records.dtype}, this index holds {self.dtype}")
        raw = np.ascontiguousarray(records).view(np.uint8)
        self.crc32 = zlib.crc32(raw, self.crc32)
        self._stream.write(raw)
        self.count += len(records)


@dataclass
class CachedIndex:
    path: Path
    records: np.ndarray  # read-only memmap of the records
    meta: dict
    built: bool  # whether this process built the file
    in_memory: bool = False  # built into memory: the disk had no room for the file at ``path``


def open_records(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """Map the records of a checked cache file (used again after unpickling, e.g. in workers)."""
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


class MappedRecords:
    """Base of a dataset over a cached index: it pickles as the file's path and maps the file again on arrival
    (e.g. in DataLoader workers) instead of copying the records."""

    def _attach(self, index: CachedIndex) -> None:
        self.index_path, self.index_built, self._records = index.path, index.built, index.records
        self.index_in_memory = index.in_memory

    def __len__(self) -> int:
        return len(self._records)

    def __getstate__(self) -> dict:
        if self.index_in_memory:  # no file to map: the records travel themselves
            return dict(self.__dict__)
        return {**self.__dict__, "_records": (self._records.dtype, len(self._records))}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if not self.index_in_memory:
            self._records = open_records(self.index_path, *self._records)


def _read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
        raise CacheFileError(f"{path}: not a complete index file")
    try:
        return json.loads(head[len(MAGIC):].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheFileError(f"{path}: unreadable header ({e})") from None


def _check(path: Path, key: str, dtype: np.dtype, verify_crc: bool) -> CachedIndex:
    header = _read_header(path)
    if header.get("key") != key:
        raise CacheFileError(f"{path}: built for another key")
    if header.get("dtype") != repr(dtype.descr):
        raise CacheFileError(f"{path}: holds records of another layout")
    count = int(header["count"])
    if path.stat().st_size != HEADER_BYTES + count * dtype.itemsize:
        raise CacheFileError(f"{path}: size does not match its header (truncated?)")
    records = open_records(path, dtype, count)
    if verify_crc and zlib.crc32(records.view(np.uint8)) != header["crc32"]:
        raise CacheFileError(f"{path}: checksum mismatch (corrupt)")
    return CachedIndex(path, records, header.get("meta", {}), built=False)


def _try_load(path: Path, key: str, dtype: np.dtype) -> CachedIndex | None:
    if not path.exists():
        return None
    try:
        return _check(path, key, dtype, verify_crc=True)
    except (ValueError, KeyError, TypeError, OSError) as e:  # CacheFileError is a ValueError
        logger.warning("rebuilding index: %s", e, extra=EVERY_RANK)
        return None


def _write(path: Path, key: str, dtype: np.dtype, build: Callable[[RecordWriter], dict]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * HEADER_BYTES)
            writer = RecordWriter(f, dtype)
            meta = build(writer)
            header = json.dumps({"key": key, "dtype": repr(dtype.descr), "count": writer.count,
                                 "crc32": writer.crc32, "meta": meta}).encode("utf-8")
            if len(MAGIC) + len(header) > HEADER_BYTES:
                raise ValueError(f"index header for {path} is too large ({len(header)} bytes)")
            f.seek(0)
            f.write(MAGIC + header.ljust(HEADER_BYTES - len(MAGIC)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_or_build(path: Path, key: str, dtype: np.dtype,
                  build: Callable[[RecordWriter], dict]) -> CachedIndex:
    """Load the index at ``path`` if it is whole and was built for ``key``, else build it.

    ``build(writer)`` appends records with ``writer.append`` and returns a small
    JSON-able dict stored in the header (``CachedIndex.meta``).
    """
    dtype = np.dtype(dtype)
    cached = _try_load(path, key, dtype)
    if cached is not None:
        return cached
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(path.with_name(path.name + ".lock")) as locked:
            cached = _try_load(path, key, dtype)  # another process may have built it meanwhile
            if cached is not None:
                return cached
            if locked:  # holding the lock, any temporary file left here is from a dead builder
                for stale in path.parent.glob(f"{path.name}.tmp-*"):
                    stale.unlink(missing_ok=True)
            _write(path, key, dtype, build)
    except PermissionError as e:
        raise PermissionError(f"cannot write the sample index beside the shards ({e.filename}); "
                              f"pass a writable cache_dir (config: data.cache_dir)") from None
    except OSError as e:
        if not is_disk_full(e):
            raise
        return _build_in_memory(path, key, dtype, build)  # outside the lock: the others need not wait for it
    return replace(_check(path, key, dtype, verify_crc=False), built=True)


def _build_in_memory(path: Path, key: str, dtype: np.dtype, build: Callable[[RecordWriter], dict]) -> CachedIndex:
    """The index ``load_or_build`` found no room to write: built again, into this process's memory."""
    warn_once(path.parent, "this process keeps its sample indexes in memory instead, and builds them again at "
                           "every start")
    stream = io.BytesIO()
    meta = build(RecordWriter(stream, dtype))
    records = np.frombuffer(stream.getvalue(), dtype=dtype)  # read-only, as the file's memory map is
    return CachedIndex(path, records, meta, built=True, in_memory=True)
