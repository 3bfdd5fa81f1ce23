"""Sharding and merging onto a full disk (a real tmpfs, ``small_disk``): one line naming the directory, the space
free there and what is kept; no half-written shard under a final name; the same command, once there is room,
ends as a run that never met a full disk."""

from __future__ import annotations

import json
import shutil

import pytest

from convbert_ds import objstore
from convbert_ds.formats.shard_manifest import MissingShardFileError, read_manifest
from preprocessing import merge, shard
from preprocessing.errors import run_cli

OPTIONS = ["--workers", "0", "--shard-tokens", "4000", "--valid-fraction", "0.1", "--block-bytes", "8000",
           "--checkpoint-every", "1", "--no-progress"]


@pytest.fixture
def small_corpus(corpus, tmp_path):
    """The first 60 kB of the session's corpus (whole documents): about ten shards of 4000 tokens."""
    text = corpus.read_text()
    path = tmp_path / "small.txt"
    path.write_text(text[:text.index("\n\n", 60_000) + 2])
    return path


def _shard(small_corpus, tokenizer_dir, out, capsys, *extra) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = run_cli(shard.main, ["--input", str(small_corpus), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                                *OPTIONS, *extra])
    return code, capsys.readouterr().err.splitlines()


def _final_names_are_checkpointed(out) -> None:
    """Every .bin/.idx under its final name is a shard progress.json lists as finished, byte for byte."""
    finished = {}
    if (out / "progress.json").is_file():
        progress = json.loads((out / "progress.json").read_text())
        finished = {f"{r['prefix']}.{ext}": r for split in progress["splits"].values()
                    for r in split["finished"] for ext in ("bin", "idx")}
    named = sorted(p.relative_to(out).as_posix() for p in out.glob("*/shard-*") if p.suffix in (".bin", ".idx"))
    assert set(named) <= set(finished), named
    for name in named:
        assert (out / name).stat().st_size == finished[name]["bytes"][name.rsplit(".", 1)[1]], name


@pytest.mark.parametrize("leave", [8 << 10, 48 << 10], ids=["in-the-first-shard", "after-some-shards"])
def test_shard_onto_a_full_disk_says_so_in_one_line_and_the_rerun_resumes(leave, small_corpus, tokenizer_dir,
                                                                          tmp_path, small_disk, capsys):
    clean = shard.shard_corpus([str(small_corpus)], str(tokenizer_dir), tmp_path / "clean", workers=0,
                               shard_tokens=4000, valid_fraction=0.1, block_bytes=8000, checkpoint_every=1)
    disk = small_disk(1 << 20, leave=leave)
    out = disk / "shards"

    code, err = _shard(small_corpus, tokenizer_dir, out, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {out}: no space left on device (0.0 MB free there); the finished shards "
                             "and progress.json are kept there, and the rerun resumes from the last checkpoint; "
                             "free some space there"), err
    assert bool(list(out.glob("train/shard-*.bin"))) == (leave > 8 << 10)  # shards finished before, or none
    _final_names_are_checkpointed(out)
    with pytest.raises(MissingShardFileError, match="manifest.json not found"):
        read_manifest(out)  # what a reader (training, inspect) does: nothing half-written is taken as shards

    (disk / "filler").unlink()
    code, err = _shard(small_corpus, tokenizer_dir, out, capsys)
    assert code == 0, err
    assert read_manifest(out)["splits"] == clean["splits"]  # the same files, by their sha256


def test_shard_to_a_store_names_its_full_staging_directory(s3, small_corpus, tokenizer_dir, small_disk, capsys,
                                                           monkeypatch):
    disk = small_disk(1 << 20, leave=8 << 10)
    monkeypatch.setenv("XDG_CACHE_HOME", str(disk))  # where the staging directory goes
    url = "s3://fulldisk/shards"
    objstore.client().create_bucket(Bucket="fulldisk")

    code, err = _shard(small_corpus, tokenizer_dir, url, capsys)
    staging = disk / "convbert_ds" / "staging" / "fulldisk" / "shards"
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {staging}: no space left on device ("), err
    assert f"(this is the staging directory of {url}; XDG_CACHE_HOME moves it)" in err[0], err
    assert not objstore.exists(f"{url}/manifest.json")

    (disk / "filler").unlink()
    code, err = _shard(small_corpus, tokenizer_dir, url, capsys)
    assert code == 0, err
    assert json.loads(objstore.read_bytes(f"{url}/manifest.json")) == read_manifest(staging)


def test_merge_onto_a_full_disk_deletes_its_partial_output_so_the_same_command_runs_again(
        small_corpus, tokenizer_dir, tmp_path, small_disk, capsys):
    slices = [tmp_path / f"slice{i}" for i in range(2)]
    for i, out in enumerate(slices):
        shard.shard_corpus([str(small_corpus)], str(tokenizer_dir), out, workers=0, shard_tokens=4000,
                           valid_fraction=0.1, slice=f"{i}/2")
    need = sum(p.stat().st_size for d in slices for p in d.rglob("shard-*"))
    disk = small_disk(1 << 20, leave=need // 2)
    out, free = disk / "merged", shutil.disk_usage(disk).free
    command = [*map(str, slices), "--out", str(out), "--copy"]  # --copy: what a merge across disks does

    capsys.readouterr()
    assert run_cli(merge.main, command) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out}: no space left on device ("), err
    assert "; nothing of the merge is kept there (its partial output is deleted) and the slice directories are " \
           "untouched; free some space there" in err[0], err
    assert list(out.iterdir()) == []  # so the rerun needs no --force
    assert shutil.disk_usage(disk).free == free  # and the room it took is given back

    (disk / "filler").unlink()
    assert run_cli(merge.main, command) == 0, capsys.readouterr().err
    merged = read_manifest(out)
    assert [s["sha256"] for s in merged["splits"]["train"]["shards"]] == \
        [s["sha256"] for d in slices for s in read_manifest(d)["splits"]["train"]["shards"]]
