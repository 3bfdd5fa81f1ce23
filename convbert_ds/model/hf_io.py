"""Reading and writing transformers ConvBERT directories (offline, safetensors).

Our modules carry transformers' parameter names, so moving weights is a
matter of prefixes: ``ConvBertForMaskedLM`` files prefix the body with
``convbert.``; a body can be loaded out of a masked-LM file (the head is then
ignored). Every mismatch is reported by tensor name, with both shapes.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from convbert_ds.config import ConfigError, ModelConfig
from convbert_ds.errors import UserError, first_line
from convbert_ds.fsutil import read_json, write_dir_atomically
from convbert_ds.model.tied import fill_tied, untie

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Buffers transformers may write that carry no weights.
_IGNORED = ("embeddings.position_ids", "embeddings.token_type_ids")
_BODY_PREFIX = "convbert."


class WeightsError(UserError, ValueError):
    """A model directory or weights file that does not fit: missing files or tensors, unexpected ones, shapes."""


def read_config(directory, **overrides) -> ModelConfig:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise WeightsError(f"{path} not found: not a transformers model directory")
    values = read_json(path, WeightsError, "restore the model directory's config.json")
    if not isinstance(values, dict):
        raise WeightsError(f"{path}: holds a {type(values).__name__}, not transformers' config mapping")
    try:
        return ModelConfig.from_hf_dict(values, **overrides)
    except UserError as error:  # ModelConfig names the field; the user needs the file too
        raise WeightsError(f"{path}: {error}") from None


# What transformers' AutoTokenizer parses as JSON in a model directory (a damaged one is a traceback there).
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def read_tokenizer(directory):
    """transformers' own ``AutoTokenizer`` of a model directory; a damaged tokenizer file is one line naming it
    (a flipped byte inside a vocabulary string cannot be told from a real piece: no checksums there)."""
    from transformers import AutoTokenizer  # seconds to import: only where a tokenizer is read

    for path in (Path(directory) / name for name in TOKENIZER_JSON_FILES):
        if path.is_file():
            read_json(path, WeightsError, "the file is damaged: copy or convert the model again")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise WeightsError(f"{directory}: transformers cannot load its tokenizer ({first_line(error)}); copy or "
                           "convert the model again") from None


def read_weights(directory) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            try:
                if name.endswith(".safetensors"):
                    return load_file(path)
                return torch.load(path, map_location="cpu", weights_only=True)
            except (SafetensorError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
                raise WeightsError(f"{path}: unreadable ({first_line(error)}); the file is damaged or of another "
                                   "format: copy or convert the model again") from None
    raise WeightsError(f"no weights in {directory}: expected one of {WEIGHT_FILES}")


def load_weights(model: torch.nn.Module, directory, prefix: str) -> None:
    """A file's weights into a model whose body prefix is ``prefix`` ("" for a bare body)."""
    weights = {k: v for k, v in read_weights(directory).items() if not k.endswith(_IGNORED)}
    if prefix == "" and any(k.startswith(_BODY_PREFIX) for k in weights):
        # A body loaded out of a model with heads: keep the body, drop the heads.
        weights = {k[len(_BODY_PREFIX):]: v for k, v in weights.items() if k.startswith(_BODY_PREFIX)}
    expected = model.state_dict()
    head, table = "generator_lm_head.weight", f"{_BODY_PREFIX}embeddings.word_embeddings.weight"
    if head in weights and table in weights and not torch.equal(weights[head], weights[table]):
        raise WeightsError(f"{directory}: {head} differs from the word embeddings; only tied "
                           "LM heads (tie_word_embeddings=true) are supported")
    weights = fill_tied(weights, model)
    missing = sorted(k for k in expected if k not in weights)
    unexpected = sorted(k for k in weights if k not in expected)
    if missing or unexpected:
        raise WeightsError(f"{directory}: weights do not match the config: missing {missing[:10]}"
                           f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
                           f"{' ...' if len(unexpected) > 10 else ''}")
    for name, tensor in expected.items():
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise WeightsError(f"{directory}: tensor {name} has shape {tuple(weights[name].shape)} in the file "
                               f"but {tuple(tensor.shape)} in the model built from config.json")
    model.load_state_dict({k: weights[k] for k in expected}, strict=True)


def config_json(config: ModelConfig, architecture: str, native_ok: bool) -> dict:
    """transformers' config.json for ``config``; with ``native_ok``, ours (``to_native_dict``) for a body
    transformers cannot express, instead of the error saying so."""
    if native_ok and config.not_in_transformers() is not None:
        return config.to_native_dict([architecture])
    return config.to_hf_dict([architecture])


def save(model: torch.nn.Module, directory, architecture: str, extra_files: dict[str, bytes] | None = None,
         extra_config: dict | None = None, native_ok: bool = False) -> Path:
    config = model.config
    if not isinstance(config, ModelConfig):
        raise ConfigError(f"cannot save {type(model).__name__}: it has no ModelConfig")
    hf_config = {**config_json(config, architecture, native_ok), **(extra_config or {}),
                 "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}

    def fill(tmp: Path) -> None:
        # Contiguous CPU tensors; a tied tensor is written once per name, as transformers expects.
        tensors = untie({k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()})
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)

    return write_dir_atomically(directory, fill)
