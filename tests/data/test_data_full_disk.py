"""The data side's caches and downloads on a full disk (a real tmpfs, ``small_disk``; a real S3 server): a cache
that finds no room warns once and the run goes on from memory; a download that must be on disk ends in one line
naming the path, the space free there and what is kept, and leaves no partial file or checkpoint behind."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from shard_factory import corpus, write_shard_dir

from convbert_ds import objstore
from convbert_ds.data.cross_document import CrossDocumentDataset
from convbert_ds.data.remote_shards import RemoteTokens, StoreCache, open_bin
from convbert_ds.data.shards import open_split
from convbert_ds.disk_full import DiskFull
from convbert_ds.formats.checkpoint import directory as tags, store
from convbert_ds.formats.shard_manifest import read_manifest

TAG = "step00000010"


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    docs = corpus()
    return write_shard_dir(tmp_path_factory.mktemp("full_disk") / "set", {"train": docs[:400], "valid": docs[400:450]})


@pytest.fixture
def bucket(s3, tmp_path):
    """A prefix of this test's own in the session's S3 server."""
    s3.client().create_bucket(Bucket="fulldisk-data")
    return f"s3://fulldisk-data/{tmp_path.name}"


@pytest.fixture
def store_shards(bucket, shard_dir):
    url = f"{bucket}/shards"
    objstore.upload_tree(shard_dir, url, last=("manifest.json",), skip=lambda name: "index_cache" in name)
    return url


def _temporary_files(directory) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if ".tmp" in p.name or ".download-" in p.name)


def test_sample_indexes_that_find_no_room_are_kept_in_memory_after_one_warning(shard_dir, tmp_path, small_disk,
                                                                                capsys):
    on_disk = CrossDocumentDataset(shard_dir, "train", seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    full = small_disk(1 << 20, leave=4096)  # the header of an index file, not one record more
    capsys.readouterr()

    # Two indexes (the packed samples, then the documents' starts derived from them): one line for both.
    in_memory = CrossDocumentDataset(shard_dir, "train", seq_len=64, seed=1, cache_dir=full, progress=False)
    assert capsys.readouterr().err.splitlines() == [
        f"{full}: no space left on device (0.0 MB free there); this process keeps its sample indexes in memory "
        "instead, and builds them again at every start; free some space there, or set data.cache_dir to a disk "
        "with room"]
    assert in_memory.index_in_memory and in_memory.chunks.index_in_memory
    assert not _temporary_files(full) and not list(full.glob("*.samples")) and not list(full.glob("*.documents"))
    np.testing.assert_array_equal(in_memory.chunks.samples, on_disk.chunks.samples)
    copy = pickle.loads(pickle.dumps(in_memory))  # what a spawned DataLoader worker gets: no file to map
    for i in (0, len(on_disk) // 2, len(on_disk) - 1):
        for name, value in on_disk[i].items():
            assert np.array_equal(in_memory[i][name], value) and np.array_equal(copy[i][name], value), (i, name)


def test_blocks_of_a_store_that_find_no_room_are_served_from_memory_after_one_warning(store_shards, shard_dir,
                                                                                      small_disk, capsys):
    shard = read_manifest(shard_dir, verify=False)["splits"]["train"]["shards"][0]
    local = np.memmap(shard_dir / f"{shard['prefix']}.bin", dtype=np.dtype(shard["dtype"]), mode="r")
    full = small_disk(1 << 20, leave=0)
    cache = StoreCache(full, limit_bytes=1 << 30, block_bytes=4096)
    tokens = RemoteTokens(open_bin(store_shards, shard, cache), local.dtype, local.nbytes, shard["sha256"]["bin"])
    assert local.nbytes > 3 * 4096
    capsys.readouterr()

    for at in (slice(0, 100), slice(4096 // local.itemsize - 5, 3 * 4096 // local.itemsize + 7), slice(0, 10)):
        assert np.array_equal(tokens[at], local[at]), at
    assert capsys.readouterr().err.splitlines() == [
        f"{full / 'blocks'}: no space left on device (0.0 MB free there); blocks of shards that find no room there "
        "are kept in memory only and fetched again when needed; free some space there, or set data.cache_dir to "
        "a disk with room"]
    assert not [p for p in (full / "blocks").rglob("*") if p.is_file()]  # no block, whole or partial


def test_index_files_of_a_store_on_a_full_disk_end_in_one_line_and_the_rerun_fetches_the_rest(store_shards,
                                                                                            shard_dir, small_disk):
    shards = read_manifest(shard_dir, verify=False)["splits"]["train"]["shards"]
    listed = {s["prefix"]: s["bytes"]["idx"] for s in shards}
    full = small_disk(1 << 20, leave=16 << 10)  # the manifest (1 page) and the first index file (3), not the second

    with pytest.raises(DiskFull) as caught:
        open_split(store_shards, "train", full)
    mirror = next((full / "store").glob("*/*/*/*"))
    assert str(caught.value).startswith(f"{mirror}: no space left on device (")
    assert str(caught.value).endswith(
        f"; the index files of {store_shards} fetched so far are kept there, each whole, and the rerun fetches the "
        "rest (data.cache_dir moves them); free some space there (or write elsewhere) and rerun the same command")
    kept = {p.relative_to(mirror).as_posix()[:-len(".idx")]: p.stat().st_size for p in mirror.rglob("*.idx")}
    assert kept and all(listed[prefix] == size for prefix, size in kept.items()) and len(kept) < len(listed)
    assert not _temporary_files(full)

    (full / "filler").unlink()
    split = open_split(store_shards, "train", full)
    assert [s.idx_path.stat().st_size for s in split.shards] == list(listed.values())


def test_a_checkpoint_download_onto_a_full_disk_ends_in_one_line_and_leaves_no_partial_tag(bucket, tmp_path,
                                                                                          small_disk):
    tag_dir = tmp_path / "run" / TAG
    tag_dir.mkdir(parents=True)
    files = {"mp_rank_00_model_states.pt": bytes(range(256)) * 200, "trainer_state.json": b"{}"}
    for name, data in files.items():
        (tag_dir / name).write_bytes(data)
    tags.write_manifest(tag_dir, 1)
    url = f"{bucket}/checkpoints"
    store.upload_tag(tmp_path / "run", TAG, url)
    full = small_disk(1 << 20, leave=32 << 10)  # less than the tag's 51 kB
    directory = full / "checkpoints"

    with pytest.raises(DiskFull) as caught:
        store.fetch_newer(directory, url)
    assert str(caught.value) == (
        f"{directory / TAG}: no space left on device (0.0 MB free there); no part of {TAG} is kept there (its "
        f"partial download is deleted), the checkpoints already there and {url}/{TAG} are untouched; free some "
        "space there (or write elsewhere) and rerun the same command")
    assert sorted(p.name for p in directory.iterdir()) == [".store-download.lock"]  # no tag, whole or partial

    (full / "filler").unlink()
    assert store.fetch_newer(directory, url).startswith(f"downloaded checkpoint {TAG} from {url}")
    assert tags.verify(directory / TAG, "checksum") is None
    assert {name: (directory / TAG / name).read_bytes() for name in files} == files
