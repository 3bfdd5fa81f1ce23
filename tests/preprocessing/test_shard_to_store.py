"""``preprocessing.shard --out s3://...`` and ``preprocessing.inspect s3://...`` against a real S3-compatible
server on loopback (``tests/object_store.py``): the store gets the files a local run writes, manifest last."""

import json

from convbert_ds import objstore
from launch import run_cli

URL = "s3://corpora/docstrings"


def _shard(tiny_corpus, *extra):
    return run_cli("preprocessing.shard", "--input", str(tiny_corpus["corpus"]), "--tokenizer",
                   str(tiny_corpus["tokenizer"]), "--out", URL, "--workers", "1", "--valid-fraction", "0.05",
                   "--no-progress", *extra)


def test_shard_out_to_a_store_uploads_what_a_local_run_writes_and_inspect_reads_it(s3, tiny_corpus, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the staging directory
    objstore.client().create_bucket(Bucket="corpora")
    result = _shard(tiny_corpus)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.rstrip().endswith(f"files to {URL} (the manifest last)"), result.stdout
    local = json.loads((tiny_corpus["shards"] / "manifest.json").read_text())
    stored = json.loads(objstore.read_bytes(f"{URL}/manifest.json"))
    assert stored["splits"] == local["splits"]  # the same shard files, byte for byte (their sha256)
    uploaded = dict(objstore.list_objects(URL))
    assert set(uploaded) == {"manifest.json"} | {f"{s['prefix']}.{ext}" for split in local["splits"].values()
                                                 for s in split["shards"] for ext in ("bin", "idx")}
    again = _shard(tiny_corpus)  # complete: uploaded again, nothing tokenized
    assert again.returncode == 0 and "is already complete" in again.stdout, again.stderr[-3000:]

    inspected, at_home = run_cli("preprocessing.inspect", URL), run_cli("preprocessing.inspect",
                                                                         str(tiny_corpus["shards"]))
    assert inspected.returncode == 0, inspected.stderr[-3000:]
    body = inspected.stdout.split("\n", 1)[1]
    assert body == at_home.stdout.split("\n", 1)[1] and inspected.stdout.startswith(f"{URL}: tokenizer")

    other = _shard(tiny_corpus, "--split-seed", "7")
    assert other.returncode == 2 and other.stderr.strip() == (
        f"error: {URL} already holds shards made from other inputs, tokenizer or settings; pass --force to "
        f"replace them"), other.stderr
    assert _shard(tiny_corpus, "--split-seed", "7", "--force").returncode == 0


def test_inspect_names_a_missing_prefix_in_one_line(s3):
    objstore.client().create_bucket(Bucket="corpora")
    result = run_cli("preprocessing.inspect", "s3://corpora/nothing")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: s3://corpora/nothing/manifest.json not found in the store at"), \
        result.stderr


def test_a_missing_bucket_is_one_line_before_anything_is_sharded(s3, tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the staging directory: nothing may be written there
    result = run_cli("preprocessing.shard", "--input", str(tiny_corpus["corpus"]), "--tokenizer",
                     str(tiny_corpus["tokenizer"]), "--out", "s3://nobucket/docstrings", "--workers", "1",
                     "--no-progress")
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip()
    assert line == (f"error: s3://nobucket/docstrings: the store at {s3.url} has no bucket 'nobucket'; create it "
                    "or fix the URL (AWS_ENDPOINT_URL chooses the store)"), line
    assert not list(tmp_path.rglob("*.bin")), "nothing was sharded"
