"""Samples that hold several documents, so that no compute goes to padding (``data.pack_documents``).

How the samples are cut (decided once, when the index is built):

1. The chunks of ``PackedDataset`` (``packing.py``: each one ``[CLS] A [SEP] B [SEP]``, inside one document,
   at most ``seq_len`` tokens) are laid end to end in corpus order, framed.
2. Sample ``k`` is positions ``[k * seq_len, (k + 1) * seq_len)`` of that stream. A chunk that a sample
   boundary cuts goes on as the next sample's first piece (the rest of its tokens, without a ``[CLS]``);
   only the split's last sample is padded. A piece of a chunk is what the model sees as one document.
3. Each sample carries ``document_ids``: 1, 2, ... per piece, 0 on padding. The model keeps the pieces
   apart (``ConvBertModel.forward``): attention stays inside a piece, both convolutions restart at each
   boundary, and position ids restart at 0, so a piece is computed exactly as if it were alone. That is
   also how fine-tuning and transformers see a sequence (one ``[CLS] A [SEP] B [SEP]`` from position 0),
   so checkpoints convert unchanged.

The framing matters where ELECTRA's recipe and fine-tuning meet: ``[CLS]`` starts each chunk, ``[SEP]``
ends A and B, and B has token type 1, so sentence-pair inputs look at fine-tuning as they did in
pretraining. The stream keeps corpus order (neighbouring documents share samples); the sampler shuffles
the samples.

On disk (``SHARD_DIR/index_cache/<split>-seq<L>-seed<S>-<key>.documents``, ``index_cache.py``'s format):
one ``START_DTYPE`` record per sample (``convbert_ds/formats/sample_packing.py``), ``(chunk, skip)``: the sample starts ``skip`` positions into framed
chunk ``chunk`` of the chunk index. O(samples), built in blocks of the chunk index (bounded memory) with
numpy, and a function of the chunk index alone, so a resumed run reads the same samples.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from convbert_ds.data.index_cache import MappedRecords, RecordWriter, load_or_build
from convbert_ds.data.packing import PackedDataset, framed_token_count
from convbert_ds.data.shards import ShardSplit
from convbert_ds.formats.sample_packing import START_DTYPE, sample_starts


class CrossDocumentDataset(MappedRecords, torch.utils.data.Dataset):
    """Full samples cut from the stream of ``chunks``' framed samples (module docstring).

    Item ``i`` is ``PackedDataset``'s dict plus ``document_ids`` (int64 ``[seq_len]``: 1, 2, ... per piece,
    0 on padding); ``attention_mask`` is ``document_ids > 0``.
    """

    def __init__(self, source: str | os.PathLike | ShardSplit, split: str = "train", seq_len: int = 128,
                 seed: int = 1234, cache_dir: str | os.PathLike | None = None, progress: bool = True):
        self.chunks = PackedDataset(source, split, seq_len, seed, cache_dir, progress)
        self.source, self.seq_len, self.seed = self.chunks.source, self.chunks.seq_len, self.chunks.seed
        self.pad_id = self.chunks.pad_id
        self.key = self.chunks.key + "/documents"  # blends of these are keyed on it
        path = self.chunks.index_path.with_suffix(".documents")
        self._attach(load_or_build(path, self.key, START_DTYPE, self._build))

    def _build(self, writer: RecordWriter) -> dict:
        records = self.chunks.samples
        for block in sample_starts(records, self.seq_len):
            writer.append(block)
        return {"chunks": len(records), "seq_len": self.seq_len}

    def real_token_fraction(self) -> float:
        """Tokens that are not padding, over ``seq_len x len(self)``."""
        return framed_token_count(self.chunks.samples) / (self.seq_len * len(self))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        chunk, skip = self._records[int(i) % len(self)].tolist()
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        token_type_ids = np.zeros(self.seq_len, dtype=np.int64)
        document_ids = np.zeros(self.seq_len, dtype=np.int64)
        filled, document = 0, 0
        while filled < self.seq_len and chunk < len(self.chunks):
            ids, types = self.chunks.framed(chunk)
            piece = slice(skip, skip + self.seq_len - filled)
            n = len(ids[piece])
            input_ids[filled:filled + n], token_type_ids[filled:filled + n] = ids[piece], types[piece]
            document += 1
            document_ids[filled:filled + n] = document
            filled, skip, chunk = filled + n, 0, chunk + 1
        return {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.from_numpy(token_type_ids),
                "attention_mask": torch.from_numpy((document_ids > 0).astype(np.int64)),
                "document_ids": torch.from_numpy(document_ids)}

