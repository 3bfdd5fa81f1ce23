"""Turning a chunk of raw input into documents made of lines.

Tokenizer training and sharding both go through ``parse_chunk`` so that they see
exactly the same text: same UTF-8 repair, same line stripping, same splitting
of over-long lines. A document is a list of non-empty, stripped lines; each
line becomes one sequence in the shards.

Input conventions:
- plain text: one sentence or paragraph per line, a blank (or whitespace-only)
  line ends a document;
- JSON lines / Parquet / Arrow: one record is one document; its text field is
  split into lines on ``\\n`` (blank lines inside a record are dropped).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from preprocessing.errors import PreprocessingError
from preprocessing.sources import iter_chunks, plan_slice, record_text

# Longer lines are cut into several sequences (see split_long_line). Far above
# any model's sequence length, and short enough that, for ordinary text, the
# float32 sums in sentencepiece's lattice stay exact (see tokenizer._quantize_scores).
MAX_LINE_CHARS = 16384

_replaced_bytes = 0
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _replace_and_count(err: UnicodeDecodeError) -> tuple[str, int]:
    global _replaced_bytes
    _replaced_bytes += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("preprocessing-count", _replace_and_count)


def decode_utf8(data: bytes, strict: bool, where: str, offset: int) -> tuple[str, int]:
    """Decode ``data``; return the text and how many invalid bytes were replaced by U+FFFD.

    With ``strict`` an invalid byte is an error naming ``where`` and the byte
    offset (``offset`` is where ``data`` starts in that file).
    """
    global _replaced_bytes
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if strict:
            raise PreprocessingError(
                f"{where}: invalid UTF-8 at byte offset {offset + e.start} (--strict); "
                "drop --strict to replace invalid bytes") from None
    _replaced_bytes = 0
    text = data.decode("utf-8", errors="preprocessing-count")
    return text, _replaced_bytes


def split_long_line(line: str, max_chars: int) -> list[str]:
    """Cut a line into pieces of at most ``max_chars``, at a space when there is one.

    The tokenizers split on whitespace anyway, so a cut at a space yields the
    same tokens as the whole line would; only the sequence boundary is new.
    """
    pieces = []
    while len(line) > max_chars:
        cut = line.rfind(" ", max_chars // 2, max_chars + 1)
        if cut > 0:
            pieces.append(line[:cut].rstrip())
            line = line[cut + 1:].lstrip()
        else:
            pieces.append(line[:max_chars])
            line = line[max_chars:]
    if line:
        pieces.append(line)
    return pieces


@dataclass
class ParsedChunk:
    """Documents of one chunk, flattened: ``lines`` holds every document's lines in order."""

    lines: list[str] = field(default_factory=list)
    doc_lines: list[int] = field(default_factory=list)  # lines per document, each > 0
    empty_documents: int = 0
    invalid_utf8_bytes: int = 0
    long_lines_split: int = 0

    def add_document(self, text_lines: list[str] | str | None, max_line_chars: int) -> None:
        """Add one document given as raw lines or a record's text (stripped here, blank lines dropped)."""
        kept = []
        for raw in text_lines.split("\n") if isinstance(text_lines, str) else text_lines or ():
            s = raw.strip()
            if len(s) > max_line_chars:
                kept.extend(split_long_line(s, max_line_chars))
                self.long_lines_split += 1
            elif s:
                kept.append(s)
        if kept:
            self.lines.extend(kept)
            self.doc_lines.append(len(kept))
        else:
            self.empty_documents += 1

    def documents(self) -> list[list[str]]:
        return [self.lines[end - n:end] for n, end in zip(self.doc_lines, accumulate(self.doc_lines))]


def parse_text(text: str, max_line_chars: int, out: ParsedChunk) -> None:
    """Plain text: non-blank lines form documents; blank lines separate them."""
    lines, doc_lines = out.lines, out.doc_lines
    first = len(lines)
    for raw in text.split("\n"):
        s = raw.strip()
        if s:
            if len(s) > max_line_chars:
                lines.extend(split_long_line(s, max_line_chars))
                out.long_lines_split += 1
            else:
                lines.append(s)
        elif len(lines) > first:
            doc_lines.append(len(lines) - first)
            first = len(lines)
    if len(lines) > first:
        doc_lines.append(len(lines) - first)


def parse_jsonl(text: str, data: bytes, text_field: str, max_line_chars: int, strict: bool, where: str,
                offset: int, out: ParsedChunk) -> None:
    """JSON lines: one record per line, one document per record."""
    for k, raw in enumerate(text.split("\n")):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            value = record_text(record, text_field, "")
            # JSON can escape lone surrogates, which are not text in any encoding.
            if value and ("\\ud" in raw or "\\uD" in raw):
                value, bad = _LONE_SURROGATE.subn("\ufffd", value)
                if bad and strict:
                    raise PreprocessingError("a lone UTF-16 surrogate escape (--strict)")
                out.invalid_utf8_bytes += bad
        except (ValueError, PreprocessingError) as e:
            at = offset + sum(len(b) + 1 for b in data.split(b"\n")[:k])
            reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e).lstrip(": ")
            raise PreprocessingError(f"{where}: record at byte offset {at}: {reason}") from None
        out.add_document(value, max_line_chars)


def parse_chunk(chunk, where: str, strict: bool, text_field: str, max_line_chars: int) -> ParsedChunk:
    """Decode and split a ``sources.Chunk`` into documents; ``where`` names its file in errors."""
    out = ParsedChunk()
    if chunk.kind == "records":  # already read by ``datasets`` (Parquet, Arrow, JSON arrays): one document each
        for value in chunk.data:
            out.add_document(value, max_line_chars)
        return out
    text, out.invalid_utf8_bytes = decode_utf8(chunk.data, strict, where, chunk.offset)
    if chunk.kind == "jsonl":
        parse_jsonl(text, chunk.data, text_field, max_line_chars, strict, where, chunk.offset, out)
    else:
        parse_text(text, max_line_chars, out)
    return out


def iter_documents(sources: list, text_field: str = "text", strict: bool = False,
                   max_line_chars: int = MAX_LINE_CHARS, stats: dict | None = None) -> Iterator[list[str]]:
    """Every document of ``sources`` (see ``sources.resolve_inputs``) as a list of lines, in order.

    ``stats``, when given, accumulates documents/lines read and what was skipped or repaired.
    """
    for chunk in iter_chunks(sources, plan_slice(sources, 0, 1), text_field):
        parsed = parse_chunk(chunk, sources[chunk.source].path, strict, text_field, max_line_chars)
        if stats is not None:
            counts = {"documents": len(parsed.doc_lines), "lines": len(parsed.lines),
                      "empty_documents": parsed.empty_documents, "invalid_utf8_bytes": parsed.invalid_utf8_bytes,
                      "long_lines_split": parsed.long_lines_split, "long_documents_split": int(chunk.forced_cut)}
            for key, value in counts.items():
                stats[key] = stats.get(key, 0) + value
        yield from parsed.documents()
