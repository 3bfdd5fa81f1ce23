"""Shared inputs for the preprocessing tests: a real-text corpus, its variants, trained tokenizers.

Everything is built once per test session (a module-level cache shared by the
test modules that import these fixtures) under pytest's temporary directory.
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convbert_ds.data.builtin_corpus import write_corpus

REPO = Path(__file__).resolve().parents[1]
CORPUS_BYTES = 250_000
_cache: dict = {}


def _once(key, build):
    if key not in _cache:
        _cache[key] = build()
    return _cache[key]


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


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd or REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return _once("data_dir", lambda: tmp_path_factory.mktemp("preprocessing_data"))


@pytest.fixture(scope="session")
def corpus(data_dir) -> Path:
    """About 250 kB of Python-stdlib docstrings: one paragraph per line, blank line between documents."""
    return _once("corpus", lambda: write_corpus(data_dir / "corpus.txt", max_bytes=CORPUS_BYTES))


@pytest.fixture(scope="session")
def corpus_documents(corpus) -> list[list[str]]:
    return _once("corpus_documents", lambda: read_text_documents(corpus))


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

    return _once("variants", build)


@pytest.fixture(scope="session")
def tokenizer_dir(data_dir, corpus) -> Path:
    """A unigram sentencepiece tokenizer (vocab 2000) trained on the corpus."""
    from preprocessing.tokenizer import train_tokenizer

    return _once("tokenizer", lambda: train_tokenizer([str(corpus)], data_dir / "tokenizer", vocab_size=2000))


@pytest.fixture(scope="session")
def sharded(data_dir, corpus, tokenizer_dir) -> Path:
    """The corpus sharded with 2 worker processes into small shards (15k tokens), 5% validation."""
    from preprocessing.shard import shard_corpus

    def build():
        out = data_dir / "shards"
        shard_corpus([str(corpus)], str(tokenizer_dir), out, workers=2, shard_tokens=15_000, valid_fraction=0.05)
        return out

    return _once("sharded", build)


def read_split_documents(shard_dir: Path, split: str) -> list[list[list[int]]]:
    """Every document of a split, in order, as lists of token-id lists, read with megatron-core."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    manifest = json.loads((shard_dir / "manifest.json").read_text())
    docs = []
    for shard in manifest["splits"][split]["shards"]:
        ds = IndexedDataset(str(shard_dir / shard["prefix"]))
        bounds = ds.document_indices
        for d in range(len(bounds) - 1):
            docs.append([ds[i].tolist() for i in range(bounds[d], bounds[d + 1])])
    return docs
