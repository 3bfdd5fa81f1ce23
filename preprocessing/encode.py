"""Worker side of sharding: chunks of raw input → token arrays per split; and the pool of workers.

Runs in worker processes, so it imports only numpy and the tokenizer library
(never torch or transformers). Everything after tokenization is vectorised:
the parent receives flat arrays and only appends them to files.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import zlib
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from preprocessing.documents import ParsedChunk, parse_chunk
from preprocessing.errors import PreprocessingError
from preprocessing.sources import Chunk

SPLITS = ("train", "valid")


class LineEncoder:
    """Encodes a batch of lines to (flat int32 ids, int32 lengths), no special tokens added.

    ``spec`` is ``Tokenizer.worker_spec()``: ("sentencepiece", model bytes) or
    ("tokenizers", tokenizer.json text).
    """

    def __init__(self, spec: tuple[str, bytes | str], single_thread: bool = True):
        self.kind, payload = spec
        if self.kind == "sentencepiece":
            import sentencepiece  # workers load only their tokenizer kind

            self._sp = sentencepiece.SentencePieceProcessor(model_proto=payload)
            # The public numpy output wraps every line in its own array, which cost
            # as much as 30% on top of encoding; the raw buffers it wraps are joined
            # here in one copy. Private API, so it is checked against the public one
            # on first use and dropped if absent or different.
            self._raw_batch = getattr(self._sp._processor, "_EncodeAsBufferBatch", None)
            self._raw_checked = False
        else:
            if single_thread:
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
            from tokenizers import Tokenizer  # workers load only their tokenizer kind

            self._tok = Tokenizer.from_str(payload)
            self._tok_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def __call__(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if not lines:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        if self.kind != "sentencepiece":
            arrays = [np.asarray(e.ids, dtype=np.int32)
                      for e in self._tok_batch(lines, add_special_tokens=False)]
        elif self._raw_batch is not None and (result := self._encode_raw(lines)) is not None:
            return result
        else:
            arrays = self._sp.encode(lines, num_threads=1, out_type="numpy")
        lengths = np.fromiter(map(len, arrays), np.int32, len(arrays))
        return np.concatenate(arrays).astype(np.int32, copy=False), lengths

    def _encode_raw(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        try:
            buffers = list(map(memoryview, self._raw_batch(lines, 1, None, False, -1, 0.1, False, False, False)))
        except (TypeError, ValueError):
            self._raw_batch = None
            return None
        lengths = np.fromiter((b.nbytes // 4 for b in buffers), np.int32, len(buffers))
        tokens = np.frombuffer(b"".join(buffers), np.int32)
        if not self._raw_checked:
            sample = lines[:64]
            expected = self._sp.encode(sample, num_threads=1)
            if [len(ids) for ids in expected] != lengths[:len(sample)].tolist() or \
                    tokens[:sum(map(len, expected))].tolist() != [i for ids in expected for i in ids]:
                self._raw_batch = None
                return None
            self._raw_checked = True
        return tokens, lengths


@dataclass(frozen=True)
class EncodeOptions:
    dtype: str  # "uint16" | "int32"
    valid_fraction: float
    split_seed: int
    strict: bool
    text_field: str
    max_line_chars: int
    source_paths: tuple[str, ...]


@dataclass
class SplitPart:
    """The documents of one chunk that belong to one split, as flat arrays."""

    tokens: np.ndarray  # all tokens, in document order
    sequence_lengths: np.ndarray  # int32, one per sequence
    document_sequences: np.ndarray  # int64, sequences per document
    document_tokens: np.ndarray  # int64, tokens per document


@dataclass
class UnitResult:
    """A work unit's chunks encoded, merged in chunk order: what the parent appends in one go."""

    parts: dict[str, SplitPart]
    stats: dict[str, int]
    documents_per_source: dict[int, int]  # documents kept, by source index


def _merge_parts(parts: list[SplitPart]) -> SplitPart:
    if len(parts) == 1:
        return parts[0]
    return SplitPart(*(np.concatenate([getattr(p, f) for p in parts])
                       for f in ("tokens", "sequence_lengths", "document_sequences", "document_tokens")))


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: spreads the bits of ``x`` over all 64 (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def document_in_valid(parsed: ParsedChunk, valid_fraction: float, split_seed: int) -> np.ndarray:
    """Which documents go to the validation split, decided by a hash of the document's text.

    The hash covers the text as tokenized (stripped lines joined by newlines),
    so the split does not depend on the input format or the tokenizer, and
    duplicate documents always land in the same split. CRC-32 (C speed; a
    cryptographic hash here cost 3% of the whole pipeline) mixed with the seed
    by splitmix64 gives values uniform enough for a threshold.
    """
    n_docs = len(parsed.doc_lines)
    if valid_fraction <= 0 or n_docs == 0:
        return np.zeros(n_docs, bool)
    if valid_fraction >= 1:
        return np.ones(n_docs, bool)
    crcs = [zlib.crc32("\n".join(doc).encode("utf-8")) for doc in parsed.documents()]
    seed = np.uint64((split_seed * 0x9E3779B97F4A7C15) % 2**64)
    with np.errstate(over="ignore"):
        values = _mix64(np.asarray(crcs, dtype=np.uint64) ^ seed)
    return values < np.uint64(int(valid_fraction * 2**64))


def encode_chunks(chunks: list[Chunk], encoder: LineEncoder, options: EncodeOptions) -> UnitResult:
    """Encode a work unit's chunks with one tokenizer call and return them merged, in chunk order.

    A corpus of many small files has a chunk per file. Per chunk, a tokenizer batch call has a fixed cost
    (about 0.1 ms measured for sentencepiece) and so has appending in the parent; merged,
    a unit of small chunks costs what one chunk of a large file does. The documents and their order are
    those of encoding chunk by chunk.
    """
    parsed = [parse_chunk(chunk, options.source_paths[chunk.source], options.strict, options.text_field,
                          options.max_line_chars) for chunk in chunks]
    tokens, lengths = encoder([line for p in parsed for line in p.lines])
    line_ends = np.cumsum([len(p.lines) for p in parsed])
    token_ends = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))[line_ends]
    line_starts, token_starts = np.concatenate(([0], line_ends[:-1])), np.concatenate(([0], token_ends[:-1]))
    stats: dict[str, int] = {}
    documents_per_source: dict[int, int] = {}
    parts: dict[str, list[SplitPart]] = {split: [] for split in SPLITS}
    for chunk, p, l0, l1, t0, t1 in zip(chunks, parsed, line_starts, line_ends, token_starts, token_ends):
        chunk_parts, chunk_stats = _split_chunk(chunk, p, tokens[t0:t1], lengths[l0:l1], options)
        for split, part in chunk_parts.items():
            parts[split].append(part)
        for key, value in chunk_stats.items():
            stats[key] = stats.get(key, 0) + value
        kept = sum(len(part.document_sequences) for part in chunk_parts.values())
        documents_per_source[chunk.source] = documents_per_source.get(chunk.source, 0) + kept
    return UnitResult({split: _merge_parts(ps) for split, ps in parts.items()}, stats, documents_per_source)


def _split_chunk(chunk: Chunk, parsed: ParsedChunk, tokens: np.ndarray, lengths: np.ndarray,
                 options: EncodeOptions) -> tuple[dict[str, SplitPart], dict[str, int]]:
    """One chunk's tokens (one run per line) → its documents' parts per split, and its statistics."""
    in_valid = document_in_valid(parsed, options.valid_fraction, options.split_seed)
    doc_lines = np.asarray(parsed.doc_lines, dtype=np.int64)

    # Lines that normalise to nothing (e.g. only zero-width characters) give no
    # sequence; a document left with none is dropped.
    kept = lengths > 0
    empty_sequences = int(len(lengths) - kept.sum())
    doc_of_line = np.repeat(np.arange(len(doc_lines)), doc_lines)
    doc_sequences = np.bincount(doc_of_line[kept], minlength=len(doc_lines)).astype(np.int64)
    nonempty_doc = doc_sequences > 0
    lengths = lengths[kept]

    parts = {}
    line_in_valid = np.repeat(in_valid, doc_lines)[kept]
    for split, want_valid in (("train", False), ("valid", True)):
        seq_mask = line_in_valid == want_valid
        doc_mask = nonempty_doc & (in_valid == want_valid)
        seq_lengths = lengths[seq_mask]
        split_tokens = tokens if seq_mask.all() else tokens[np.repeat(seq_mask, lengths)]
        docs = doc_sequences[doc_mask]
        starts = np.concatenate(([0], np.cumsum(docs)[:-1])) if len(docs) else np.zeros(0, np.int64)
        doc_tokens = (np.add.reduceat(seq_lengths.astype(np.int64), starts) if len(docs)
                      else np.zeros(0, np.int64))
        parts[split] = SplitPart(split_tokens.astype(options.dtype, copy=False), seq_lengths, docs, doc_tokens)

    stats = {
        "documents_read": len(doc_lines) + parsed.empty_documents,
        "empty_documents": parsed.empty_documents + int((~nonempty_doc).sum()),
        "empty_sequences": empty_sequences,
        "invalid_utf8_bytes": parsed.invalid_utf8_bytes,
        "long_lines_split": parsed.long_lines_split,
        "long_documents_split": int(chunk.forced_cut),
    }
    return parts, stats


# Worker-process state, set once by `init_worker` (ProcessPoolExecutor initializer).
_worker: dict = {}


def _die_with_parent(parent_pid: int) -> None:
    """On Linux, have the kernel kill this worker when its parent dies.

    Forked workers share the task pipe with each other, so a parent killed
    with -9 would otherwise leave them blocked forever (holding the output
    directory's lock against the rerun).
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def init_worker(tokenizer_spec: tuple[str, bytes | str], options: EncodeOptions, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _worker["encoder"] = LineEncoder(tokenizer_spec)
    _worker["options"] = options


def encode_in_worker(chunks: list[Chunk]) -> UnitResult:
    return encode_chunks(chunks, _worker["encoder"], _worker["options"])


def chunk_bytes(chunk: Chunk) -> int:
    """How much text a chunk holds (bytes of a file, or characters of dataset records)."""
    return len(chunk.data) if isinstance(chunk.data, bytes) else sum(len(t or "") for t in chunk.data)


def work_units(chunks, unit_bytes: int, max_chunks: int = 256):
    """Consecutive chunks grouped into units of about ``unit_bytes`` of text, one unit per worker task.

    A chunk is whole documents of one source, so a corpus of many small files has as many small chunks;
    sent one by one, the per-task cost (pickling, a pipe round trip, a result to wait for) outweighed
    tokenizing them. Grouped, a task carries about as much text as one chunk of a large file.

    The parent appends a unit as one and checkpoints between units (or inside one, where a shard fills,
    counting the unit's documents written). A resume starts at a unit's first chunk, and grouping depends
    only on the chunks from there on, so it forms the same unit again and the count still applies.
    """
    unit, size = [], 0
    for chunk in chunks:
        unit.append(chunk)
        size += chunk_bytes(chunk)
        if size >= unit_bytes or len(unit) >= max_chunks:
            yield unit
            unit, size = [], 0
    if unit:
        yield unit


def _start_method() -> str:
    """Start workers by fork when this process holds nothing that forking breaks, else by spawn.

    A forked worker starts in milliseconds with the tokenizer already loaded; a
    spawned one re-imports everything (about half a second, 10% of a 60 MB
    run). Forking is unsafe once other Python threads run or libraries with
    their own thread pools are loaded (torch, HF tokenizers), e.g. when the
    trainer or a test suite calls ``shard_corpus``; then spawn.
    """
    unsafe = ("torch", "tokenizers", "transformers")
    if ("fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
            and not any(name in sys.modules for name in unsafe)):
        return "fork"
    return "spawn"


class EncoderPool:
    """``submit(chunks) -> Future`` of their ``UnitResult``, over worker processes (this one if ``workers == 0``)."""

    def __init__(self, workers: int, tokenizer_spec: tuple[str, bytes | str], options: EncodeOptions):
        self.workers, self.spec, self.options = workers, tokenizer_spec, options
        self.executor = None

    def __enter__(self):
        if self.workers == 0:
            encoder = LineEncoder(self.spec, single_thread=False)

            def submit(chunks) -> Future:
                f: Future = Future()
                try:
                    f.set_result(encode_chunks(chunks, encoder, self.options))
                except PreprocessingError as e:
                    f.set_exception(e)
                return f
            return submit
        context = multiprocessing.get_context(_start_method())
        self.executor = ProcessPoolExecutor(self.workers, mp_context=context, initializer=init_worker,
                                            initargs=(self.spec, self.options, os.getpid()))
        return lambda chunks: self.executor.submit(encode_in_worker, chunks)

    def __exit__(self, *exc) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
