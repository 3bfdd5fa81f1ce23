"""The downstream task and the pretraining corpus it is held out of (convbert_ds/builtin/docstring_summaries.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convbert_ds.builtin import docstring_summaries as tt
from convbert_ds.builtin.labelled_splits import dedup_key


def _read(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("task")
    info = tt.write_transfer_task(out, seed=0)
    return {"dir": out, "info": info, "train": _read(out / "train.jsonl"), "validation": _read(out / "validation.jsonl")}


def test_classes_and_counts(task):
    for split, per_class in (("train", 500), ("validation", 100)):
        labels = [row["label"] for row in task[split]]
        assert {label: labels.count(label) for label in set(labels)} == {label: per_class for label in tt.TASK_CLASSES}
        assert task["info"]["counts"][split] == per_class * len(tt.TASK_CLASSES)
    assert set(task["info"]["classes"]) == set(tt.TASK_CLASSES)


def test_splits_are_disjoint_and_deduplicated(task):
    keys = {split: [dedup_key(row["text"]) for row in task[split]] for split in ("train", "validation")}
    assert all(len(set(k)) == len(k) for k in keys.values())
    assert not set(keys["train"]) & set(keys["validation"])


def test_examples_are_short_and_do_not_name_a_library(task):
    for row in task["train"] + task["validation"]:
        assert 6 <= len(row["text"].split()) <= 40
        assert not tt._LIBRARY_NAME.search(row["text"]), row


def test_same_seed_same_files_other_seed_other_split(task, tmp_path):
    tt.write_transfer_task(tmp_path / "again", seed=0)
    tt.write_transfer_task(tmp_path / "other", seed=1)
    for name in ("train.jsonl", "validation.jsonl"):
        assert (tmp_path / "again" / name).read_bytes() == (task["dir"] / name).read_bytes()
    assert _read(tmp_path / "other" / "validation.jsonl") != task["validation"]


def test_asking_for_more_examples_than_a_class_has_fails(tmp_path):
    with pytest.raises(ValueError, match="not enough examples"):
        tt.write_transfer_task(tmp_path, train_per_class=10**6)


def test_corpus_reads_no_task_package_nor_its_readme():
    names = {tt._top_level_name(entry) for entry in tt._site_entries(tt.TASK_EXCLUDED_NAMES)}
    assert names and not names & tt.TASK_EXCLUDED_NAMES
    assert {"torch", "transformers"} <= names


def test_copies_of_task_text_are_recognised(task):
    banned = tt.excluded_shingles(tt.TASK_EXCLUDED_NAMES)
    lengths = sorted({len(shingle) for shingle in banned})
    for row in task["validation"][:50]:
        copy = f"As another library puts it: {row['text'].upper()} That is all."
        assert tt._copies_excluded_text(copy, banned, lengths), row
    assert not tt._copies_excluded_text("The weather was pleasant and the river ran quietly past the mill.",
                                        banned, lengths)


def test_bounded_corpus_holds_no_task_text(task, tmp_path):
    corpus = tt.write_pretraining_corpus(tmp_path / "corpus.txt", max_bytes=1_500_000)
    text = corpus.read_text(encoding="utf-8")
    assert len(text) > 1_000_000
    normalized = dedup_key(text)
    leaked = [row["text"] for row in task["train"] + task["validation"]
              if f" {dedup_key(row['text'])} " in f" {normalized} "]
    assert not leaked


def test_definitions_found_without_walking_expressions_are_ast_walks():
    """The corpus skips expressions when looking for docstrings: the same definitions, in ast.walk's order, on
    definitions nested in every kind of statement and on real files."""
    import ast

    from convbert_ds.builtin.stdlib_docstrings import _DEFINITIONS, _statements, _stdlib_files

    nested = '''
"""module"""
class A:
    """a"""
    def f(self):
        """f"""
        if x:
            def g(): """g"""
        try:
            pass
        except E:
            def h(): """h"""
        else:
            async def i(): """i"""
        finally:
            with c:
                class J: """j"""
    match v:
        case 1:
            def k(): """k"""
    y = [lambda: 0 for _ in z]
'''
    sources = [nested] + [path.read_text(encoding="utf-8") for path in _stdlib_files()[:40]]
    for source in sources:
        tree = ast.parse(source)
        want = [node for node in ast.walk(tree) if isinstance(node, (ast.Module, *_DEFINITIONS))]
        assert [node for node in _statements(tree) if isinstance(node, (ast.Module, *_DEFINITIONS))] == want
    found = [ast.get_docstring(node) for node in _statements(ast.parse(nested))
             if isinstance(node, (ast.Module, *_DEFINITIONS))]
    assert sorted(found) == ["a", "f", "g", "h", "i", "j", "k", "module"]
