"""The out-of-domain task (convbert_ds/builtin/aws_api_passages.py) and the corpus it is held out of."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from convbert_ds.builtin import aws_api_passages as cdt
from convbert_ds.builtin import docstring_summaries as tt
from convbert_ds.builtin.labelled_splits import dedup_key


def _read(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cloud_docs")
    info = cdt.write_cloud_docs_task(out)
    return {"dir": out, "info": info, "train": _read(out / "train.jsonl"), "validation": _read(out / "validation.jsonl")}


def test_balanced_disjoint_and_of_another_length(task):
    for split in ("train", "validation"):
        labels = [row["label"] for row in task[split]]
        assert {label: labels.count(label) for label in set(labels)} == {label: 60 for label in cdt.SERVICES}
    keys = {split: {dedup_key(row["text"]) for row in task[split]} for split in ("train", "validation")}
    assert len(keys["train"]) == len(task["train"]) and not keys["train"] & keys["validation"]
    words = sorted(len(row["text"].split()) for row in task["train"] + task["validation"])
    assert words[0] >= cdt.MIN_WORDS and words[-1] <= cdt.MAX_WORDS
    assert words[len(words) // 2] > 40, "longer than the in-domain task's summaries (6 to 40 words)"


def test_passages_are_plain_prose_naming_no_service(task):
    for row in task["train"] + task["validation"]:
        assert not re.search(r"</?[A-Za-z]|&[a-z]+;", row["text"]), row
        assert not cdt._SERVICE_NAME.search(row["text"]), row


def test_same_files_on_every_run(task, tmp_path):
    cdt.write_cloud_docs_task(tmp_path)
    for name in ("train.jsonl", "validation.jsonl"):
        assert (tmp_path / name).read_bytes() == (task["dir"] / name).read_bytes()


def test_corpus_filter_drops_copies_of_any_passage(task):
    banned = tt.excluded_shingles(tt.TASK_EXCLUDED_NAMES)
    lengths = sorted({len(shingle) for shingle in banned})
    for row in task["validation"][:50] + task["train"][:50]:
        quoted = " ".join(dedup_key(row["text"]).split()[5:5 + tt.SHINGLE_WORDS])  # a few words, inside other text
        assert tt._copies_excluded_text(f"The service notes that {quoted} and more.", banned, lengths), row


def test_bounded_corpus_holds_no_passage(task, tmp_path):
    text = tt.write_pretraining_corpus(tmp_path / "corpus.txt", max_bytes=1_500_000).read_text(encoding="utf-8")
    normalized = f" {dedup_key(text)} "
    assert not [row["text"] for row in task["train"] + task["validation"] if f" {dedup_key(row['text'])} " in normalized]
