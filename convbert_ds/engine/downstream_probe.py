"""``eval.downstream``: fine-tune saved checkpoints on a task while pretraining goes on, and log the scores.

Rank 0 only. After a checkpoint whose step is a multiple of ``eval.downstream.interval``, a probe
(``python -m convbert_ds.finetune --model CHECKPOINT ...``) is queued; probes run one at a time as separate
processes at a lower priority (``nice``), so the training ranks never wait on them: ``poll`` is a
non-blocking check called once per step. A random-init baseline of the same command runs once per run
(first in the queue). Each finished probe becomes a ``downstream`` row in metrics.jsonl and TensorBoard at
the checkpoint's step: ``score`` (the median of the primary metric over the probe's seeds) and
``random_init`` (the baseline's, once known). A probe that fails is a warning naming its log, never an
error of the run. Probe directories: ``LOG_DIR/downstream/{stepNNNNNNNN,random_init}/`` (finetune's OUT,
with ``probe.log``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from convbert_ds.engine.distributed import TORCH_VARS
from convbert_ds.formats.train_config import DownstreamSection
from convbert_ds.log import get_logger

log = get_logger(__name__)

BASELINE = "random_init"


@dataclass
class Probe:
    name: str  # stepNNNNNNNN or random_init
    step: int | None  # the checkpoint's step; None for the baseline
    checkpoint: Path
    command: list[str]
    out: Path
    process: subprocess.Popen | None = None


class DownstreamProbes:
    def __init__(self, section: DownstreamSection, log_dir: Path, log_row):
        """``log_row(step, metrics)`` writes one downstream row (the trainer's metrics log)."""
        self.section = section
        self.root = log_dir / "downstream"
        self.log_row = log_row
        self.queue: list[Probe] = []
        self.running: Probe | None = None
        # Queued before the first checkpoint's probe, and probes run one at a time in queue order, so the
        # baseline has finished (or failed) before any checkpoint's score comes in.
        self.baseline: float | None = None
        self.baseline_queued = False

    def _task_args(self) -> list[str]:
        d = self.section
        if d.glue_task:
            args = ["--glue-task", d.glue_task, "--data-dir", d.data_dir]
        else:
            args = ["--train", d.train, "--validation", d.validation, "--text-column", d.text_column,
                    "--label-column", d.label_column]
            args += ["--text-pair-column", d.text_pair_column] if d.text_pair_column else []
            args += ["--task-type", d.task_type] if d.task_type else []
        return args + [str(a) for a in d.finetune_args]

    def _probe(self, name: str, step: int | None, model: Path | str, extra: list[str]) -> Probe:
        out = self.root / name
        command = [sys.executable, "-m", "convbert_ds.finetune", "--model", str(model), "--out", str(out),
                   *self._task_args(), *extra]
        return Probe(name, step, model, command, out)

    def after_save(self, step: int, checkpoint: Path | str) -> None:
        """Queue a probe of the checkpoint just saved (and, the first time, the baseline): its directory, or
        its URL in the mirror (on node-local disks no directory holds it whole)."""
        if self.section.interval <= 0 or step % self.section.interval:
            return
        if self.section.random_baseline and not self.baseline_queued:
            self.baseline_queued = True
            self.queue.append(self._probe(BASELINE, None, checkpoint, ["--random-init"]))
        # --force: after a resume, the re-saved step is probed afresh.
        name = str(checkpoint).rstrip("/").rsplit("/", 1)[-1]
        self.queue.append(self._probe(name, step, checkpoint, ["--force"]))
        self.poll()

    def _start(self, probe: Probe) -> None:
        probe.out.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.section.threads), "CUDA_VISIBLE_DEVICES": "",
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
        for name in TORCH_VARS:
            env.pop(name, None)  # the probe is a single process of its own, not a rank of this job
        with open(probe.out.parent / f"{probe.name}.log", "w") as output:
            probe.process = subprocess.Popen(probe.command, stdout=output, stderr=subprocess.STDOUT, env=env,
                                             preexec_fn=lambda: os.nice(self.section.nice))
        self.running = probe

    def _finish(self, probe: Probe) -> None:
        log_file = probe.out.parent / f"{probe.name}.log"
        results = probe.out / "results.json"
        if probe.process.returncode != 0 or not results.is_file():
            tail = log_file.read_text().strip().splitlines()[-1:] if log_file.is_file() else []
            log.info(f"warning: downstream probe {probe.name} failed (exit code {probe.process.returncode}; "
                  f"{tail[0] if tail else 'no output'}); see {log_file}")
            return
        score = json.loads(results.read_text())["median"]
        if probe.step is None:
            self.baseline = score
            log.info(f"downstream: random-init baseline {score:.4f}")
            return
        row = {"score": score}
        line = f"downstream step {probe.step} | score {score:.4f}"
        if self.baseline is not None:
            row["random_init"] = self.baseline
            line += f" | random init {self.baseline:.4f} | gain {score - self.baseline:+.4f}"
        log.info(line)
        self.log_row(probe.step, row)

    def poll(self) -> None:
        """Non-blocking: collect a finished probe, start the next."""
        if self.running is not None and self.running.process.poll() is not None:
            probe, self.running = self.running, None
            self._finish(probe)
        while self.running is None and self.queue:
            probe = self.queue.pop(0)
            if probe.step is not None and not probe.checkpoint.is_dir():
                # Probes slower than checkpoints: this one was rotated away (checkpoint.keep_last) meanwhile.
                log.info(f"downstream: {probe.name} was deleted before its probe could start; skipped")
                continue
            self._start(probe)

    def wait(self) -> None:
        """End of the run: let the queued probes finish, so their scores are logged."""
        while self.running is not None or self.queue:
            self.poll()
            time.sleep(0.2)
