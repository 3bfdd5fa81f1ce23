"""ELECTRA pretraining: masking statistics, sampling, RTD labels, and learning on real text."""

import pytest
import torch

from convbert_ds.config import ConfigError, ElectraConfig, ModelConfig, generator_config
from convbert_ds.model import ElectraForPretraining
from convbert_ds.model.electra import (AUC_BINS, IGNORE_INDEX, binary_auc, corrupt, gumbel_sample, histogram_auc,
                                       histogram_auc_bound, mask_tokens, rtd_score_counts)
from convbert_ds.model.op_count import OpCounter
from exact_auc import exact_auc
from plain_training import train_plain

SPECIALS = (0, 2, 3)


def _electra(**overrides) -> ElectraConfig:
    disc = ModelConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, embedding_size=32, max_position_embeddings=64)
    return ElectraConfig(discriminator=disc, generator=generator_config(disc, 0.25), **overrides)


@pytest.mark.parametrize("masking", ["fixed", "bernoulli"])
def test_masking_rates_and_specials(masking):
    config = _electra(masking=masking)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 200, (64, 60), generator=gen)
    input_ids[:, 0], input_ids[:, 30], input_ids[:, -1] = 2, 3, 3
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, 50:] = 0
    input_ids[:, 50:] = 0
    masked_ids, labels, positions, chosen = mask_tokens(input_ids, attention_mask, config, generator=gen)
    masked = labels != IGNORE_INDEX
    # The static form the step uses: P slots per row, the masked positions among them, nothing else.
    assert positions.shape == chosen.shape == (64, 9 if masking == "fixed" else 60)
    assert torch.equal(torch.zeros_like(masked).scatter_(1, positions, chosen), masked)
    eligible = attention_mask.bool() & ~torch.isin(input_ids, torch.tensor(SPECIALS))
    assert not (masked & ~eligible).any(), "specials and padding are never masked"
    if masking == "fixed":  # 50 real tokens: round(7.5) = 8 (half to even), under the cap int(0.155 x 60) = 9
        assert masked.sum(-1).tolist() == [8] * 64
    else:
        assert abs(masked.sum() / eligible.sum() - 0.15) < 0.01
    to_mask_token = masked_ids == config.mask_token_id
    assert abs(to_mask_token.sum() / masked.sum() - 0.85) < 0.03
    assert torch.equal(masked_ids[masked & ~to_mask_token], input_ids[masked & ~to_mask_token])
    assert torch.equal(masked_ids[~masked], input_ids[~masked])
    assert torch.equal(labels[masked], input_ids[masked])


@pytest.mark.parametrize("seq_len,cap", [(128, None), (512, None), (128, 5)])
def test_fixed_masking_count_per_sequence_is_the_official_formula(seq_len, cap):
    """k = max(1, min(max_predictions, round(0.15 x real tokens))), over many random sequences: real tokens
    counted with [CLS] and [SEP], round half to even (tf.round), max_predictions int((0.15 + 0.005) x seq_len)."""
    config = _electra(masking="fixed", max_predictions_per_seq=cap)
    assert config.max_predictions(seq_len) == (cap or {128: 19, 512: 79}[seq_len])
    gen = torch.Generator().manual_seed(seq_len)
    batch = 2000
    real = torch.randint(2, seq_len + 1, (batch,), generator=gen)
    real[:40] = torch.arange(2, 42)  # the short ones, where rounding and the floor of 1 matter
    positions = torch.arange(seq_len)
    attention_mask = (positions < real[:, None]).long()
    input_ids = torch.randint(5, 200, (batch, seq_len), generator=gen) * attention_mask
    input_ids[:, 0] = 2
    input_ids[torch.arange(batch), real - 1] = 3
    labels = mask_tokens(input_ids, attention_mask, config, generator=gen).labels
    masked = labels != IGNORE_INDEX
    maskable = (real - 2).clamp(min=0)
    k = [max(1, min(config.max_predictions(seq_len), round(0.15 * n))) for n in real.tolist()]  # half to even
    assert masked.sum(-1).tolist() == [min(a, b) for a, b in zip(k, maskable.tolist())]
    assert not masked[:, 0].any() and not masked[torch.arange(batch), real - 1].any()
    # Uniform over the maskable positions: every inner position of the full-length rows is picked about equally.
    full = real == seq_len
    if full.sum() > 20:
        rate = masked[full][:, 1:-1].float().mean(0)
        assert rate.std() / rate.mean() < 0.5


def test_gumbel_sampling_follows_the_softmax_without_gradient():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], requires_grad=True).repeat(20000, 1)
    samples = gumbel_sample(logits)
    assert not samples.requires_grad
    frequencies = torch.bincount(samples, minlength=4).float() / samples.numel()
    assert (frequencies - torch.softmax(logits[0].detach(), -1)).abs().max() < 0.015


def test_rtd_label_only_where_the_sample_differs():
    input_ids = torch.tensor([[2, 10, 11, 12, 3]])
    positions, chosen = torch.tensor([[1, 3, 2]]), torch.tensor([[True, True, False]])
    corrupted, is_replaced = corrupt(input_ids, positions, chosen, torch.tensor([[10, 40, 99]]))
    assert corrupted.tolist() == [[2, 10, 11, 40, 3]], "an unchosen slot changes nothing"
    assert is_replaced.tolist() == [[False, False, False, True, False]]


def test_auc_without_sync_matches_the_rank_formula():
    """binary_auc sorts instead of reading counts on the host; against a direct pairwise count with ties
    and excluded (weight 0) entries."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (300,), generator=gen).float()  # many ties
    positive = torch.rand(300, generator=gen) < 0.3
    weight = (torch.rand(300, generator=gen) < 0.8).float()
    keep = weight.bool()
    pos, neg = scores[keep & positive], scores[keep & ~positive]
    pairs = (pos[:, None] > neg[None, :]).float() + 0.5 * (pos[:, None] == neg[None, :]).float()
    assert binary_auc(scores, positive, weight).item() == pytest.approx(pairs.mean().item(), abs=1e-6)
    assert binary_auc(scores, torch.zeros(300, dtype=torch.bool)).item() == 0.5


@pytest.mark.parametrize("spread, bound", [(1.0, 6.1e-6), (0.05, 1.22e-4)], ids=["trained", "untrained"])
def test_histogram_auc_is_the_exact_auc_within_its_bound(spread, bound):
    """The validation AUC from bin counts against the exact rank AUC (by hand, tests/exact_auc.py) on random
    logits: within ``histogram_auc_bound``, which is below the docstring's figure for that spread (unit
    spread: a trained discriminator; 0.05: a fresh one's narrow logits), counted over three batches."""
    gen = torch.Generator().manual_seed(1)
    replaced = torch.rand(3, 40, 128, generator=gen) < 0.15
    logits = (torch.randn(3, 40, 128, generator=gen) + 0.8 * replaced) * spread
    real = torch.rand(3, 40, 128, generator=gen) < 0.9
    counts = None
    for b in range(3):
        counts = rtd_score_counts(logits[b], replaced[b], real[b], counts)
    exact = exact_auc(logits[real].tolist(), replaced[real].tolist())
    error_bound = histogram_auc_bound(counts).item()
    assert abs(histogram_auc(counts).item() - exact) <= error_bound + 1e-12
    assert error_bound < bound
    assert counts.sum().item() == real.sum().item(), "every real token counted once, no padding"


def test_histogram_auc_ties_out_of_range_and_nan_scores():
    """Scores on a coarse grid (as bf16 rounds them) fall into distinct bins, so ties are the exact AUC's ties and
    the two agree to rounding; beyond +-16 logits scores tie in the end bins, NaN counts as 0."""
    gen = torch.Generator().manual_seed(2)
    replaced = torch.rand(5000, generator=gen) < 0.3
    logits = torch.round((torch.randn(5000, generator=gen) + replaced) * 8) / 8
    counts = rtd_score_counts(logits, replaced, torch.ones(5000, dtype=torch.bool))
    assert histogram_auc(counts).item() == pytest.approx(exact_auc(logits.tolist(), replaced.tolist()), abs=1e-12)
    odd = torch.tensor([-100.0, -17.0, float("nan"), 0.0, 40.0, float("inf")])
    is_replaced = torch.tensor([True, False, True, False, True, False])
    counts = rtd_score_counts(odd, is_replaced, torch.ones(6, dtype=torch.bool))
    as_read = [-16.0, -16.0, 0.0, 0.0, 16.0, 16.0]
    assert histogram_auc(counts).item() == pytest.approx(exact_auc(as_read, is_replaced.tolist()), abs=1e-12)
    assert histogram_auc(torch.zeros(2 * AUC_BINS, dtype=torch.float64)).item() == 0.5


def test_counting_scores_never_waits_for_the_device():
    logits, replaced = torch.randn(8, 128), torch.rand(8, 128) < 0.15
    with OpCounter() as ops:
        counts = rtd_score_counts(logits, replaced, torch.ones(8, 128, dtype=torch.bool))
        counts = rtd_score_counts(logits, replaced, torch.ones(8, 128, dtype=torch.bool), counts)
        histogram_auc(counts)
    assert ops.syncs == 0, ops.sync_ops


def test_generator_shares_the_embedding_tables():
    model = ElectraForPretraining(_electra())
    shared = model.discriminator.convbert.embeddings
    assert model.generator.convbert.embeddings is shared
    assert model.generator.generator_lm_head.weight is shared.word_embeddings.weight
    unique = {id(p) for p in model.parameters()}
    assert len(unique) == len(list(model.parameters()))


def test_tied_generator_is_the_discriminator_encoder_under_an_mlm_head():
    disc = _electra().discriminator
    config = ElectraConfig(discriminator=disc, generator=generator_config(disc, 1.0), tie_generator_body=True)
    model = ElectraForPretraining(config)
    assert model.generator.convbert is model.discriminator.convbert
    untied = ElectraForPretraining(ElectraConfig(discriminator=disc, generator=generator_config(disc, 1.0)))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    own_encoder = count(untied.generator.convbert) - count(untied.generator.convbert.embeddings)
    assert count(untied) - count(model) == own_encoder
    # The MLM loss alone (rtd_weight 0) now trains the encoder the discriminator is exported from.
    config.rtd_weight = 0.0
    input_ids = torch.randint(5, 200, (4, 32))
    model(input_ids, torch.ones_like(input_ids)).loss.backward()
    assert model.discriminator.convbert.encoder.layer[0].intermediate.dense.weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match=r"tie_generator_body.*generator_multiplier=1\.0"):
        ElectraConfig(discriminator=disc, generator=generator_config(disc, 0.25), tie_generator_body=True)


def test_loss_is_mlm_plus_weighted_rtd_and_gradients_reach_both_models():
    torch.manual_seed(0)
    model = ElectraForPretraining(_electra(rtd_weight=50.0))
    input_ids = torch.randint(5, 200, (4, 32))
    out = model(input_ids, torch.ones_like(input_ids))
    assert torch.allclose(out.loss, out.mlm_loss + 50.0 * out.rtd_loss)
    out.loss.backward()
    assert model.generator.generator_predictions.dense.weight.grad.abs().sum() > 0
    assert model.discriminator.discriminator_predictions.dense_prediction.weight.grad.abs().sum() > 0


def test_mlm_objective_trains_the_masked_lm_alone():
    torch.manual_seed(0)
    config = _electra(objective="mlm")
    model = ElectraForPretraining(config)
    assert model.discriminator is None
    assert model.generator.config.hidden_size == config.discriminator.hidden_size
    input_ids = torch.randint(5, 200, (4, 32))
    out = model(input_ids)
    assert out.rtd_loss is None and torch.equal(out.loss.detach(), out.mlm_loss)


def test_electra_learns_on_real_text(tiny_corpus):
    """A few hundred CPU steps of the tiny preset on the standard library's docstrings."""
    history = train_plain(tiny_corpus["shards"], steps=250)
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    first, last = history[:5], history[-40:]
    assert mean(last, "mlm_loss") < mean(first, "mlm_loss") - 0.8
    assert mean(last, "mlm_accuracy") > mean(first, "mlm_accuracy") + 0.03
    assert mean(last, "rtd_accuracy") > mean(first, "rtd_accuracy") + 0.05
    # Never worse than always answering "original" (the class prior); replaced tokens are ~15% x (1 - p(hit)).
    assert mean(last, "rtd_accuracy") > 1 - mean(last, "replaced_fraction") - 0.005
    assert 0.05 < mean(last, "replaced_fraction") < 0.15
