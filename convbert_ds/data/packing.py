"""Packing token shards into fixed-length ``[CLS] A [SEP] B [SEP]`` samples (BERT / ELECTRA style).

How a document becomes samples (decided once, when the index is built):

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
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from convbert_ds.config import ConfigError
from convbert_ds.data.index_cache import MappedRecords, RecordWriter, load_or_build
from convbert_ds.data.shards import CACHE_SUBDIR, ShardSplit, open_split
from convbert_ds.formats.shard_manifest import ShardManifestError

logger = logging.getLogger(__name__)

INDEX_FORMAT_VERSION = 1
MIN_SEQ_LEN = 8
SAMPLE_DTYPE = np.dtype([("shard", "<i4"), ("start", "<i8"), ("len_a", "<i4"), ("len_b", "<i4")])
_BLOCK_SEQUENCES = 1 << 20


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _uniform(seed: int, shard: int, positions: np.ndarray) -> np.ndarray:
    """Deterministic uniforms in [0, 1), one per position; independent of how the build is blocked."""
    salt = _splitmix64(_splitmix64(np.array([seed], dtype=np.uint64)) ^ np.uint64(shard))
    return (_splitmix64(positions.astype(np.uint64) ^ salt) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def pack_documents(seq_lengths: np.ndarray, seq_starts: np.ndarray, doc_bounds: np.ndarray,
                   seq_len: int, seed: int, shard: int) -> np.ndarray:
    """Pack whole documents into sample records (``SAMPLE_DTYPE``), in corpus order.

    Args:
        seq_lengths: tokens per sentence.
        seq_starts: token offset of each sentence in the shard's ``.bin``.
        doc_bounds: sentence index where each document starts, plus the end (len = docs + 1).
        seq_len, seed, shard: as for the dataset; ``shard`` is stored and salts the split RNG.
    """
    budget = seq_len - 3
    seq_lengths = np.asarray(seq_lengths, dtype=np.int64)
    seq_doc = np.repeat(np.arange(len(doc_bounds) - 1), np.diff(doc_bounds))

    # 1. Units: sentences, with the ones over budget cut into budget-sized pieces; empty ones vanish.
    pieces = -(-seq_lengths // budget)
    unit_seq = np.repeat(np.arange(len(seq_lengths)), pieces)
    piece_no = np.arange(len(unit_seq)) - (np.cumsum(pieces) - pieces)[unit_seq]
    unit_start = seq_starts[unit_seq] + piece_no * budget
    unit_len = np.minimum(budget, seq_lengths[unit_seq] - piece_no * budget)
    unit_doc = seq_doc[unit_seq]
    if len(unit_seq) == 0:
        return np.empty(0, dtype=SAMPLE_DTYPE)
    cum = np.concatenate([[0], np.cumsum(unit_len)])  # tokens before unit i (within the block)
    doc_units = np.searchsorted(unit_doc, np.arange(len(doc_bounds)))  # first unit of each document

    # 2. Greedy chunks: a chunk starting at unit i ends before the furthest unit
    # boundary within budget, never past its document's end. Chunk starts are the
    # orbit of each document's first unit under `nxt`, followed for all documents at once.
    nxt = np.searchsorted(cum, cum[:-1] + budget, side="right") - 1
    nxt = np.minimum(nxt, doc_units[unit_doc + 1])
    nonempty = doc_units[:-1] < doc_units[1:]
    cur, end = doc_units[:-1][nonempty], doc_units[1:][nonempty]
    starts = []
    while len(cur):
        starts.append(cur)
        cur = nxt[cur]
        keep = cur < end
        cur, end = cur[keep], end[keep]
    first = np.sort(np.concatenate(starts))
    last = nxt[first]  # one past the chunk's last unit
    n_tok = cum[last] - cum[first]
    n_units_in = last - first

    # 3. Split into A | B: at an inner unit boundary, or inside a lone unit.
    u = _uniform(seed, shard, unit_start[first])
    boundary = first + 1 + np.minimum((u * (n_units_in - 1)).astype(np.int64), np.maximum(n_units_in - 2, 0))
    len_a_multi = cum[boundary] - cum[first]
    len_a_single = np.where(n_tok >= 2, 1 + np.minimum((u * (n_tok - 1)).astype(np.int64), n_tok - 2), n_tok)
    len_a = np.where(n_units_in >= 2, len_a_multi, len_a_single)

    records = np.empty(len(first), dtype=SAMPLE_DTYPE)
    records["shard"] = shard
    records["start"] = unit_start[first]
    records["len_a"] = len_a
    records["len_b"] = n_tok - len_a
    return records


def _pack_shard(split: ShardSplit, shard_no: int, seq_len: int, seed: int, writer: RecordWriter, bar) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # slow import: only when building

    shard = split.shards[shard_no]
    ds = IndexedDataset(str(shard.prefix), mmap=False)  # index only; megatron cannot mmap an empty .bin
    index = ds.index
    docs, lengths, pointers = index.document_indices, index.sequence_lengths, index.sequence_pointers
    found = (len(docs) - 1, len(lengths), int(lengths.sum(dtype=np.int64)), np.dtype(index.dtype))
    listed = (shard.documents, shard.sequences, shard.tokens, shard.dtype)
    if found != listed:
        raise ShardManifestError(f"{shard.idx_path}: holds (documents, sequences, tokens, dtype) = {found} but the "
                         f"manifest lists {listed}; re-run python -m preprocessing.shard")
    d0, n_docs, token_cursor = 0, len(docs) - 1, 0
    while d0 < n_docs:
        d1 = int(np.searchsorted(docs, docs[d0] + _BLOCK_SEQUENCES, side="right")) - 1
        d1 = min(max(d1, d0 + 1), n_docs)
        lo, hi = int(docs[d0]), int(docs[d1])
        block_lengths = np.array(lengths[lo:hi], dtype=np.int64)
        starts = token_cursor + np.concatenate([[0], np.cumsum(block_lengths)[:-1]])
        if not np.array_equal(pointers[lo:hi], starts * shard.dtype.itemsize):
            raise ShardManifestError(f"{shard.idx_path}: sequences are not stored back to back in the .bin; "
                             f"re-write the shard with megatron's IndexedDatasetBuilder")
        writer.append(pack_documents(block_lengths, starts, np.asarray(docs[d0:d1 + 1]) - lo, seq_len, seed, shard_no))
        token_cursor += int(block_lengths.sum())
        bar.update(hi - lo)
        d0 = d1


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
            raise ConfigError(f"{self.source.shard_dir}: split {self.source.split!r} packs into no samples")

    def _build(self, writer: RecordWriter, progress: bool) -> dict:
        t0 = time.time()
        total = sum(s.sequences for s in self.source.shards)
        desc = f"packing {self.source.shard_dir.name}/{self.source.split} (seq_len {self.seq_len})"
        with tqdm(total=total, desc=desc, unit="sent", unit_scale=True, disable=not progress) as bar:
            for shard_no in range(len(self.source.shards)):
                _pack_shard(self.source, shard_no, self.seq_len, self.seed, writer, bar)
        logger.info("built %s sample index: %d samples from %d sentences in %.1fs",
                    self.source.shard_dir / self.source.split, writer.count, total, time.time() - t0)
        return {"shard_dir": str(self.source.shard_dir), "split": self.source.split, "seq_len": self.seq_len}

    @property
    def samples(self) -> np.ndarray:
        """The packed index: one ``SAMPLE_DTYPE`` record (shard, start, len_a, len_b) per sample."""
        return self._records

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_bins": None}  # the receiving process maps the shards again

    def _shard_tokens(self, shard: int) -> np.ndarray:
        if self._bins is None:
            self._bins = [np.memmap(s.bin_path, dtype=s.dtype, mode="r") if s.tokens else np.empty(0, s.dtype)
                          for s in self.source.shards]
        return self._bins[shard]

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Segments A and B of sample ``i`` as token arrays (no special tokens)."""
        shard, start, len_a, len_b = self._records[i].tolist()
        chunk = self._shard_tokens(shard)[start:start + len_a + len_b]
        return chunk[:len_a], chunk[len_a:]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        a, b = self.tokens(int(i) % len(self))
        # Filled in place: this runs for every sample the loader yields, so no temporary arrays.
        n_a, n_b = len(a), len(b)
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        input_ids[0] = self.cls_id
        input_ids[1:1 + n_a] = a
        input_ids[1 + n_a] = self.sep_id
        input_ids[2 + n_a:2 + n_a + n_b] = b
        input_ids[2 + n_a + n_b] = self.sep_id
        token_type_ids = np.zeros(self.seq_len, dtype=np.int64)
        token_type_ids[2 + n_a:3 + n_a + n_b] = 1
        attention_mask = np.zeros(self.seq_len, dtype=np.int64)
        attention_mask[:3 + n_a + n_b] = 1
        return {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.from_numpy(token_type_ids),
                "attention_mask": torch.from_numpy(attention_mask)}
