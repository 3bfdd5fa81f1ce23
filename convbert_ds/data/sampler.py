"""Distributed batch samplers: a resumable shuffled one for training, a fixed one for evaluation.

Training order is one global stream of positions 0, 1, 2, ...: position ``p``
is sample ``perm_e[p % N]`` of epoch ``e = p // N``, where ``perm_e`` is a
permutation seeded by ``(seed, e)``. Each micro-batch step takes the next
``micro_batch_size * dp_size`` positions and hands rank ``r`` the ``r``-th
slice of ``micro_batch_size``; a global step (``grad_accum`` micro steps)
therefore consumes ``micro_batch_size * dp_size * grad_accum`` positions.
``consumed_samples`` (global, identical on every rank) is the whole state:
resuming from it continues the stream exactly, whatever ``dp_size`` was.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np


class _Layout:
    """The data-parallel layout both samplers share."""

    def __init__(self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if num_samples <= 0:
            raise ValueError(f"sampler needs a non-empty dataset (num_samples={num_samples})")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive (got {micro_batch_size})")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside data-parallel size {dp_size}")
        self.num_samples, self.micro_batch_size = int(num_samples), int(micro_batch_size)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)

    @property
    def samples_per_step(self) -> int:
        """Positions one micro-batch step consumes across all data-parallel ranks."""
        return self.micro_batch_size * self.dp_size


class PretrainingSampler(_Layout):
    """Endless shuffled batch sampler for one data-parallel rank; a ``batch_sampler`` for DataLoader.

    Iterating does not advance ``consumed_samples``: DataLoader workers draw
    indices ahead of training, so whoever hands batches to the trainer advances
    it (``PretrainingDataLoader`` does, per delivered batch; or call ``advance``).
    """

    def __init__(self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 consumed_samples: int = 0, shuffle: bool = True):
        super().__init__(num_samples, micro_batch_size, dp_rank, dp_size)
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0 (got {consumed_samples})")
        if seed < 0:
            raise ValueError(f"sampler seed must be >= 0 (got {seed})")
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.consumed_samples = int(consumed_samples)
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample indices in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            dtype = np.int32 if self.num_samples < 2**31 else np.int64
            order = np.arange(self.num_samples, dtype=dtype)
            np.random.default_rng([self.seed, epoch]).shuffle(order)
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1]

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """Sample index at each global stream position."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(len(positions), dtype=np.int64)
        epochs = positions // self.num_samples
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = self.epoch_order(int(epoch))[positions[here] % self.num_samples]
        return out

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        return (self.indices_at(np.arange(position, position + self.micro_batch_size)).tolist()
                for position in itertools.count(first, self.samples_per_step))

    def advance(self, micro_batches: int = 1) -> None:
        """Record that ``micro_batches`` micro-batch steps were handed to training (on every rank)."""
        self.consumed_samples += micro_batches * self.samples_per_step

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "num_samples": self.num_samples,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for name in ("num_samples", "seed", "shuffle"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"checkpointed sampler has {name}={state[name]} but this run has {getattr(self, name)}; "
                    f"resuming would replay or skip samples (the dataset or data seed changed)")
        self.consumed_samples = int(state["consumed_samples"])


class EvalSampler(_Layout):
    """One unshuffled pass over the dataset, the same every time; ranks take disjoint slices.

    Positions that do not fill a whole ``micro_batch_size * dp_size`` step are
    left out, so every rank runs the same number of fixed-shape micro-batches.
    """

    def __init__(self, num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        super().__init__(num_samples, micro_batch_size, dp_rank, dp_size)
        if len(self) == 0:
            raise ValueError(f"evaluation set has {num_samples} samples, fewer than one step of "
                             f"micro_batch_size {micro_batch_size} x dp_size {dp_size}; use a larger valid split")

    def __len__(self) -> int:
        return self.num_samples // self.samples_per_step

    def __iter__(self) -> Iterator[list[int]]:
        step = self.samples_per_step
        for first in range(self.dp_rank * self.micro_batch_size, len(self) * step, step):
            yield list(range(first, first + self.micro_batch_size))
