"""Where fine-tuning starts: a transformers ConvBERT directory, or a training checkpoint converted on the fly.

A checkpoint directory (the trainer's ``checkpoint.dir`` or one ``stepNNNNNNNN`` in it) goes through the
converter (``convbert_ds.convert.convert_checkpoint``) into ``OUT/converted/TAG/``; the discriminator is
fine-tuned (the generator for an ``mlm`` run, which has no discriminator). The same directory's
config.json and tokenizer serve ``--random-init``, so the baseline differs in its starting weights only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from convbert_ds.formats.checkpoint import store as checkpoint_store
from convbert_ds.formats.checkpoint.directory import TRAINER_STATE, latest_complete
from convbert_ds.config import ConfigError, ModelConfig
from convbert_ds.convert import ConvertError, convert_checkpoint, open_checkpoint
from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.model import WeightsError
from convbert_ds.model.hf_io import load_weights, read_config
from convbert_ds.objstore import is_url

@dataclass
class ModelSource:
    hf_dir: Path  # a transformers ConvBERT directory with its tokenizer
    config: ModelConfig
    description: str  # for results.json: what was given and what it resolved to


def resolve_model(path, work_dir: Path) -> ModelSource:
    """``path`` as a ModelSource; a checkpoint is converted into ``work_dir/converted/TAG`` once. A store URL
    (a run's ``checkpoint.mirror``, or one tag in it) is downloaded into the local cache first. Fine-tuning
    resolves on rank 0 alone and hands the result to the other ranks."""
    if is_url(path):
        root, tag = checkpoint_store.local_copy(str(path))
        path = root / tag
    path = Path(path)
    if not path.is_dir():
        raise FinetuneError(f"--model {path}: no such directory; pass a ConvBERT directory (config.json + "
                            "model.safetensors) or a convbert_ds.train checkpoint directory")
    description = str(path)
    # A checkpoint: one tag directory, or the trainer's checkpoint.dir (it has a complete tag).
    if not (path / "config.json").is_file() and ((path / TRAINER_STATE).is_file() or latest_complete(path) is not None):
        try:
            ckpt = open_checkpoint(path)
            converted = work_dir / "converted" / ckpt.tag
            if not converted.is_dir():
                # native_ok: a body transformers cannot express (an ablation's) is written in our own format.
                convert_checkpoint(path, converted, native_ok=True)
        except ConvertError as error:
            raise FinetuneError(f"--model {path}: {error}") from None
        part = "discriminator" if ckpt.electra.objective == "electra" else "generator"
        description = f"{ckpt.directory} (step checkpoint, converted to {converted / part})"
        path = converted / part
    if not (path / "config.json").is_file():
        raise FinetuneError(f"--model {path}: no config.json; not a ConvBERT model directory nor a "
                            "convbert_ds.train checkpoint directory")
    try:
        config = read_config(path)
    except (ConfigError, json.JSONDecodeError, TypeError) as error:
        raise FinetuneError(f"--model {path}/config.json: not a usable ConvBERT config ({error})") from None
    if not (path / "tokenizer.json").is_file():
        raise FinetuneError(f"--model {path}: no tokenizer; the directory needs tokenizer.json (as written by "
                            "preprocessing.tokenizer and the converter)")
    return ModelSource(path, config, description)


def initial_model(source: ModelSource, head, dropout: float, seed: int, random_init: bool) -> torch.nn.Module:
    """The model a seed starts from: ``head(config)`` (e.g. a ``ConvBertForSequenceClassification``), its body
    then loaded with the pretrained weights. The RNG draws are the same with and without ``random_init`` (the
    whole model is drawn, then the body is overwritten), so the head, and every later draw (dropout, data
    order), is identical in the baseline and the pretrained run."""
    config = source.config.replace(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(seed)
    model = head(config)
    if not random_init:
        try:
            load_weights(model.convbert, source.hf_dir, prefix="")
        except WeightsError as error:
            raise FinetuneError(f"--model {source.hf_dir}: {error}") from None
    return model
