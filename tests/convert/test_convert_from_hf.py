"""transformers ConvBERT -> INIT_DIR -> our ELECTRA model -> transformers again, bit for bit.

The published-model side is built by transformers itself (random, perturbed ConvBERT models and a
WordPiece tokenizer saved with ``save_pretrained``); our side loads INIT_DIR the way the trainer does.
"""

import json
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

from convbert_ds.config import ElectraConfig, generator_config
from convbert_ds.convert import (
    ConvertError,
    convert_from_hf,
    export_model,
    init_generator_config,
    init_model_config,
    load_init_weights,
)
from convbert_ds.convert.__main__ import main as cli_main
from convbert_ds.model import ElectraForPretraining, WeightsError
from launch import REPO, env

WORDS = "the quick brown fox jumps over lazy dog it was not amused check points are convert once and load".split()
SHARED = dict(num_hidden_layers=2, embedding_size=32, max_position_embeddings=64, pad_token_id=0,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _perturb(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A ConvBERT body + a generator with the same embedding tables, and a WordPiece tokenizer."""
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("published")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz.,",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"), *WORDS]
    tokenizer = transformers.ConvBertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    config = dict(vocab_size=len(tokenizer), **SHARED)
    torch.manual_seed(0)
    body = transformers.ConvBertModel(transformers.ConvBertConfig(hidden_size=64, num_attention_heads=4,
                                                                  intermediate_size=128, **config))
    _perturb(body, 1)
    gen = transformers.ConvBertForMaskedLM(transformers.ConvBertConfig(hidden_size=32, num_attention_heads=2,
                                                                       intermediate_size=64, **config))
    _perturb(gen, 2)
    with torch.no_grad():
        gen.convbert.embeddings.load_state_dict(body.embeddings.state_dict())
    body.save_pretrained(str(root / "body"))
    tokenizer.save_pretrained(str(root / "body"))
    gen.save_pretrained(str(root / "generator"))
    tokenizer.save_pretrained(str(root / "generator"))
    return {"body": root / "body", "generator": root / "generator", "tokenizer": tokenizer}


def _electra(init_dir, objective="electra"):
    main = init_model_config(init_dir)
    if objective == "mlm":
        return ElectraConfig(discriminator=main, objective="mlm")
    return ElectraConfig(discriminator=main, generator=init_generator_config(init_dir) or generator_config(main, 0.25))


def _same_files(original, exported):
    a, b = load_file(str(original / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert set(a) <= set(b)
    for name, tensor in a.items():
        assert tensor.dtype == b[name].dtype and torch.equal(tensor, b[name]), name
    return set(b) - set(a)


def test_hf_to_ours_to_hf_is_bit_exact(published, tmp_path):
    init_dir = tmp_path / "init"
    init = convert_from_hf(published["body"], init_dir, generator_dir=published["generator"])
    assert init["notes"] == [] and init["tokenizer"]["kind"] == "huggingface"
    model = ElectraForPretraining(_electra(init_dir))
    fresh = load_init_weights(model, init_dir)
    assert fresh == [f"discriminator.discriminator_predictions.{n}" for n in
                     ("dense.weight", "dense.bias", "dense_prediction.weight", "dense_prediction.bias")]
    export_model(model, tmp_path / "back", init_dir / "tokenizer", verify=True)
    assert _same_files(published["body"], tmp_path / "back" / "discriminator") == set()
    # transformers leaves the tied LM head out of its file; ours writes it, equal to the embeddings.
    assert _same_files(published["generator"], tmp_path / "back" / "generator") == {"generator_lm_head.weight"}
    # ... and the RTD head, now trained-from-scratch, travels too: back in, it is no longer fresh.
    again = convert_from_hf(tmp_path / "back" / "discriminator", tmp_path / "init2",
                            generator_dir=tmp_path / "back" / "generator")
    assert any(t.startswith("discriminator.discriminator_predictions.") for t in again["tensors"])
    assert load_init_weights(ElectraForPretraining(_electra(tmp_path / "init2")), tmp_path / "init2") == []


def test_body_only_init_leaves_generator_and_head_fresh_and_keeps_the_wordpiece_tokenizer(published, tmp_path):
    init_dir = tmp_path / "init"
    code = cli_main(["--from-hf", str(published["body"]), "--out", str(init_dir)])
    assert code == 0
    init = json.loads((init_dir / "init.json").read_text())
    assert init["generator"] is None and all(t.startswith("discriminator.convbert.") for t in init["tensors"])
    model = ElectraForPretraining(_electra(init_dir))
    before = model.generator.convbert.encoder.layer[0].attention.self.query.weight.clone()
    fresh = load_init_weights(model, init_dir)
    assert "generator.convbert.encoder.layer.0.attention.self.query.weight" in fresh
    assert not any(name.startswith("discriminator.convbert.") for name in fresh)
    assert torch.equal(model.generator.convbert.encoder.layer[0].attention.self.query.weight, before)
    # The generator shares the loaded embeddings.
    hf = load_file(str(published["body"] / "model.safetensors"))
    assert torch.equal(model.generator.convbert.embeddings.word_embeddings.weight,
                       hf["embeddings.word_embeddings.weight"])
    # Corpora sharded with INIT_DIR/tokenizer get the published tokenizer's ids.
    from preprocessing.tokenizer import load_tokenizer

    ours = load_tokenizer(init_dir / "tokenizer")
    text = "the quick brown fox jumped over the lazy dogs."
    assert ours.encode(text) == published["tokenizer"](text, add_special_tokens=False)["input_ids"]
    assert ours.sha256 == init["tokenizer"]["sha256"] and ours.special_ids["mask"] == 4


def test_mlm_objective_init_from_a_masked_lm(published, tmp_path):
    init_dir = tmp_path / "init"
    convert_from_hf(published["generator"], init_dir, objective="mlm")
    model = ElectraForPretraining(_electra(init_dir, "mlm"))
    assert load_init_weights(model, init_dir) == []
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(published["generator"]), local_files_only=True).eval()
    ids = torch.randint(5, 60, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.generator.eval()(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=0)
    electra = ElectraForPretraining(ElectraConfig(discriminator=init_model_config(init_dir),
                                                  generator=generator_config(init_model_config(init_dir), 0.5)))
    with pytest.raises(ConvertError, match="objective 'mlm'"):
        load_init_weights(electra, init_dir)


def test_weights_that_do_not_fit_name_the_tensor_and_both_shapes(published, tmp_path):
    init_dir = tmp_path / "init"
    convert_from_hf(published["body"], init_dir)
    wider = ElectraConfig(discriminator=init_model_config(init_dir).replace(intermediate_size=256),
                          generator=generator_config(init_model_config(init_dir), 0.5))
    with pytest.raises(WeightsError) as error:
        load_init_weights(ElectraForPretraining(wider), init_dir)
    message = str(error.value)
    assert "intermediate.dense.weight" in message and "(128, 64)" in message and "(256, 64)" in message


def test_bad_from_hf_inputs_are_one_line_errors(published, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["--from-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "a")], "config.json"),
        (["--from-hf", str(published["body"]), "--out", str(tmp_path / "full")], "--force"),
        (["--from-hf", str(published["body"]), "--out", str(tmp_path / "b"), "--objective", "mlm",
          "--from-hf-generator", str(published["generator"])], "--objective electra"),
        (["--from-hf", str(published["body"]), "--out", str(tmp_path / "c"), "--verify"], "--checkpoint"),
    ]
    for args, needle in cases:
        assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and needle in err, err
    # A generator whose widths do not fit the body's shared embeddings.
    bad = transformers.ConvBertForMaskedLM(transformers.ConvBertConfig(
        vocab_size=len(published["tokenizer"]), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        **{**SHARED, "embedding_size": 16}))
    bad.save_pretrained(str(tmp_path / "badgen"))
    assert cli_main(["--from-hf", str(published["body"]), "--from-hf-generator", str(tmp_path / "badgen"),
                     "--out", str(tmp_path / "d")]) == 2
    assert "embedding_size" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abcd")


@pytest.mark.slow
def test_from_hf_cli_in_a_fresh_process(published, tmp_path):
    done = subprocess.run([sys.executable, "-m", "convbert_ds.convert", "--from-hf", str(published["body"]),
                           "--out", str(tmp_path / "init")], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "wrote" in done.stdout and (tmp_path / "init" / "model.safetensors").is_file()
