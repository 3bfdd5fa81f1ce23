"""The shard-directory factory of the data tests writes what the manifest reader and megatron-core read."""

from __future__ import annotations

import numpy as np
from shard_factory import corpus, read_split_documents, write_shard_dir

from convbert_ds.formats.shard_manifest import read_manifest


def test_written_shards_read_back_with_megatron(tmp_path):
    docs = corpus()[:40]
    out = write_shard_dir(tmp_path / "set", {"train": docs}, num_shards=2, dtype=np.int32)
    manifest = read_manifest(out)  # sizes and sha256 of every file, and every field readers rely on
    assert {s["dtype"] for s in manifest["splits"]["train"]["shards"]} == {"int32"}
    assert read_split_documents(out, "train") == [[list(s) for s in d] for d in docs]
    assert manifest["splits"]["train"]["documents"] == len(docs)
