"""Packed samples (several documents in one row, ``document_ids``): nothing leaks between documents.

A packed row's outputs, document by document, equal each document run alone; a row holding one document
and no padding equals transformers' ConvBERT. Checked through the torch SDConv path here and through the
Triton kernels in the interpreter (their own tests compare them with the torch path)."""

import pytest
import torch
import transformers

from convbert_ds.config import ElectraConfig, ModelConfig, generator_config
from convbert_ds.model import ConvBertModel, ElectraForPretraining
from convbert_ds.model.layers import document_positions

BASE = dict(vocab_size=101, num_hidden_layers=2, max_position_embeddings=40, pad_token_id=0, hidden_size=64,
            num_attention_heads=4, intermediate_size=128, embedding_size=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
LENGTHS = (9, 3, 14, 1)  # documents of one packed row, then 5 pads: boundaries closer than a kernel's reach


def _perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return model.eval()


def _documents(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    documents = []
    for length in LENGTHS:
        ids = torch.randint(1, BASE["vocab_size"], (length,), generator=gen)
        types = (torch.arange(length) >= length // 2).long()
        documents.append((ids, types))
    return documents


def _packed(documents, pad: int = 5):
    ids = torch.cat([d[0] for d in documents] + [torch.zeros(pad, dtype=torch.long)])[None]
    types = torch.cat([d[1] for d in documents] + [torch.zeros(pad, dtype=torch.long)])[None]
    doc_ids = torch.cat([torch.full((len(d[0]),), i + 1) for i, d in enumerate(documents)]
                        + [torch.zeros(pad, dtype=torch.long)])[None]
    return ids, (doc_ids > 0).long(), types, doc_ids


@pytest.mark.parametrize("conv", [dict(conv_type="sdconv", conv_kernel_size=9),
                                  dict(conv_type="sdconv", conv_kernel_size=5, sdconv_mask_padding=True),
                                  dict(conv_type="conventional", conv_kernel_size=7),
                                  dict(conv_type="sdconv", conv_kernel_size=9, sdconv_impl="triton")],
                         ids=["sdconv-k9", "sdconv-k5-masked", "conventional-k7", "sdconv-triton"])
def test_each_document_of_a_packed_row_is_computed_as_if_alone(conv):
    model = _perturbed(ConvBertModel(ModelConfig(**BASE, **conv)))
    documents = _documents()
    ids, mask, types, doc_ids = _packed(documents)
    with torch.no_grad():
        packed = model(ids, mask, types, document_ids=doc_ids)[0]
        start = 0
        for doc_ids_, doc_types in documents:
            alone = model(doc_ids_[None], torch.ones_like(doc_ids_)[None], doc_types[None])[0]
            torch.testing.assert_close(packed[start:start + len(doc_ids_)], alone, rtol=1e-5, atol=1e-5)
            start += len(doc_ids_)


def test_one_document_without_padding_equals_transformers(tmp_path):
    config = ModelConfig(**BASE, conv_kernel_size=9)
    torch.manual_seed(0)
    theirs = _perturbed(transformers.ConvBertModel(transformers.ConvBertConfig(**config.to_hf_dict(["ConvBertModel"]))))
    theirs.save_pretrained(tmp_path / "hf")
    ours = ConvBertModel.from_hf_pretrained(tmp_path / "hf").eval()
    ids, _, types, _ = _packed(_documents()[:1], pad=0)
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types).last_hidden_state
        got = ours(ids, torch.ones_like(ids), types, document_ids=torch.ones_like(ids))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_positions_restart_per_document_and_gradients_stay_inside():
    ids, mask, types, doc_ids = _packed(_documents())
    assert document_positions(doc_ids)[0].tolist() == [*range(9), *range(3), *range(14), 0, *range(5)]
    model = _perturbed(ConvBertModel(ModelConfig(**BASE, conv_kernel_size=9)))
    embedded = {}

    def keep(module, args, output):
        output.retain_grad()
        embedded["tokens"] = output

    model.embeddings.register_forward_hook(keep)
    model(ids, mask, types, document_ids=doc_ids)[0, 9:12].sum().backward()  # document 2's outputs
    reached = embedded["tokens"].grad[0].abs().sum(-1)  # which tokens' embeddings they depend on
    assert reached[9:12].gt(0).all() and reached[:9].eq(0).all() and reached[12:].eq(0).all()


def test_electra_step_on_a_packed_batch():
    body = ModelConfig(**BASE, conv_kernel_size=9)
    config = ElectraConfig(discriminator=body, generator=generator_config(body, 0.5), mask_token_id=3,
                           special_token_ids=(0, 1, 2))
    model = ElectraForPretraining(config)
    ids, mask, types, doc_ids = _packed(_documents())
    out = model(ids.repeat(2, 1), mask.repeat(2, 1), types.repeat(2, 1), document_ids=doc_ids.repeat(2, 1))
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                            if p.grad is not None)
