"""The margin of pretrained over random init and its bootstrap interval over seeds."""

import json

import pytest

from convbert_ds.errors import UserError
from convbert_ds.finetune.margin import Margin, bootstrap_interval, seed_scores


def test_interval_of_identical_seeds_is_the_margin_itself():
    assert bootstrap_interval([70.0] * 5, [60.0] * 5) == (10.0, 10.0)


def test_interval_brackets_the_margin_and_is_bounded_by_the_extreme_pairs():
    pretrained, random_init = [62.0, 66.0, 70.0, 71.0, 75.0], [55.0, 60.0, 61.0, 64.0, 68.0]
    low, high = bootstrap_interval(pretrained, random_init)
    margin = Margin("t", "accuracy", pretrained, random_init)
    assert margin.value == 70.0 - 61.0
    assert low < margin.value < high
    # no resample's median lies outside its init's range
    assert min(pretrained) - max(random_init) <= low and high <= max(pretrained) - min(random_init)
    assert bootstrap_interval(pretrained, random_init) == (low, high), "the same draws on every call"


def test_more_seeds_of_the_same_spread_narrow_the_interval():
    few = bootstrap_interval([60.0, 70.0, 80.0], [50.0, 60.0, 70.0])
    many = bootstrap_interval([60.0, 70.0, 80.0] * 4, [50.0, 60.0, 70.0] * 4)
    assert many[1] - many[0] < few[1] - few[0]


def test_scores_are_read_per_seed_and_reported(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"seeds": [
        {"seed": 0, "final": {"validation": {"accuracy": 0.5}}},
        {"seed": 1, "final": {"validation": {"accuracy": 0.75}}}]}))
    assert seed_scores(tmp_path, "accuracy", 100) == [50.0, 75.0]
    few = Margin("docstrings", "accuracy x 100", [50.0, 75.0], [40.0, 45.0])
    report = few.report()
    assert "margin       +20.0 points" in report and "2/2 pretrained seeds above" in report
    assert few.interval is None and "no interval under 5 seeds" in report and few.as_dict()["interval95"] is None
    enough = Margin("cloud", "accuracy x 100", [70.0, 71.0, 72.0, 73.0, 74.0], [60.0, 62.0, 64.0, 66.0, 68.0])
    assert enough.as_dict()["interval95"] == list(enough.interval)
    assert f"95% interval {enough.interval[0]:+.1f} to {enough.interval[1]:+.1f}" in enough.report()
    with pytest.raises(UserError, match="results.json: a seed has no final validation f1; delete it and rerun"):
        seed_scores(tmp_path, "f1")  # results of another task: one line, not a KeyError


def test_a_torn_results_file_is_one_line(tmp_path):
    (tmp_path / "results.json").write_text('{"seeds": [{"final": {"valid')
    with pytest.raises(UserError) as caught:
        seed_scores(tmp_path, "accuracy")
    assert str(caught.value) == (f"{tmp_path / 'results.json'}: not valid JSON (Unterminated string starting at: "
                                 "line 1 column 23 (char 22)); delete it and rerun the same command: that "
                                 "fine-tuning is summarised again")
