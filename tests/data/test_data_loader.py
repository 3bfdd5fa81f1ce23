"""build_dataloader end to end (workers, resume, evaluation) and its errors on bad inputs."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch
from shard_factory import corpus, write_shard_dir

from convbert_ds.data.loader import build_dataloader, build_dataset, parse_sets

SEQ_LEN, MBS = 64, 4


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    docs = corpus()
    return write_shard_dir(tmp_path_factory.mktemp("loader") / "set",
                           {"train": docs[:300], "valid": docs[300:380]})


def _train(shard_dir, **kwargs):
    return build_dataloader([{"path": shard_dir, "weight": 1.0}], "train", seq_len=SEQ_LEN, micro_batch_size=MBS,
                            seed=7, progress=False, **kwargs)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_batches_have_fixed_shape(shard_dir):
    batch = next(iter(_train(shard_dir)))
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask"}
    for value in batch.values():
        assert value.dtype == torch.int64 and value.shape == (MBS, SEQ_LEN)


def test_resume_with_prefetching_workers(shard_dir):
    """Workers draw indices ahead; the checkpointed count must be what training received."""
    uninterrupted = list(itertools.islice(iter(_train(shard_dir, dp_rank=1, dp_size=2)), 12))
    loader = _train(shard_dir, dp_rank=1, dp_size=2, num_workers=2)
    received = list(itertools.islice(iter(loader), 5))
    time.sleep(0.5)  # let the workers prefetch further
    state = loader.state_dict()
    assert state["consumed_samples"] == 5 * MBS * 2
    resumed = _train(shard_dir, dp_rank=1, dp_size=2, num_workers=2, consumed_samples=state["consumed_samples"])
    rest = list(itertools.islice(iter(resumed), 7))
    assert all(_same(a, b) for a, b in zip(received + rest, uninterrupted, strict=True))
    reloaded = _train(shard_dir, dp_rank=1, dp_size=2)
    reloaded.load_state_dict(json.loads(json.dumps(state)))  # checkpoints store it as plain data
    assert _same(next(iter(reloaded)), uninterrupted[5])


def test_ranks_read_different_samples(shard_dir):
    first = [next(iter(_train(shard_dir, dp_rank=r, dp_size=2))) for r in range(2)]
    rows = [tuple(row.tolist()) for b in first for row in b["input_ids"]]
    assert len(set(rows)) == len(rows)


def test_validation_is_fixed_and_unshuffled(shard_dir):
    def valid(rank, **kwargs):
        return build_dataloader([shard_dir], "valid", seq_len=SEQ_LEN, micro_batch_size=MBS, dp_rank=rank,
                                dp_size=2, progress=False, **kwargs)

    loaders = [valid(0), valid(1)]
    passes = [list(loader) for loader in loaders]
    assert all(_same(a, b) for a, b in zip(passes[0], list(loaders[0]), strict=True))  # same every evaluation
    dataset = build_dataset([shard_dir], "valid", SEQ_LEN, progress=False)
    assert len(passes[0]) == len(loaders[0]) == len(dataset) // (MBS * 2)
    assert _same(passes[0][0], torch.utils.data.default_collate([dataset[i] for i in range(MBS)]))
    assert _same(passes[1][0], torch.utils.data.default_collate([dataset[i] for i in range(MBS, 2 * MBS)]))
    capped = valid(0, max_samples=16)
    assert len(capped) == 2 and not _same(next(iter(capped)), passes[0][0])


# ---- errors: each names the path or field and the fix, and fails fast ----

def _expect(error, match, sets, split="train", seq_len=SEQ_LEN):
    started = time.time()
    with pytest.raises(error, match=match):
        build_dataloader(sets, split, seq_len=seq_len, micro_batch_size=MBS, progress=False)
    assert time.time() - started < 30


def test_missing_manifest(tmp_path):
    _expect(FileNotFoundError, r"nowhere/manifest\.json not found.*preprocessing\.shard", [tmp_path / "nowhere"])


def test_missing_shard_file(tmp_path):
    shard_dir = write_shard_dir(tmp_path / "set", {"train": corpus()[:20]})
    (shard_dir / "train" / "shard-00001.idx").unlink()
    _expect(FileNotFoundError, r"train/shard-00001\.idx not found", [shard_dir])


def test_truncated_shard_file(tmp_path):
    shard_dir = write_shard_dir(tmp_path / "set", {"train": corpus()[:20]})
    bin_path = shard_dir / "train" / "shard-00000.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    _expect(ValueError, r"shard-00000\.bin: .* bytes but", [shard_dir])


def test_empty_split_does_not_hang(tmp_path):
    shard_dir = write_shard_dir(tmp_path / "set", {"train": corpus()[:20], "valid": []}, num_shards=1)
    _expect(ValueError, r"split 'valid' has no documents", [shard_dir], split="valid")
    _expect(ValueError, r"no split 'test' \(has \['train', 'valid'\]\)", [shard_dir], split="test")


def test_manifest_disagreeing_with_its_shards(tmp_path):
    shard_dir = write_shard_dir(tmp_path / "set", {"train": corpus()[:20]}, num_shards=1)
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["documents"] += 1
    (shard_dir / "manifest.json").write_text(json.dumps(manifest))
    _expect(ValueError, r"shard-00000\.idx: holds .* but the manifest lists", [shard_dir])


@pytest.mark.parametrize("seq_len", [7, 0, -3])
def test_seq_len_too_short(shard_dir, seq_len):
    _expect(ValueError, r"data\.seq_len must be an integer >= 8", [shard_dir], seq_len=seq_len)


def test_tokenizer_mismatch_names_both_sets(tmp_path, shard_dir):
    other = write_shard_dir(tmp_path / "other", {"train": corpus()[:20]}, tokenizer_sha256="tok-b")
    _expect(ValueError, rf"{shard_dir} and {other} use different tokenizers \(sha256 tok-a vs tok-b",
            [shard_dir, other])
    bigger = write_shard_dir(tmp_path / "bigger", {"train": corpus()[:20]}, vocab=100_000)
    _expect(ValueError, r"vocab_size \d+ vs 100000", [shard_dir, bigger])


def test_bad_weights(shard_dir):
    _expect(ValueError, r"data\.sets\[1\]\.weight must be a positive number", [shard_dir, {"path": shard_dir,
                                                                                         "weight": 0}])
    _expect(ValueError, r"data\.sets is empty", [])
    _expect(ValueError, r"data\.sets\[0\] has no 'path'", [{"weight": 1.0}])


def test_a_set_written_without_spaces_or_with_a_misspelt_key_is_refused(shard_dir):
    """As typed on a command line: ``{path:DIR}`` is one YAML key, and ``wieght: 2`` would train at weight 1."""
    from convbert_ds.formats.train_config import parse_overrides

    unspaced = parse_overrides([f"data.sets=[{{path:'{shard_dir}',weight:2.0}}]"])["data"]["sets"]
    _expect(ValueError, r"data\.sets\[0\] has unknown key\(s\) \"path:.*\", 'weight:2\.0' "
                        r"\(YAML needs a space after each ':'\); write it as \{path: SHARD_DIR, weight: 1\.0\}",
            unspaced)
    _expect(ValueError, r"data\.sets\[0\] has unknown key\(s\) 'wieght'; write it as",
            [{"path": shard_dir, "wieght": 2.0}])


def test_sets_as_the_plan_parsed_them_read_the_same(shard_dir):
    """The trainer hands the loader ``parse_sets``'s own output: parsing it again changes nothing."""
    raw = [{"path": str(shard_dir), "weight": 2.0}, shard_dir]
    assert parse_sets(parse_sets(raw)) == parse_sets(raw) == [(shard_dir, 2.0), (shard_dir, 1.0)]
