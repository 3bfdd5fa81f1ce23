"""The distributed samplers: exact resume, disjoint ranks, a new permutation every epoch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from convbert_ds.data.sampler import EvalSampler, PretrainingSampler

N = 103  # prime, so micro-batch steps straddle epoch boundaries at varying offsets


def take(sampler, n_batches):
    return list(itertools.islice(iter(sampler), n_batches))


def global_stream(num_samples, seed, n, shuffle=True):
    """The order a single rank with micro-batch 1 sees: the reference stream of positions."""
    sampler = PretrainingSampler(num_samples, 1, 0, 1, seed, shuffle=shuffle)
    return [b[0] for b in take(sampler, n)]


def test_epochs_are_fresh_permutations():
    stream = np.array(global_stream(N, seed=7, n=3 * N))
    epochs = stream.reshape(3, N)
    for epoch in epochs:
        assert sorted(epoch) == list(range(N))
    assert not (epochs[0] == epochs[1]).all() and not (epochs[1] == epochs[2]).all()
    assert not (epochs[0] == np.arange(N)).all()
    assert global_stream(N, seed=7, n=N) == epochs[0].tolist()
    assert global_stream(N, seed=8, n=N) != epochs[0].tolist()


def test_unshuffled_order_wraps():
    assert global_stream(N, seed=7, n=2 * N, shuffle=False) == list(range(N)) * 2


@pytest.mark.parametrize("micro_batch_size,dp_size", [(4, 3), (1, 2), (5, 1), (64, 2)])
def test_ranks_split_each_global_batch(micro_batch_size, dp_size):
    steps = 40
    reference = global_stream(N, seed=3, n=steps * micro_batch_size * dp_size)
    per_rank = [take(PretrainingSampler(N, micro_batch_size, r, dp_size, seed=3), steps) for r in range(dp_size)]
    for step in range(steps):
        batches = [per_rank[r][step] for r in range(dp_size)]
        assert all(len(b) == micro_batch_size for b in batches)
        union = [i for b in batches for i in b]
        lo = step * micro_batch_size * dp_size
        assert union == reference[lo:lo + micro_batch_size * dp_size]
        if micro_batch_size * dp_size <= N and lo % N + micro_batch_size * dp_size <= N:
            assert len(set(union)) == len(union), "ranks overlap within one epoch"


@pytest.mark.parametrize("consumed_steps", [0, 1, 8, 9, 17, 25])
def test_resume_continues_exactly(consumed_steps):
    micro_batch_size, dp_size, grad_accum = 4, 3, 2
    steps = 60
    full = [take(PretrainingSampler(N, micro_batch_size, r, dp_size, seed=11), steps) for r in range(dp_size)]
    consumed = consumed_steps * micro_batch_size * dp_size * grad_accum
    skip = consumed // (micro_batch_size * dp_size)
    for r in range(dp_size):
        resumed = PretrainingSampler(N, micro_batch_size, r, dp_size, seed=11, consumed_samples=consumed)
        assert take(resumed, steps - skip) == full[r][skip:]


def test_resume_with_another_data_parallel_size():
    """consumed_samples is global: the stream continues even if the job restarts on more ranks."""
    reference = global_stream(N, seed=2, n=400)
    consumed = 4 * 2 * 10  # 10 steps of micro-batch 4 on 2 ranks
    resumed = [take(PretrainingSampler(N, 2, r, 4, seed=2, consumed_samples=consumed), 20) for r in range(4)]
    union = [i for step in zip(*resumed) for b in step for i in b]
    assert union == reference[consumed:consumed + len(union)]


def test_state_dict_round_trip_and_guards():
    sampler = PretrainingSampler(N, 4, 1, 2, seed=5)
    first = take(sampler, 3)
    assert sampler.consumed_samples == 0  # iterating alone does not advance: workers prefetch
    sampler.advance(3)
    state = sampler.state_dict()
    assert state["consumed_samples"] == 3 * 4 * 2
    resumed = PretrainingSampler(N, 4, 1, 2, seed=5)
    resumed.load_state_dict(state)
    assert take(resumed, 2) == take(PretrainingSampler(N, 4, 1, 2, seed=5), 5)[3:] and first
    for changed in (PretrainingSampler(N + 1, 4, 1, 2, seed=5), PretrainingSampler(N, 4, 1, 2, seed=6)):
        with pytest.raises(ValueError, match="replay or skip"):
            changed.load_state_dict(state)
    with pytest.raises(ValueError, match="dp_rank"):
        PretrainingSampler(N, 4, 2, 2, seed=5)


def test_eval_sampler_is_fixed_and_disjoint():
    samplers = [EvalSampler(N, 4, r, 3) for r in range(3)]
    passes = [list(s) for s in samplers]
    assert passes == [list(s) for s in samplers]  # the same every evaluation
    assert all(len(p) == len(samplers[0]) == N // 12 for p in passes)
    union = sorted(i for p in passes for b in p for i in b)
    assert union == list(range(N // 12 * 12))
    with pytest.raises(ValueError, match="fewer than one step"):
        EvalSampler(5, 4, 0, 2)
