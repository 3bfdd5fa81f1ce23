"""F1's positive class: GLUE's fixed "1" (MRPC, QQP), a two-label custom task's ``--positive-label`` or its
documented default, the one-line refusals, and where the choice is recorded. No process is started."""

from __future__ import annotations

import csv

import pytest

from convbert_ds.finetune.__main__ import parse_args, read_task
from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.finetune.metrics import compute_metrics, f1
from convbert_ds.finetune.recipe import Recipe
from convbert_ds.finetune.run import RunSpec, _settings
from convbert_ds.finetune.tagging import TaggingTask
from convbert_ds.finetune.tasks import TaskData, choose_positive_label, default_positive_label, read_custom

# references [1,1,1,1,0,0,0], predictions [1,1,1,0,0,0,1]
# class 1 positive: TP=3 FP=1 FN=1 -> F1 = 6/8 = 3/4
# class 0 positive: TP=2 (rows 5,6) FP=1 (row 4) FN=1 (row 7) -> F1 = 4/6 = 2/3
REFERENCES = [1, 1, 1, 1, 0, 0, 0]
PREDICTIONS = [1, 1, 1, 0, 0, 0, 1]


def task(name, labels, positive_label=None, task_type="classification"):
    return TaskData(name, task_type, labels, [], {"dev": []}, "accuracy", {}, positive_label=positive_label)


@pytest.mark.parametrize("labels, positive", [
    (["0", "1"], "1"),
    (["-1", "1"], "1"),
    (["false", "true"], "true"),
    (["No", "Yes"], "Yes"),
    (["Positive", "negative"], "Positive"),  # sorts first: the pair, not the order, decides
    (["NEG", "POS"], "POS"),
    (["1", "2"], "2"),  # no pair (Yelp polarity's 1 is negative): the label that sorts second
    (["cat", "dog"], "dog"),
])
def test_default_positive_label(labels, positive):
    assert default_positive_label(labels)[0] == positive


def test_the_default_is_said_in_one_note(capsys):
    assert choose_positive_label("classification", ["Positive", "negative"], None) == "Positive"
    assert capsys.readouterr().out == ("note: F1's positive class is 'Positive' (the positive side of "
                                       "Positive/negative); choose it with --positive-label\n")
    assert choose_positive_label("classification", ["cat", "dog"], None) == "dog"
    assert capsys.readouterr().out == ("note: F1's positive class is 'dog' (the label that sorts second: the labels "
                                       "are no pair like 1/0, yes/no or true/false); choose it with "
                                       "--positive-label\n")


def test_an_explicit_positive_label_wins_and_no_f1_means_none(capsys):
    assert choose_positive_label("classification", ["neg", "pos"], "neg") == "neg"
    assert choose_positive_label("classification", ["a", "b", "c"], None) is None
    assert choose_positive_label("regression", [], None) is None
    assert capsys.readouterr().out == ""


def test_f1_counts_the_positive_label():
    assert f1(PREDICTIONS, REFERENCES) == pytest.approx(3 / 4)
    assert f1(PREDICTIONS, REFERENCES, positive=0) == pytest.approx(2 / 3)
    # A custom task's chosen label, by index into label_names: "neg" is class 0.
    assert compute_metrics(task("custom", ["neg", "pos"], "neg"), PREDICTIONS, REFERENCES)["f1"] == pytest.approx(2 / 3)
    assert compute_metrics(task("custom", ["neg", "pos"], "pos"), PREDICTIONS, REFERENCES)["f1"] == pytest.approx(3 / 4)
    # Made without one, the default: "Positive" is class 0 here (it sorts before "negative").
    assert compute_metrics(task("custom", ["Positive", "negative"]), PREDICTIONS, REFERENCES)["f1"] == \
        pytest.approx(2 / 3)
    # GLUE keeps the official class "1".
    assert compute_metrics(task("mrpc", ["0", "1"], "1"), PREDICTIONS, REFERENCES)["f1"] == pytest.approx(3 / 4)
    assert compute_metrics(task("qqp", ["0", "1"]), PREDICTIONS, REFERENCES)["f1"] == pytest.approx(3 / 4)


@pytest.mark.parametrize("task_type, labels, requested, message", [
    ("classification", ["neg", "pos"], "positive",
     "--positive-label positive: not one of the task's labels ('neg', 'pos'); pass one of them as written in the "
     "label column"),
    ("classification", ["a", "b", "c"], "a",
     "--positive-label a: the task has 3 labels ('a', 'b', 'c'); F1, and so a positive class, is reported for two "
     "labels only; drop the option"),
    ("regression", [], "1",
     "--positive-label 1: the task is a regression, which has no classes; drop the option, or pass --task-type "
     "classification if the labels are classes"),
])
def test_a_positive_label_that_cannot_apply_is_refused(task_type, labels, requested, message):
    with pytest.raises(FinetuneError) as refused:
        choose_positive_label(task_type, labels, requested)
    assert str(refused.value) == message


def _args(*options):
    return parse_args(["--model", "m", "--out", "o", *options])


@pytest.mark.parametrize("options, message", [
    (["--glue-task", "mrpc", "--data-dir", "glue/MRPC"],
     "--positive-label 0: GLUE tasks keep the benchmark's positive class (MRPC's and QQP's '1'); drop the option, "
     "which is for custom classification tasks with two labels"),
    (["--task", "conll", "--train", "t.txt", "--validation", "v.txt"],
     "--positive-label 0: --task conll has no positive class; drop the option, which is for custom classification "
     "tasks with two labels"),
])
def test_positive_label_with_a_glue_or_builtin_task_is_refused(options, message):
    with pytest.raises(FinetuneError) as refused:
        read_task(_args(*options, "--positive-label", "0"))  # refused before any file is read
    assert str(refused.value) == message


def _write_csv(path, labels):
    with path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["text", "label"], *[[f"text {i}", label] for i, label in enumerate(labels)]])
    return path


def test_the_option_reaches_the_custom_task_and_the_run_settings(tmp_path, capsys):
    data = _write_csv(tmp_path / "train.csv", ["no", "yes", "no"])
    custom = ["--train", str(data), "--validation", str(data), "--text-column", "text", "--label-column", "label"]
    chosen = read_task(_args(*custom, "--positive-label", "no"))
    assert chosen.positive_label == "no" and "note:" not in capsys.readouterr().out
    default = read_task(_args(*custom))
    assert default.positive_label == "yes" and "note: F1's positive class is 'yes'" in capsys.readouterr().out
    with pytest.raises(FinetuneError, match=r"^--positive-label maybe: not one of the task's labels \('no', 'yes'\)"):
        read_task(_args(*custom, "--positive-label", "maybe"))
    # Recorded with the task in run.json and results.json (both are _settings); absent where there is no F1.
    settings = _settings(RunSpec(chosen, "m", tmp_path / "out", Recipe()), Recipe(), "model")
    assert settings["task"]["positive_label"] == "no"
    tagging = TaggingTask("conll", ["O", "B-X"], [], {}, {})
    assert "positive_label" not in _settings(RunSpec(tagging, "m", tmp_path / "out", Recipe()), Recipe(), "m")["task"]
