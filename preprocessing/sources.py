"""Finding, checking and reading the input corpus as a stream of chunks.

Inputs are globs, files or directories. Formats are told by name:
``*.jsonl``/``*.ndjson`` (JSON lines), ``*.json`` (JSON lines, or a JSON array
when it starts with ``[``), ``*.parquet``, a ``datasets.save_to_disk``
directory, and anything else is plain text; ``.gz``/``.bz2``/``.xz``/``.zst``
are decompressed on the fly. Every input is opened and its first record checked
before any work starts, so a bad input fails in seconds, not hours.

Plain text and JSON lines are read here as bytes, which gives exact byte
offsets for errors, counts of repaired bytes and byte-range slices; Parquet,
Arrow directories and JSON arrays are read through ``datasets``.

The stream is cut into chunks (about ``block_bytes`` each) at document
boundaries. Where a chunk starts depends only on where the previous one
started, so a resumed run re-reads exactly the chunks of the first run, and
each chunk carries the position needed to resume at the next one.
"""

from __future__ import annotations

import bz2
import contextlib
import glob
import gzip
import io
import json
import lzma
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import BinaryIO

from preprocessing.errors import PreprocessingError

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

_COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd", ".zstd": "zstd"}
_OPENERS = {"gzip": gzip.open, "bz2": bz2.open, "xz": lzma.open, None: open}
_FORMAT_SUFFIXES = ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "json"), (".parquet", "parquet"))
_DATASETS_DIR_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
_WHITESPACE = b" \t\r\f\v\n"


@dataclass(frozen=True)
class Source:
    """One input file (or ``save_to_disk`` directory)."""

    path: str
    format: str  # "text" | "jsonl" | "json" | "parquet" | "arrow"
    compression: str | None
    size: int
    mtime_ns: int

    @property
    def splittable(self) -> bool:
        """Whether byte ranges of this source can go to different slices."""
        return self.format in ("text", "jsonl") and self.compression is None and self.size > 0

    def describe(self) -> dict:
        return {"path": self.path, "format": self.format, "compression": self.compression, "bytes": self.size}


def open_binary(source: Source) -> BinaryIO:
    """Open a text/JSON-lines source for reading decompressed bytes."""
    if source.compression == "zstd":
        import zstandard  # optional: needed only for .zst inputs

        raw = open(source.path, "rb")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return _OPENERS[source.compression](source.path, "rb")


def _read_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error, lzma.LZMAError, ValueError]
    with contextlib.suppress(ImportError):
        import zstandard  # optional: needed only for .zst inputs

        errors.append(zstandard.ZstdError)
    return tuple(errors)


# ---------------------------------------------------------------------------
# resolving and checking inputs


def _format_of(path: str) -> tuple[str, str | None]:
    name = os.path.basename(path).lower()
    stem, ext = os.path.splitext(name)
    compression = _COMPRESSIONS.get(ext)
    if compression:
        name = stem
    return next((fmt for suffix, fmt in _FORMAT_SUFFIXES if name.endswith(suffix)), "text"), compression


def _expand(pattern: str) -> list[str]:
    if os.path.isdir(pattern):
        if any(os.path.exists(os.path.join(pattern, m)) for m in _DATASETS_DIR_MARKERS):
            return [pattern]
        found = []
        for dirpath, dirnames, filenames in os.walk(pattern):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith("."))
        return found
    if os.path.lexists(pattern):
        return [pattern]
    return sorted(glob.glob(pattern, recursive=True))


def resolve_inputs(patterns: list[str], text_field: str = "text") -> list[Source]:
    """Expand globs/dirs into sources and check that each can be read; errors name the input."""
    if not patterns:
        raise PreprocessingError("no --input given")
    sources, seen = [], set()
    for pattern in patterns:
        matches = _expand(pattern)
        if not matches:
            raise PreprocessingError(f"--input {pattern!r} matches no files")
        for path in matches:
            if (key := os.path.realpath(path)) not in seen:
                seen.add(key)
                sources.append(_check_source(path, text_field))
    return sources


def _check_source(path: str, text_field: str) -> Source:
    try:
        if os.path.isdir(path):
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            source = Source(path, "arrow", None, size, os.stat(path).st_mtime_ns)
            for ds in _arrow_datasets(source):
                _check_column(source, ds.column_names, text_field)
            return source
        st = os.stat(path)
        fmt, compression = _format_of(path)
        if fmt == "parquet" and compression:
            raise PreprocessingError(f"{path}: compressed Parquet files are not supported (Parquet compresses itself)")
        source = Source(path, fmt, compression, st.st_size, st.st_mtime_ns)
        # Opening proves a file readable. The head is read only where it says something: JSON's form (an
        # array or lines), a compressed stream's soundness. Read from every plain file, it cost a tenth of
        # sharding a directory of 18 KB files, read again right after.
        with open_binary(source) as f:
            head = f.read(1 << 16 if fmt == "json" or compression else 0)  # buffered: short only at the end
        if fmt == "json" and head.lstrip()[:1] != b"[":
            source = replace(source, format="jsonl")
        if source.format == "jsonl":
            _check_jsonl(source, text_field)
        elif source.format in ("json", "parquet"):
            _check_with_datasets(source, text_field)
        return source
    except PreprocessingError:
        raise
    except _read_errors() as e:
        raise PreprocessingError(f"cannot read {path}: {e}") from None


def record_text(record: object, text_field: str, where: str) -> str | None:
    """The text of one JSON record; ``None`` for a null field; an error if it is missing."""
    if not isinstance(record, dict):
        raise PreprocessingError(f"{where}: expected a JSON object, found {type(record).__name__}")
    if text_field not in record:
        fields = ", ".join(sorted(map(str, record))[:10]) or "none"
        raise PreprocessingError(f"{where}: no field {text_field!r} (fields: {fields}); "
                                 "pick one with --text-field")
    value = record[text_field]
    if value is not None and not isinstance(value, str):
        raise PreprocessingError(f"{where}: field {text_field!r} is {type(value).__name__}, not a string")
    return value


def _check_jsonl(source: Source, text_field: str) -> None:
    with open_binary(source) as f:
        offset = 0
        for line in f:
            if line.strip():
                where = f"{source.path}: record at byte offset {offset}"
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise PreprocessingError(f"{where}: not valid JSON ({e})") from None
                record_text(record, text_field, where)
                return
            offset += len(line)


def _check_column(source: Source, columns: list[str], text_field: str) -> None:
    if text_field not in columns:
        raise PreprocessingError(f"{source.path}: no column {text_field!r} (columns: {', '.join(columns)}); "
                                 "pick one with --text-field")


def _check_with_datasets(source: Source, text_field: str) -> None:
    if source.format == "parquet":
        import pyarrow.parquet as pq  # heavy: only for Parquet inputs

        return _check_column(source, pq.read_schema(source.path).names, text_field)
    first = next(iter(_streaming_dataset(source)), None)
    if first is not None:
        record_text(first, text_field, f"{source.path}: record 0")


# ---------------------------------------------------------------------------
# reading through `datasets`


def _streaming_dataset(source: Source):
    import datasets  # heavy (seconds): only for Parquet/JSON/Arrow inputs

    datasets.disable_progress_bars()
    builder = "parquet" if source.format == "parquet" else "json"
    return datasets.load_dataset(builder, data_files=[source.path], split="train", streaming=True)


def _arrow_datasets(source: Source) -> list:
    import datasets  # heavy (seconds): only for Parquet/JSON/Arrow inputs

    datasets.disable_progress_bars()
    loaded = datasets.load_from_disk(source.path)
    if isinstance(loaded, datasets.DatasetDict):
        return [loaded[name] for name in loaded]
    return [loaded]


def _record_batches(source: Source, text_field: str, start: int, batch: int = 1024) -> Iterator[list]:
    """Text values of the records of a datasets-read source, from record ``start`` on."""
    if source.format == "arrow":
        for ds in _arrow_datasets(source):
            ds = ds.select_columns([text_field])
            for i in range(start, len(ds), batch):
                yield ds[i:i + batch][text_field]
            start = max(start - len(ds), 0)
        return
    ds = _streaming_dataset(source).select_columns([text_field])
    if start:
        ds = ds.skip(start)
    for rows in ds.iter(batch_size=batch):
        yield rows[text_field]


# ---------------------------------------------------------------------------
# slices


def parse_slice(spec: str | tuple[int, int] | None) -> tuple[int, int]:
    """``"i/N"`` (0 <= i < N) → (i, N); ``None`` → (0, 1)."""
    if spec is None:
        return 0, 1
    if isinstance(spec, str):
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
        if not m:
            raise PreprocessingError(f"--slice {spec!r}: expected i/N, e.g. 0/4")
        spec = int(m.group(1)), int(m.group(2))
    index, count = spec
    if not 0 <= index < count:
        raise PreprocessingError(f"--slice {index}/{count}: need 0 <= i < N")
    return index, count


@dataclass(frozen=True)
class Range:
    """The part of one source a slice reads: bytes [start, end) of a splittable file, else all of it.

    A document belongs to the slice in whose range its leading boundary falls,
    so the N slices of a corpus hold every document exactly once.
    """

    source: int
    start: int = 0
    end: int | None = None


def plan_slice(sources: list[Source], index: int, count: int) -> list[Range]:
    """Cut the concatenated inputs into ``count`` equal byte spans and return span ``index``."""
    total = sum(s.size for s in sources)
    lo, hi = total * index // count, total * (index + 1) // count
    ranges, pos = [], 0
    for i, s in enumerate(sources):
        a, b = pos, pos + s.size
        pos = b
        if s.splittable:
            x, y = max(a, lo), min(b, hi)
            if x < y:
                ranges.append(Range(i, x - a, None if y == b else y - a))
        elif lo <= a < hi or (index == count - 1 and a == total):
            ranges.append(Range(i))
    return ranges


# ---------------------------------------------------------------------------
# chunks


@dataclass
class Chunk:
    """A unit of work: whole documents from one source, plus where the next chunk starts."""

    index: int
    source: int
    kind: str  # "text" | "jsonl" | "records"
    offset: int  # byte offset (text, jsonl) or record number (records) in the source
    data: bytes | list
    position: tuple[int, int]  # (range index, offset): where to restart to read this chunk again
    next_position: tuple[int, int | None]  # the same for the next chunk; None = the range's start
    progress_bytes: int
    forced_cut: bool = False  # the chunk ends inside an over-long document


def _last_boundary(buf: bytearray, limit: int, kind: str) -> int | None:
    """Position just after the last document boundary in ``buf[:limit]``, if any."""
    if kind == "jsonl":
        i = buf.rfind(b"\n", 0, limit)
        return i + 1 if i >= 0 else None
    i = buf.rfind(b"\n\n", 0, limit)
    if i >= 0:
        return i + 2
    last = None
    for m in _BLANK_LINE.finditer(buf, 0, limit):
        last = m.end()
    return last


def _forced_cut(buf: bytearray, limit: int) -> int:
    """Where to cut a document with no boundary in ``limit`` bytes: a newline, a space, or a character edge."""
    for sep in (b"\n", b" "):
        i = buf.rfind(sep, 0, limit)
        if i >= 0:
            return i + 1
    cut = limit
    while cut > limit - 3 and (buf[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut


def _first_boundary(f: BinaryIO, pos: int, kind: str) -> int:
    """Position just after the first document boundary at or after ``pos`` (EOF if none)."""
    f.seek(pos)
    buf = bytearray()
    scan_from = 0
    while True:
        data = f.read(1 << 20)
        if not data:
            return pos + len(buf)
        buf += data
        if kind == "jsonl":
            i = buf.find(b"\n", scan_from)
            if i >= 0:
                return pos + i + 1
        else:
            m = _BLANK_LINE.search(buf, scan_from)
            if m:
                return pos + m.end()
        scan_from = len(buf.rstrip(_WHITESPACE))


def _byte_chunks(source: Source, rng: Range, kind: str, offset: int | None, block_bytes: int,
                 max_document_bytes: int) -> Iterator[tuple[int, bytes, int | None, bool]]:
    """(offset, data, next offset or None at the range's end, forced cut) for a text/jsonl range."""
    with open_binary(source) as f:
        if offset is None:
            offset = 0 if rng.start == 0 else _first_boundary(f, rng.start, kind)
        end = None if rng.end is None else _first_boundary(f, rng.end, kind)
        if f.seekable():
            f.seek(offset)
        else:
            skipped = 0
            while skipped < offset and (step := f.read(min(1 << 22, offset - skipped))):
                skipped += len(step)
        pos, buf, eof = offset, bytearray(), False

        def fill(n: int) -> None:
            nonlocal eof
            while len(buf) < n and not eof:
                data = f.read(max(n - len(buf), 1 << 16))
                buf.extend(data)
                eof = not data

        while end is None or pos < end:
            limit, forced = block_bytes, False
            while True:
                # One byte past the limit tells "the rest fits" from "exactly full".
                fill(limit + 1)
                remaining = len(buf) if end is None else min(len(buf), end - pos)
                if remaining <= limit:
                    cut = remaining
                    break
                cut = _last_boundary(buf, limit, kind)
                if cut:
                    break
                if kind == "text" and limit >= max_document_bytes:
                    cut, forced = _forced_cut(buf, limit), True
                    break
                limit = limit * 2 if kind == "jsonl" else min(limit * 2, max_document_bytes)
            if cut == 0:
                return
            data = bytes(buf[:cut])
            del buf[:cut]
            pos += cut
            at_end = (end is not None and pos >= end) or (eof and not buf)
            yield pos - cut, data, None if at_end else pos, forced
            if at_end:
                return


def _record_chunks(source: Source, text_field: str, offset: int | None,
                   block_bytes: int) -> Iterator[tuple[int, list, int | None]]:
    """(record offset, texts, next offset or None at the end) for a datasets-read source."""
    start = offset or 0
    pending, size = [], 0
    for texts in _record_batches(source, text_field, start):
        for t in texts:
            pending.append(t)
            size += len(t) if t else 1
            if size >= block_bytes:
                yield start, pending, start + len(pending)
                start += len(pending)
                pending, size = [], 0
    yield start, pending, None


def range_bytes(sources: list[Source], rng: Range) -> int:
    """Approximate input bytes a range covers (for progress bars)."""
    size = sources[rng.source].size
    return (size if rng.end is None else rng.end) - rng.start


def iter_chunks(sources: list[Source], ranges: list[Range], text_field: str = "text",
                block_bytes: int = 1 << 20, max_document_bytes: int = 64 << 20,
                start: tuple[int, tuple[int, int | None]] = (0, (0, None))) -> Iterator[Chunk]:
    """Chunks of the given ranges, in order; ``start`` = (chunk index, position) to resume from."""
    index, (range_index, offset) = start
    errors = _read_errors()
    for r in range(range_index, len(ranges)):
        rng = ranges[r]
        source = sources[rng.source]
        first_offset = offset if r == range_index else None
        try:
            if source.format in ("text", "jsonl"):
                for at, data, nxt, forced in _byte_chunks(source, rng, source.format, first_offset,
                                                         block_bytes, max_document_bytes):
                    yield Chunk(index, rng.source, source.format, at, data, (r, at),
                                (r, nxt) if nxt is not None else (r + 1, None), len(data), forced)
                    index += 1
            else:
                for at, texts, nxt in _record_chunks(source, text_field, first_offset, block_bytes):
                    done = nxt is None
                    yield Chunk(index, rng.source, "records", at, texts, (r, at),
                                (r, nxt) if not done else (r + 1, None), source.size if done else 0)
                    index += 1
        except PreprocessingError:
            raise
        except errors as e:
            raise PreprocessingError(f"cannot read {source.path}: {e}") from None
