"""The timing loop the op benchmarks share: medians over repeated runs after warm-up, synchronized on CUDA."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def medians_ms(runs: dict[str, Callable[[], object]], reps: int, cuda: bool, warmup: int = 3) -> dict[str, float]:
    """Median wall time in milliseconds of each of ``runs`` over ``reps`` calls, after ``warmup`` untimed ones
    (where ``torch.compile`` compiles). The runs take turns, one call each per round, so a machine that slows
    down or speeds up part of the way through (a shared CPU, a GPU's clocks) weighs on all of them alike.
    On CUDA each call is timed between two synchronizations: its kernels count whole, and none of the
    previous call's spill into it."""
    for once in runs.values():
        for _ in range(warmup):
            once()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, once in runs.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            once()
            if cuda:
                torch.cuda.synchronize()
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in times.items()}
