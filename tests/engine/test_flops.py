"""MFU's numerator checked: ``engine.flops.training_flops_per_sample`` against torch's FlopCounterMode over a
real forward and backward of ``ElectraForPretraining`` (``benchmarks.analysis.flop_count``: the counter with a
grouped convolution's backward counted right, plus the dynamic convolution's taps, which run elementwise).

The two agree exactly, term for term, for every convolution type, grouped feed-forward layers, an embedding
projection, the MLM-only objective and the presets themselves; what the counter adds over the formula is
the generator's head on slots the loss does not use (``prediction_slots`` less ``predictions_per_sequence``),
which MFU does not count as model work.
"""

import pytest
import torch

from benchmarks.analysis.flop_count import count_training_flops
from benchmarks.common import electra_config_for
from convbert_ds.config import ElectraConfig, generator_config, preset
from convbert_ds.engine.flops import mlm_head_forward_flops, training_flops_per_sample
from convbert_ds.model import mask_tokens
from convbert_ds.model.electra import IGNORE_INDEX, prediction_slots, predictions_per_sequence

SPECIAL_IDS = {"pad": 0, "cls": 2, "sep": 3, "mask": 4}


def tiny_electra(objective: str = "electra", masking: str = "fixed", **body) -> ElectraConfig:
    disc = preset("tiny", vocab_size=500, max_position_embeddings=512, sdconv_impl="torch", **body)
    return ElectraConfig(discriminator=disc, generator=generator_config(disc, 1 / 4) if objective == "electra"
                         else None, objective=objective, masking=masking)


def unused_head_flops(config: ElectraConfig, seq_len: int) -> float:
    """Forward and backward FLOPs of the generator's head on the slots that carry no prediction."""
    gen = config.generator if config.objective == "electra" else config.discriminator
    unused = prediction_slots(config, seq_len) - predictions_per_sequence(config, seq_len)
    return 3 * mlm_head_forward_flops(gen) * unused


@pytest.mark.parametrize("config, seq_len", [
    pytest.param(tiny_electra(), 64, id="sdconv"),
    pytest.param(tiny_electra(conv_type="dynamic"), 64, id="dynamic"),
    pytest.param(tiny_electra(conv_type="conventional"), 64, id="conventional"),
    pytest.param(tiny_electra(conv_type="none"), 64, id="attention-only"),
    pytest.param(tiny_electra(num_groups=2), 64, id="grouped-ffn"),
    pytest.param(tiny_electra(embedding_size=128), 64, id="no-embedding-projection"),
    pytest.param(tiny_electra(objective="mlm"), 64, id="mlm-objective"),
    pytest.param(tiny_electra(masking="bernoulli"), 32, id="bernoulli-head-on-every-slot"),
    pytest.param(tiny_electra(), 512, id="seq512-unused-slots"),
    pytest.param(electra_config_for("small", 30522, SPECIAL_IDS, sdconv_impl="torch"), 128, id="small"),
    pytest.param(electra_config_for("base", 30522, SPECIAL_IDS, sdconv_impl="torch"), 128, id="base"),
])
def test_formula_matches_the_counted_step(config, seq_len):
    counted = count_training_flops(config, seq_len, batch=2).counted
    expected = training_flops_per_sample(config, seq_len) + unused_head_flops(config, seq_len)
    assert counted == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("seq_len", [32, 128, 512])
def test_predictions_per_sequence_is_what_fixed_masking_draws(seq_len):
    config = tiny_electra()
    input_ids = torch.randint(5, 500, (4, seq_len))
    input_ids[:, 0], input_ids[:, -1] = SPECIAL_IDS["cls"], SPECIAL_IDS["sep"]
    masking = mask_tokens(input_ids, torch.ones_like(input_ids), config, torch.Generator().manual_seed(0))
    drawn = (masking.labels != IGNORE_INDEX).sum(-1)
    assert drawn.tolist() == [predictions_per_sequence(config, seq_len)] * 4
