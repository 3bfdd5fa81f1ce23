"""Evaluation on the validation split every ``eval.interval`` steps and after the last one: the metrics
averaged over every data-parallel rank's share, logged to the console, the metrics files and the progress
record (which keeps the best validation loss for the run's summary)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from convbert_ds.engine.pipeline import pipeline_batch, pipeline_metrics
from convbert_ds.engine.train_step import MetricSums, TrainStep
from convbert_ds.log import get_logger

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
        self.engine.eval_batch(iter(batches), num_micro_batches=len(batches))
        return pipeline_metrics(self.engine)

    def _plain_metrics(self) -> dict:
        sums = MetricSums()
        for batch in self.loader:
            sums.add(self.train_step.forward(batch))
        keys = sorted(sums.sums)
        # On the rank's device: NCCL reduces CUDA tensors only (a CPU tensor fails the first eval on GPUs).
        packed = torch.zeros(len(keys) + 1, dtype=torch.float64, device=self.engine.device)
        if keys:
            packed[:-1] = torch.stack([sums.sums[k] for k in keys])
        packed[-1] = sums.count
        dist.all_reduce(packed)
        return {k: packed[i].item() / max(packed[-1].item(), 1) for i, k in enumerate(keys)}
