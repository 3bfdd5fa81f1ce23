"""``benchmarks/ablation.py`` end to end on a tiny budget: two variants (ConvBERT and dynamic convolution),
4 pretraining steps on 1 rank, one fine-tuning seed of one epoch on a small transfer task."""

from __future__ import annotations

import json
import math
import sys

import pytest

from convbert_ds.builtin.docstring_summaries import write_transfer_task
from launch import REPO, env, run_group


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The script's own downstream task, 8 training and 4 dev examples per class (a few seconds to build)."""
    out = tmp_path_factory.mktemp("task")
    write_transfer_task(out, train_per_class=8, dev_per_class=4)
    return out


def _ablation(work, shards, task) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "ablation.py"), "--work-dir", str(work),
            "--variants", "bnk-sdconv,dynamic", "--steps", "4", "--batch", "8", "--seq-len", "64", "--ranks", "1",
            "--seeds", "1", "--threads", "1", "--shards", str(shards), "--task-dir", str(task),
            "--finetune-arg", "--epochs 1 --batch-size 8"]


def _in_unit_interval(result: dict) -> bool:
    return len(result["scores"]) == 1 and all(0.0 <= s <= 1.0 for s in result["scores"])


@pytest.mark.slow
def test_ablation_reports_both_variants_and_resumes(tiny_corpus, task, tmp_path):
    work = tmp_path / "work"
    command = _ablation(work, tiny_corpus["shards"], task)
    first = run_group(command, timeout=300, cwd=REPO, env=env())
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]

    variants = json.loads((work / "ablation.json").read_text())["variants"]
    assert set(variants) == {"bnk-sdconv", "dynamic"}
    for result in variants.values():
        assert all(math.isfinite(result["valid"][key]) for key in ("mlm_loss", "rtd_loss"))
        assert result["pretrain_wall_s"] > 0
    # Same budget in samples, not in FLOPs: the span-aware key projection makes ConvBERT's sample dearer.
    assert variants["bnk-sdconv"]["flops_per_sample"] > variants["dynamic"]["flops_per_sample"] > 0
    convbert = variants["bnk-sdconv"]
    assert all(_in_unit_interval(got) for got in convbert["finetune"].values())
    assert convbert["gain"] == pytest.approx(convbert["finetune"]["pretrained"]["median"]
                                             - convbert["finetune"]["random_init"]["median"])
    # Dynamic convolution has no transformers equivalent: fine-tuned from the converter's own format.
    assert all(_in_unit_interval(got) for got in variants["dynamic"]["finetune"].values())
    assert variants["dynamic"]["gain"] is not None

    report = (work / "ablation.md").read_text()
    for row in ("| bnk-sdconv | +BNK+SDConv (ConvBERT) |", "| bnk-sdconv | span-based dynamic, K=9 |",
                "| dynamic | dynamic, K=9 |"):
        assert row in report and row in first.stdout
    assert "paper's ordering bnk-sdconv > dynamic > conventional" in report  # conventional not run: cannot tell

    # Re-running launches no pretraining and keeps the recorded wall times (the fine-tuning results too).
    again = run_group(command, timeout=120, cwd=REPO, env=env())
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "pretraining:" not in again.stdout
    rerun = json.loads((work / "ablation.json").read_text())["variants"]
    assert {s: r["pretrain_wall_s"] for s, r in rerun.items()} == {s: r["pretrain_wall_s"] for s, r in variants.items()}
    assert rerun["bnk-sdconv"]["finetune"] == convbert["finetune"]
