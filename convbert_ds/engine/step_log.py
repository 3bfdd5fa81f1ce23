"""The training log line every ``log.interval`` steps (and at the first and last step): the step's metrics,
learning rate, gradient norm, throughput, TFLOP/s, MFU and memory, on the console and in the metrics files.

Throughput is measured between logging steps, whose metric read waits for the device: between them the
host runs ahead of the GPU, so one step's host time says nothing. Time that is not training (an evaluation,
a save) is taken out with ``pause()``."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from convbert_ds.log import get_logger
from convbert_ds.model.layers import compiled_graph_count

log = get_logger(__name__)

_FIELDS = (("loss", "loss", ".4f"), ("mlm_loss", "gen", ".4f"), ("rtd_loss", "disc", ".4f"),
           ("mlm_accuracy", "mlm_acc", ".3f"), ("rtd_accuracy", "rtd_acc", ".3f"), ("lr", "lr", ".2e"),
           ("grad_norm", "gnorm", ".3f"), ("samples_per_s", "samples/s", ".1f"), ("tokens_per_s", "tok/s", ".0f"),
           ("tflops", "TFLOP/s", ".2f"), ("mfu", "MFU", ".1%"), ("gpu_memory_gib", "GPU GiB", ".1f"))


def format_line(step: int, steps: int, m: dict) -> str:
    parts = [f"step {step}/{steps}"]
    parts += [f"{label} {m[key]:{fmt}}" for key, label, fmt in _FIELDS if m.get(key) is not None]
    return " | ".join(parts)


class StepLog:
    """``due(step)``: whether ``step`` is a logging step (asked before it runs: only those read metrics);
    ``write(step, metrics)`` after it. ``grad_norm()`` and ``counts()`` (the run's counters: non-finite
    losses, samples consumed) are read when a line is written."""

    def __init__(self, cfg, flops_per_sample: float, peak_tflops: float | None, engine, grad_norm, counts,
                 graphs, progress, metrics_log, start_step: int):
        self.cfg, self.flops_per_sample, self.peak_tflops, self.engine = cfg, flops_per_sample, peak_tflops, engine
        self.grad_norm, self.counts, self.graphs = grad_norm, counts, graphs
        self.progress, self.metrics_log = progress, metrics_log
        self.timed_from, self.timed_step = time.perf_counter(), start_step

    def due(self, step: int) -> bool:
        return step % self.cfg.log.interval == 0 or step in (1, self.cfg.train.steps)

    def pause(self, step: int) -> None:
        """What came after ``step`` was not training: the next throughput is timed from here."""
        self.timed_from, self.timed_step = time.perf_counter(), step

    def write(self, step: int, metrics: dict) -> None:
        now = time.perf_counter()
        metrics = {**metrics, **self._measures(step, (now - self.timed_from) / (step - self.timed_step))}
        self.progress.record_pace(step - self.timed_step, now - self.timed_from)  # before the line: its ETA
        self.timed_from, self.timed_step = now, step
        self.graphs.check(step, metrics["cuda_graphs"])
        log.info(f"{self.progress.prefix()} {format_line(step, self.cfg.train.steps, metrics)} | "
                 f"{self.progress.suffix(step)}")
        self.progress.record_step(metrics)
        self.metrics_log.write(step, {k: v for k, v in metrics.items() if v is not None})

    def _measures(self, step: int, step_seconds: float) -> dict:
        t, device = self.cfg.train, self.engine.device
        samples_per_s = t.global_batch_size / step_seconds
        tflops = self.flops_per_sample * samples_per_s / dist.get_world_size() / 1e12
        grad_norm = self.grad_norm()
        # The rate step ``step`` ran at: the engine's get_lr() is already the next step's.
        return {"lr": self.engine.lr_scheduler.ran_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * self.cfg.data.seq_len,
                "tflops": tflops, "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
                **self.counts(),
                # Constant after warm-up; growing means something recompiles every step.
                "compiled_graphs": compiled_graph_count() if t.compile else None,
                "cuda_graphs": self.graphs.recorded(),
                # The most this process's allocator has held since it started (the allocator's own count:
                # no device sync): what a larger batch, or another process on the GPU, has left to use.
                "gpu_memory_gib": (torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None)}
