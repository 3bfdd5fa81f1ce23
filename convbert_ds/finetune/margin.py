"""The margin of a pretrained init over random init: medians over seeds and a bootstrap 95% interval.

Both inits are fine-tuned on the same task with the same seeds (``python -m convbert_ds.finetune`` and the
same command with ``--random-init``); each run's ``results.json`` holds one final score per seed. The margin
is the difference of the two medians. Its interval resamples each init's seeds with replacement (a percentile
bootstrap): it says how much the margin moves with the fine-tuning seeds, not with the pretraining run, of
which there is one.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.fsutil import read_json

BOOTSTRAP_DRAWS = 10_000
# Below this many seeds a side, resampling them says little (2 seeds give 3 possible medians): no interval.
MIN_SEEDS_FOR_INTERVAL = 5


def seed_scores(results_dir: Path, metric: str, scale: float = 1.0) -> list[float]:
    """The final validation ``metric`` of every seed in ``results_dir/results.json``, times ``scale``."""
    path = Path(results_dir) / "results.json"
    fix = "delete it and rerun the same command: that fine-tuning is summarised again"
    try:
        return [scale * seed["final"]["validation"][metric]
                for seed in read_json(path, FinetuneError, fix, needs=("seeds",))["seeds"]]
    except (KeyError, TypeError):
        raise FinetuneError(f"{path}: a seed has no final validation {metric}; {fix}") from None


def bootstrap_interval(pretrained: list[float], random_init: list[float], level: float = 0.95,
                       draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap of median(pretrained) - median(random_init), each init's seeds resampled."""
    rng = random.Random(seed)
    margins = sorted(statistics.median(rng.choices(pretrained, k=len(pretrained)))
                     - statistics.median(rng.choices(random_init, k=len(random_init))) for _ in range(draws))
    tail = (1 - level) / 2
    return margins[int(tail * (draws - 1))], margins[round((1 - tail) * (draws - 1))]


@dataclass(frozen=True)
class Margin:
    """One task's scores per seed for both inits, in points (accuracy x 100, or F1 as SQuAD reports it)."""

    task: str
    metric: str
    pretrained: list[float]
    random_init: list[float]

    @property
    def value(self) -> float:
        return statistics.median(self.pretrained) - statistics.median(self.random_init)

    @property
    def interval(self) -> tuple[float, float] | None:
        """The bootstrap 95% interval, or None with fewer than ``MIN_SEEDS_FOR_INTERVAL`` seeds a side."""
        if min(len(self.pretrained), len(self.random_init)) < MIN_SEEDS_FOR_INTERVAL:
            return None
        return bootstrap_interval(self.pretrained, self.random_init)

    def as_dict(self) -> dict:
        return {"task": self.task, "metric": self.metric, "margin": self.value,
                "interval95": list(self.interval) if self.interval else None,
                "pretrained": self.pretrained, "random_init": self.random_init}

    def report(self) -> str:
        above = sum(score > max(self.random_init) for score in self.pretrained)
        show = lambda scores: ", ".join(f"{s:.1f}" for s in scores)  # noqa: E731
        interval = (f"95% interval {self.interval[0]:+.1f} to {self.interval[1]:+.1f} (bootstrap over seeds)"
                    if self.interval else f"no interval under {MIN_SEEDS_FOR_INTERVAL} seeds a side")
        return (f"{self.task}: dev {self.metric}, median over {len(self.pretrained)} seed(s)\n"
                f"  pretrained   {statistics.median(self.pretrained):5.1f}  ({show(self.pretrained)})\n"
                f"  random init  {statistics.median(self.random_init):5.1f}  ({show(self.random_init)})\n"
                f"  margin       {self.value:+5.1f} points, {interval}; {above}/{len(self.pretrained)} pretrained "
                f"seeds above the best random-init seed")
