"""ELECTRA on DeepSpeed's pipeline engine: equal to the plain model, trains, checkpoints, rejects bad configs.

Real engines on gloo CPU ranks (``tests/engine/pipeline_worker.py`` under torchrun); the worker records
numbers, the checks are here.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.model import ElectraForPretraining
from convbert_ds.engine.pipeline import check_pipeline_ds_config
from convbert_ds.formats.checkpoint.names import pipeline_layer_names
from launch import run_group

WORKER = Path(__file__).with_name("pipeline_worker.py")
REPO = WORKER.parent.parent
# fp32: the pipeline computes the same operations on the same values; only summation order may differ.
RELATIVE_TOLERANCE = 1e-5


def _launch(scenario: str, ranks: int, out_dir: Path) -> list[dict]:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                        str(ranks), str(WORKER), scenario, str(out_dir)], 400, cwd=REPO, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-8000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(ranks)]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("pipeline_parity")
    return _launch("parity", 2, out_dir), out_dir


@pytest.fixture(scope="module")
def topologies(tmp_path_factory):
    return _launch("topologies", 4, tmp_path_factory.mktemp("pipeline_topologies"))


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return _launch("train", 2, tmp_path_factory.mktemp("pipeline_train"))


def _assert_matches_plain(runs: list[dict]) -> None:
    first = runs[0]
    for rank, run in enumerate(runs):
        assert run == first, f"rank {rank} reports other metrics than rank 0"
    for step, (pipe, plain) in enumerate(zip(first["pipe"], first["plain"])):
        assert pipe.keys() == plain.keys()
        for name in plain:
            assert pipe[name] == pytest.approx(plain[name], rel=RELATIVE_TOLERANCE, abs=1e-7), (
                f"step {step} {name}: pipeline {pipe[name]} vs plain {plain[name]} (stages start at "
                f"{first['stage_starts']})")
        assert first["returned_loss"][step] == pytest.approx(pipe["loss"], rel=RELATIVE_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["electra_zero0", "electra_zero1", "electra_zero1_activation_checkpointing",
                                 "mlm_zero1", "electra_zero1_packed_documents"])
def test_pipeline_equals_plain_model(parity, run):
    """First step: loss and every metric; second step (after an AdamW step on both): again, which also
    checks the gradients, the tied table's included, and ZeRO-1's gradient clipping across stages;
    then ``eval_batch``."""
    runs, _ = parity
    _assert_matches_plain([r[run] for r in runs])


@pytest.mark.slow
@pytest.mark.parametrize("run", ["four_stages", "two_stages_two_replicas"])
def test_pipeline_equals_plain_model_on_four_ranks(topologies, run):
    """Middle stages (4 stages: gradients cross stages both ways) and data parallelism (2 x 2)."""
    _assert_matches_plain([r[run] for r in topologies])


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_checkpoint_round_trip(parity, zero_stage):
    runs, _ = parity
    run = runs[0][f"checkpoint_zero{zero_stage}"]
    assert run["loaded"]
    assert run["fresh"] != pytest.approx(run["continued"][0], rel=1e-3), "the loading engine started elsewhere"
    # The step right after loading (weights) and the one after it (optimizer state too).
    assert run["resumed"] == pytest.approx(run["continued"], rel=1e-6)


@pytest.mark.slow
def test_layer_files_hold_the_plain_parameters(parity):
    """Each ``layer_XX-model_states.pt`` key, under ``pipeline_layer_names``, is a plain parameter of that
    shape; together they are all of them (the tied table once)."""
    runs, out_dir = parity
    config = ElectraConfig(**runs[0]["checkpoint_zero1"]["config"])
    plain = {name: p.shape for name, p in ElectraForPretraining(config).named_parameters()}  # tied: listed once
    names = pipeline_layer_names(config)
    found = {}
    for path in sorted((out_dir / "ckpt1" / "step1").glob("layer_*-model_states.pt")):
        index = int(path.name.split("-")[0].removeprefix("layer_"))
        state = torch.load(path, map_location="cpu")
        if index not in names:
            assert not state, f"{path.name} has parameters but no plain name"
            continue
        for key, tensor in state.items():
            found[names[index] + key] = tensor.shape
    assert found == plain


@pytest.mark.slow
def test_trains_on_real_text(training):
    history = training[0]["fp32"]
    assert all(run["fp32"] == history for run in training), "ranks disagree on the metrics"
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    first, last = history[:3], history[-10:]
    assert mean(last, "loss") < mean(first, "loss") - 5
    assert mean(last, "mlm_loss") < mean(first, "mlm_loss") - 0.5
    assert mean(last, "rtd_accuracy") > history[0]["rtd_accuracy"]
    assert mean(history, "mlm_accuracy") > 0, "the generator's accuracy never reached the last stage"


@pytest.mark.slow
def test_bf16_with_zero1_trains(training):
    history = training[0]["bf16"]
    assert all(math.isfinite(value) for row in history for value in row.values())
    assert history[-1]["loss"] < history[0]["loss"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_are_rejected_before_the_engine_starts(stage):
    with pytest.raises(ValueError, match=f"zero_optimization.stage={stage} cannot be combined with pipeline "
                                         "parallelism; use stage 0 or 1"):
        check_pipeline_ds_config({"zero_optimization": {"stage": stage}, "gradient_clipping": 0.0})


def test_other_pipeline_config_errors():
    with pytest.raises(ValueError, match="bf16.enabled=true with zero_optimization.stage=0.*set zero_optimization"):
        check_pipeline_ds_config({"bf16": {"enabled": True}, "gradient_clipping": 0.0})
    # DeepSpeed clips at 1.0 unless told otherwise, and with ZeRO-0 it would use the first stage's norm only.
    with pytest.raises(ValueError, match="gradient_clipping=1.0 with zero_optimization.stage=0 in fp32"):
        check_pipeline_ds_config({"zero_optimization": {"stage": 0}})
    for valid in ({"zero_optimization": {"stage": 1}}, {"zero_optimization": {"stage": 0}, "gradient_clipping": 0},
                  {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "gradient_clipping": 1.0}):
        check_pipeline_ds_config(valid)
