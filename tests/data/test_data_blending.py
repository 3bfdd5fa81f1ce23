"""Blending shard sets by weight: proportions in every prefix, determinism, up- and down-sampling."""

from __future__ import annotations

import numpy as np
import pytest
from shard_factory import corpus, write_shard_dir

from convbert_ds.data.blending import BLEND_DTYPE, BlendedDataset, blend_counts, build_blend_index, describe_blend
from convbert_ds.data.index_cache import load_or_build
from convbert_ds.data.loader import build_dataset
from convbert_ds.data.packing import PackedDataset


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    docs = corpus()
    root = tmp_path_factory.mktemp("blend")
    return [write_shard_dir(root / "big", {"train": docs[:450]}),
            write_shard_dir(root / "small", {"train": docs[450:520]}, num_shards=1),
            write_shard_dir(root / "mid", {"train": docs[520:700]})]


def _max_prefix_deviation(dataset_ids, n_sets):
    counts = np.stack([np.cumsum(dataset_ids == i) for i in range(n_sets)])
    n = np.arange(1, len(dataset_ids) + 1)
    share = counts[:, -1:] / len(dataset_ids)
    return np.abs(counts - n * share).max()


@pytest.mark.parametrize("weights", [[3.0, 1.0], [0.5, 0.5], [0.1, 0.9]])
def test_two_sets_follow_their_weights(sets, tmp_path, weights):
    blend = build_dataset([{"path": sets[0], "weight": weights[0]}, {"path": sets[1], "weight": weights[1]}],
                          "train", seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    assert isinstance(blend, BlendedDataset)
    ids = np.asarray(blend.blend["dataset"])
    total = len(blend.datasets[0]) + len(blend.datasets[1])
    assert len(blend) == total
    share = np.bincount(ids, minlength=2) / total
    np.testing.assert_allclose(share, np.array(weights) / sum(weights), atol=1.0 / total)
    assert _max_prefix_deviation(ids, 2) <= 1.0  # every prefix is in proportion, not just the whole


def test_three_sets_with_fixed_size_and_determinism(sets, tmp_path):
    spec = [{"path": s, "weight": w} for s, w in zip(sets, (0.2, 0.5, 0.3))]

    def blend(cache):
        return build_dataset(spec, "train", seq_len=32, seed=4, num_samples=5000, cache_dir=tmp_path / cache,
                             progress=False)

    a, b, again = blend("a"), blend("b"), blend("a")
    assert a.index_built and b.index_built and not again.index_built
    np.testing.assert_array_equal(a.blend, b.blend)
    ids = np.asarray(a.blend["dataset"])
    assert list(np.bincount(ids)) == [1000, 2500, 1500]
    assert _max_prefix_deviation(ids, 3) <= 1.5
    for i in (0, 1, 2, 777, 4999):
        dataset, sample = a.blend[i].tolist()
        for key, value in a[i].items():
            assert (a.datasets[dataset][sample][key] == value).all()


def test_upsampled_set_repeats_whole_downsampled_set_never_repeats(sets, tmp_path):
    big = PackedDataset(sets[0], "train", seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    small = PackedDataset(sets[1], "train", seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    blend = BlendedDataset([big, small], [0.5, 0.5], seed=1, cache_dir=tmp_path, progress=False)
    records = np.asarray(blend.blend)
    big_draws = records["sample"][records["dataset"] == 0]
    small_draws = records["sample"][records["dataset"] == 1]
    assert len(small_draws) > 2 * len(small)
    assert len(np.unique(big_draws)) == len(big_draws) < len(big)  # a subset, no repeats
    assert big_draws.max() > 0.9 * len(big)  # drawn from the whole set, not its first documents
    uses = np.bincount(small_draws, minlength=len(small))
    assert uses.min() == len(small_draws) // len(small) and uses.max() - uses.min() <= 1


def test_blend_counts_sum_exactly():
    for weights, total in [([1, 1, 1], 10), ([0.7, 0.2, 0.1], 999), ([5, 1e-3], 7)]:
        counts = blend_counts(weights, total)
        assert counts.sum() == total
        assert np.abs(counts - np.array(weights) / np.sum(weights) * total).max() < 1


def test_windowed_build_matches_a_single_window(tmp_path):
    """The blend is built window by window; the windows must join seamlessly."""
    def build(window):
        return load_or_build(tmp_path / f"w{window}.blend", "key", BLEND_DTYPE, lambda writer: build_blend_index(
            [300, 50, 1000], [0.3, 0.3, 0.4], 4001, seed=3, writer=writer, window=window) or {}).records

    np.testing.assert_array_equal(build(97), build(1 << 20))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_temperature_sampling_draws_in_proportion_to_weight_times_size_to_the_alpha(sets, tmp_path, alpha):
    entries = [{"path": sets[0], "weight": 1.0}, {"path": sets[1], "weight": 2.0}]
    blend = build_dataset(entries, "train", seq_len=64, seed=1, cache_dir=tmp_path, progress=False,
                          size_exponent=alpha)
    sizes = np.array([len(d) for d in blend.datasets], dtype=np.float64)
    expected = np.array([1.0, 2.0]) * sizes ** alpha
    expected /= expected.sum()
    share = np.bincount(np.asarray(blend.blend["dataset"]), minlength=2) / len(blend)
    np.testing.assert_allclose(share, expected, atol=1.0 / len(blend))
    assert sizes[0] > 3 * sizes[1]  # the big set's share grows with alpha: 1/3 at 0, most of it at 1


def test_the_run_plan_says_what_each_set_gives_in_epochs(sets, tmp_path):
    blend = build_dataset([{"path": sets[0], "weight": 3.0}, {"path": sets[1], "weight": 1.0}], "train",
                          seq_len=64, seed=1, cache_dir=tmp_path, progress=False)
    big, small = (len(d) for d in blend.datasets)
    real = [f"real tokens: {d.real_token_fraction():.1%} of 64 x {len(d):,} samples" for d in blend.datasets]
    lines = describe_blend(blend, run_samples=4000)
    assert lines == [f"{sets[0]}: 75.0% of the samples, 3,000 of its {big:,} = {3000 / big:.2f} epochs; {real[0]}",
                     f"{sets[1]}: 25.0% of the samples, 1,000 of its {small:,} = {1000 / small:.2f} epochs; {real[1]}"]
