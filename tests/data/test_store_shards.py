"""Shard directories in an object store (``data.sets: [{path: s3://...}]``), read from a real S3-compatible
server over HTTP (``tests/object_store.py``): the same samples as the local copy, a bounded block cache
that ranks share, the manifest's checksums, and one line for each way the store can be wrong."""

import re
import subprocess
import sys

import numpy as np
import pytest

from convbert_ds import objstore
from convbert_ds.data.loader import build_dataset
from convbert_ds.data.remote_shards import RemoteTokens, StoreCache, evict, open_bin
from convbert_ds.data.shards import open_split, verify_checksums
from convbert_ds.errors import UserError
from convbert_ds.formats.shard_manifest import ShardManifestError, read_manifest
from launch import REPO, TINY_CONFIG
from object_store import S3Server

URL = "s3://shards/tiny"


@pytest.fixture
def store_shards(s3, tiny_corpus):
    """tiny_corpus's shards uploaded to the store as ``preprocessing.shard --out s3://`` leaves them."""
    objstore.client().create_bucket(Bucket="shards")
    objstore.upload_tree(tiny_corpus["shards"], URL, last=("manifest.json",), skip=lambda n: "index_cache" in n)
    return URL


@pytest.mark.parametrize("pack_documents", [False, True])
def test_samples_from_the_store_are_the_local_ones(store_shards, tiny_corpus, tmp_path, pack_documents):
    local = build_dataset([tiny_corpus["shards"]], "train", 64, pack_documents=pack_documents,
                          cache_dir=tmp_path / "local", progress=False)
    remote = build_dataset([store_shards], "train", 64, pack_documents=pack_documents,
                           cache_dir=tmp_path / "cache", progress=False)
    assert len(local) == len(remote) > 100
    for i in range(len(local)):
        a, b = local[i], remote[i]
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), i
    # What the run keeps: the manifest and index files in the mirror, the tokens as blocks named by content.
    split = open_split(store_shards, "train", tmp_path / "cache")
    assert split.origin == URL and (split.shard_dir / "manifest.json").is_file()
    assert all(s.idx_path.is_file() and not s.bin_path.exists() for s in split.shards)
    blocks = sorted((tmp_path / "cache" / "blocks").glob("*/*"))
    assert {b.parent.name for b in blocks} == {s.sha256["bin"] for s in split.shards}


def test_a_rank_fetches_only_the_blocks_it_reads_and_the_cache_stays_under_its_limit(store_shards, tiny_corpus,
                                                                                       tmp_path):
    split = open_split(tiny_corpus["shards"], "train")
    shard = read_manifest(tiny_corpus["shards"], verify=False)["splits"]["train"]["shards"][0]
    local = np.memmap(split.shards[0].bin_path, dtype=split.shards[0].dtype, mode="r")
    cache = StoreCache(tmp_path, limit_bytes=3 * 4096, block_bytes=4096)
    tokens = RemoteTokens(open_bin(URL, shard, cache), local.dtype, local.nbytes, shard["sha256"]["bin"])
    assert len(tokens) == len(local) and local.nbytes > 20 * 4096
    assert np.array_equal(tokens[100:150], local[100:150])  # inside block 0
    assert tokens.fetched_bytes == 4096
    across = slice(4096 // local.itemsize - 5, 3 * 4096 // local.itemsize + 7)  # blocks 0-3
    assert np.array_equal(tokens[across], local[across]) and tokens.fetched_bytes == 4 * 4096
    assert np.array_equal(tokens[len(local) - 3:], local[len(local) - 3:])  # the short last block
    on_disk = sorted((tmp_path / "blocks" / shard["sha256"]["bin"]).iterdir())
    assert sum(p.stat().st_size for p in on_disk) <= cache.limit_bytes and len(on_disk) == 3
    assert on_disk[-1].stat().st_size == local.nbytes % 4096 or local.nbytes % 4096 == 0
    # Another process (another rank on the node, or a restart) reads the kept blocks from disk.
    again = RemoteTokens(open_bin(URL, shard, cache), local.dtype, local.nbytes, shard["sha256"]["bin"])
    kept = int(on_disk[0].name)
    at = slice(kept * 4096 // local.itemsize, kept * 4096 // local.itemsize + 10)
    assert np.array_equal(again[at], local[at]) and again.fetched_bytes == 0
    assert evict(StoreCache(tmp_path, limit_bytes=0)) == 0 and not list((tmp_path / "blocks").glob("*/*"))


def test_checksums_of_a_store_are_verified_once_and_a_changed_byte_is_named(store_shards, tiny_corpus, tmp_path):
    size = sum(p.stat().st_size for p in tiny_corpus["shards"].rglob("shard-*.*"))
    assert verify_checksums(store_shards, tmp_path) == size
    assert verify_checksums(store_shards, tmp_path) == 0  # the stamp holds each object's ETag
    name = "train/shard-00000.bin"
    data = bytearray((tiny_corpus["shards"] / name).read_bytes())
    data[10] ^= 1
    objstore.put_bytes(f"{URL}/{name}", bytes(data))  # same size, new ETag: hashed again
    with pytest.raises(ShardManifestError, match=rf"^{URL}/{name}: sha256 differs from {URL}/manifest.json"):
        verify_checksums(store_shards, tmp_path)


def test_an_object_replaced_mid_run_ends_the_run_instead_of_mixing_versions(store_shards, tmp_path):
    dataset = build_dataset([store_shards], "train", 64, cache_dir=tmp_path, progress=False)
    name = "train/shard-00000.bin"
    original = objstore.read_bytes(f"{URL}/{name}")
    objstore.put_bytes(f"{URL}/{name}", original[::-1])  # same size, another version
    with pytest.raises(objstore.StoreChanged, match=rf"^{URL}/{name} was replaced while this run used it"):
        dataset[0]


def test_a_missing_bucket_prefix_denied_access_or_absent_store_is_one_line_naming_the_url(s3, tiny_corpus, tmp_path, monkeypatch):
    objstore.client().create_bucket(Bucket="empty")
    cases = {"s3://nobucket/tiny": "the store at .* has no bucket 'nobucket'; create it or fix the URL",
             "s3://empty/tiny": "s3://empty/tiny/manifest.json not found in the store at",
             "gs://shards/tiny": "only s3:// URLs are supported"}
    for url, message in cases.items():
        with pytest.raises(UserError, match=message) as caught:
            open_split(url, "train", tmp_path)
        assert "\n" not in str(caught.value)
    with S3Server(checks_credentials=True) as denying:
        monkeypatch.setenv("AWS_ENDPOINT_URL", denying.url)
        with pytest.raises(objstore.StoreError, match=r"^s3://shards/tiny/manifest.json: access denied "
                                                      r"\(InvalidAccessKeyId\); check the credentials"):
            open_split(URL, "train", tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv(objstore.PATIENCE_VAR, "2")
    with pytest.raises(objstore.StoreError, match=r"^s3://shards/tiny/manifest.json: the store at "
                                                  r"http://127.0.0.1:9 did not answer for 2 s"):
        open_split(URL, "train", tmp_path)


@pytest.mark.parametrize("overrides, says", [
    (["data.sets=[{path: 's3://nobucket/x'}]"], "s3://nobucket/x/manifest.json: the store at .* has no bucket "
                                                "'nobucket'; create it or fix the URL"),
    (["checkpoint.mirror=s3://nobucket/run"], "s3://nobucket/run: the store at .* has no bucket 'nobucket'"),
    (["checkpoint.mirror=/shared/run"], "checkpoint.mirror='/shared/run': /shared/run: only s3:// URLs are "
                                        "supported"),
    (["checkpoint.dir=s3://bucket/run"], "checkpoint.dir='s3://bucket/run': DeepSpeed writes checkpoints to a "
                                         "directory; keep one on this disk and set checkpoint.mirror="),
], ids=["shards", "mirror", "mirror-path", "dir"])
def test_the_training_cli_says_what_is_wrong_with_a_store_in_one_line(s3, store_shards, tmp_path, overrides, says):
    result = subprocess.run([sys.executable, "-m", "convbert_ds.train", "--config", str(TINY_CONFIG),
                             f"data.sets=[{{path: '{URL}'}}]", f"checkpoint.dir={tmp_path}/c",
                             f"data.cache_dir={tmp_path}/cache", *overrides], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.search(says, last) and len(result.stderr.strip().splitlines()) <= 2, result.stderr[-3000:]
