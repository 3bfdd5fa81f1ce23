"""Rank 0's metrics, written in one place to every sink a run asked for.

- ``metrics.jsonl``: one JSON object per line, ``{"step", "split", <metric>: value, ...}`` (the plots and
  the tests read it; ``split`` is ``train``, ``valid`` or ``downstream``).
- ``metrics.csv`` (``log.csv``): long format, one row per value: ``step,split,metric,value`` with a
  header; ``pandas.read_csv(...).pivot_table(index=["split", "step"], columns="metric")`` makes it wide.
- TensorBoard events under ``tensorboard/``, as ``split/metric``.
- Weights & Biases (``log.wandb.project``), also as ``split/metric`` against our ``step``.

A resumed run first drops what was logged after its checkpoint (the steps it is about to redo), so each
file ends up as an uninterrupted run's. W&B keeps what it was sent; its charts use our ``step`` field, so
a redone step shows as a second point at that step rather than being dropped.

One W&B run per training run: its id is written to ``wandb_run_id`` in the log directory at the first
start and reused by every later start (a Slurm requeue, a resume by hand), with W&B's resume, so all
attempts land in one run. Offline runs (``mode: offline``, for compute nodes without internet) go to
``wandb/offline-run-*`` in the log directory; ``wandb sync`` them later, each attempt's directory
uploads into the same run.
"""

from __future__ import annotations

import csv
import json
import math
import re
import uuid
from pathlib import Path

from convbert_ds.formats.train_config import LogSection
from convbert_ds.fsutil import truncate_jsonl, write_text_atomically
from convbert_ds.log import get_logger

log = get_logger(__name__)

RUN_ID_FILE = "wandb_run_id"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _say_redone(rows: list[dict], start_step: int) -> None:
    """What a restart costs in training: the steps after ``start_step`` an earlier attempt had logged, and
    their time at that attempt's own speed (its samples/s and samples per step)."""
    if not rows or "samples_per_s" not in rows[-1]:
        return
    per_step = rows[-1]["consumed_samples"] / rows[-1]["step"]
    seconds, before = 0.0, start_step
    for row in sorted(rows, key=lambda r: r["step"]):
        seconds += per_step * (row["step"] - before) / max(row.get("samples_per_s") or 0.0, 1e-9)
        before = row["step"]
    steps = f"step {before} was" if before == start_step + 1 else f"steps {start_step + 1}-{before} were"
    log.info(f"{steps} trained before this restart and {'is' if before == start_step + 1 else 'are'} trained again "
             f"(about {seconds:.1f} s of training at that attempt's speed)")


class MetricsLog:
    def __init__(self, log_dir: Path, start_step: int, enabled: bool, section: LogSection | None = None,
                 run_config: dict | None = None):
        section = section or LogSection()
        self.enabled = enabled
        self.path = log_dir / "metrics.jsonl"
        self.csv_path = log_dir / "metrics.csv" if section.csv else None
        self.writer = self.wandb_run = None
        if not enabled:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        _say_redone([row for row in truncate_jsonl(self.path, start_step) if row.get("split") == "train"],
                    start_step)
        if self.csv_path is not None:
            _truncate_csv(self.csv_path, start_step)
        from torch.utils.tensorboard import SummaryWriter  # here: the other ranks never pay its import

        self.writer = SummaryWriter(str(log_dir / "tensorboard"), purge_step=start_step + 1)
        if section.wandb.project is not None:
            self.wandb_run = _start_wandb(section, log_dir, run_config or {})

    def write(self, step: int, metrics: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "split": prefix, **metrics}) + "\n")
        numbers = {key: value for key, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
        if self.csv_path is not None:
            new = not self.csv_path.is_file()
            with open(self.csv_path, "a", newline="") as f:
                rows = csv.writer(f)
                if new:
                    rows.writerow(["step", "split", "metric", "value"])
                rows.writerows([step, prefix, key, value] for key, value in numbers.items())
        for key, value in numbers.items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)
        self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({"step": step, **{f"{prefix}/{key}": value for key, value in numbers.items()}})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            import wandb  # optional: only runs with log.wandb get here
            self.wandb_run.finish()
            # The trainer leaves through os._exit (see distributed.exit_process): stop W&B's service now.
            wandb.teardown()
            self.wandb_run = None


def _start_wandb(section: LogSection, log_dir: Path, run_config: dict):
    import wandb  # optional: its absence is a config error (engine/plan.py), found before any rank starts
    id_file = log_dir / RUN_ID_FILE
    run_id = id_file.read_bytes().decode("ascii", "replace").strip() if id_file.is_file() else None
    if run_id is not None and not _RUN_ID.fullmatch(run_id):  # damaged: a new run beats a crash at start
        log.info(f"warning: {id_file} is damaged ({run_id[:40]!r} is not a W&B run id); this run logs to a new "
                 "W&B run")
        run_id = None
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]
        write_text_atomically(id_file, run_id + "\n")
    w = section.wandb
    run = wandb.init(project=w.project, entity=w.entity, name=w.name or log_dir.resolve().parent.name,
                     tags=list(w.tags), mode=w.mode, dir=str(log_dir), id=run_id, resume="allow",
                     config=run_config)
    run.define_metric("*", step_metric="step")
    return run


def _truncate_csv(path: Path, step: int) -> None:
    if not path.is_file():
        return
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    kept = rows[:1] + [row for row in rows[1:] if row and int(row[0]) <= step]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(kept)
