"""Shard directories for tests: the one factory (``write_shard_dir``) and the one reader of their documents.

``write_shard_dir`` writes real text (the standard library's docstrings) with a deterministic
word -> id map as the tokenizer, megatron-core's ``IndexedDatasetBuilder`` for the shard files and the
manifest through ``convbert_ds.formats.shard_manifest.write_manifest``, the writer preprocessing uses.
Shard directories made by the real preprocessing come from the ``sharded`` and ``tiny_corpus`` fixtures.
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from convbert_ds.builtin.stdlib_docstrings import iter_documents
from convbert_ds.fsutil import file_sha256
from convbert_ds.formats.shard_manifest import (
    SHARD_FILES, read_manifest, shard_prefix, split_entry, write_manifest)

SPECIAL_IDS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _megatron_indexed_dataset():
    # Imported on use: processes spawned by the tests start without megatron's slow import.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


@functools.lru_cache(maxsize=None)
def corpus(max_bytes: int = 200_000) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Documents as tuples of sentences as tuples of token ids (words, first seen = smallest id)."""
    vocab: dict[str, int] = {}
    docs = []
    for paragraphs in iter_documents(max_bytes):
        sentences = [s for p in paragraphs for s in _SENTENCE_END.split(p) if s]
        docs.append(tuple(tuple(vocab.setdefault(w, len(SPECIAL_IDS) + len(vocab)) for w in s.split())
                          for s in sentences))
    return tuple(docs)


def vocab_size(docs) -> int:
    return 1 + max((t for d in docs for s in d for t in s), default=0)


def write_shard_dir(out: Path, splits: dict, num_shards: int = 2, dtype=np.uint16,
                    tokenizer_sha256: str = "tok-a", vocab: int | None = None) -> Path:
    """Write ``out/manifest.json`` and ``out/<split>/shard-NNNNN.{bin,idx}``.

    ``splits`` maps a split name to its documents (lists of sentences of token ids);
    each split's documents are dealt to ``num_shards`` shards in contiguous runs. All
    directories written with the default ``tokenizer_sha256`` and ``vocab`` share a tokenizer.
    """
    builder_class = _megatron_indexed_dataset().IndexedDatasetBuilder
    out = Path(out)
    all_docs = [d for docs in splits.values() for d in docs]
    tokenizer = {"dir": "tokenizer", "sha256": tokenizer_sha256, "special_ids": SPECIAL_IDS,
                 "vocab_size": vocab or max(vocab_size(corpus()), vocab_size(all_docs))}
    entries = {}
    for split, docs in splits.items():
        (out / split).mkdir(parents=True, exist_ok=True)
        bounds = np.linspace(0, len(docs), num_shards + 1).astype(int)
        entries[split] = []
        for i in range(num_shards):
            prefix = shard_prefix(split, i)
            builder = builder_class(str(out / f"{prefix}.bin"), dtype=dtype)
            part = docs[bounds[i]:bounds[i + 1]]
            for doc in part:
                for sentence in doc:
                    builder.add_item(torch.tensor(sentence, dtype=torch.int64))
                builder.end_document()
            builder.finalize(str(out / f"{prefix}.idx"))
            paths = {ext: out / f"{prefix}.{ext}" for ext in SHARD_FILES}
            entries[split].append({"prefix": prefix, "documents": len(part), "sequences": sum(map(len, part)),
                                   "tokens": sum(len(s) for d in part for s in d), "dtype": np.dtype(dtype).name,
                                   "sha256": {ext: file_sha256(p) for ext, p in paths.items()},
                                   "bytes": {ext: p.stat().st_size for ext, p in paths.items()}})
    write_manifest(out, {"tokenizer": tokenizer, "dtype": np.dtype(dtype).name,
                         "splits": {split: split_entry(shards) for split, shards in entries.items()}})
    return out


def read_split_documents(shard_dir: Path, split: str) -> list[list[list[int]]]:
    """Every document of a split, in order, as lists of token-id lists, read with megatron-core."""
    indexed_dataset = _megatron_indexed_dataset()
    docs = []
    for shard in read_manifest(shard_dir, verify=False)["splits"][split]["shards"]:
        ds = indexed_dataset.IndexedDataset(str(Path(shard_dir) / shard["prefix"]))
        bounds = ds.document_indices
        for d in range(len(bounds) - 1):
            docs.append([ds[i].tolist() for i in range(bounds[d], bounds[d + 1])])
    return docs


def read_text_documents(path: Path) -> list[list[str]]:
    """The documents of a plain-text corpus file, parsed independently of the package."""
    text = path.read_text(encoding="utf-8")
    docs, current = [], []
    for line in text.split("\n"):
        if line.strip():
            current.append(line.strip())
        elif current:
            docs.append(current)
            current = []
    if current:
        docs.append(current)
    return docs
