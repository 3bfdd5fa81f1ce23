"""Damaged artifacts, made here from good ones: each is found where it is first read (at start, before any
process group, not at the first evaluation hours later) and reported in one line naming the file, exit 2.

Shard directories (train and valid splits: ``.bin``, ``.idx`` and the manifest, truncated, bit-flipped or
emptied; bit rot that keeps size and mtime), tokenizer directories missing each file or with each file
damaged, HF model directories with a wrong ``config.json``, damaged weights or tokenizer files (bytes flipped
inside them where the directory has our sha256 record, ``checksums.sha256``, or that record damaged), fine-tuning
task files, a checkpoint's damaged ``trainer_state.json``. The other damaged checkpoint files are
``tests/engine/test_checkpoint_integrity.py``'s; a damaged index cache is rebuilt (``test_data_cache.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import transformers

from convbert_ds import train
from convbert_ds.convert.__main__ import main as convert_main
from convbert_ds.finetune.__main__ import main as finetune_main
from convbert_ds.formats.shard_manifest import ShardManifestError
from convbert_ds.model.hf_io import CHECKSUM_FILE, TOKENIZER_JSON_FILES, write_checksums
from launch import TINY_CONFIG
from preprocessing.errors import run_cli
from preprocessing.shard import main as shard_main
from preprocessing.tokenizer import WRITTEN_FILES


def _damage(path, kind: str) -> None:
    data = bytearray(path.read_bytes())
    if kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "emptied":
        data = bytearray()
    elif kind == "another format":
        data = bytearray(b"\x89PNG\r\n\x1a\n" + bytes(64))
    else:  # one bit flipped: the size stays, only the checksum can tell
        data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def _err_lines(capsys) -> list[str]:
    """stderr less DeepSpeed's start-up warning and progress bars (datasets' "... examples/s]" lines)."""
    return [line for line in capsys.readouterr().err.splitlines()
            if line.strip() and "[WARNING]" not in line and not re.search(r" \w+/s\]$", line)]


@pytest.mark.parametrize("kind", ["truncated", "bit-flipped", "emptied", "another format"])
@pytest.mark.parametrize("file", ["train/shard-00000.bin", "train/shard-00000.idx", "valid/shard-00000.bin",
                                  "valid/shard-00000.idx", "manifest.json"])
def test_a_damaged_shard_file_stops_the_run_at_start(file, kind, tiny_corpus, tmp_path, capsys):
    shards = tmp_path / "shards"
    shutil.copytree(tiny_corpus["shards"], shards, ignore=shutil.ignore_patterns("index_cache"))
    _damage(shards / file, kind)
    code = train.main(["--config", str(TINY_CONFIG), f"data.sets=[{{path: '{shards}'}}]", "--check-config",
                       "--world-size", "2"])
    err = _err_lines(capsys)
    assert code == 2 and len(err) == 1, err
    assert str(shards / file) in err[0] and "python -m preprocessing.shard" in err[0], err


def test_checksums_are_read_once_per_file_and_again_after_a_change(tiny_corpus, tmp_path, capsys):
    from convbert_ds.data.shards import VERIFIED_STAMP, verify_checksums
    shards = tmp_path / "shards"
    shutil.copytree(tiny_corpus["shards"], shards, ignore=shutil.ignore_patterns("index_cache"))
    total = sum(p.stat().st_size for p in shards.rglob("shard-*"))
    assert verify_checksums(shards) == total  # first start: every byte
    assert (shards / "index_cache" / VERIFIED_STAMP).is_file()
    assert verify_checksums(shards) == 0  # next starts: nothing
    idx = shards / "valid" / "shard-00000.idx"
    _damage(idx, "bit-flipped")  # rewritten: a new mtime, so it is hashed again, and fails
    with pytest.raises(ShardManifestError, match=f"^{re.escape(str(idx))}: sha256 differs"):
        verify_checksums(shards)


def test_bit_rot_that_keeps_size_and_mtime_is_caught_by_verify_always(tiny_corpus, tmp_path, capsys):
    """The stamp trusts an unchanged size and mtime (``data.verify: checksum``); ``always`` re-hashes."""
    shards = tmp_path / "shards"
    shutil.copytree(tiny_corpus["shards"], shards, ignore=shutil.ignore_patterns("index_cache"))
    def check(verify: str) -> int:
        return train.main(["--config", str(TINY_CONFIG), f"data.sets=[{{path: '{shards}'}}]", f"data.verify={verify}",
                           "--check-config", "--world-size", "2"])

    from convbert_ds.data.shards import verify_checksums
    assert verify_checksums(shards) > 0  # a run's start stamps every file (a check writes no stamp)
    rotten = shards / "train" / "shard-00000.bin"
    stat = rotten.stat()
    _damage(rotten, "bit-flipped")
    os.utime(rotten, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # what rot on the disk looks like: nothing moved
    capsys.readouterr()
    assert check("checksum") == 0  # trusted, as documented
    assert check("always") == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and f"{rotten}: sha256 differs" in err[0], err


def test_sets_sharing_a_cache_dir_keep_their_own_checksum_stamps(tiny_corpus, tmp_path):
    """Two shard dirs have the same relative file names; one data.cache_dir must not mix their stamps."""
    from convbert_ds.data.shards import verify_checksums
    sets = [tmp_path / name for name in ("a", "b")]
    for shards in sets:
        shutil.copytree(tiny_corpus["shards"], shards, ignore=shutil.ignore_patterns("index_cache"))
    for file in sets[1].rglob("shard-*"):  # b's files differ from a's (here by mtime), as two corpora would
        os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))
    cache = tmp_path / "cache"
    assert all(verify_checksums(shards, cache) > 0 for shards in sets)
    assert [verify_checksums(shards, cache) for shards in sets] == [0, 0]
    assert len(list(cache.glob("verified-*.json"))) == 2


@pytest.mark.parametrize("missing", WRITTEN_FILES[:-1])  # all but the summary, whose absence marks a foreign dir
def test_a_tokenizer_dir_missing_a_file_is_one_line(missing, tiny_corpus, tmp_path, capsys):
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tiny_corpus["tokenizer"], tokenizer)
    (tokenizer / missing).unlink()
    code = run_cli(shard_main, ["--input", str(tiny_corpus["corpus"]), "--tokenizer", str(tokenizer),
                                "--out", str(tmp_path / "shards")])
    err = _err_lines(capsys)
    assert code == 2 and len(err) == 1, err
    assert str(tokenizer) in err[0], err


@pytest.mark.parametrize("kind", ["truncated", "bit-flipped", "emptied", "another format"])
@pytest.mark.parametrize("file", WRITTEN_FILES)
def test_a_damaged_tokenizer_file_is_one_line_naming_it(file, kind, tiny_corpus, tmp_path, capsys):
    """Every file preprocessing.tokenizer writes, damaged in its content: the digests its summary recorded
    name the file before sentencepiece or transformers read it. In the summary itself the digest is what is
    flipped: its other fields describe the run and no command reads them."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tiny_corpus["tokenizer"], tokenizer)
    path = tokenizer / file
    if kind == "bit-flipped" and file == WRITTEN_FILES[-1]:
        text = path.read_text()
        digest = json.loads(text)["sha256"]
        path.write_text(text.replace(digest, digest[:5] + ("0" if digest[5] != "0" else "1") + digest[6:]))
    else:
        _damage(path, kind)
    code = run_cli(shard_main, ["--input", str(tiny_corpus["corpus"]), "--tokenizer", str(tokenizer),
                                "--out", str(tmp_path / "shards")])
    err = _err_lines(capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{path}: " in err[0] and ("damaged" in err[0] or "changed since" in err[0]), err


@pytest.fixture(scope="module")
def hf_dir(tiny_corpus, tmp_path_factory):
    """A small transformers ConvBertModel directory with the tiny corpus's tokenizer."""
    out = tmp_path_factory.mktemp("hf")
    config = transformers.ConvBertConfig(vocab_size=2000, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=128, embedding_size=64, max_position_embeddings=128)
    transformers.ConvBertModel(config).save_pretrained(out)
    for path in tiny_corpus["tokenizer"].iterdir():
        if path.name not in ("config.json",):
            shutil.copy(path, out / path.name)
    return out


@pytest.mark.parametrize("damage, message", [
    (lambda c: "{not json", "config.json"),
    (lambda c: json.dumps({**c, "model_type": "bert"}), "model_type"),
    # transformers' default (768) or another width: the weights no longer fit, and the line says which.
    (lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden_size"}), "weights do not match the config"),
    (lambda c: json.dumps({**c, "hidden_size": 96}), "weights do not match the config"),
    (lambda c: json.dumps({**c, "num_attention_heads": 5}), "num_attention_heads"),
])
def test_an_hf_dir_with_a_wrong_config_json_is_one_line(damage, message, hf_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(damage(config))
    code = convert_main(["--from-hf", str(model), "--out", str(tmp_path / "init")])
    err = _err_lines(capsys)
    assert code == 2 and len(err) == 1, err
    assert message in err[0] and str(model) in err[0], err


@pytest.mark.parametrize("kind", ["truncated", "emptied", "header"])
def test_an_hf_dir_with_damaged_weights_is_one_line(kind, hf_dir, tmp_path, capsys):
    """A weights file cut short, emptied, or with a flipped byte in its header, in a directory from
    elsewhere (no sha256 record: a flipped byte among the tensors' values is caught only where there is one,
    as in every directory we write; see below)."""
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    weights = model / "model.safetensors"
    if kind == "header":
        data = bytearray(weights.read_bytes())
        data[20] ^= 0x10
        weights.write_bytes(bytes(data))
    else:
        _damage(weights, kind)
    code = convert_main(["--from-hf", str(model), "--out", str(tmp_path / "init")])
    err = _err_lines(capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{weights}: unreadable" in err[0], err


def _finetune_error(model: Path, tmp_path, capsys) -> str:
    """Fine-tune MODEL on a small good task: the one line it must stop with (exit 2)."""
    task = tmp_path / "task.csv"
    task.write_text("text,label\n" + "".join(f"example number {i},{i % 2}\n" for i in range(8)))
    code = finetune_main(["--model", str(model), "--out", str(tmp_path / "out"), "--train", str(task),
                          "--validation", str(task), "--text-column", "text", "--label-column", "label"])
    err = _err_lines(capsys)
    assert code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("kind", ["truncated", "emptied", "another format"])
@pytest.mark.parametrize("file", TOKENIZER_JSON_FILES)
def test_an_hf_dir_with_a_damaged_tokenizer_file_is_one_line(file, kind, hf_dir, tmp_path, capsys):
    """The tokenizer files of a transformers directory without a sha256 record (one from elsewhere), read by
    fine-tuning."""
    model = tmp_path / "model"
    shutil.copytree(hf_dir, model, ignore=shutil.ignore_patterns("preprocessing_tokenizer.json"))
    _damage(model / file, kind)
    err = _finetune_error(model, tmp_path, capsys)
    assert f"{model / file}: not valid JSON" in err, err


@pytest.fixture(scope="module")
def recorded_hf_dir(hf_dir, tmp_path_factory):
    """``hf_dir`` with the sha256 record our writers leave in every model directory."""
    out = tmp_path_factory.mktemp("recorded") / "model"
    shutil.copytree(hf_dir, out, ignore=shutil.ignore_patterns("preprocessing_tokenizer.json"))
    write_checksums(out)
    return out


def _flip_inside(path: Path, needle: bytes) -> None:
    """One bit flipped inside the bytes after ``needle``: the file still parses, only its sha256 can tell."""
    data = bytearray(path.read_bytes())
    data[data.index(needle, len(data) // 2) + len(needle) + 1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_inside_recorded_weights_is_one_line(recorded_hf_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(recorded_hf_dir, model)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64] ^= 0x01  # inside the last tensor's values: safetensors reads it as a number like any other
    weights.write_bytes(bytes(data))
    code = convert_main(["--from-hf", str(model), "--out", str(tmp_path / "init")])
    err = _err_lines(capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{weights}: its bytes differ from the sha256 recorded in {CHECKSUM_FILE}" in err[0], err


@pytest.mark.parametrize("damage", ["vocabulary", "record emptied", "record truncated", "record renames a file"])
def test_a_flipped_byte_inside_a_recorded_tokenizer_is_one_line(damage, recorded_hf_dir, tmp_path, capsys):
    """Fine-tuning reads the directory's tokenizer: a vocabulary piece changed by one bit (valid JSON, a
    plausible piece) is caught by the record, and a damaged record is itself one line."""
    model = tmp_path / "model"
    shutil.copytree(recorded_hf_dir, model)
    record = model / CHECKSUM_FILE
    if damage == "vocabulary":
        _flip_inside(model / "tokenizer.json", b'"vocab"')
        named = f"{model / 'tokenizer.json'}: its bytes differ from the sha256 recorded"
    elif damage == "record emptied":
        record.write_text("")
        named = f"{record}: empty"
    elif damage == "record truncated":
        record.write_bytes(record.read_bytes()[:40])
        named = f"{record}: line 1 is not"
    else:
        record.write_text(record.read_text().replace("tokenizer.json", "tokenizer.jsom"))
        named = f"{record}: line"
    err = _finetune_error(model, tmp_path, capsys)
    assert named in err, err


def _task_file(path: Path) -> None:
    rows = [(f"sentence number {i} is {'good' if i % 2 else 'bad'}, or so", i % 2) for i in range(40)]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": text, "label": label}) + "\n" for text, label in rows))
    else:
        sep = "," if path.suffix == ".csv" else "\t"
        path.write_text(f"text{sep}label\n" + "".join(f'"{text}"{sep}{label}\n' for text, label in rows))


@pytest.mark.parametrize("kind", ["truncated", "emptied", "another format"])
@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".tsv"])
def test_a_damaged_task_file_is_one_line_naming_it(suffix, kind, hf_dir, tmp_path, capsys):
    """Fine-tuning's task files, cut inside a record, emptied or replaced by another format, through the real
    command (a flipped byte inside a text is a different text: user data carries no checksums)."""
    train_file, validation = tmp_path / f"train{suffix}", tmp_path / f"validation{suffix}"
    _task_file(train_file)
    _task_file(validation)
    if kind == "truncated":  # inside a record: a file cut between two records is a valid shorter file
        data = train_file.read_bytes()
        train_file.write_bytes(data[:data.index(b"sentence number 20") + 9])
    else:
        _damage(train_file, kind)
    code = finetune_main(["--model", str(hf_dir), "--out", str(tmp_path / "out"), "--train", str(train_file),
                          "--validation", str(validation), "--text-column", "text", "--label-column", "label"])
    err = _err_lines(capsys)
    assert code == 2 and len(err) == 1, err
    assert str(train_file) in err[0], err


@pytest.mark.parametrize("content", ['{"step": 2, "da', "[1, 2]", ""])
def test_a_damaged_trainer_state_is_one_line(content, tmp_path, capsys):
    """The converter opens a tag by its trainer_state.json (the checkpoint of tests/convert/checkpoint_v1)."""
    fixture = Path(__file__).parents[1] / "convert" / "checkpoint_v1"
    shutil.copytree(fixture / "checkpoints", tmp_path / "checkpoints")
    state = tmp_path / "checkpoints" / "step00000002" / "trainer_state.json"
    state.write_text(content)
    code = convert_main(["--checkpoint", str(tmp_path / "checkpoints"), "--out", str(tmp_path / "hf"),
                         "--tokenizer", str(fixture / "tokenizer")])
    err = _err_lines(capsys)
    assert code == 2 and len(err) == 1, err
    assert str(state) in err[0] and "the tag is damaged" in err[0], err


def test_a_set_without_a_validation_split_warns_at_start(tmp_path, capsys):
    """Not an error (the run can train), but never silence: one warning line before anything starts."""
    from shard_factory import corpus, write_shard_dir
    shards = write_shard_dir(tmp_path / "train_only", {"train": corpus()[:200]}, vocab=2000)
    code = train.main(["--config", str(TINY_CONFIG), f"data.sets=[{{path: '{shards}'}}]", "--check-config"])
    err = _err_lines(capsys)
    assert code == 0 and len(err) == 1, err
    assert err[0].startswith("warning: not every data.sets directory has a validation split, so evaluation is off")
    assert train.main(["--config", str(TINY_CONFIG), f"data.sets=[{{path: '{shards}'}}]", "eval.interval=0",
                       "--check-config"]) == 0
    assert _err_lines(capsys) == []
