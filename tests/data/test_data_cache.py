"""The sample index cache: built once, shared by concurrent builders, never read when damaged."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os

import numpy as np
import pytest
from shard_factory import corpus, write_shard_dir

from convbert_ds.data.index_cache import HEADER_BYTES, load_or_build
from convbert_ds.data.packing import PackedDataset


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    docs = corpus()
    return write_shard_dir(tmp_path_factory.mktemp("cache") / "set", {"train": docs[:400], "valid": docs[400:450]})


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


def test_built_once_then_loaded(shard_dir, tmp_path):
    first = PackedDataset(shard_dir, "train", seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    mtime = first.index_path.stat().st_mtime_ns
    second = PackedDataset(shard_dir, "train", seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    assert first.index_built and not second.index_built
    assert second.index_path == first.index_path and first.index_path.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(first.samples, second.samples)
    # seq_len, seed and split each get their own file.
    for kwargs in ({"seq_len": 32, "seed": 1}, {"seq_len": 64, "seed": 2}):
        other = PackedDataset(shard_dir, "train", cache_dir=tmp_path, progress=False, **kwargs)
        assert other.index_built and other.index_path != first.index_path
    valid = PackedDataset(shard_dir, "valid", seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    assert valid.index_built and valid.index_path != first.index_path
    assert len(list(tmp_path.glob("*.samples"))) == 4 and not _leftovers(tmp_path)


def test_default_cache_lives_beside_the_shards(shard_dir):
    ds = PackedDataset(shard_dir, "valid", seq_len=16, seed=9, progress=False)
    assert ds.index_path.parent == shard_dir / "index_cache"


def test_changed_shards_get_a_new_index(tmp_path):
    docs = corpus()
    a = PackedDataset(write_shard_dir(tmp_path / "set", {"train": docs[:50]}), seq_len=32, progress=False)
    b = PackedDataset(write_shard_dir(tmp_path / "set", {"train": docs[50:90]}), seq_len=32, progress=False)
    assert b.index_built and b.index_path != a.index_path


@pytest.mark.parametrize("damage", ["truncate", "flip_record_byte", "garbage_header", "empty"])
def test_damaged_cache_is_rebuilt(shard_dir, tmp_path, damage):
    good = PackedDataset(shard_dir, "train", seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    expected = np.array(good.samples)
    path = good.index_path
    data = bytearray(path.read_bytes())
    del good
    if damage == "truncate":
        data = data[:-7]
    elif damage == "flip_record_byte":
        data[HEADER_BYTES + len(data[HEADER_BYTES:]) // 2] ^= 0x40
    elif damage == "garbage_header":
        data[10:40] = b"x" * 30
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    rebuilt = PackedDataset(shard_dir, "train", seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    assert rebuilt.index_built
    np.testing.assert_array_equal(rebuilt.samples, expected)


def test_failed_build_leaves_nothing_behind(tmp_path):
    def build(writer):
        writer.append(np.arange(10, dtype=np.int64))
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        load_or_build(tmp_path / "x.idx", "key", np.int64, build)
    assert not (tmp_path / "x.idx").exists() and not _leftovers(tmp_path)


def test_stale_temp_file_of_a_dead_builder_is_removed(tmp_path):
    stale = tmp_path / "x.idx.tmp-99999-deadbeef"
    stale.write_bytes(b"half written")
    index = load_or_build(tmp_path / "x.idx", "key", np.int64, lambda w: w.append(np.arange(5)) or {})
    assert index.built and list(index.records) == [0, 1, 2, 3, 4] and not stale.exists()


def _build_in_child(shard_dir, cache_dir, barrier, results):
    barrier.wait()
    ds = PackedDataset(shard_dir, "train", seq_len=128, seed=5, cache_dir=cache_dir, progress=False)
    results.put((os.getpid(), ds.index_built, str(ds.index_path),
                 hashlib.sha256(ds.index_path.read_bytes()).hexdigest(), len(ds)))


def test_concurrent_builders_agree(shard_dir, tmp_path):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(shard_dir, tmp_path, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, "a builder process failed"
    outcomes = [results.get(timeout=10) for _ in procs]
    built = [o[1] for o in outcomes]
    assert sorted(built) == [False, True], "exactly one process builds; the other waits and loads"
    assert len({o[2:] for o in outcomes}) == 1
    assert not _leftovers(tmp_path)
    here = PackedDataset(shard_dir, "train", seq_len=128, seed=5, cache_dir=tmp_path, progress=False)
    assert not here.index_built and len(here) == outcomes[0][4]
