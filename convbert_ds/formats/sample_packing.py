"""How token shards become samples: the sample index's maths, pure numpy (no I/O).

``convbert_ds.data.packing`` (one piece of one document per sample) and ``convbert_ds.data.cross_document``
(several documents per sample) build their on-disk indexes with these functions and document the
formats; ``preprocessing.inspect`` counts with them what a sequence length would waste on padding.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

SAMPLE_DTYPE = np.dtype([("shard", "<i4"), ("start", "<i8"), ("len_a", "<i4"), ("len_b", "<i4")])
START_DTYPE = np.dtype([("chunk", "<i8"), ("skip", "<i4")])
BLOCK_SEQUENCES = 1 << 20  # sentences per block of an index build: bounded memory
FRAMING_TOKENS = 3  # [CLS] A [SEP] B [SEP]
MIN_SEQ_LEN = 8  # shortest sample length (data.seq_len)


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


def document_blocks(document_indices: np.ndarray, block: int = BLOCK_SEQUENCES) -> Iterator[tuple[int, int]]:
    """``(first, last)`` document numbers of consecutive blocks of about ``block`` sentences (at least one
    document each); ``document_indices`` is megatron's: each document's first sentence, then the end."""
    d0, n_docs = 0, len(document_indices) - 1
    while d0 < n_docs:
        d1 = int(np.searchsorted(document_indices, document_indices[d0] + block, side="right")) - 1
        d1 = min(max(d1, d0 + 1), n_docs)
        yield d0, d1
        d0 = d1


def framed_lengths(records: np.ndarray) -> np.ndarray:
    """Tokens of each ``SAMPLE_DTYPE`` record once framed as ``[CLS] A [SEP] B [SEP]``."""
    return records["len_a"].astype(np.int64) + records["len_b"] + FRAMING_TOKENS


def sample_starts(chunks: np.ndarray, seq_len: int, block: int = BLOCK_SEQUENCES) -> Iterator[np.ndarray]:
    """Yield, block by block, the ``START_DTYPE`` records ``(chunk, skip)`` of the samples that start in each
    block of ``chunks`` (``SAMPLE_DTYPE`` records, maybe a large memmap), their framed tokens laid end to end
    and cut every ``seq_len`` positions."""
    before = 0  # framed positions of the chunks before this block
    for first in range(0, len(chunks), block):
        lengths = framed_lengths(chunks[first:first + block])
        ends = before + np.cumsum(lengths)
        # Samples whose first position falls in this block: k * seq_len in [before, ends[-1]).
        k = np.arange(-(-before // seq_len), -(-int(ends[-1]) // seq_len), dtype=np.int64)
        at = k * seq_len
        chunk = np.searchsorted(ends, at, side="right")  # the chunk holding position `at`
        records = np.empty(len(k), dtype=START_DTYPE)
        records["chunk"] = first + chunk
        records["skip"] = at - (ends[chunk] - lengths[chunk])
        yield records
        before = int(ends[-1])
