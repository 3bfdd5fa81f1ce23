"""One map of parameter names: the plain ``ElectraForPretraining``, its pipeline layers, universal copies.

The pipeline engine (``convbert_ds.engine.pipeline``) arranges the plain model's layers in the order
``pipeline_layer_prefixes`` lists; a DeepSpeed pipeline checkpoint holds ``layer_{index:02d}-model_states.pt``
per layer that has parameters of its own, and key ``k`` of that file is the plain parameter ``prefix + k``.
Universal copies and converted checkpoints store every tensor under its canonical plain name (the first
of its tied names). Transformers' names are the plain model's (``convbert_ds.model.hf_io``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from convbert_ds.config import ElectraConfig, ModelConfig
from convbert_ds.model import ElectraForPretraining
from convbert_ds.model.tied import tied_groups

SHARED_EMBEDDINGS_LAYER = 1  # the pipeline layer holding the embeddings every stage shares


def _body(prefix: str, config: ModelConfig) -> list[str]:
    projection = [f"{prefix}embeddings_project."] if config.embedding_size != config.hidden_size else []
    return projection + [f"{prefix}encoder.layer.{i}." for i in range(config.num_hidden_layers)]


def pipeline_layer_prefixes(config: ElectraConfig) -> list[str | None]:
    """Per pipeline layer, in order: the plain-model prefix of the parameters it holds, or None (no file)."""
    if config.objective != "electra":  # MLM: the generator alone, ending at its output layer
        return [None, "generator.convbert.embeddings.", *_body("generator.convbert.", config.discriminator),
                "generator.", None]
    return [None, "discriminator.convbert.embeddings.", *_body("generator.convbert.", config.generator),
            "generator.", None, *_body("discriminator.convbert.", config.discriminator),
            "discriminator.discriminator_predictions."]


def pipeline_layer_names(config: ElectraConfig) -> dict[int, str]:
    """Pipeline layer index -> the plain prefix of that layer's parameters; layers without a file are absent."""
    return {index: prefix for index, prefix in enumerate(pipeline_layer_prefixes(config)) if prefix is not None}


def pipeline_to_plain(config: ElectraConfig) -> Callable[[str], str]:
    """Maps a ``PipelineModule`` parameter name ("8.attention.self.query.weight", "tied_modules.embeddings.
    LayerNorm.bias") to the plain model's name of the same tensor."""
    layers = pipeline_layer_names(config)
    shared = layers[SHARED_EMBEDDINGS_LAYER]

    def plain(name: str) -> str:
        head, _, rest = name.partition(".")
        return shared + rest.partition(".")[2] if head == "tied_modules" else layers[int(head)] + rest

    return plain


def meta_model(config: ElectraConfig) -> ElectraForPretraining:
    """The plain model on the meta device: its names, shapes and parameter order, no memory."""
    with torch.device("meta"):
        return ElectraForPretraining(config)


def canonical_names(config: ElectraConfig) -> dict[str, str]:
    """Every parameter name of the plain model (tied twins included) -> the name its tensor is stored under."""
    return {alias: first for first, names in tied_groups(meta_model(config)).items() for alias in names}
