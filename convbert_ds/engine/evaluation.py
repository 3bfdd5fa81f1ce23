"""Evaluation on the validation split every ``eval.interval`` steps and after the last one: the metrics
averaged over every data-parallel rank's share, logged to the console, the metrics files and the progress
record (which keeps the best validation loss for the run's summary).

Each metric is the mean of the batches' values, but for ``rtd_auc``: the AUC of the whole validation set
(every rank's share together), from the discriminator's scores counted in bins on the device
(``model.electra.rtd_score_counts``, ``histogram_auc``; error bound there). A mean of per-batch AUCs is not
the set's AUC: it ignores how scores compare across batches. The pass reads the device once, at its end."""

from __future__ import annotations

import torch
import torch.distributed as dist

from convbert_ds.engine.pipeline import pipeline_batch, pipeline_metrics
from convbert_ds.engine.train_step import MetricSums, TrainStep
from convbert_ds.log import get_logger
from convbert_ds.model.electra import histogram_auc

log = get_logger(__name__)


class Evaluation:
    """``due(step)`` says whether ``run(step)`` evaluates at this step; ``run_last(step)`` is the run's
    final evaluation, unless the last step was an interval's. ``loader`` None: the run evaluates nothing."""

    def __init__(self, train_step: TrainStep, loader, interval: int, seed: int, dp_rank: int, progress, metrics_log):
        self.train_step, self.engine, self.loader, self.interval = train_step, train_step.engine, loader, interval
        self.seed, self.dp_rank, self.progress, self.metrics_log = seed, dp_rank, progress, metrics_log

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def run_last(self, step: int) -> bool:
        """After the last step: evaluate unless ``due`` already did at this step. True when it ran."""
        if not self.interval or self.due(step):
            return False
        self.run(step)
        return True

    def run(self, step: int) -> None:
        metrics = self.evaluate()
        if metrics is None:
            return
        log.info(f"{self.progress.prefix()} eval step {step} | "
                 + " | ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
                 + f" | {self.progress.suffix(step)}")
        self.progress.record_eval(metrics)
        self.metrics_log.write(step, metrics, prefix="valid")

    def evaluate(self) -> dict | None:
        if self.loader is None:
            return None
        device = self.engine.device
        self.engine.eval()
        # Evaluation draws its masks from a fixed seed, off the training RNG stream, so that
        # evaluating (or not) never changes training and every evaluation sees the same masks.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(self.seed + 7919 * (1 + self.dp_rank))
            metrics = self._pipeline_metrics() if self.train_step.pipelined else self._plain_metrics()
        self.engine.train()
        return metrics

    def _pipeline_metrics(self) -> dict:
        batches = [pipeline_batch(self.train_step.to_device(b)) for b in self.loader]
        if not batches:
            return {}
        loss_fn = self.engine.module.loss_fn
        loss_fn.count_rtd_scores = True  # the last stage counts the scores; pipeline_metrics takes the AUC
        try:
            self.engine.eval_batch(iter(batches), num_micro_batches=len(batches))
            return pipeline_metrics(self.engine)
        finally:
            loss_fn.count_rtd_scores = False

    def _plain_metrics(self) -> dict:
        sums, counts = MetricSums(batch_auc=False), None
        for batch in self.loader:
            out = self.train_step.forward(batch)
            sums.add(out)
            counts = out.rtd_score_counts(counts)
        return self._reduce(sums.sums, sums.count, counts)

    def _reduce(self, sums: dict[str, torch.Tensor], batches: int, counts: torch.Tensor | None) -> dict:
        """Every rank's sums, batch count and score counts added by one all-reduce, then one read. Ranks run
        the same model, so they hold the same keys and their packed tensors line up."""
        keys = sorted(sums)
        # On the rank's device: NCCL reduces CUDA tensors only (a CPU tensor fails the first eval on GPUs).
        device = self.engine.device
        packed = torch.zeros(len(keys) + 1, dtype=torch.float64, device=device)
        if keys:
            packed[:-1] = torch.stack([sums[k] for k in keys])
        packed[-1] = batches
        if counts is not None:
            packed = torch.cat([packed, counts])
        dist.all_reduce(packed)
        means = packed[:len(keys)] / packed[len(keys)].clamp_min(1)
        if counts is not None:
            means = torch.cat([means, histogram_auc(packed[len(keys) + 1:]).view(1)])
            keys.append("rtd_auc")
        return dict(sorted(zip(keys, means.tolist())))  # the pass's one read; keys in their old order
