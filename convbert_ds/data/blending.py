"""Blending several packed datasets by weight into one, in a fixed interleaved order.

Like megatron's blend index, every prefix of the blend holds each set in
proportion to its weight: set ``i`` gets ``c_i`` of the ``N`` positions
(largest-remainder rounding of ``N * w_i``) and its ``k``-th draw sits at
``(k + 1/2) / c_i`` of the way through, so after any ``n`` positions each set
has been drawn ``n * c_i / N`` times to within about one sample (``len(sets) / 2``
at worst). That is megatron's "largest deficit first" rule computed in closed
form, so the index builds vectorised, window by window, in bounded memory.

``N`` defaults to the sets' total size. A set drawn more often than it has
samples is repeated whole and then topped up with a seeded random subset; a set
drawn less often contributes a seeded random subset (the same one every epoch;
pass ``num_samples`` to size the blend to the run instead).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from convbert_ds.data.index_cache import MappedRecords, RecordWriter, load_or_build
from convbert_ds.data.packing import INDEX_FORMAT_VERSION, PackedDataset
from convbert_ds.log import get_logger

logger = get_logger(__name__)

BLEND_DTYPE = np.dtype([("dataset", "<i4"), ("sample", "<i8")])
_WINDOW = 1 << 20


def blend_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """Draws per set: ``total * w`` rounded so the counts sum to ``total`` (largest remainder)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:short]] += 1
    return counts


def build_blend_index(sizes: Sequence[int], weights: Sequence[float], total: int, seed: int,
                      writer: RecordWriter, progress: bool = False, window: int = _WINDOW) -> None:
    """Append the ``total`` (dataset, sample) records of the blend to ``writer``, in blend order.

    Works through the blend ``window`` positions at a time; the result does not depend on it.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    counts = blend_counts(weights, total)
    full_passes = counts // sizes
    top_up = [np.sort(np.random.default_rng([seed, i]).choice(int(size), int(count % size), replace=False))
              for i, (size, count) in enumerate(zip(sizes, counts))]
    n_windows = max(1, math.ceil(total / window))
    lo = np.zeros(len(sizes), dtype=np.int64)
    for j in tqdm(range(1, n_windows + 1), desc="blending", unit="window", disable=not progress):
        # How many of each set's draws sit before fraction j / n_windows of the blend (monotone in j).
        hi = np.clip(np.ceil(j / n_windows * counts - 0.5), 0, counts).astype(np.int64) if j < n_windows else counts
        dataset = np.repeat(np.arange(len(sizes)), hi - lo)
        k = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
        position = (k + 0.5) / counts[dataset]
        order = np.lexsort((dataset, position))
        dataset, k = dataset[order], k[order]
        repeated = k < full_passes[dataset] * sizes[dataset]
        sample = np.where(repeated, k % sizes[dataset], 0)
        for i in np.unique(dataset[~repeated]):
            pick = (~repeated) & (dataset == i)
            sample[pick] = top_up[i][k[pick] - full_passes[i] * sizes[i]]
        records = np.empty(len(k), dtype=BLEND_DTYPE)
        records["dataset"], records["sample"] = dataset, sample
        writer.append(records)
        lo = hi


class BlendedDataset(MappedRecords, torch.utils.data.Dataset):
    """Several ``PackedDataset`` s (same tokenizer) drawn by weight in a fixed interleaved order."""

    def __init__(self, datasets: Sequence[PackedDataset], weights: Sequence[float], seed: int = 1234,
                 num_samples: int | None = None, cache_dir: str | os.PathLike | None = None, progress: bool = True):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset and at least one dataset")
        self.datasets = list(datasets)
        total = int(num_samples) if num_samples is not None else sum(len(d) for d in datasets)
        if total <= 0:
            raise ValueError(f"blend size must be positive (got num_samples={num_samples})")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or np.any(w <= 0):
            raise ValueError(f"data.sets weights must be positive numbers (got {list(weights)})")
        self.weights = (w / w.sum()).tolist()
        identity = {"format": INDEX_FORMAT_VERSION, "sets": [d.key for d in datasets],
                    "weights": [round(x, 12) for x in self.weights], "total": total, "seed": seed}
        self.key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
        first = datasets[0]
        cache_dir = Path(cache_dir) if cache_dir is not None else first.index_path.parent
        path = cache_dir / f"blend-{first.source.split}-seed{seed}-{self.key[:16]}.blend"
        sizes = [len(d) for d in datasets]

        def build(writer: RecordWriter) -> dict:
            build_blend_index(sizes, self.weights, total, seed, writer, progress)
            logger.info("built blend index %s: %d positions over sets of %s samples", path, total, sizes)
            return {"sets": [str(d.source.shard_dir) for d in datasets], "weights": self.weights}

        self._attach(load_or_build(path, self.key, BLEND_DTYPE, build))
        self.seq_len = first.seq_len

    @property
    def blend(self) -> np.ndarray:
        """One ``BLEND_DTYPE`` record (dataset, sample) per position."""
        return self._records

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        dataset, sample = self._records[i].tolist()
        return self.datasets[dataset][sample]


def describe_blend(dataset, run_samples: int) -> list[str]:
    """What a run of ``run_samples`` samples takes from each set of ``dataset`` (a ``BlendedDataset`` or one
    ``PackedDataset``): its share of the samples, how many it gives, how many epochs of it that is, and how
    much of its samples is real tokens (the rest is padding: compute spent on nothing)."""
    datasets = getattr(dataset, "datasets", [dataset])
    fractions = getattr(dataset, "weights", [1.0])
    lines = []
    for d, fraction in zip(datasets, fractions):
        drawn = fraction * run_samples
        lines.append(f"{d.source.origin}: {fraction:.1%} of the samples, {drawn:,.0f} of its {len(d):,} "
                     f"= {drawn / len(d):.2f} epochs; real tokens: {d.real_token_fraction():.1%} of "
                     f"{d.seq_len} x {len(d):,} samples")
    return lines
