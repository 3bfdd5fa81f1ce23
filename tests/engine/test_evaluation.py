"""The validation pass combines batches and ranks: its ``rtd_auc`` is the AUC of the whole validation set
(every rank's batches together), not a mean of per-batch AUCs, and the pass reads the device once at its end.
Two real gloo ranks run the trainer's ``Evaluation`` (``evaluation_worker.py``); the pipeline's pass runs its
real loss function and ``pipeline_metrics`` under a one-stage stand-in for DeepSpeed's pipeline engine."""

import json
import sys

import pytest
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.engine.evaluation import Evaluation
from convbert_ds.engine.pipeline import pipeline_metrics
from convbert_ds.engine.pipeline.layers import DiscriminatorHidden, float_row, to_pipe
from convbert_ds.engine.pipeline.module import ElectraPipelineLoss
from convbert_ds.model.electra import binary_auc
from evaluation_worker import PADDED, validation_batches
from exact_auc import exact_auc
from launch import REPO, check, env, run_group, spawn_ranks


def _pooled(batches):
    """Every batch's real tokens together: their scores and classes."""
    scores, positive = [], []
    for b in batches:
        scores += b["logits"][:, :-PADDED].flatten().tolist()
        positive += b["replaced"][:, :-PADDED].flatten().tolist()
    return scores, positive


@pytest.mark.slow  # starts 2 ranks
def test_validation_rtd_auc_is_the_whole_sets_auc_across_batches_and_ranks(tmp_path):
    check(run_group(spawn_ranks(2, [sys.executable, str(REPO / "tests" / "engine" / "evaluation_worker.py"),
                                    str(tmp_path)]), 180, cwd=REPO, env=env()))
    result = json.loads((tmp_path / "metrics.json").read_text())
    batches = validation_batches()
    exact = exact_auc(*_pooled(batches))
    per_batch = [binary_auc(b["logits"], b["replaced"], b["mask"].float()).item() for b in batches]
    mean_of_batches = sum(per_batch) / len(per_batch)
    # The case tells them apart: each batch ranks well alone, the set does not.
    assert mean_of_batches - exact > 0.1, (mean_of_batches, exact)
    # Bins of 2**-15 logits over scores of unit spread: the bound (model.electra.histogram_auc) is below 6.1e-6.
    assert abs(result["metrics"]["rtd_auc"] - exact) < 6.1e-6, (result["metrics"]["rtd_auc"], exact)
    assert result["batches_per_rank"] == 3
    assert result["syncs"] <= 1, "one read at the end of the pass, none per batch"


class _LastStage:
    """What the pipeline pass and ``pipeline_metrics`` use of DeepSpeed's ``PipelineEngine``, as one stage and one
    replica: ``eval_batch`` hands each micro-batch's end of the pipe (the discriminator's logits as the
    ``DiscriminatorHidden`` the last stage receives) to the module's real loss function."""

    device, is_data_parallel, is_pipe_parallel = torch.device("cpu"), False, False

    def __init__(self, batches):
        self.batches = batches
        self.module = type("Module", (), {})()
        self.module.loss_fn = ElectraPipelineLoss(ElectraConfig.from_preset("tiny", vocab_size=1000))

    def is_last_stage(self):
        return True

    def eval_batch(self, data_iter, num_micro_batches):
        self.fwd_outputs = []
        for (_, _), batch in zip(data_iter, self.batches, strict=True):
            zero, mask = torch.zeros(()), batch["mask"]
            end = DiscriminatorHidden(batch["logits"], zero, batch["replaced"].long(), mask, float_row(zero, mask),
                                      float_row(zero, mask), mask)
            self.fwd_outputs.append(self.module.loss_fn(to_pipe(end), ()))

    def eval(self):
        pass

    def train(self):
        pass


def test_the_pipelines_validation_rtd_auc_is_the_whole_sets_auc_too():
    batches = validation_batches()
    for b in batches:
        b["input_ids"] = torch.zeros_like(b["mask"])
    engine = _LastStage(batches)
    step = type("Step", (), {"engine": engine, "pipelined": True, "to_device": staticmethod(lambda b: b)})()
    metrics = Evaluation(step, batches, interval=1, seed=0, dp_rank=0, progress=None, metrics_log=None).evaluate()
    assert abs(metrics["rtd_auc"] - exact_auc(*_pooled(batches))) < 6.1e-6
    assert engine.module.loss_fn.count_rtd_scores is False and engine.module.loss_fn.rtd_counts is None
    # Training steps (no counting asked) keep the step's mean over its micro-batches.
    engine.eval_batch(iter([((), ())] * len(batches)), len(batches))
    per_batch = [binary_auc(b["logits"], b["replaced"], b["mask"].float()).item() for b in batches]
    assert pipeline_metrics(engine)["rtd_auc"] == pytest.approx(sum(per_batch) / len(per_batch), abs=1e-6)
