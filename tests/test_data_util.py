"""Shard directories for the data tests, written the way preprocessing.shard writes them.

Real text (the standard library's docstrings), a deterministic word -> id map as
the tokenizer, megatron-core's ``IndexedDatasetBuilder`` for the shard files and
a manifest.json with the same fields. Imported by the other ``test_data_*`` files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import torch

from convbert_ds.data.builtin_corpus import iter_documents

SPECIAL_IDS = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_shard_dir(out: Path, splits: dict, num_shards: int = 2, dtype=np.uint16,
                    tokenizer_sha256: str = "tok-a", vocab: int | None = None) -> Path:
    """Write ``out/manifest.json`` and ``out/<split>/shard-NNNNN.{bin,idx}``.

    ``splits`` maps a split name to its documents (lists of sentences of token ids);
    each split's documents are dealt to ``num_shards`` shards in contiguous runs. All
    directories written with the default ``tokenizer_sha256`` and ``vocab`` share a tokenizer.
    """
    # Imported here so processes spawned by the tests start without megatron's slow import.
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    out = Path(out)
    all_docs = [d for docs in splits.values() for d in docs]
    manifest = {"format_version": 1,
                "tokenizer": {"dir": "tokenizer", "sha256": tokenizer_sha256,
                              "vocab_size": vocab or max(vocab_size(corpus()), vocab_size(all_docs)),
                              "special_ids": SPECIAL_IDS},
                "splits": {}}
    for split, docs in splits.items():
        (out / split).mkdir(parents=True, exist_ok=True)
        bounds = np.linspace(0, len(docs), num_shards + 1).astype(int)
        entries = []
        for i in range(num_shards):
            prefix = f"{split}/shard-{i:05d}"
            builder = IndexedDatasetBuilder(str(out / f"{prefix}.bin"), dtype=dtype)
            part = docs[bounds[i]:bounds[i + 1]]
            for doc in part:
                for sentence in doc:
                    builder.add_item(torch.tensor(sentence, dtype=torch.int64))
                builder.end_document()
            builder.finalize(str(out / f"{prefix}.idx"))
            entries.append({"prefix": prefix, "documents": len(part), "sequences": sum(len(d) for d in part),
                            "tokens": sum(len(s) for d in part for s in d), "dtype": np.dtype(dtype).name,
                            "sha256": {"bin": _sha256(out / f"{prefix}.bin"),
                                       "idx": _sha256(out / f"{prefix}.idx")}})
        manifest["splits"][split] = {key: sum(e[key] for e in entries)
                                     for key in ("documents", "sequences", "tokens")} | {"shards": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def test_written_shards_read_back_with_megatron(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = corpus()[:40]
    out = write_shard_dir(tmp_path / "set", {"train": docs}, num_shards=2, dtype=np.int32)
    manifest = json.loads((out / "manifest.json").read_text())
    read = []
    for entry in manifest["splits"]["train"]["shards"]:
        ds = IndexedDataset(str(out / entry["prefix"]))
        assert ds.index.dtype == np.int32
        bounds = ds.document_indices
        read += [tuple(tuple(ds[j].tolist()) for j in range(bounds[k], bounds[k + 1]))
                 for k in range(len(bounds) - 1)]
    assert read == list(docs)
    assert manifest["splits"]["train"]["documents"] == len(docs)
