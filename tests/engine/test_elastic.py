"""Resuming on another layout (issue: elastic checkpoints), on real DeepSpeed engines over gloo CPU ranks.

A run trains on layout A and saves; the same command on layout B resumes it through the checkpoint's
universal copy. DeepSpeed's own full-state API (``gather_state``) reads both engines: the fp32 weights
and both Adam moments after loading must equal what A saved, bit for bit (every move is a copy).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from convbert_ds.config import ConfigError
from convbert_ds.convert import open_checkpoint, read_state_dict
from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from convbert_ds.formats.checkpoint import universal
from convbert_ds.formats.checkpoint.directory import UNIVERSAL
from launch import NOT_THE_SUBJECT, REPO, TINY_CONFIG, check, env, run_group, run_training, spawn_ranks, train_metrics

pytestmark = pytest.mark.slow

ZERO0, ZERO1, ZERO2, ZERO3 = (f"deepspeed.config=ds_configs/zero{s}_bf16.json" for s in (0, 1, 2, 3))
PIPELINE = ("deepspeed.config=ds_configs/pipeline_zero1_bf16.json", "pipeline.stages=2")
# fp32 weights and torch's AdamW without ZeRO, bf16 compute: loads (and is read) as ZeRO-0 fp32
AUTOCAST = "deepspeed.config=ds_configs/zero0_autocast_bf16.json"
SHORT = ("train.warmup_steps=2", "eval.interval=0", "log.interval=1", "train.micro_batch_size=4")


def run_worker(out: Path, run_dir: Path, shards: Path, nproc: int, *overrides: str) -> dict:
    """tests/engine/reshape_worker.py on ``nproc`` ranks (``spawn_ranks``); returns its state and info."""
    worker = [sys.executable, str(REPO / "tests" / "engine" / "reshape_worker.py"), str(out), "--config",
              str(TINY_CONFIG), f"data.sets=[{{path: '{shards}', weight: 1.0}}]",
              f"checkpoint.dir={run_dir / 'checkpoints'}", f"log.dir={run_dir / 'logs'}", *SHORT, *overrides]
    command = spawn_ranks(nproc, worker)
    output = check(run_group(command, 420, cwd=REPO, env=env()))
    state = {q: load_file(str(out / f"{q}.safetensors")) for q in universal.QUANTITIES}
    return {"state": state, "info": json.loads((out / "info.json").read_text()), "output": output}


def assert_same_state(saved: dict, loaded: dict) -> None:
    for quantity in universal.QUANTITIES:
        assert saved[quantity].keys() == loaded[quantity].keys(), quantity
        for name, tensor in saved[quantity].items():
            assert torch.equal(tensor, loaded[quantity][name]), f"{quantity} {name}"


# Between them, every reader (ZeRO-0 fp32/bf16, ZeRO-1/2, ZeRO-3, pipeline) and every way of loading
# (torch's Adam without ZeRO, the bf16 optimizer, ZeRO-1/2, ZeRO-3, pipeline stages).
@pytest.mark.parametrize("before, after", [
    ((2, ZERO2), (1, ZERO2)),
    ((1, ZERO2), (2, ZERO2)),
    ((2, ZERO1), (2, ZERO3)),
    ((2, *PIPELINE), (2, ZERO1)),
    ((2, ZERO1, "train.precision=bf16"), (2, *PIPELINE, "train.precision=bf16")),
    ((2, ZERO3, "train.precision=bf16"), (1, AUTOCAST)),
    ((1, ZERO0, "train.precision=fp32"), (2, ZERO0, "train.precision=bf16")),
], ids=["zero2-2to1", "zero2-1to2", "zero1-to-zero3", "pipeline-to-plain", "plain-to-pipeline-bf16",
        "zero3-bf16-to-zero0-autocast", "zero0-fp32-to-zero0-bf16"])
def test_resume_on_another_layout_restores_the_saved_state(before, after, tiny_corpus, tmp_path):
    shards = tiny_corpus["shards"]
    saved = run_worker(tmp_path / "saved", tmp_path, shards, before[0], *before[1:], "train.steps=3",
                       "checkpoint.interval=3")
    from_layout, how = read_state_dict(open_checkpoint(tmp_path / "checkpoints"))
    loaded = run_worker(tmp_path / "loaded", tmp_path, shards, after[0], *after[1:], "train.steps=3",
                        "checkpoint.interval=3")
    assert saved["info"]["resumed_at"] == 0 and loaded["info"]["resumed_at"] == 3
    assert "layout changed: " + saved["info"]["layout"] + " -> " + loaded["info"]["layout"] in loaded["output"]
    assert_same_state(saved["state"], loaded["state"])
    for key in ("consumed_samples", "lr", "global_steps", "global_samples"):
        assert loaded["info"][key] == saved["info"][key], key
    assert (tmp_path / "checkpoints" / "step00000003" / UNIVERSAL / universal.META).is_file()
    # The converter reads the universal copy now: the same weights as from the layout's own files.
    from_universal, how_now = read_state_dict(open_checkpoint(tmp_path / "checkpoints"))
    assert "universal" in how_now and "universal" not in how
    assert from_universal.keys() == from_layout.keys()
    assert all(torch.equal(from_universal[name], from_layout[name]) for name in from_layout)


def test_a_run_goes_on_at_another_size_as_it_would_have(tiny_corpus, tmp_path):
    """2 ranks -> 1 rank through the trainer's command line: the sample stream goes on exactly, the
    conversion is made once and reused, and the losses follow those of the run that stayed on 2 ranks."""
    shards, common = tiny_corpus["shards"], (ZERO2, *SHORT, "checkpoint.interval=4", "checkpoint.keep_last=5")
    stayed, moved = tmp_path / "stayed", tmp_path / "moved"
    check(run_training(stayed, shards, *common, "train.steps=4", launcher=NOT_THE_SUBJECT))
    shutil.copytree(stayed, moved)
    check(run_training(stayed, shards, *common, "train.steps=8", launcher=NOT_THE_SUBJECT))
    first = check(run_training(moved, shards, *common, "train.steps=6", nproc=1, launcher=NOT_THE_SUBJECT))
    assert "converting" in first and "layout changed: 2 ranks, ZeRO-2, fp32 -> 1 rank, ZeRO-2, fp32" in first
    # A rerun from the same checkpoint (step 4, since step 6 is removed) reuses the universal copy.
    shutil.rmtree(moved / "checkpoints" / "step00000006")
    (moved / "checkpoints" / "latest").write_text("step00000004\n")
    second = check(run_training(moved, shards, *common, "train.steps=8", nproc=1, launcher=NOT_THE_SUBJECT))
    assert "converting" not in second and "layout changed" in second
    before, after = train_metrics(stayed), train_metrics(moved)
    assert [r["consumed_samples"] for r in after] == [r["consumed_samples"] for r in before] == \
        [16 * step for step in range(1, 9)]
    # Masks and Gumbel draws come from each rank's own random stream, so another layout draws other
    # masks: the losses after the move agree to within the noise of the draws, not bit for bit.
    for a, b in zip(before[4:], after[4:]):
        assert abs(a["loss"] - b["loss"]) < 0.05 * a["loss"], (a, b)
    assert [r["loss"] for r in after[:4]] == [r["loss"] for r in before[:4]]


def test_killed_conversion_is_redone(tiny_corpus, tmp_path):
    shards, common = tiny_corpus["shards"], (ZERO2, *SHORT, "checkpoint.interval=2")
    check(run_training(tmp_path, shards, *common, "train.steps=2", launcher=NOT_THE_SUBJECT))
    killed = run_training(tmp_path, shards, *common, "train.steps=4", nproc=1, launcher=NOT_THE_SUBJECT,
                          faults={"kill_during_conversion": True})
    assert killed.returncode != 0
    tag = tmp_path / "checkpoints" / "step00000002"
    assert not (tag / UNIVERSAL).exists() and list(tag.glob(f".{UNIVERSAL}.tmp-*"))
    output = check(run_training(tmp_path, shards, *common, "train.steps=4", nproc=1, launcher=NOT_THE_SUBJECT))
    assert "converting" in output and "resumed from" in output
    assert not list(tag.glob(f".{UNIVERSAL}.tmp-*"))
    assert [r["step"] for r in train_metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_different_model_is_one_line_before_anything_starts(tiny_corpus, tmp_path):
    shards = tiny_corpus["shards"]
    check(run_training(tmp_path, shards, ZERO2, *SHORT, "train.steps=2", "checkpoint.interval=2",
                       launcher=NOT_THE_SUBJECT))
    before = sorted(p.name for p in (tmp_path / "checkpoints").rglob("*"))
    result = run_training(tmp_path, shards, ZERO2, *SHORT, "train.steps=4", "model.overrides={hidden_size: 96}")
    assert result.returncode == 2
    line = [l for l in result.stderr.splitlines() if l.startswith("config error")]
    assert len(line) == 1 and "hidden_size" in line[0] and "checkpoint.dir" in line[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "launcher=" not in result.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").rglob("*")) == before
    # Shards of another tokenizer: refused by the same check, before any process group.
    state_file = tmp_path / "checkpoints" / "step00000002" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["tokenizer"]["sha256"] = "0" * 64
    state_file.write_text(json.dumps(state))
    cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{shards}'}}]", f"checkpoint.dir={tmp_path / 'checkpoints'}",
                                    ZERO2])
    with pytest.raises(ConfigError, match="holds a run on shards of another tokenizer"):
        resolve(cfg, world_size=2)


def test_more_pipeline_stages_than_layers_is_one_line(tiny_corpus):
    cfg = load_config(TINY_CONFIG, [f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]", "pipeline.stages=10",
                                    "deepspeed.config=ds_configs/pipeline_zero1_bf16.json"])
    with pytest.raises(ConfigError, match=r"pipeline.stages=10: the model has 9 layers .* use at most 9 stages"):
        resolve(cfg, world_size=10)
