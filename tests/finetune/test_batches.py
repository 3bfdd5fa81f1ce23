"""Fine-tuning's training batches: the epoch's permutation, and batches grouped by length."""

from __future__ import annotations

import random

import pytest
import torch

from convbert_ds.finetune.batches import epoch_batches

_RNG = random.Random(0)
LENGTHS = [_RNG.randint(5, 128) for _ in range(203)]  # 203: the last batch of 16 is partial


def _padded_positions(batches: list[list[int]]) -> int:
    return sum(max(LENGTHS[i] for i in batch) * len(batch) - sum(LENGTHS[i] for i in batch) for batch in batches)


def test_ungrouped_batches_are_the_seeded_permutation_cut_in_order():
    """Without grouping the batches are what they always were, so earlier runs' orders (and resumes) hold."""
    order = torch.randperm(203, generator=torch.Generator().manual_seed(3 * 100_003 + 2)).tolist()
    assert epoch_batches(203, 16, seed=3, epoch=2, world_size=1) == [order[i:i + 16] for i in range(0, 203, 16)]
    assert epoch_batches(203, 16, 3, 2, 1, LENGTHS, group_by_length=0) == epoch_batches(203, 16, 3, 2, 1)


@pytest.mark.parametrize("group", [1, 4, 50])
def test_grouped_batches_hold_every_example_once_from_one_window(group):
    batches = epoch_batches(203, 16, 3, 2, 1, LENGTHS, group_by_length=group)
    assert sorted(i for batch in batches for i in batch) == list(range(203))
    assert [len(b) for b in batches].count(16) == 12 and sorted(len(b) for b in batches)[0] == 11
    # batch-mates are drawn from one window of the epoch's permutation: group x 16 consecutive examples
    window_of = {i: position // (group * 16) for position, i in enumerate(
        torch.randperm(203, generator=torch.Generator().manual_seed(3 * 100_003 + 2)).tolist())}
    assert all(len({window_of[i] for i in batch}) == 1 for batch in batches)
    assert batches == epoch_batches(203, 16, 3, 2, 1, LENGTHS, group_by_length=group)  # a resume sees the same
    assert batches != epoch_batches(203, 16, 3, 3, 1, LENGTHS, group_by_length=group)  # a new epoch does not


def test_grouping_cuts_padding_and_does_not_run_short_to_long():
    plain = epoch_batches(203, 16, 0, 0, 1)
    grouped = epoch_batches(203, 16, 0, 0, 1, LENGTHS, group_by_length=4)
    assert _padded_positions(grouped) < _padded_positions(plain) / 2
    longest = [max(LENGTHS[i] for i in batch) for batch in grouped]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_a_partial_batch_smaller_than_the_ranks_is_dropped_wherever_it_lands():
    for group in (0, 4):
        batches = epoch_batches(203, 16, 0, 0, world_size=12, lengths=LENGTHS, group_by_length=group)
        assert len(batches) == 12 and all(len(b) == 16 for b in batches)  # the 11-example batch is gone


def test_grouping_without_a_length_per_example_is_refused():
    for lengths in (None, LENGTHS[:-1]):
        with pytest.raises(ValueError, match="one length per example"):
            epoch_batches(203, 16, 0, 0, 1, lengths, group_by_length=4)
