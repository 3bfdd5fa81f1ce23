"""``--check-config`` and ``--print-config`` read what they check and write nothing: not in checkpoint.dir, not
in the store it mirrors to, not in the shard directories nor the store's cache (the Slurm scripts run the
check up front, on a login node, before the job's ranks; what a run needs on disk is fetched and stamped by
``convbert_ds.engine.prepare`` when it starts).

The scenario gives every such write its occasion: the store holds a checkpoint newer than the local one (a run
would download it and move ``latest``), the local shards were never verified (a run writes a checksum stamp
beside them), and a second set lives in the store (a run fetches its manifest and index files into the cache).
"""

import json
import shutil

import pytest

from convbert_ds import train
from launch import TINY_CONFIG

LOCAL_TAG, STORE_TAG = "step00000002", "step00000004"


def _files(root) -> dict:
    """Every path under ``root``: a file's bytes and mtime, None for a directory; None when root is absent."""
    if not root.exists():
        return None
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def _objects(server, bucket: str) -> dict:
    """Every object of ``bucket``: its bytes, ETag and time of its last write."""
    client = server.client()
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: (client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read(), o["ETag"], o["LastModified"])
            for o in listed}


@pytest.fixture
def scenario(s3, tiny_corpus, tmp_path, monkeypatch):
    """The command's arguments and a snapshot function of everything it must leave alone."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where a store's files would be cached
    shards = tmp_path / "shards"
    shutil.copytree(tiny_corpus["shards"], shards, ignore=shutil.ignore_patterns("index_cache"))  # never verified
    objects = {f"tiny/{p.relative_to(shards).as_posix()}": p.read_bytes() for p in shards.rglob("*") if p.is_file()}
    s3.restore("purecheck-shards", objects)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / LOCAL_TAG).mkdir(parents=True)
    (checkpoints / LOCAL_TAG / "COMPLETE").write_text(json.dumps({"files": {}}))
    (checkpoints / "latest").write_text(f"{LOCAL_TAG}\n")
    s3.restore("purecheck-checkpoints", {f"run/{STORE_TAG}/COMPLETE": json.dumps({"files": {}}).encode(),
                                         "run/latest": f"{STORE_TAG}\n".encode()})
    args = ["--config", str(TINY_CONFIG), f"data.sets=[{{path: '{shards}'}}, {{path: 's3://purecheck-shards/tiny'}}]",
            f"checkpoint.dir={checkpoints}", "checkpoint.mirror=s3://purecheck-checkpoints/run", "--world-size", "2"]

    def snapshot() -> dict:
        return {"checkpoint.dir": _files(checkpoints), "shards": _files(shards), "cache": _files(tmp_path / "cache"),
                "store": {b: _objects(s3, b) for b in ("purecheck-checkpoints", "purecheck-shards")}}
    return args, snapshot


@pytest.mark.parametrize("mode", ["--check-config", "--print-config"])
def test_checking_or_printing_a_config_writes_nothing(mode, scenario, capsys):
    args, snapshot = scenario
    before = snapshot()
    assert train.main([*args, mode]) == 0, capsys.readouterr().err
    after = snapshot()
    assert [place for place in before if after[place] != before[place]] == [], f"{mode} wrote there"
