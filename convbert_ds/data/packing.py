"""Packing token shards into fixed-length ``[CLS] A [SEP] B [SEP]`` samples (BERT / ELECTRA style).

How a document becomes samples (decided once, when the index is built; the maths is
``convbert_ds/formats/sample_packing.py``, which ``preprocessing.inspect`` also uses):

1. Each sentence (one shard sequence) longer than ``budget = seq_len - 3`` is cut
   into pieces of ``budget`` tokens (the last piece shorter); no token is dropped.
2. Walking the document, sentences/pieces are accumulated greedily while the
   total stays within ``budget``; a full chunk becomes one sample. Samples never
   cross documents.
3. Each chunk is split into A and B at one of its inner sentence boundaries,
   chosen uniformly by a hash of (seed, shard, chunk position); a chunk of a
   single sentence/piece is split inside it (a one-token chunk leaves B empty).

Sequences of a megatron IndexedDataset lie back to back in the ``.bin`` file
(checked while building), so a chunk is one contiguous token range and a sample
is stored as four numbers: shard, first token, len(A), len(B). ``__getitem__``
reads that range from a memory map: O(seq_len), no Python loop over the corpus.

The index build is vectorised with numpy over blocks of about a million
sentences (bounded memory); the only Python loop runs once per chunk *rank*
within a document (the longest document's sample count), over all documents of
the block at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from convbert_ds.config import ConfigError
from convbert_ds.data.index_cache import MappedRecords, RecordWriter, load_or_build
from convbert_ds.data.remote_shards import RemoteTokens
from convbert_ds.data.shards import CACHE_SUBDIR, ShardSplit, open_split
from convbert_ds.formats.sample_packing import (MIN_SEQ_LEN, SAMPLE_DTYPE, document_blocks, framed_lengths,
                                                pack_documents)
from convbert_ds.formats.shard_manifest import ShardManifestError
from convbert_ds.log import get_logger

logger = get_logger(__name__)

INDEX_FORMAT_VERSION = 1


def _pack_shard(split: ShardSplit, shard_no: int, seq_len: int, seed: int, writer: RecordWriter, bar) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # slow import: only when building

    shard = split.shards[shard_no]
    # The index only (megatron cannot mmap an empty .bin). A store's .bin is not on this disk: fast_cache_load
    # skips megatron's check that it is (the counts are checked against the manifest just below).
    ds = IndexedDataset(str(shard.prefix), mmap=False, fast_cache_load=shard.remote is not None)
    index = ds.index
    docs, lengths, pointers = index.document_indices, index.sequence_lengths, index.sequence_pointers
    found = (len(docs) - 1, len(lengths), int(lengths.sum(dtype=np.int64)), np.dtype(index.dtype))
    listed = (shard.documents, shard.sequences, shard.tokens, shard.dtype)
    if found != listed:
        raise ShardManifestError(f"{shard.idx_path}: holds (documents, sequences, tokens, dtype) = {found} but the "
                         f"manifest lists {listed}; re-run python -m preprocessing.shard")
    token_cursor = 0
    for d0, d1 in document_blocks(docs):
        lo, hi = int(docs[d0]), int(docs[d1])
        block_lengths = np.array(lengths[lo:hi], dtype=np.int64)
        starts = token_cursor + np.concatenate([[0], np.cumsum(block_lengths)[:-1]])
        if not np.array_equal(pointers[lo:hi], starts * shard.dtype.itemsize):
            raise ShardManifestError(f"{shard.idx_path}: sequences are not stored back to back in the .bin; "
                             f"re-write the shard with megatron's IndexedDatasetBuilder")
        writer.append(pack_documents(block_lengths, starts, np.asarray(docs[d0:d1 + 1]) - lo, seq_len, seed, shard_no))
        token_cursor += int(block_lengths.sum())
        bar.update(hi - lo)


def sample_index_key(split: ShardSplit, seq_len: int, seed: int) -> str:
    identity = {"format": INDEX_FORMAT_VERSION, "split": split.split, "seq_len": seq_len, "seed": seed,
                "shards": [s.identity() for s in split.shards]}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, (int, np.integer)) or seq_len < MIN_SEQ_LEN:
        raise ConfigError(f"data.seq_len must be an integer >= {MIN_SEQ_LEN} (got {seq_len!r}); "
                         f"128 or 512 are the usual values")


class PackedDataset(MappedRecords, torch.utils.data.Dataset):
    """Fixed-length BERT samples packed from one shard directory's split.

    Item ``i`` is a dict of int64 tensors of length ``seq_len``: ``input_ids``
    (``[CLS] A [SEP] B [SEP]`` then pad), ``token_type_ids`` (0 through the first
    ``[SEP]``, 1 for B and its ``[SEP]``, 0 on padding) and ``attention_mask``.
    The sample index is cached in ``cache_dir`` (default ``SHARD_DIR/index_cache``).
    """

    def __init__(self, source: str | os.PathLike | ShardSplit, split: str = "train", seq_len: int = 128,
                 seed: int = 1234, cache_dir: str | os.PathLike | None = None, progress: bool = True):
        check_seq_len(seq_len)
        if seed < 0:
            raise ConfigError(f"data seed must be >= 0 (got {seed})")
        self.source = source if isinstance(source, ShardSplit) else open_split(source, split)
        self.seq_len, self.seed = int(seq_len), int(seed)
        ids = self.source.special_ids
        self.pad_id, self.cls_id, self.sep_id = int(ids["pad"]), int(ids["cls"]), int(ids["sep"])
        self.key = sample_index_key(self.source, self.seq_len, self.seed)
        cache_dir = Path(cache_dir) if cache_dir is not None else self.source.shard_dir / CACHE_SUBDIR
        path = cache_dir / f"{self.source.split}-seq{self.seq_len}-seed{self.seed}-{self.key[:16]}.samples"
        self._attach(load_or_build(path, self.key, SAMPLE_DTYPE, lambda writer: self._build(writer, progress)))
        self._bins: list[np.ndarray] | None = None
        if len(self) == 0:
            raise ConfigError(f"{self.source.origin}: split {self.source.split!r} packs into no samples")

    def _build(self, writer: RecordWriter, progress: bool) -> dict:
        t0 = time.time()
        total = sum(s.sequences for s in self.source.shards)
        desc = f"packing {Path(self.source.origin).name}/{self.source.split} (seq_len {self.seq_len})"
        with tqdm(total=total, desc=desc, unit="sent", unit_scale=True, disable=not progress) as bar:
            for shard_no in range(len(self.source.shards)):
                _pack_shard(self.source, shard_no, self.seq_len, self.seed, writer, bar)
        logger.info("built %s/%s sample index: %d samples from %d sentences in %.1fs",
                    self.source.origin, self.source.split, writer.count, total, time.time() - t0)
        return {"shard_dir": str(self.source.shard_dir), "split": self.source.split, "seq_len": self.seq_len}

    @property
    def samples(self) -> np.ndarray:
        """The packed index: one ``SAMPLE_DTYPE`` record (shard, start, len_a, len_b) per sample."""
        return self._records

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_bins": None}  # the receiving process maps the shards again

    def _shard_tokens(self, shard: int) -> np.ndarray:
        if self._bins is None:
            self._bins = [np.empty(0, s.dtype) if not s.tokens else
                          RemoteTokens(s.remote, s.dtype, s.tokens * s.dtype.itemsize, s.sha256["bin"]) if s.remote
                          else np.memmap(s.bin_path, dtype=s.dtype, mode="r") for s in self.source.shards]
        return self._bins[shard]

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Segments A and B of sample ``i`` as token arrays (no special tokens)."""
        shard, start, len_a, len_b = self._records[i].tolist()
        chunk = self._shard_tokens(shard)[start:start + len_a + len_b]
        return chunk[:len_a], chunk[len_a:]

    def framed(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``i`` as ``[CLS] A [SEP] B [SEP]`` token ids and their token types (0 through the first
        ``[SEP]``, 1 for B and its ``[SEP]``), unpadded: ``len_a + len_b + 3`` of each."""
        a, b = self.tokens(i)
        input_ids = np.concatenate(([self.cls_id], a, [self.sep_id], b, [self.sep_id]), dtype=np.int64)
        token_type_ids = np.zeros(len(input_ids), dtype=np.int64)
        token_type_ids[2 + len(a):] = 1
        return input_ids, token_type_ids

    def real_token_fraction(self) -> float:
        """Tokens that are not padding, over ``seq_len x len(self)`` (read in blocks: bounded memory)."""
        return framed_token_count(self._records) / (self.seq_len * len(self))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        ids, types = self.framed(int(i) % len(self))
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        input_ids[:len(ids)] = ids
        token_type_ids = np.zeros(self.seq_len, dtype=np.int64)
        token_type_ids[:len(ids)] = types
        attention_mask = np.zeros(self.seq_len, dtype=np.int64)
        attention_mask[:len(ids)] = 1
        return {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.from_numpy(token_type_ids),
                "attention_mask": torch.from_numpy(attention_mask)}


def framed_token_count(records: np.ndarray, block: int = 1 << 20) -> int:
    """Sum of ``len_a + len_b + 3`` over ``records`` (a memmap, maybe large), a block at a time."""
    return sum(int(framed_lengths(records[i:i + block]).sum()) for i in range(0, len(records), block))
