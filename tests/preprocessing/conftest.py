"""The preprocessing tests' inputs, built once per session: a real-text corpus, its variants (compressed,
JSONL, Parquet, Arrow), a tokenizer trained on it and its shards."""

from __future__ import annotations

import bz2
import gzip
import json
from pathlib import Path

import pytest

from convbert_ds.builtin.stdlib_docstrings import write_corpus
from preprocessing.shard import shard_corpus
from preprocessing.tokenizer import train_tokenizer
from shard_factory import read_text_documents

CORPUS_BYTES = 250_000


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("preprocessing_data")


@pytest.fixture(scope="session")
def corpus(data_dir) -> Path:
    """About 250 kB of Python-stdlib docstrings: one paragraph per line, blank line between documents."""
    return write_corpus(data_dir / "corpus.txt", max_bytes=CORPUS_BYTES)


@pytest.fixture(scope="session")
def corpus_documents(corpus) -> list[list[str]]:
    return read_text_documents(corpus)


@pytest.fixture(scope="session")
def corpus_variants(data_dir, corpus, corpus_documents) -> dict[str, Path]:
    """The same documents as gz/bz2/zst text, JSONL (plain, gz, zst), a JSON array, Parquet and an Arrow dir."""

    def build():
        import datasets
        import pyarrow as pa
        import pyarrow.parquet as pq
        import zstandard

        raw = corpus.read_bytes()
        texts = ["\n".join(doc) for doc in corpus_documents]
        jsonl = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)).encode()
        out = {"txt": corpus}
        files = {"txt.gz": gzip.compress(raw), "txt.bz2": bz2.compress(raw),
                 "txt.zst": zstandard.ZstdCompressor().compress(raw), "jsonl": jsonl,
                 "jsonl.gz": gzip.compress(jsonl), "jsonl.zst": zstandard.ZstdCompressor().compress(jsonl),
                 "json": json.dumps([{"text": t} for t in texts]).encode()}
        for ext, data in files.items():
            path = data_dir / f"variant.{ext}"
            path.write_bytes(data)
            out[ext] = path
        pq.write_table(pa.table({"text": texts}), data_dir / "variant.parquet", row_group_size=300)
        out["parquet"] = data_dir / "variant.parquet"
        datasets.disable_progress_bars()
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(data_dir / "variant_arrow"))
        out["arrow"] = data_dir / "variant_arrow"
        return out

    return build()


@pytest.fixture(scope="session")
def tokenizer_dir(data_dir, corpus) -> Path:
    """A unigram sentencepiece tokenizer (vocab 2000) trained on the corpus."""
    return train_tokenizer([str(corpus)], data_dir / "tokenizer", vocab_size=2000)


@pytest.fixture(scope="session")
def sharded(data_dir, corpus, tokenizer_dir) -> Path:
    """The corpus sharded with 2 worker processes into small shards (15k tokens), 5% validation."""
    def build():
        out = data_dir / "shards"
        shard_corpus([str(corpus)], str(tokenizer_dir), out, workers=2, shard_tokens=15_000, valid_fraction=0.05)
        return out

    return build()
