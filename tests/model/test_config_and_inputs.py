"""Presets follow the paper; bad configs and bad inputs get errors that name the problem."""

import pytest
import torch

from convbert_ds.config import ConfigError, ElectraConfig, ModelConfig, preset
from convbert_ds.model import ConvBertModel, InputError

# ConvBERT paper, Table 5 (and Table 1 for groups): heads after the bottleneck, head size, FFN, embedding.
PAPER = {
    "small": dict(hidden=256, heads=2, head_dim=64, ffn=1024, embedding=128, groups=1, generator=64),
    "medium-small": dict(hidden=384, heads=4, head_dim=48, ffn=1536, embedding=128, groups=2, generator=96),
    "base": dict(hidden=768, heads=6, head_dim=64, ffn=3072, embedding=768, groups=1, generator=256),
}
# Table 3 parameter counts (discriminator body), in millions.
PAPER_PARAMS = {"small": 14, "medium-small": 17, "base": 106}


@pytest.mark.parametrize("name", list(PAPER))
def test_presets_follow_the_paper(name):
    config, paper = preset(name), PAPER[name]
    assert (config.hidden_size, config.num_heads, config.head_dim, config.intermediate_size,
            config.embedding_size, config.num_groups) == (paper["hidden"], paper["heads"], paper["head_dim"],
                                                          paper["ffn"], paper["embedding"], paper["groups"])
    assert config.num_hidden_layers == 12 and config.conv_kernel_size == 9 and config.head_ratio == 2
    electra = ElectraConfig.from_preset(name)
    assert electra.generator.hidden_size == paper["generator"]
    assert electra.generator.num_hidden_layers == 12
    assert electra.generator.embedding_size == config.embedding_size


@pytest.mark.parametrize("name", ["small", "medium-small"])
def test_preset_sizes_match_the_paper(name):
    params = sum(p.numel() for p in ConvBertModel(preset(name)).parameters()) / 1e6
    assert abs(params - PAPER_PARAMS[name]) / PAPER_PARAMS[name] < 0.08


@pytest.mark.parametrize("changes, field", [
    (dict(hidden_size=250), "num_attention_heads"),
    (dict(num_attention_heads=1), "num_attention_heads"),
    (dict(num_attention_heads=6, hidden_size=264, head_ratio=4), "head_ratio"),
    (dict(conv_kernel_size=8), "conv_kernel_size"),
    (dict(conv_kernel_size=33), "conv_kernel_size"),
    (dict(num_groups=3), "num_groups"),
    (dict(conv_type="lightweight"), "conv_type"),
    (dict(sdconv_impl="cuda"), "sdconv_impl"),
    (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
    (dict(pad_token_id=40000), "pad_token_id"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_invalid_model_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}="):
        ModelConfig(**changes)


def test_unknown_fields_and_presets_are_rejected():
    with pytest.raises(ConfigError, match="hidden_sise"):
        ModelConfig.from_dict({"hidden_sise": 128})
    with pytest.raises(ConfigError, match="hidden_sise"):  # model.overrides reach the model through preset
        preset("tiny", hidden_sise=128)
    with pytest.raises(ConfigError, match="preset 'large'"):
        preset("large")


def test_generator_must_share_embedding_shapes():
    disc = preset("tiny")
    with pytest.raises(ConfigError, match="generator.embedding_size"):
        ElectraConfig(discriminator=disc, generator=disc.replace(embedding_size=32))


@pytest.mark.parametrize("conv_type, width_factor", [("sdconv", 2), ("dynamic", 2), ("conventional", 2),
                                                     ("none", 1)])
def test_ablation_switches_build_and_run(conv_type, width_factor):
    config = preset("tiny", conv_type=conv_type, head_ratio=2 if conv_type != "none" else 1)
    model = ConvBertModel(config)
    out = model(torch.randint(0, config.vocab_size, (2, 11)))
    assert out.shape == (2, 11, config.hidden_size)
    dense = model.encoder.layer[0].attention.output.dense
    assert dense.in_features == config.attention_width * width_factor


def test_bad_inputs_get_clear_errors():
    model = ConvBertModel(preset("tiny", vocab_size=100, max_position_embeddings=16))
    with pytest.raises(InputError, match="id 100, outside"):
        model(torch.tensor([[1, 2, 100]]))
    with pytest.raises(InputError, match="id -1"):
        model(torch.tensor([[1, -1]]))
    with pytest.raises(InputError, match="exceeds max_position_embeddings=16"):
        model(torch.ones(1, 17, dtype=torch.long))
    with pytest.raises(InputError, match="attention_mask has shape"):
        model(torch.ones(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 4))
    with pytest.raises(InputError, match="integer tensor"):
        model(torch.ones(1, 5))


def test_span_aware_key_conv_is_initialised_as_the_official_code():
    """yitu-opensource/ConvBert: depthwise taps ~ truncated normal(std 1/K), pointwise ~ truncated normal(0.02),
    both cut at 2 std (TensorFlow's truncated_normal_initializer); bias zero."""
    torch.manual_seed(0)
    model = ConvBertModel(preset("base", vocab_size=100, num_hidden_layers=2))
    conv = model.encoder.layer[0].attention.self.key_conv_attn_layer
    cut_std = 0.8796  # the std of a standard normal truncated at +-2
    for weight, std in ((conv.depthwise.weight, 1 / 9), (conv.pointwise.weight, 0.02)):
        values = weight.detach().flatten()
        assert values.abs().max() <= 2 * std + 1e-7
        assert abs(values.std().item() / (std * cut_std) - 1) < 0.03, (values.std().item(), std)
        assert abs(values.mean().item()) < 0.02 * std * 10
        # The tails fill up to the cut: not a narrower normal.
        assert (values.abs() > 1.8 * std).float().mean() > 0.01
    assert not conv.bias.any()
    # The other dense layers keep transformers' normal(0.02): draws beyond 2 std exist.
    query = model.encoder.layer[0].attention.self.query.weight.detach()
    assert query.abs().max() > 2 * 0.02 and abs(query.std().item() - 0.02) < 0.001


@pytest.mark.parametrize("name, heads, head_dim, width", [
    # The official code: ConvBERT-small's generator (hidden 64, 4 x 1/4 = 1 head) has no head left after the
    # bottleneck, which it then switches off: 1 attention + 1 conv head of 64/1 = 64 (concatenation 128).
    ("small", 1, 64, 64),
    ("medium-small", 1, 48, 48),  # 8 x 1/4 = 2 heads -> 1 + 1 of 96/2 = 48: as transformers
    ("base", 2, 64, 128),  # 12 x 1/3 = 4 heads -> 2 + 2 of 256/4 = 64: as transformers
])
def test_official_generator_heads(name, heads, head_dim, width):
    from convbert_ds.config import generator_config

    disc = preset(name)
    official = generator_config(disc, ElectraConfig.from_preset(name).generator.hidden_size / disc.hidden_size,
                                heads="official")
    assert (official.num_heads, official.head_dim, official.attention_width) == (heads, head_dim, width)
    ours = ElectraConfig.from_preset(name).generator
    if name == "small":  # transformers halves the width: 1 + 1 heads of 32, and cannot express the official one
        assert (ours.num_heads, ours.head_dim) == (1, 32)
        with pytest.raises(ConfigError, match="attention_head_size=64.*export the discriminator only"):
            official.to_hf_dict(["ConvBertForMaskedLM"])
        model = ConvBertModel(official.replace(vocab_size=100, num_hidden_layers=1))
        attention = model.encoder.layer[0].attention
        assert attention.self.query.out_features == 64 and attention.output.dense.in_features == 128
        out = model(torch.randint(5, 100, (2, 20)))
        assert out.shape == (2, 20, 64) and torch.isfinite(out).all()
    else:  # the same config: it exports
        assert official == ours and official.attention_head_size is None
