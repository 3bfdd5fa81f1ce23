"""A transformers ConvBERT directory -> an INIT_DIR the trainer can start pretraining from
(``python -m convbert_ds.convert --from-hf``; options in ``convbert_ds.convert``).

The INIT_DIR format and its readers (``read_init``, ``load_init_weights``, ...) are the on-disk contract
in ``convbert_ds.formats.init_dir``; this module is its writer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from convbert_ds.config import OBJECTIVES, ElectraConfig, ModelConfig
from convbert_ds.convert.to_hf import RTD_HEAD_FILE, tokenizer_files, write_output
from convbert_ds.formats.checkpoint.names import meta_model
from convbert_ds.formats.init_dir import (INIT_FILE, INIT_FORMAT, INIT_FORMAT_VERSION, WEIGHTS_FILE, ConvertError,
                                          match_weights)
from convbert_ds.fsutil import refuse_non_empty
from convbert_ds.model import ConvBertForMaskedLM, ConvBertModel
from convbert_ds.model.hf_io import WeightsError, check_recorded_sha256, read_weights
from preprocessing.tokenizer import load_tokenizer
_RTD = "discriminator_predictions."


def _rtd_head(hf_dir: Path, hidden_size: int) -> dict[str, torch.Tensor]:
    if (hf_dir / RTD_HEAD_FILE).is_file():
        check_recorded_sha256(hf_dir, [RTD_HEAD_FILE])
        head = load_file(str(hf_dir / RTD_HEAD_FILE))
    else:
        head = {k: v for k, v in read_weights(hf_dir).items() if k.startswith(_RTD)}
    expected = {"dense.weight": (hidden_size, hidden_size), "dense.bias": (hidden_size,),
                "dense_prediction.weight": (1, hidden_size), "dense_prediction.bias": (1,)}
    if not head:
        return {}
    for key, shape in expected.items():
        tensor = head.get(_RTD + key)
        if tensor is None or tuple(tensor.shape) != shape:
            raise WeightsError(f"{hf_dir}: RTD head tensor {_RTD}{key} has shape "
                               f"{None if tensor is None else tuple(tensor.shape)} but the model needs {shape}")
    return {_RTD + key: head[_RTD + key] for key in expected}


def convert_from_hf(hf_dir, out, generator_dir=None, objective: str = "electra", tokenizer=None,
                    force: bool = False) -> dict:
    """Write INIT_DIR (see ``convbert_ds.formats.init_dir``); returns its init.json."""
    hf_dir, out = Path(hf_dir), Path(out)
    if objective not in OBJECTIVES:
        raise ConvertError(f"--objective {objective!r}: use one of {OBJECTIVES}")
    if objective == "mlm" and generator_dir is not None:
        raise ConvertError("--from-hf-generator needs --objective electra (an mlm model has no separate generator)")
    refuse_non_empty(out, force, error=ConvertError)
    for directory in (hf_dir, generator_dir):
        if directory is not None and not (Path(directory) / "config.json").is_file():
            raise ConvertError(f"{Path(directory) / 'config.json'} not found: not a transformers model directory")
    tokenizer_dir = Path(tokenizer) if tokenizer is not None else hf_dir
    tok_files = tokenizer_files(tokenizer_dir)
    if not tok_files:
        raise ConvertError(f"{tokenizer_dir} holds no tokenizer files (vocab.txt, tokenizer.json, ...); "
                           "pass --tokenizer DIR")

    body = ConvBertModel.from_hf_pretrained(hf_dir)
    weights, notes, generator_config = {}, [], None
    if objective == "mlm":
        has_head = any(k.startswith("generator_predictions.") for k in read_weights(hf_dir))
        source = ConvBertForMaskedLM.from_hf_pretrained(hf_dir) if has_head else body
        prefix = "generator." if has_head else "generator.convbert."
        weights.update({prefix + k: v for k, v in source.state_dict().items() if k != "generator_lm_head.weight"})
    else:
        weights.update({f"discriminator.convbert.{k}": v for k, v in body.state_dict().items()})
        weights.update({f"discriminator.{k}": v for k, v in _rtd_head(hf_dir, body.config.hidden_size).items()})
        if generator_dir is not None:
            generator = ConvBertForMaskedLM.from_hf_pretrained(generator_dir)
            generator_config = generator.config
            ElectraConfig(discriminator=body.config, generator=generator_config)  # shared-embedding checks
            state = generator.state_dict()
            if any(not torch.equal(v, weights[f"discriminator.{k}"]) for k, v in state.items()
                   if k.startswith("convbert.embeddings.")):
                notes.append(f"{generator_dir}'s embedding tables differ from {hf_dir}'s; the generator shares "
                             f"the discriminator's, so {hf_dir}'s were kept")
            weights.update({f"generator.{k}": v for k, v in state.items()
                            if not k.startswith("convbert.embeddings.") and k != "generator_lm_head.weight"})

    init = {"format": INIT_FORMAT, "format_version": INIT_FORMAT_VERSION, "objective": objective,
            "model": body.config.to_dict(), "generator": generator_config.to_dict() if generator_config else None,
            "tensors": sorted(weights), "tokenizer": None,
            "sources": {"body": str(hf_dir), "generator": str(generator_dir) if generator_dir else None,
                        "tokenizer": str(tokenizer_dir)},
            "notes": notes}

    def fill(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "tokenizer").mkdir()
        for path in tok_files:
            shutil.copyfile(path, tmp / "tokenizer" / path.name)
        tok = load_tokenizer(tmp / "tokenizer")
        if tok.vocab_size > body.config.vocab_size:
            raise ConvertError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                               f"{body.config.vocab_size}; pass --tokenizer DIR with the model's own tokenizer")
        if tok.special_ids["pad"] != body.config.pad_token_id:
            notes.append(f"config.json's pad_token_id={body.config.pad_token_id} but the tokenizer's [PAD] is "
                         f"{tok.special_ids['pad']}; the config's value was kept")
        init["tokenizer"] = {"dir": "tokenizer", **tok.describe()}
        (tmp / INIT_FILE).write_text(json.dumps(init, indent=2) + "\n")
        (tmp / "README.md").write_text(_readme(init))

    # Fail now, not at the trainer's start, if the weights do not fit a model built from init.json.
    match_weights(meta_model(_electra_for_check(init)), weights, "the converted weights")
    write_output(out, fill)
    return init


def _electra_for_check(init: dict) -> ElectraConfig:
    main = ModelConfig.from_dict(init["model"])
    if init["objective"] == "mlm":
        return ElectraConfig(discriminator=main, objective="mlm")
    generator = ModelConfig.from_dict(init["generator"]) if init["generator"] else main
    return ElectraConfig(discriminator=main, generator=generator)


def _readme(init: dict) -> str:
    fresh = "the generator" if init["objective"] == "electra" and not init["generator"] else "nothing named"
    return (f"# convbert_ds init directory\n\nMade by `python -m convbert_ds.convert --from-hf` from "
            f"`{init['sources']['body']}` (objective {init['objective']}). Start pretraining from it with "
            "`model.init_from_hf: THIS_DIR` and shard corpora with "
            "`python -m preprocessing.shard --tokenizer THIS_DIR/tokenizer`. Tensors not in model.safetensors "
            f"(here: {fresh}, and the RTD head unless listed in init.json) start from fresh initialisation.\n")
