"""The INIT_DIR contract: what ``python -m convbert_ds.convert --from-hf`` writes and the trainer starts from.

    python -m convbert_ds.convert --from-hf HF_DIR [--from-hf-generator GEN_DIR] [--objective electra|mlm]
                                  [--tokenizer DIR] --out INIT_DIR

INIT_DIR (format ``convbert_ds.init`` version 1):

    model.safetensors   ``ElectraForPretraining`` parameter names, each tensor once (tied names are
                        implied: the generator's embeddings and LM-head matrix are the discriminator's
                        embeddings). electra: ``discriminator.convbert.*`` from HF_DIR's body,
                        ``discriminator.discriminator_predictions.*`` when HF_DIR has an RTD head
                        (``rtd_head.safetensors`` as this converter writes it, or inside its weights),
                        ``generator.*`` from GEN_DIR (its embeddings must equal the body's).
                        mlm: ``generator.convbert.*`` and, when HF_DIR is a ConvBertForMaskedLM, its head.
    init.json           {"format", "format_version", "objective", "model": ModelConfig dict (the main body),
                         "generator": ModelConfig dict or null, "tensors": [names in model.safetensors],
                         "tokenizer": {"dir": "tokenizer", kind, vocab_size, special_ids, sha256},
                         "sources": {...}, "notes": [...]}
    tokenizer/          the tokenizer files (HF_DIR's, or --tokenizer's): shard corpora with
                        ``python -m preprocessing.shard --tokenizer INIT_DIR/tokenizer``
    README.md

Whatever model.safetensors lacks (the generator unless GEN_DIR is given; the RTD head unless HF_DIR has
one) is initialised fresh: ``load_init_weights`` returns those names. The writer is
``convbert_ds.convert.from_hf``; this module holds the readers the trainer uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from convbert_ds.config import ModelConfig
from convbert_ds.errors import UserError
from convbert_ds.model.hf_io import WeightsError
from convbert_ds.model.tied import tied_groups

INIT_FORMAT, INIT_FORMAT_VERSION, INIT_FILE, WEIGHTS_FILE = "convbert_ds.init", 1, "init.json", "model.safetensors"


class ConvertError(UserError, ValueError):
    """Input a conversion (or a converted directory) cannot use; the message names what is wrong and the fix."""


def read_init(init_dir) -> dict:
    path = Path(init_dir) / INIT_FILE
    if not path.is_file():
        raise ConvertError(f"{path} not found: {init_dir} is not a directory made by "
                           "`python -m convbert_ds.convert --from-hf HF_DIR --out INIT_DIR`")
    init = json.loads(path.read_text())
    if init.get("format") != INIT_FORMAT or init.get("format_version") != INIT_FORMAT_VERSION:
        raise ConvertError(f"{path}: format {init.get('format')!r} v{init.get('format_version')} is not "
                           f"{INIT_FORMAT!r} v{INIT_FORMAT_VERSION}; re-run the conversion")
    return init


def _record(init) -> dict:
    return init if isinstance(init, dict) else read_init(init)


def init_model_config(init) -> ModelConfig:
    """The main body's config (the discriminator; the masked LM for objective mlm). ``init``: INIT_DIR,
    or what ``read_init`` returned for it (read once by a caller that needs several of its fields)."""
    return ModelConfig.from_dict(_record(init)["model"])


def init_generator_config(init) -> ModelConfig | None:
    """The generator's config when INIT_DIR has generator weights, else None (the trainer picks one)."""
    generator = _record(init)["generator"]
    return ModelConfig.from_dict(generator) if generator else None


@torch.no_grad()
def load_init_weights(model, init_dir) -> list[str]:
    """Copy INIT_DIR's weights into ``model`` (an ``ElectraForPretraining``); returns the canonical names of
    the parameters left as initialised (tied names count once). Every tensor in the file must fit."""
    init = read_init(init_dir)
    if model.config.objective != init["objective"]:
        raise ConvertError(f"{init_dir} was made for objective {init['objective']!r} but the model's is "
                           f"{model.config.objective!r}; set model.objective accordingly or re-convert with "
                           f"--objective {model.config.objective}")
    path = Path(init_dir) / WEIGHTS_FILE
    weights = load_file(str(path))
    fresh = match_weights(model, weights, str(path))
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in weights.items():
        params[name].copy_(tensor)
    return fresh


def match_weights(model, weights: dict[str, torch.Tensor], where: str) -> list[str]:
    """Check names and shapes; the canonical names of the parameters ``weights`` leaves untouched."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unexpected = sorted(set(weights) - set(params))
    if unexpected:
        raise WeightsError(f"{where} holds tensors the model does not have: {unexpected[:8]}"
                           f"{' ...' if len(unexpected) > 8 else ''}")
    for name, param in params.items():  # in model order, so the first mismatch reported is the first one
        if name in weights and tuple(weights[name].shape) != tuple(param.shape):
            raise WeightsError(f"tensor {name} has shape {tuple(weights[name].shape)} in {where} but "
                               f"{tuple(param.shape)} in the model")
    return [canonical for canonical, names in tied_groups(model).items() if not any(n in weights for n in names)]
