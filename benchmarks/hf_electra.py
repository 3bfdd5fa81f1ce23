"""transformers' own ConvBERT as an ELECTRA step in a plain PyTorch loop: the baseline row of
``benchmarks/train_step.py``.

What a user would write on top of transformers: ``ConvBertForMaskedLM`` as the generator (our generator's
sizes, ``config.generator``), ``ConvBertModel`` under ELECTRA's replaced-token-detection head
(transformers' ``ElectraDiscriminatorPredictions``: dense, activation, one logit: the head our
discriminator has), the embeddings shared between the two as ELECTRA
shares them. Masking is ours (``mask_tokens``), so both sides mask the same positions at the same rate;
the generator's loss and logits are transformers' (the LM head over every position, where ours runs it on
the masked ones only), the replacement is a Gumbel sample at every masked position, and
loss = mlm + rtd_weight (50) x rtd. ``train_step.py`` runs it in the same plain loop as our model (AdamW,
gradient clipping at 1.0, ``torch.autocast`` for bf16), so the two rows differ by the model alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.electra.modeling_electra import ElectraDiscriminatorPredictions

from convbert_ds.config import ElectraConfig, ModelConfig
from convbert_ds.model.electra import IGNORE_INDEX, gumbel_sample, mask_tokens
from convbert_ds.model.hf_io import config_json


def hf_config(config: ModelConfig, architecture: str) -> transformers.ConvBertConfig:
    """Our ModelConfig as transformers' ConvBertConfig (the config.json our exports write)."""
    return transformers.ConvBertConfig(**config_json(config, architecture, native_ok=False))


class HFElectra(nn.Module):
    """ELECTRA's generator + discriminator built from transformers' ConvBERT classes; ``forward`` returns the
    loss."""

    def __init__(self, config: ElectraConfig):
        super().__init__()
        if config.objective != "electra" or config.tie_generator_body:
            raise ValueError(f"HFElectra: objective={config.objective!r}, tie_generator_body="
                             f"{config.tie_generator_body}: the baseline builds the default ELECTRA pair only; "
                             "use objective='electra' with an untied generator")
        self.config = config
        disc = config.discriminator
        self.generator = transformers.ConvBertForMaskedLM(hf_config(config.generator, "ConvBertForMaskedLM"))
        self.discriminator = transformers.ConvBertModel(hf_config(disc, "ConvBertModel"))
        self.discriminator_predictions = ElectraDiscriminatorPredictions(
            transformers.ElectraConfig(hidden_size=disc.hidden_size, hidden_act=disc.hidden_act))
        # ELECTRA shares the embedding tables (ElectraConfig checks their sizes agree); the generator's LM
        # head stays tied to the word embeddings, now the shared ones.
        self.generator.convbert.embeddings = self.discriminator.embeddings
        self.generator.generator_lm_head.weight = self.discriminator.embeddings.word_embeddings.weight

    @torch.no_grad()
    def load_from(self, ours: nn.Module) -> None:
        """Start from the weights of our ``ElectraForPretraining`` (our modules carry transformers' names), so
        every row of the benchmark starts from the same model."""
        self.generator.load_state_dict(ours.generator.state_dict(), strict=True)
        self.discriminator.load_state_dict(ours.discriminator.convbert.state_dict(), strict=True)
        self.discriminator_predictions.load_state_dict(ours.discriminator.discriminator_predictions.state_dict(),
                                                       strict=True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
                ) -> torch.Tensor:
        config = self.config
        masking = mask_tokens(input_ids, attention_mask, config)
        generated = self.generator(masking.masked_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                   labels=masking.labels)
        # A sample at every position, kept at the masked ones: no boolean indexing, so whatever syncs this
        # row shows come from transformers, not from this loop.
        sampled = gumbel_sample(generated.logits.detach(), config.temperature)
        corrupted = torch.where(masking.labels != IGNORE_INDEX, sampled, input_ids)
        hidden = self.discriminator(corrupted, attention_mask=attention_mask,
                                    token_type_ids=token_type_ids).last_hidden_state
        logits = self.discriminator_predictions(hidden)
        weight = attention_mask.float()
        per_token = F.binary_cross_entropy_with_logits(logits.float(), (corrupted != input_ids).float(),
                                                       reduction="none")
        rtd = (per_token * weight).sum() / weight.sum().clamp_min(1)
        return generated.loss + config.rtd_weight * rtd


def compile_hf_layers(model: HFElectra) -> int:
    """transformers' encoder layers through torch.compile, as ``compile_layers`` does ours (``--compile``)."""
    from transformers.models.convbert.modeling_convbert import ConvBertLayer

    layers = [module for module in model.modules() if isinstance(module, ConvBertLayer)]
    for layer in layers:
        layer.compile(dynamic=False)
    return len(layers)

