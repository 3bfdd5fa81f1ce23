"""The table of ``python -m convbert_ds.evaluate`` from jobs' results: the paper's row for its sizes, the two
averages by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from convbert_ds.config import preset
from convbert_ds.evaluate.paper import GLUE
from convbert_ds.evaluate.plan import Job, TaskSource
from convbert_ds.evaluate.report import markdown, paper_size, summarise
from convbert_ds.evaluate.workers import Outcome
from convbert_ds.finetune.recipe import Recipe


def _outcome(task: str, seed: int, value: float) -> Outcome:
    split = {"mnli": "dev_matched"}.get(task, "dev")
    final = {split: {"accuracy": value, "f1": value / 2, "mcc": value, "pearson": value / 2, "spearman": value}}
    if task == "mnli":
        final["dev_mismatched"] = {"accuracy": value / 2}
    return Outcome(Job(TaskSource(task, (Path("x"),)), "pretrained", seed, Path("m"), Recipe(), Path("o")), final)


def test_the_paper_row_and_both_averages():
    assert [paper_size(preset(name)) for name in ("small", "medium-small", "base", "tiny")] == \
        ["small", "medium-small", "base", None]
    values = {task: 0.5 + i / 100 for i, task in enumerate(GLUE)}
    outcomes = [_outcome(task, seed, value + seed / 10) for task, value in values.items() for seed in (0, 1, 2)]
    summary = summarise(outcomes, GLUE, preset("base"), {"model": "m", "tasks": list(GLUE), "command": "c"})
    row = summary["rows"]["pretrained"]
    median = {task: 100 * (value + 0.1) for task, value in values.items()}  # seed 1's, the middle one
    assert row["glue_average"] == pytest.approx(sum(median[t] for t in GLUE[:8]) / 8)  # WNLI left out
    # Leaderboard: MRPC, QQP (F1, accuracy), STS-B (Pearson, Spearman), MNLI (m, mm) averaged first; WNLI in.
    halves = {t: (median[t] + median[t] / 2) / 2 for t in ("mrpc", "qqp", "stsb", "mnli")}
    assert row["leaderboard_average"] == pytest.approx(sum(halves.get(t, median[t]) for t in GLUE) / 9)
    table = markdown(summary)
    assert "| paper, ConvBERT-base | 85.3 | 92.4 | 89.6 | 74.7 | 95.0 | 88.2 | 66.0 | 88.2 | - | 84.9 |" in table
    assert "on the GLUE *test* set (its Table 3" in table


def test_a_missing_task_leaves_the_averages_unset():
    outcomes = [_outcome("rte", 0, 0.6)]
    summary = summarise(outcomes, GLUE, preset("tiny"), {"model": "m", "tasks": list(GLUE), "command": "c"})
    assert summary["rows"]["pretrained"]["glue_average"] is None and "paper" not in summary
    assert "n/a (not every task ran)" in markdown(summary)
