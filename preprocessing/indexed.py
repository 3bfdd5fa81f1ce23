"""Writing megatron-core ``IndexedDataset`` shards (.bin/.idx) with bounded memory.

The files are byte-for-byte what ``megatron.core.datasets.indexed_dataset.
IndexedDatasetBuilder`` writes (tests compare them), but the builder keeps
every sequence length in Python lists and builds the pointer table in a
Python loop at ``finalize`` — the out-of-memory at finalize Megatron users know.
Here lengths and document ends go to append-only side files and the index is
streamed from them in blocks, so memory does not grow with the shard. The
append-only files also make a shard resumable: truncate them to the sizes in
the last checkpoint and go on appending.

Layout of ``.idx`` (little-endian): b"MMIDIDX\\x00\\x00", u64 version = 1,
u8 dtype code, u64 sequence count, u64 document count + 1, int32 lengths,
int64 byte pointers, int64 document ends (starting with 0).

This module does not import torch or megatron; readers do.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from convbert_ds.fsutil import file_sha256

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
_BLOCK = 1 << 20  # entries per block when streaming the index


class ShardWriter:
    """Appends documents to one shard, under temporary names until ``finish`` + ``commit``.

    Files while open: ``PREFIX.bin.tmp`` (tokens), ``PREFIX.lens.tmp`` (int32 per
    sequence), ``PREFIX.docs.tmp`` (int64 end of each document, in sequences).
    """

    def __init__(self, prefix: Path, dtype: str, resume: dict | None = None):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self.paths = {ext: Path(f"{prefix}.{ext}.tmp") for ext in ("bin", "lens", "docs")}
        self.documents = self.sequences = self.tokens = 0
        if resume is not None:
            self.documents, self.sequences, self.tokens = resume["documents"], resume["sequences"], resume["tokens"]
            sizes = {"bin": self.tokens * self.dtype.itemsize, "lens": self.sequences * 4, "docs": self.documents * 8}
            for ext, size in sizes.items():
                if not self.paths[ext].is_file() or self.paths[ext].stat().st_size < size:
                    raise FileNotFoundError(f"{self.paths[ext]} is missing or shorter than its checkpoint")
                os.truncate(self.paths[ext], size)
        self._files = {ext: open(path, "wb" if resume is None else "ab") for ext, path in self.paths.items()}

    def add(self, tokens: np.ndarray, sequence_lengths: np.ndarray, document_sequences: np.ndarray) -> None:
        """Append whole documents: flat tokens, their sequence lengths, sequences per document."""
        self._files["bin"].write(np.ascontiguousarray(tokens, dtype=self.dtype).data)
        self._files["lens"].write(np.ascontiguousarray(sequence_lengths, dtype=np.int32).data)
        ends = self.sequences + np.cumsum(document_sequences, dtype=np.int64)
        self._files["docs"].write(ends.data)
        self.documents += len(document_sequences)
        self.sequences += len(sequence_lengths)
        self.tokens += int(tokens.size)

    def state(self) -> dict:
        return {"documents": self.documents, "sequences": self.sequences, "tokens": self.tokens}

    def sync(self) -> None:
        """Make everything appended so far durable (before a checkpoint names its sizes)."""
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def finish(self) -> dict:
        """Write ``PREFIX.idx.tmp``; return the shard's counts, dtype and file hashes."""
        self.sync()
        self.close()
        idx_tmp = Path(f"{self.prefix}.idx.tmp")
        idx_hash = _write_index(idx_tmp, self.dtype, self.paths["lens"], self.paths["docs"],
                                self.sequences, self.documents)
        return {**self.state(), "dtype": self.dtype.name,
                "sha256": {"bin": file_sha256(self.paths["bin"]), "idx": idx_hash},
                "bytes": {"bin": self.paths["bin"].stat().st_size, "idx": idx_tmp.stat().st_size}}

    def discard(self) -> None:
        self.close()
        for path in self.paths.values():
            path.unlink(missing_ok=True)


def commit_shard(prefix: Path) -> None:
    """Give a finished shard its final names (.bin/.idx) and drop the side files."""
    for ext in ("bin", "idx"):
        tmp = Path(f"{prefix}.{ext}.tmp")
        if tmp.exists():
            os.replace(tmp, f"{prefix}.{ext}")
    for ext in ("lens", "docs"):
        Path(f"{prefix}.{ext}.tmp").unlink(missing_ok=True)


def _write_index(path: Path, dtype: np.dtype, lens_path: Path, docs_path: Path, sequences: int,
                 documents: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as out:
        def write(data) -> None:
            out.write(data)
            h.update(data)

        write(INDEX_HEADER)
        write(struct.pack("<QBQQ", INDEX_VERSION, DTYPE_CODES[dtype.name], sequences, documents + 1))
        with open(lens_path, "rb") as f:
            while block := f.read(_BLOCK * 4):
                write(block)
        pointer = 0
        with open(lens_path, "rb") as f:
            while block := f.read(_BLOCK * 4):
                lengths = np.frombuffer(block, np.int32).astype(np.int64) * dtype.itemsize
                ends = np.cumsum(lengths) + pointer
                starts = np.concatenate(([pointer], ends[:-1]))
                pointer = int(ends[-1])
                write(starts.astype(np.int64).data)
        write(np.zeros(1, np.int64).data)
        with open(docs_path, "rb") as f:
            while block := f.read(_BLOCK * 8):
                write(block)
        out.flush()
        os.fsync(out.fileno())
    return h.hexdigest()
