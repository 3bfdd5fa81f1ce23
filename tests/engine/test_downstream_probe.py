"""``eval.downstream``: a 2-rank tiny run fine-tunes its checkpoints on a task in a side process and logs the
scores, without changing a single training loss; a probe that fails is a warning, not a crash."""

from __future__ import annotations

import json

import pytest

from launch import NOT_THE_SUBJECT, check, run_training, train_metrics
from shard_factory import read_text_documents

pytestmark = pytest.mark.slow

COMMON = ["train.steps=6", "checkpoint.interval=3", "eval.interval=0"]
PROBE_ARGS = "[--epochs, 1, --max-train-examples, 16, --batch-size, 8, --max-seq-length, 32]"


@pytest.fixture(scope="module")
def task(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("probe_task")
    lines = [line for doc in read_text_documents(tiny_corpus["corpus"]) for line in doc if len(line.split()) > 5][:48]
    rows = [{"text": line, "label": "long" if len(line.split()) > 15 else "short"} for line in lines]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    (root / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[32:]))
    (root / "broken.jsonl").write_text("".join(json.dumps({"sentence": r["text"]}) + "\n" for r in rows[:32]))
    return root


def _probe(task, train_file: str) -> list[str]:
    return ["eval.downstream.interval=3", f"eval.downstream.train={task / train_file}",
            f"eval.downstream.validation={task / 'dev.jsonl'}", f"eval.downstream.finetune_args={PROBE_ARGS}"]


def _rows(run_dir, split: str) -> list[dict]:
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["split"] == split]


def test_probe_logs_scores_and_leaves_the_losses_unchanged(tiny_corpus, task, tmp_path):
    check(run_training(tmp_path / "plain", tiny_corpus["shards"], *COMMON, launcher=NOT_THE_SUBJECT))
    output = check(run_training(tmp_path / "probed", tiny_corpus["shards"], *COMMON, *_probe(task, "train.jsonl"),
                                launcher=NOT_THE_SUBJECT))
    drop = ("samples_per_s", "tokens_per_s", "tflops", "mfu")  # wall-clock figures
    plain, probed = ([{k: v for k, v in r.items() if k not in drop} for r in train_metrics(tmp_path / d)]
                     for d in ("plain", "probed"))
    assert plain == probed and len(plain) == 6
    rows = _rows(tmp_path / "probed", "downstream")
    assert [r["step"] for r in rows] == [3, 6], output[-3000:]
    assert all(0.0 <= r["score"] <= 1.0 and 0.0 <= r["random_init"] <= 1.0 for r in rows)
    assert len({r["random_init"] for r in rows}) == 1  # the baseline runs once
    assert "downstream: random-init baseline" in output and "downstream step 6 | score" in output
    probes = tmp_path / "probed" / "logs" / "downstream"
    assert (probes / "step00000006" / "best" / "config.json").is_file()
    assert json.loads((probes / "random_init" / "results.json").read_text())["init"] == "random"

    from convbert_ds.plot import plot

    assert plot(tmp_path / "probed" / "logs", tmp_path / "curves.png").stat().st_size > 0


def test_failing_probe_is_a_warning(tiny_corpus, task, tmp_path):
    output = check(run_training(tmp_path, tiny_corpus["shards"], *COMMON, *_probe(task, "broken.jsonl"),
                                launcher=NOT_THE_SUBJECT))
    assert "warning: downstream probe step00000003 failed" in output
    assert "column 'text' not found" in output  # the probe's own one-line error, in the warning
    assert not _rows(tmp_path, "downstream")
    assert len(train_metrics(tmp_path)) == 6
