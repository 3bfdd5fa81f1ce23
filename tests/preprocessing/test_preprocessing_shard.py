"""Sharding: round trip through megatron-core, crash/resume, slices + merge, bad input, inspection."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from launch import REPO, run_cli
from shard_factory import read_split_documents

from convbert_ds.formats.shard_manifest import ShardManifestError, read_manifest
from preprocessing.errors import PreprocessingError
from preprocessing.indexed import ShardWriter, commit_shard
from preprocessing.inspect import inspect_path
from preprocessing.merge import merge_slices
from preprocessing.shard import shard_corpus
from preprocessing.tokenizer import load_tokenizer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def _interleaving(source: list, train: list, valid: list) -> bool:
    """Whether ``source`` is exactly ``train`` and ``valid`` merged, each keeping its order."""
    t = v = 0
    for item in source:
        if t < len(train) and train[t] == item:
            t += 1
        elif v < len(valid) and valid[v] == item:
            v += 1
        else:
            return False
    return t == len(train) and v == len(valid)


def test_round_trip_through_megatron_reproduces_the_documents(sharded, corpus_documents, tokenizer_dir):
    manifest = read_manifest(sharded)
    tok = load_tokenizer(tokenizer_dir)
    assert manifest["tokenizer"]["special_ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert manifest["tokenizer"]["sha256"] == tok.sha256 and manifest["dtype"] == "uint16"
    splits = {}
    for name in ("train", "valid"):
        split = manifest["splits"][name]
        for shard in split["shards"]:
            ds = IndexedDataset(str(sharded / shard["prefix"]))
            assert (len(ds), len(ds.document_indices) - 1) == (shard["sequences"], shard["documents"])
            assert int(ds.sequence_lengths.sum()) == shard["tokens"]
            assert ds[0].dtype == np.uint16
        splits[name] = read_split_documents(sharded, name)
        assert len(splits[name]) == split["documents"]
        assert sum(len(d) for d in splits[name]) == split["sequences"]
    assert len(manifest["splits"]["train"]["shards"]) > 3 and 0 < len(splits["valid"]) < 0.15 * len(splits["train"])
    # Shards hold exactly the sentencepiece ids of every line, document by document, nothing lost.
    expected = [tok.encode_batch(doc) for doc in corpus_documents]
    assert _interleaving(expected, splits["train"], splits["valid"])
    # Decoding gives back the normalised source text, document boundaries included.
    decoded = [[tok.decode(ids) for ids in doc] for doc in splits["train"] + splits["valid"]]
    normalised = [[tok.normalize(line) for line in doc] for doc in corpus_documents]
    assert sorted(map(tuple, decoded)) == sorted(map(tuple, normalised))
    # ... and the HF tokenizer files give the same ids as the shards.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    some = [line for doc in corpus_documents[:300] for line in doc]
    assert [hf.encode(line, add_special_tokens=False) for line in some] == [tok.encode(line) for line in some]
    assert manifest["sources"][0]["documents"] == len(corpus_documents)
    assert manifest["skipped"] == {"empty_documents": 0, "empty_sequences": 0, "blank_files": 0}


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_writer_output_is_byte_identical_to_megatron_builder(tmp_path, dtype):
    import torch

    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 60000, rng.integers(1, 50)) for _ in range(rng.integers(1, 6))] for _ in range(300)]
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.dtype(dtype).type)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.from_numpy(seq))
        builder.end_document()
    builder.finalize(str(tmp_path / "ref.idx"))
    # Written in two sessions, the second resuming from a checkpoint with junk appended after it.
    writer = ShardWriter(tmp_path / "ours", dtype)
    for doc in docs[:120]:
        writer.add(np.concatenate(doc), np.array([len(s) for s in doc]), np.array([len(doc)]))
    writer.sync()
    state = writer.state()
    writer.add(np.arange(7), np.array([7]), np.array([1]))
    writer.close()
    writer = ShardWriter(tmp_path / "ours", dtype, resume=state)
    for doc in docs[120:]:
        writer.add(np.concatenate(doc), np.array([len(s) for s in doc]), np.array([len(doc)]))
    record = writer.finish()
    commit_shard(tmp_path / "ours")
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"ref.{ext}").read_bytes()
    assert record["documents"] == 300 and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("variant", ["jsonl.zst", "parquet", "arrow"])
def test_output_is_the_same_for_any_worker_count_and_input_format(tmp_path, sharded, corpus_variants,
                                                                  tokenizer_dir, variant):
    reference = read_manifest(sharded)
    manifest = shard_corpus([str(corpus_variants[variant])], str(tokenizer_dir), tmp_path / "out", workers=0,
                            shard_tokens=15_000, valid_fraction=0.05)
    for split in ("train", "valid"):
        assert ([s["sha256"] for s in manifest["splits"][split]["shards"]]
                == [s["sha256"] for s in reference["splits"][split]["shards"]])


def test_read_manifest_names_missing_and_damaged_files(tmp_path, sharded):
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    read_manifest(copy)
    victim = copy / "train" / "shard-00001.bin"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ShardManifestError, match=r"train/shard-00001\.bin: sha256 differs"):
        read_manifest(copy)
    read_manifest(copy, verify=False)
    (copy / "valid" / "shard-00000.idx").unlink()
    with pytest.raises(FileNotFoundError, match=r"valid/shard-00000\.idx not found \(listed in .*manifest\.json"):
        read_manifest(copy, verify=False)


def _repeat_corpus(corpus: Path, out: Path, times: int) -> Path:
    text = corpus.read_text()
    out.write_text("".join(text.replace("\n\n", f" (copy {i})\n\n") for i in range(times)))
    return out


def _as_small_files(text_file: Path, out: Path, file_bytes: int) -> Path:
    """``text_file``'s documents as files of about ``file_bytes``, in name order (a directory of articles)."""
    out.mkdir()
    group, size, n = [], 0, 0
    for doc in text_file.read_text().split("\n\n"):
        group.append(doc + "\n\n")
        size += len(doc)
        if size >= file_bytes:
            (out / f"part-{n:05d}.txt").write_text("".join(group))
            group, size, n = [], 0, n + 1
    if group:
        (out / f"part-{n:05d}.txt").write_text("".join(group))
    return out


# One file: a chunk per 64 KB block, a worker task per chunk, a checkpoint after each. Small files: a
# chunk per file, eight files to a worker task, and checkpoints only where a shard closes, which is inside
# a task: the crash lands mid-task, and the rerun must re-form that task and skip what it already wrote.
@pytest.mark.parametrize("layout, chunks_per_block, checkpoint_every", [("one file", 1, 1), ("small files", 8, 1000)])
def test_kill_9_then_rerun_gives_the_uninterrupted_manifest(layout, chunks_per_block, checkpoint_every, tmp_path,
                                                            corpus, tokenizer_dir):
    big = _repeat_corpus(corpus, tmp_path / "big.txt", 16)
    if layout == "small files":
        big = _as_small_files(big, tmp_path / "articles", 65536 // chunks_per_block)
    args = ["--input", str(big), "--tokenizer", str(tokenizer_dir), "--shard-tokens", "20000",
            "--valid-fraction", "0.05", "--block-bytes", "65536"]
    clean = shard_corpus([str(big)], str(tokenizer_dir), tmp_path / "clean", workers=0, shard_tokens=20_000,
                         valid_fraction=0.05, block_bytes=65536)
    assert len(clean["splits"]["train"]["shards"]) > 20

    out = tmp_path / "crashed"
    shard_args = [*args, "--out", str(out), "--workers", "2", "--checkpoint-every", str(checkpoint_every),
                  "--no-progress"]
    cmd = [sys.executable, "-m", "preprocessing.shard", *shard_args]
    kept, inside_a_task = None, []
    for stop_after in (10 * chunks_per_block, 30 * chunks_per_block):  # crash twice, at different points
        # The process SIGKILLs itself right after the first checkpoint that records this many input chunks
        # as done (preprocessing.shard's after_checkpoint hook, set by shard_killed_at.py).
        killed_at = [sys.executable, str(Path(__file__).with_name("shard_killed_at.py")), str(stop_after), *shard_args]
        proc = subprocess.Popen(killed_at, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = proc.communicate(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # workers left behind, if any, like a node failure
        assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}, stderr:\n{stderr}"
        progress = json.loads((out / "progress.json").read_text())
        assert progress["chunk"] >= stop_after and not (out / "manifest.json").exists(), stderr
        inside_a_task.append(any(progress["done_in_chunk"].values()))
        if kept is None:
            assert len(progress["splits"]["train"]["finished"]) >= 3, progress["splits"]["train"]
            kept = (out / "train" / "shard-00000.bin").stat().st_ino
    if layout == "small files":
        assert all(inside_a_task), "a crash landed between worker tasks; move the stop points"
    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert (out / "manifest.json").read_bytes() == (tmp_path / "clean" / "manifest.json").read_bytes()
    assert (out / "train" / "shard-00000.bin").stat().st_ino == kept  # finished shards were kept
    assert not list(out.rglob("*.tmp")) and not (out / "progress.json").exists()
    read_manifest(out)


def test_slices_and_merge_equal_one_run(tmp_path, corpus, corpus_documents, tokenizer_dir):
    half = len(corpus_documents) // 2
    a, b, c = tmp_path / "a.txt", tmp_path / "b.jsonl.gz", tmp_path / "c.txt"
    a.write_text("".join("\n".join(d) + "\n\n" for d in corpus_documents[:half]))
    b.write_bytes(gzip.compress("".join(json.dumps({"text": "\n".join(d)}) + "\n"
                                        for d in corpus_documents[half:half + 300]).encode()))
    c.write_text("".join("\n".join(d) + "\n\n" for d in corpus_documents[half + 300:]))
    inputs = [str(a), str(b), str(c)]
    options = dict(workers=0, shard_tokens=8_000, valid_fraction=0.05)
    single = shard_corpus(inputs, str(tokenizer_dir), tmp_path / "single", **options)
    slices = [str(tmp_path / f"slice{i}") for i in range(3)]
    for i in (2, 0, 1):
        shard_corpus(inputs, str(tokenizer_dir), slices[i], slice=f"{i}/3", **options)
    with pytest.raises(PreprocessingError, match="exactly once"):
        merge_slices(slices[:2], tmp_path / "partial")
    with pytest.raises(PreprocessingError, match="each hold the whole corpus .* would repeat every document"):
        merge_slices([str(tmp_path / "single"), str(tmp_path / "single")], tmp_path / "twice")
    assert not (tmp_path / "twice").exists()
    merged = merge_slices([slices[1], slices[2], slices[0]], tmp_path / "merged")
    assert read_manifest(tmp_path / "merged") == merged
    for split in ("train", "valid"):
        for key in ("documents", "sequences", "tokens"):
            assert merged["splits"][split][key] == single["splits"][split][key]
        assert read_split_documents(tmp_path / "merged", split) == read_split_documents(tmp_path / "single", split)
    assert [s["documents"] for s in merged["sources"]] == [s["documents"] for s in single["sources"]]
    assert merged["skipped"] == single["skipped"] and merged["documents_read"] == single["documents_read"]
    slice_docs = [json.loads((Path(s) / "manifest.json").read_text())["splits"]["train"]["documents"] for s in slices]
    assert all(n > 0 for n in slice_docs)


def test_bad_input_is_repaired_or_skipped_and_counted(tmp_path, tokenizer_dir):
    good = "A normal line of text.\nAnother line.\n\n"
    (tmp_path / "bytes.txt").write_bytes(good.encode() + b"bad \xff\xfe bytes \xe2\x82 here\n\nok again\n")
    (tmp_path / "blank.txt").write_text("  \n\n \t\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "zw.txt").write_text("\u200b\u200b\n\nvisible line\n\u200b\n")
    (tmp_path / "records.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"text": "kept record"}, {"text": ""}, {"text": None}, {"text": " \n \n"}, {"text": "a\ud800b"}]) + "\n")
    words = " ".join(f"word{i}" for i in range(6000))  # ~53k characters, spaces between
    (tmp_path / "long.txt").write_text(words + "\n" + "x" * 40000 + "\n")
    manifest = shard_corpus([str(tmp_path / "*")], str(tokenizer_dir), tmp_path / "out", workers=0,
                            valid_fraction=0.0, max_line_chars=16384)
    assert manifest["skipped"] == {"empty_documents": 4, "empty_sequences": 2, "blank_files": 2}
    assert manifest["repaired"] == {"invalid_utf8_bytes": 5, "long_lines_split": 2, "long_documents_split": 0}
    by_name = {Path(s["path"]).name: s["documents"] for s in manifest["sources"]}
    assert by_name == {"blank.txt": 0, "bytes.txt": 3, "empty.txt": 0, "long.txt": 1, "records.jsonl": 2,
                       "zw.txt": 1}
    tok = load_tokenizer(tokenizer_dir)
    docs = read_split_documents(tmp_path / "out", "train")
    long_doc = next(d for d in docs if len(d) > 3)
    pieces = [tok.decode(ids) for ids in long_doc]
    assert all(len(p) <= 16384 for p in pieces) and len(pieces) > 5
    # Cut at spaces where there are spaces, anywhere (at a character boundary) where there are none.
    k = sum(p.startswith("word") for p in pieces)
    assert " ".join(pieces[:k]) == words and "".join(pieces[k:]) == "x" * 40000
    # Invalid bytes became U+FFFD, which the tokenizer's NFKC rules then drop.
    assert tok.decode(docs[1][0]) == tok.normalize("bad \ufffd\ufffd bytes \ufffd here") == "bad bytes here"


def test_strict_mode_names_the_file_and_byte_offset(tmp_path, tokenizer_dir):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine line\n\nsecond doc " + b"\xc3\x28" + b" tail\n")
    out = tmp_path / "out"
    with pytest.raises(PreprocessingError, match=rf"{path}: invalid UTF-8 at byte offset 22 "):
        shard_corpus([str(path)], str(tokenizer_dir), out, workers=0, strict=True)
    result = run_cli("preprocessing.shard", "--input", str(path), "--tokenizer", str(tokenizer_dir), "--out",
                     str(tmp_path / "cli"), "--strict", "--workers", "1", "--no-progress")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {path}: invalid UTF-8 at byte offset 22 (--strict); drop --strict to replace invalid bytes"]
    # Nothing that looks complete was left behind.
    assert not (tmp_path / "cli" / "manifest.json").exists() and not list((tmp_path / "cli").rglob("*.bin"))


def test_input_errors_stop_before_any_work(tmp_path, tokenizer_dir, corpus):
    (tmp_path / "nofield.jsonl").write_text(json.dumps({"body": "text"}) + "\n")
    (tmp_path / "corrupt.txt.gz").write_bytes(b"this is not gzip data")
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "does-not-exist.txt")
    cases = {
        str(tmp_path / "missing" / "*.txt"): "matches no files",
        str(tmp_path / "nofield.jsonl"): "no field 'text' (fields: body)",
        str(tmp_path / "corrupt.txt.gz"): "cannot read",
        str(tmp_path / "dangling.txt"): "cannot read",
    }
    for i, (bad, message) in enumerate(cases.items()):
        out = tmp_path / f"out{i}"
        result = run_cli("preprocessing.shard", "--input", str(corpus), bad, "--tokenizer", str(tokenizer_dir),
                         "--out", str(out), "--no-progress")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith("error: ") and message in lines[0] and Path(bad).name in lines[0]
        assert not out.exists()


def test_rerun_checks_settings_and_reuses_finished_output(tmp_path, corpus, tokenizer_dir):
    out = tmp_path / "out"
    first = shard_corpus([str(corpus)], str(tokenizer_dir), out, workers=0, shard_tokens=50_000)
    mtime = (out / "manifest.json").stat().st_mtime_ns
    assert shard_corpus([str(corpus)], str(tokenizer_dir), out, workers=0, shard_tokens=50_000) == first
    assert (out / "manifest.json").stat().st_mtime_ns == mtime
    with pytest.raises(PreprocessingError, match="pass --force to replace them"):
        shard_corpus([str(corpus)], str(tokenizer_dir), out, workers=0, shard_tokens=20_000)
    result = run_cli("preprocessing.shard", "--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--out",
                     str(out), "--workers", "0", "--shard-tokens", "20000", "--overwrite", "--no-progress")
    assert result.returncode == 0, result.stderr  # --overwrite: the old name of --force still works
    again = read_manifest(out)
    assert again["splits"]["train"]["tokens"] == first["splits"]["train"]["tokens"]
    assert len(again["splits"]["train"]["shards"]) > len(first["splits"]["train"]["shards"])


def test_wordpiece_tokenizer_with_large_vocab_writes_int32(tmp_path, corpus_documents):
    from transformers import BertTokenizer

    words = sorted({w.lower() for doc in corpus_documents for line in doc for w in line.split() if w.isalpha()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghijklmnopqrstuvwxyz.,()")
    vocab += words + [f"filler{i}" for i in range(70_000)]
    d = tmp_path / "bert"
    d.mkdir()
    (d / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    text = tmp_path / "in.txt"
    text.write_text("".join("\n".join(doc) + "\n\n" for doc in corpus_documents[:150]))
    manifest = shard_corpus([str(text)], str(d), tmp_path / "out", workers=1, valid_fraction=0.0)
    assert manifest["dtype"] == "int32" and manifest["tokenizer"]["vocab_size"] > 65500
    assert manifest["tokenizer"]["special_ids"] == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    bert = BertTokenizer.from_pretrained(str(d), local_files_only=True)
    docs = read_split_documents(tmp_path / "out", "train")
    assert docs == [[bert.encode(line, add_special_tokens=False) for line in doc] for doc in corpus_documents[:150]]
    prefix = tmp_path / "out" / manifest["splits"]["train"]["shards"][0]["prefix"]
    assert IndexedDataset(str(prefix))[0].dtype == np.int32


def test_inspect_prints_counts_histogram_and_text(sharded, corpus_documents):
    result = run_cli("preprocessing.inspect", str(sharded), "--documents", "2")
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(sharded)
    assert f"{manifest['splits']['train']['tokens']:,} tokens" in result.stdout
    assert "sequence length histogram" in result.stdout and "#" in result.stdout
    assert any(f"| {line[:40]}" in result.stdout for doc in corpus_documents[:5] for line in doc)
    one = inspect_path(str(sharded / "train" / "shard-00000.idx"), documents=1)
    assert one.splitlines()[1].startswith(f"  1 shards, {manifest['splits']['train']['shards'][0]['documents']:,} "
                                          "documents")
