"""Our ConvBERT is the same function as transformers' ConvBERT, in both directions.

transformers is the oracle: random transformers models (every parameter
perturbed, so no zero bias or unit LayerNorm hides a mistake) are loaded into
ours through a saved directory, and ours are loaded into transformers.
"""

import pytest
import torch
import transformers

from convbert_ds.config import ModelConfig
from convbert_ds.model import ConvBertForMaskedLM, ConvBertModel

CONFIGS = {
    "embedding-projection": dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, embedding_size=32,
                                 conv_kernel_size=9),
    "grouped-ffn-k3": dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, embedding_size=64,
                           num_groups=2, conv_kernel_size=3),
    "k15-no-bottleneck": dict(hidden_size=48, num_attention_heads=2, head_ratio=1, intermediate_size=96,
                              embedding_size=24, conv_kernel_size=15),
    "three-heads-groups3": dict(hidden_size=96, num_attention_heads=6, intermediate_size=192, embedding_size=48,
                                num_groups=3, conv_kernel_size=9),
    "k1-gelu-new": dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, embedding_size=16,
                        conv_kernel_size=1, hidden_act="gelu_new"),
    "k5-relu": dict(hidden_size=64, num_attention_heads=8, head_ratio=4, intermediate_size=64, embedding_size=64,
                    conv_kernel_size=5, hidden_act="relu"),
}
BASE = dict(vocab_size=101, num_hidden_layers=2, max_position_embeddings=40, pad_token_id=0,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _config(name: str) -> ModelConfig:
    return ModelConfig(**{**BASE, **CONFIGS[name]})


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


def _batch(config: ModelConfig, seq_len: int = 13, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, config.vocab_size, (3, seq_len), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, seq_len - 4:] = 0  # padded sequences, of two different lengths
    attention_mask[2, seq_len // 2:] = 0
    input_ids[attention_mask == 0] = config.pad_token_id
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, seq_len // 3:] = 1
    return input_ids, attention_mask, token_type_ids


def _hf(cls, config: ModelConfig, arch: str, seed: int):
    torch.manual_seed(seed)
    model = cls(transformers.ConvBertConfig(**config.to_hf_dict([arch]))).eval()
    _perturb(model, seed)
    return model


def _assert_close_grads(ours: torch.nn.Module, theirs: torch.nn.Module):
    theirs_grads = {n: p.grad for n, p in theirs.named_parameters()}
    # Some gradients are zero in exact arithmetic (the key bias: softmax ignores a constant shift) and
    # only rounding noise in practice; measure those against the largest gradient, not against noise.
    floor = 1e-3 * max(g.abs().max() for g in theirs_grads.values())
    for name, param in ours.named_parameters():
        reference = theirs_grads[name]
        scale = torch.maximum(reference.abs().max(), floor)
        assert (param.grad - reference).abs().max() / scale < 1e-4, name


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seq_len", [13, 3])
def test_body_matches_transformers(name, seq_len, tmp_path):
    config = _config(name)
    theirs = _hf(transformers.ConvBertModel, config, "ConvBertModel", seed=1)
    theirs.save_pretrained(tmp_path / "hf")
    ours = ConvBertModel.from_hf_pretrained(tmp_path / "hf").eval()
    input_ids, attention_mask, token_type_ids = _batch(config, seq_len)

    expected = theirs(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
    got = ours(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < 1e-5

    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7))
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    _assert_close_grads(ours, theirs)


@pytest.mark.parametrize("name", ["embedding-projection", "grouped-ffn-k3", "k15-no-bottleneck"])
def test_masked_lm_matches_transformers(name, tmp_path):
    config = _config(name)
    theirs = _hf(transformers.ConvBertForMaskedLM, config, "ConvBertForMaskedLM", seed=2)
    theirs.save_pretrained(tmp_path / "hf")
    ours = ConvBertForMaskedLM.from_hf_pretrained(tmp_path / "hf").eval()
    input_ids, attention_mask, token_type_ids = _batch(config)

    expected = theirs(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits
    got = ours(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert (got - expected).abs().max() < 1e-5
    labels = torch.randint(0, config.vocab_size, input_ids.shape, generator=torch.Generator().manual_seed(3))
    torch.nn.functional.cross_entropy(expected.flatten(0, 1), labels.flatten()).backward()
    torch.nn.functional.cross_entropy(got.flatten(0, 1), labels.flatten()).backward()
    _assert_close_grads(ours, theirs)


@pytest.mark.parametrize("name", ["embedding-projection", "three-heads-groups3"])
def test_ours_saved_loads_in_transformers(name, tmp_path):
    config = _config(name)
    torch.manual_seed(4)
    ours = ConvBertForMaskedLM(config).eval()
    _perturb(ours, 4)
    ours.save_hf_pretrained(tmp_path / "ours")
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "ours", local_files_only=True).eval()
    assert type(theirs).__name__ == "ConvBertForMaskedLM"
    input_ids, attention_mask, token_type_ids = _batch(config)
    got = ours(input_ids, attention_mask, token_type_ids)
    expected = theirs(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits
    assert (got - expected).abs().max() < 1e-5

    body = transformers.AutoModel.from_pretrained(tmp_path / "ours", local_files_only=True).eval()
    assert (ours.convbert(input_ids, attention_mask, token_type_ids)
            - body(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
            ).abs().max() < 1e-5


def test_saved_config_is_explicit(tmp_path):
    import json

    config = _config("embedding-projection")
    ConvBertModel(config).save_hf_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["model_type"] == "convbert"
    assert saved["pad_token_id"] == 0
    assert saved["architectures"] == ["ConvBertModel"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dir left behind


def test_hf_round_trip_is_bit_exact(tmp_path):
    config = _config("grouped-ffn-k3")
    theirs = _hf(transformers.ConvBertForMaskedLM, config, "ConvBertForMaskedLM", seed=5)
    theirs.save_pretrained(tmp_path / "a")
    ConvBertForMaskedLM.from_hf_pretrained(tmp_path / "a").save_hf_pretrained(tmp_path / "b")
    again = transformers.ConvBertForMaskedLM.from_pretrained(tmp_path / "b", local_files_only=True)
    original = theirs.state_dict()
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, original[name]), name


@pytest.mark.parametrize("name", ["embedding-projection", "k15-no-bottleneck", "k1-gelu-new"])
def test_triton_kernel_matches_transformers(name, tmp_path):
    """The fused Triton SDConv (the interpreter when there is no GPU) behind the same model.

    On a GPU both models run there in fp32; cuDNN's convolutions may use TF32 (torch's default), hence
    the looser forward bound there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = _config(name)
    theirs = _hf(transformers.ConvBertModel, config, "ConvBertModel", seed=6)
    theirs.save_pretrained(tmp_path / "hf")
    theirs.to(device)
    ours = ConvBertModel.from_hf_pretrained(tmp_path / "hf", sdconv_impl="triton").eval().to(device)
    input_ids, attention_mask, token_type_ids = (t.to(device) for t in _batch(config, seq_len=7))
    expected = theirs(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
    got = ours(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert (got - expected).abs().max() < (1e-5 if device == "cpu" else 2e-3)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(8)).to(device)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    _assert_close_grads(ours, theirs)


@pytest.mark.parametrize("changes", [dict(conv_type="dynamic"), dict(conv_type="none", head_ratio=1),
                                     dict(num_attention_heads=2, head_ratio=1, attention_head_size=48)])
def test_bodies_transformers_cannot_express_round_trip_in_our_format_only(changes, tmp_path):
    """Ablation bodies (another conv type, no conv heads) and the official generator heads: refused as a
    transformers directory; with native_ok written under model_type convbert_ds, which our classes load
    to the same function and transformers refuses rather than building another model."""
    from convbert_ds.config import ConfigError
    from convbert_ds.model import ConvBertForSequenceClassification

    config = _config("embedding-projection").replace(**changes)
    model = ConvBertForSequenceClassification(config, label_names=["a", "b"]).eval()
    _perturb(model, 3)
    with pytest.raises(ConfigError):
        model.save_hf_pretrained(tmp_path / "hf")
    model.save_hf_pretrained(tmp_path / "native", native_ok=True)
    loaded = ConvBertForSequenceClassification.from_hf_pretrained(tmp_path / "native").eval()
    assert loaded.config == config
    ids = torch.randint(1, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    with pytest.raises(ValueError, match="convbert_ds"):
        transformers.AutoModel.from_pretrained(str(tmp_path / "native"), local_files_only=True)
