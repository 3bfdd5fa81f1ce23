"""The ELECTRA step as a sequence of pipeline layers, and the tuples that flow between them.

Every layer takes the tuple its predecessor returned and returns the next one. A stage boundary can
fall between any two layers, so each tuple carries exactly what the rest of the step needs, in the
form DeepSpeed's pipeline engine (0.19) can ship:

- ``(ints, *floats)``: all integer fields stacked in one int64 ``[fields, B, T]`` tensor (scalars as
  constant rows), then the floating-point tensors, all in the model's dtype, each of which receives
  a gradient downstream (the engine sends one back for every float a stage received);
- shapes fixed by the micro-batch. The engine reuses one receive buffer per tuple position for
  activations *and* gradients, ignoring dtype: with one integer tensor first, every float's gradient
  lands on a float buffer, or on a fresh one because the first float (hidden states, ``[B, T, W]``
  with ``W > fields``) outgrows the integers. Separate integer tensors or a float32 loss beside bf16
  hidden states would receive gradients into integer or bf16 buffers on middle stages (3+ stages).

The parameterised layers are the model's own classes (``ConvBertEmbeddings``, ``ConvBertLayer``,
``ConvBertGeneratorPredictions``, ``ConvBertDiscriminatorPredictions``, ``nn.Linear``) with a
``forward`` that unpacks the tuple; their state-dict keys are the plain model's below a prefix.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import nn

from convbert_ds.config import ElectraConfig, ModelConfig
from convbert_ds.model.convbert import (ConvBertDiscriminatorPredictions, ConvBertGeneratorPredictions,
                                       vocabulary_logits)
from convbert_ds.model.electra import corrupt, mask_tokens, masked_positions, mlm_loss_and_sample
from convbert_ds.model.layers import ConvBertEmbeddings, ConvBertLayer, document_positions, init_weights, padding_masks


class Masked(NamedTuple):
    """After the masking layer. ``stream_seed`` seeds the micro-batch's masking + Gumbel stream."""

    FLOATS = ()
    input_ids: torch.Tensor
    masked_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    mlm_labels: torch.Tensor
    stream_seed: torch.Tensor
    document_ids: torch.Tensor  # packed samples' document ids; a copy of attention_mask, unread, when not packed


class GeneratorHidden(NamedTuple):
    FLOATS = ("hidden",)
    hidden: torch.Tensor  # [B, T, E] after the embeddings, [B, T, H_gen] after the projection
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    mlm_labels: torch.Tensor
    stream_seed: torch.Tensor
    document_ids: torch.Tensor


class GeneratorTransformed(NamedTuple):
    """``transformed``: the MLM transform at masked positions, zeros elsewhere. ``lm_bias``: the generator's
    output bias, on its way to the layer that holds the tied output table."""

    FLOATS = ("transformed", "lm_bias")
    transformed: torch.Tensor  # [B, T, E]
    lm_bias: torch.Tensor  # [V]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    mlm_labels: torch.Tensor
    stream_seed: torch.Tensor
    document_ids: torch.Tensor


class DiscriminatorHidden(NamedTuple):
    """``mlm_loss`` in the model's dtype carries the gradient; the ``*_bits`` rows are float32 bit patterns
    of the exact MLM loss and accuracy (metrics as floats would have to receive gradients)."""

    FLOATS = ("hidden", "mlm_loss")
    hidden: torch.Tensor  # [B, T, E] or [B, T, H]; the RTD logits [B, T] after the head
    mlm_loss: torch.Tensor  # []
    is_replaced: torch.Tensor  # 0/1 (bool tensors are special-cased by the engine)
    attention_mask: torch.Tensor
    mlm_loss_bits: torch.Tensor
    mlm_accuracy_bits: torch.Tensor
    document_ids: torch.Tensor


class MaskedLMOutput(NamedTuple):
    """The end of the ``mlm`` objective's pipeline (never sent: the loss is computed on the same stage)."""

    FLOATS = ("mlm_loss",)
    mlm_loss: torch.Tensor
    mlm_accuracy_bits: torch.Tensor


MAX_INT_FIELDS = max(len(s._fields) - len(s.FLOATS) for s in (Masked, GeneratorHidden, GeneratorTransformed,
                                                               DiscriminatorHidden))


def to_pipe(state: NamedTuple) -> tuple:
    ints = torch.stack([getattr(state, name) for name in state._fields if name not in state.FLOATS])
    return (ints, *(getattr(state, name) for name in state.FLOATS))


def from_pipe(state_type: type[NamedTuple], inputs: tuple | torch.Tensor) -> NamedTuple:
    # DeepSpeed unwraps a one-element tuple when activation checkpointing is on.
    ints, *floats = (inputs,) if torch.is_tensor(inputs) else inputs
    names = [name for name in state_type._fields if name not in state_type.FLOATS]
    return state_type(**dict(zip(names, ints.unbind(0))), **dict(zip(state_type.FLOATS, floats)))


def float_row(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A float32 scalar as a constant int64 row shaped like ``like`` (its bit pattern, exact)."""
    return value.detach().float().view(torch.int32).long().expand_as(like)


def row_float(row: torch.Tensor) -> torch.Tensor:
    return row[0, 0].to(torch.int32).view(torch.float32)


def draw_stream_seed(generator: torch.Generator | None = None) -> int:
    """The seed of one micro-batch's masking + Gumbel random stream (from torch's global CPU RNG by default).

    After ``torch.manual_seed(draw_stream_seed(g))`` the plain ``ElectraForPretraining`` makes the same
    random draws as the pipeline does for the micro-batch that drew this seed.
    """
    return int(torch.randint(0, 2**62, (), generator=generator))


@contextmanager
def _global_rng_at(stream: torch.Generator):
    """Run the block with the global RNG of ``stream``'s device in ``stream``'s state, then restore it."""
    device = stream.device
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
        if device.type == "cpu":
            torch.set_rng_state(stream.get_state())
        else:
            getattr(torch, device.type).set_rng_state(stream.get_state(), device)
        yield


def _bert_init(module: nn.Module, config: ModelConfig) -> None:
    for sub in module.modules():
        init_weights(sub, config.initializer_range)


class MaskingLayer(nn.Module):
    """First layer: masks the inputs, as ``ElectraForPretraining.forward`` does (the trainer has checked them
    on the host).

    Each micro-batch gets its own random stream, a generator seeded by ``draw_stream_seed`` (from
    ``seed``'s generator if given, else from torch's global RNG). Only the seed travels: the sampling
    layer replays the masking draw on the same stream and continues it for the Gumbel noise, exactly
    as the plain model's single stream does in one process.
    """

    def __init__(self, config: ElectraConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.seed_generator = None if seed is None else torch.Generator().manual_seed(seed)

    def forward(self, inputs) -> tuple:
        input_ids, attention_mask, token_type_ids, document_ids = inputs
        seed = draw_stream_seed(self.seed_generator)
        stream = torch.Generator(device=input_ids.device).manual_seed(seed)
        masked_ids, labels, _, _ = mask_tokens(input_ids, attention_mask, self.config, generator=stream)
        return to_pipe(Masked(input_ids, masked_ids, attention_mask, token_type_ids, labels,
                              torch.full_like(input_ids, seed), document_ids))


class SharedEmbeddings(ConvBertEmbeddings):
    """The one embedding module of ELECTRA (a ``TiedLayerSpec``); as a layer it embeds the masked tokens.

    Its other use is ``generator_output_forward``: output table of the generator, then the
    discriminator's embeddings.
    """

    def __init__(self, config: ModelConfig, packed: bool = False):
        super().__init__(config)
        self.packed = packed  # batches hold several documents: positions restart per document
        _bert_init(self, config)

    def positions(self, document_ids: torch.Tensor) -> torch.Tensor | None:
        return document_positions(document_ids) if self.packed else None

    def forward(self, inputs) -> tuple:
        s = from_pipe(Masked, inputs)
        hidden = super().forward(s.masked_ids, s.token_type_ids, self.positions(s.document_ids))
        return to_pipe(GeneratorHidden(hidden, s.input_ids, s.attention_mask, s.token_type_ids, s.mlm_labels,
                                       s.stream_seed, s.document_ids))


class EmbeddingProjection(nn.Linear):
    """``embeddings_project`` (embedding width -> hidden width) of a body whose widths differ."""

    def __init__(self, config: ModelConfig, state_type: type[NamedTuple]):
        super().__init__(config.embedding_size, config.hidden_size)
        self.state_type = state_type
        _bert_init(self, config)

    def forward(self, inputs) -> tuple:
        s = from_pipe(self.state_type, inputs)
        return to_pipe(s._replace(hidden=super().forward(s.hidden)))


class EncoderLayer(ConvBertLayer):
    """One ``ConvBertLayer`` of the generator or the discriminator (``state_type`` says which tuple it sees)."""

    def __init__(self, config: ModelConfig, state_type: type[NamedTuple], packed: bool = False):
        super().__init__(config)
        self.state_type, self.packed, self.kernel_size = state_type, packed, config.conv_kernel_size
        _bert_init(self, config)

    def forward(self, inputs) -> tuple:
        s = from_pipe(self.state_type, inputs)
        masks = padding_masks(s.attention_mask, s.document_ids if self.packed else None, self.kernel_size)
        return to_pipe(s._replace(hidden=super().forward(s.hidden, masks)))


class GeneratorHead(nn.Module):
    """The generator's own head parameters, named as in ``ConvBertForMaskedLM``: the MLM transform and the
    output bias. The output matrix is the shared word-embedding table, applied by the next layer."""

    def __init__(self, config: ModelConfig, electra: ElectraConfig):
        super().__init__()
        self.electra = electra
        self.generator_predictions = ConvBertGeneratorPredictions(config)
        self.generator_lm_head = nn.Module()
        self.generator_lm_head.bias = nn.Parameter(torch.zeros(config.vocab_size))
        init_weights(self.generator_predictions.dense, config.initializer_range)

    def forward(self, inputs) -> tuple:
        s = from_pipe(GeneratorHidden, inputs)
        # Only the masked positions' slots are transformed (as in the plain model), scattered back into [B, T, E].
        positions, _ = masked_positions(s.mlm_labels, self.electra)
        hidden = s.hidden.gather(1, positions[..., None].expand(-1, -1, s.hidden.shape[-1]))
        picked = self.generator_predictions(hidden)
        transformed = picked.new_zeros(*s.hidden.shape[:2], picked.shape[-1])
        transformed = transformed.scatter(1, positions[..., None].expand_as(picked), picked)
        # An op's output rather than the parameter, so that a send across stages backpropagates into it.
        lm_bias = self.generator_lm_head.bias * 1
        return to_pipe(GeneratorTransformed(transformed, lm_bias, s.input_ids, s.attention_mask, s.token_type_ids,
                                            s.mlm_labels, s.stream_seed, s.document_ids))


def generator_output_forward(embeddings: SharedEmbeddings, inputs, config: ElectraConfig) -> tuple:
    """The shared table as the generator's output layer: MLM loss and accuracy; for ELECTRA also the Gumbel
    sample, the corrupted sequence, and the table again as the discriminator's embeddings."""
    s = from_pipe(GeneratorTransformed, inputs)
    electra = config.objective == "electra"
    stream = torch.Generator(device=s.input_ids.device).manual_seed(int(s.stream_seed[0, 0]))
    mask_tokens(s.input_ids, s.attention_mask, config, generator=stream)  # replay: on to the Gumbel draws
    # The ``head`` that mlm_loss_and_sample calls: transformed hidden states -> logits over the shared table.
    table = embeddings.word_embeddings.weight
    tied_output = SimpleNamespace(head=lambda transformed: vocabulary_logits(transformed, table, s.lm_bias))
    positions, chosen = masked_positions(s.mlm_labels, config)
    with _global_rng_at(stream):
        mlm, accuracy, sampled = mlm_loss_and_sample(tied_output, s.transformed, s.input_ids, positions, chosen,
                                                     config.temperature, sample=electra)
    accuracy_bits = float_row(accuracy, s.input_ids)
    if not electra:
        return to_pipe(MaskedLMOutput(mlm, accuracy_bits))
    corrupted, is_replaced = corrupt(s.input_ids, positions, chosen, sampled)
    hidden = ConvBertEmbeddings.forward(embeddings, corrupted, s.token_type_ids, embeddings.positions(s.document_ids))
    return to_pipe(DiscriminatorHidden(hidden, mlm.to(hidden.dtype), is_replaced.long(), s.attention_mask,
                                       float_row(mlm, s.input_ids), accuracy_bits, s.document_ids))


class RTDHead(ConvBertDiscriminatorPredictions):
    """The discriminator's replaced-token-detection head: one logit per position."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        _bert_init(self, config)

    def forward(self, inputs) -> tuple:
        s = from_pipe(DiscriminatorHidden, inputs)
        return to_pipe(s._replace(hidden=super().forward(s.hidden)))
