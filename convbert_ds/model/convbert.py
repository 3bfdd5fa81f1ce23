"""ConvBERT models: the body, the generator (masked LM) and the discriminator (RTD).

``ConvBertModel`` and ``ConvBertForMaskedLM`` compute the same functions as
transformers' classes of the same names and share their parameter names, so
``from_hf_pretrained`` / ``save_hf_pretrained`` move weights without renaming.
``ConvBertForPreTraining`` adds ELECTRA's replaced-token-detection head
(``discriminator_predictions.dense`` / ``.dense_prediction``, ELECTRA's names).
``ConvBertForSequenceClassification`` is transformers' class of that name (fine-tuning).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch import nn

from convbert_ds.config import ModelConfig
from convbert_ds.errors import UserError
from convbert_ds.model import hf_io
from convbert_ds.model.layers import (ACTIVATIONS, ConvBertEmbeddings, ConvBertLayer, document_positions,
                                      ResidualLayerNorm, init_weights, padding_masks, run_layer_compiled_once)


class InputError(UserError, ValueError):
    """Model inputs that the model cannot take (ids out of range, too long, wrong shape)."""


def check_inputs(config: ModelConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 token_type_ids: torch.Tensor | None, document_ids: torch.Tensor | None = None) -> None:
    """Reject bad inputs with a message, before they become an index error deep inside torch."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise InputError(f"input_ids must be an integer tensor [batch, seq_len], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    seq_len = input_ids.shape[1]
    if seq_len > config.max_position_embeddings:
        raise InputError(f"sequence length {seq_len} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}; truncate the inputs or use a longer-context model")
    for name, mask in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                       ("document_ids", document_ids)):
        if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
            raise InputError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(input_ids.shape)} "
                             "like input_ids")
    if input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= config.vocab_size:
            raise InputError(f"input_ids contain id {high if high >= config.vocab_size else low}, outside "
                             f"[0, vocab_size={config.vocab_size}); the tokenizer and the model config disagree")
    if token_type_ids is not None and token_type_ids.numel() and int(token_type_ids.max()) >= config.type_vocab_size:
        raise InputError(f"token_type_ids contain {int(token_type_ids.max())}, but type_vocab_size="
                         f"{config.type_vocab_size}")


class HFInterop:
    """``from_hf_pretrained`` / ``save_hf_pretrained`` for classes that declare their transformers twin."""

    hf_architecture: str
    hf_prefix: str

    @classmethod
    def from_hf_pretrained(cls, directory, **config_overrides):
        """Load a transformers ConvBERT directory (config.json + safetensors/bin), offline."""
        model = cls(hf_io.read_config(directory, **config_overrides))
        hf_io.load_weights(model, directory, prefix=cls.hf_prefix)
        return model

    def save_hf_pretrained(self, directory, extra_files: dict[str, bytes] | None = None,
                           native_ok: bool = False) -> None:
        """Write a directory transformers loads with ``from_pretrained`` (atomic: temp dir + rename);
        ``native_ok``: a body transformers cannot express is written in our format (``to_native_dict``)."""
        hf_io.save(self, directory, self.hf_architecture, extra_files, self.hf_config_extra(), native_ok)

    def hf_config_extra(self) -> dict:
        """config.json entries beyond the body's ModelConfig (a head's labels, say)."""
        return {}


class ConvBertModel(HFInterop, nn.Module):
    """The ConvBERT encoder. ``forward`` returns the last hidden state ``[B, T, H]``.

    ``embeddings`` lets an ELECTRA generator share the discriminator's tables.
    """

    hf_architecture = "ConvBertModel"
    hf_prefix = ""

    def __init__(self, config: ModelConfig, embeddings: ConvBertEmbeddings | None = None):
        super().__init__()
        self.config = config
        self.embeddings = embeddings if embeddings is not None else ConvBertEmbeddings(config)
        if config.embedding_size != config.hidden_size:
            self.embeddings_project = nn.Linear(config.embedding_size, config.hidden_size)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(ConvBertLayer(config) for _ in range(config.num_hidden_layers))
        # Recompute each layer in backward instead of keeping its activations (memory for compute).
        self.gradient_checkpointing = False
        # Each layer through one compiled region per width under torch.compile (``compile_step``'s
        # ``layers_once``); a plain call otherwise.
        self.layers_compiled_once = False
        # Shared embeddings were initialised by their owner; re-drawing them here would change its weights.
        for name, module in self.named_modules():
            if embeddings is None or not name.startswith("embeddings."):
                init_weights(module, config.initializer_range)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, check: bool = True,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``document_ids`` ``[B, T]`` (packed samples: 1, 2, ... per document, 0 on padding): each document
        is computed as if alone, its position ids restarting at 0."""
        if check:
            check_inputs(self.config, input_ids, attention_mask, token_type_ids, document_ids)
        positions = None if document_ids is None else document_positions(document_ids)
        hidden = self.embeddings(input_ids, token_type_ids, positions)
        if hasattr(self, "embeddings_project"):
            hidden = self.embeddings_project(hidden)
        masks = padding_masks(attention_mask, document_ids, self.config.conv_kernel_size)  # once per body
        for layer in self.encoder.layer:
            if self.gradient_checkpointing and self.training:
                hidden = torch.utils.checkpoint.checkpoint(layer, hidden, masks, use_reentrant=False)
            elif self.layers_compiled_once:
                hidden = run_layer_compiled_once(layer, hidden, masks)
            else:
                hidden = layer(hidden, masks)
        return hidden


class ConvBertGeneratorPredictions(nn.Module):
    """MLM transform: hidden -> embedding width, GELU, LayerNorm (transformers always uses exact GELU here)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.LayerNorm = ResidualLayerNorm(config.embedding_size, config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(nn.functional.gelu(self.dense(hidden_states)))


def vocabulary_logits(hidden_states: torch.Tensor, table: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The tied output layer, ``hidden_states @ table.T + bias`` (``[..., E]`` -> ``[..., V]``). Eagerly one
    ``addmm``; compiled, a matmul and then the bias, added in the matmul's dtype (``addmm``'s under autocast).

    Why two ways: CUDA's ``addmm`` adds a bias in cuBLASLt's epilogue only into a contiguous output, and
    inductor (outside max-autotune) pads the row stride of an output this wide to 128 bytes (rows of 30,166
    bf16 logits are stored 30,208 apart). A compiled ``addmm`` then copies the bias, broadcast, into the whole
    ``[rows, V]`` output and runs a GEMM that adds to it (cuBLAS's ``badd`` kernel after the copy:
    benchmarks/RESULTS.md#row-generator-head-mm). A plain matmul writes the padded rows without a copy, and inductor
    fuses the add into the kernels that read the logits (the loss, the sample). Its pattern that folds an add
    on an ``mm`` back into ``addmm`` does not match the add on the ``[B, P, V]`` view the model's rows give.
    Eagerly the output is contiguous, the epilogue adds the bias, and an add of its own would be one more
    pass (and other values in bf16)."""
    if not torch.compiler.is_compiling():
        return nn.functional.linear(hidden_states, table, bias)
    logits = nn.functional.linear(hidden_states, table)
    return logits + bias.to(logits.dtype)


class VocabularyOutput(nn.Linear):
    """``nn.Linear`` (its parameters, names and hooks: ZeRO-3 gathers them as for any module) computed as
    ``vocabulary_logits``."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return vocabulary_logits(hidden_states, self.weight, self.bias)


class ConvBertForMaskedLM(HFInterop, nn.Module):
    """Body + MLM head whose output matrix is the word-embedding table (tied). Returns logits ``[B, T, V]``."""

    hf_architecture = "ConvBertForMaskedLM"
    hf_prefix = "convbert."

    def __init__(self, config: ModelConfig, embeddings: ConvBertEmbeddings | None = None,
                 body: ConvBertModel | None = None):
        super().__init__()
        self.config = config
        # ``body``: an existing encoder to share whole (ELECTRA's "tie all weights"), else a new one.
        self.convbert = body if body is not None else ConvBertModel(config, embeddings)
        self.generator_predictions = ConvBertGeneratorPredictions(config)
        self.generator_lm_head = VocabularyOutput(config.embedding_size, config.vocab_size)
        init_weights(self.generator_predictions.dense, config.initializer_range)
        self.generator_lm_head.bias.data.zero_()
        self.generator_lm_head.weight = self.convbert.embeddings.word_embeddings.weight

    def head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits for any subset of positions' hidden states ``[..., H]`` -> ``[..., V]``."""
        return self.generator_lm_head(self.generator_predictions(hidden_states))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.convbert(input_ids, attention_mask, token_type_ids))


class ConvBertDiscriminatorPredictions(nn.Module):
    """ELECTRA's RTD head: dense, activation, one logit per token (named as in transformers' ELECTRA)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.dense_prediction = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dense_prediction(self.act(self.dense(hidden_states))).squeeze(-1)


class ConvBertForPreTraining(nn.Module):
    """Discriminator: body + RTD head. Returns one replaced-token logit per position ``[B, T]``."""

    def __init__(self, config: ModelConfig, embeddings: ConvBertEmbeddings | None = None):
        super().__init__()
        self.config = config
        self.convbert = ConvBertModel(config, embeddings)
        self.discriminator_predictions = ConvBertDiscriminatorPredictions(config)
        self.discriminator_predictions.apply(lambda m: init_weights(m, config.initializer_range))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, check: bool = True,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.discriminator_predictions(
            self.convbert(input_ids, attention_mask, token_type_ids, check, document_ids))


class ConvBertClassificationHead(nn.Module):
    """transformers' ConvBERT sentence head: [CLS] state, dropout, dense, activation, dropout, projection."""

    def __init__(self, config: ModelConfig, num_labels: int, dropout: float):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.act = ACTIVATIONS[config.hidden_act]
        self.out_proj = nn.Linear(config.hidden_size, num_labels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.dropout(hidden_states[:, 0])
        return self.out_proj(self.dropout(self.act(self.dense(x))))


class ConvBertForSequenceClassification(HFInterop, nn.Module):
    """Body + classification (or, with one label, regression) head. Returns logits ``[B, num_labels]``.

    ``label_names`` become ``id2label`` in config.json; ``classifier_dropout`` None means
    ``hidden_dropout_prob``, as in transformers.
    """

    hf_architecture = "ConvBertForSequenceClassification"
    hf_prefix = "convbert."

    def __init__(self, config: ModelConfig, label_names: list[str] | None = None, num_labels: int | None = None,
                 classifier_dropout: float | None = None):
        super().__init__()
        if label_names is None and num_labels is None:
            raise ValueError("ConvBertForSequenceClassification needs label_names (classification) or num_labels=1")
        self.config = config
        self.label_names = list(label_names) if label_names is not None else None
        self.num_labels = len(self.label_names) if self.label_names is not None else num_labels
        self.classifier_dropout = classifier_dropout
        self.convbert = ConvBertModel(config)
        dropout = config.hidden_dropout_prob if classifier_dropout is None else classifier_dropout
        self.classifier = ConvBertClassificationHead(config, self.num_labels, dropout)
        self.classifier.apply(lambda m: init_weights(m, config.initializer_range))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier(self.convbert(input_ids, attention_mask, token_type_ids))

    def hf_config_extra(self) -> dict:
        names = self.label_names or ["LABEL_0"]
        return {"id2label": {str(i): name for i, name in enumerate(names)},
                "label2id": {name: i for i, name in enumerate(names)},
                "problem_type": "regression" if self.label_names is None else "single_label_classification",
                "classifier_dropout": self.classifier_dropout}

    @classmethod
    def from_hf_pretrained(cls, directory, **config_overrides):
        """A ``ConvBertForSequenceClassification`` directory (labels read from its config.json)."""
        hf = json.loads((Path(directory) / "config.json").read_text())
        id2label = hf.get("id2label") or {}
        regression = hf.get("problem_type") == "regression"
        names = None if regression else [id2label[str(i)] for i in range(len(id2label))]
        model = cls(hf_io.read_config(directory, **config_overrides), label_names=names,
                    num_labels=1 if regression else None, classifier_dropout=hf.get("classifier_dropout"))
        hf_io.load_weights(model, directory, prefix=cls.hf_prefix)
        return model


class ConvBertForQuestionAnswering(HFInterop, nn.Module):
    """Body + span head (transformers' class of that name). Returns logits ``[B, T, 2]``: each token's score as
    the answer's first (``[..., 0]``) and last (``[..., 1]``) token."""

    hf_architecture = "ConvBertForQuestionAnswering"
    hf_prefix = "convbert."

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.convbert = ConvBertModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.qa_outputs.apply(lambda m: init_weights(m, config.initializer_range))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.qa_outputs(self.convbert(input_ids, attention_mask, token_type_ids))


class ConvBertForTokenClassification(HFInterop, nn.Module):
    """Body + per-token classifier (transformers' class of that name). Returns logits ``[B, T, num_labels]``."""

    hf_architecture = "ConvBertForTokenClassification"
    hf_prefix = "convbert."

    def __init__(self, config: ModelConfig, label_names: list[str], classifier_dropout: float | None = None):
        super().__init__()
        self.config, self.label_names, self.classifier_dropout = config, list(label_names), classifier_dropout
        self.convbert = ConvBertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob if classifier_dropout is None else classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, len(self.label_names))
        self.classifier.apply(lambda m: init_weights(m, config.initializer_range))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier(self.dropout(self.convbert(input_ids, attention_mask, token_type_ids)))

    def hf_config_extra(self) -> dict:
        return {"id2label": {str(i): name for i, name in enumerate(self.label_names)},
                "label2id": {name: i for i, name in enumerate(self.label_names)},
                "classifier_dropout": self.classifier_dropout}
