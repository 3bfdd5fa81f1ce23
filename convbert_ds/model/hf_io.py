"""Reading and writing transformers ConvBERT directories (offline, safetensors).

Our modules carry transformers' parameter names, so moving weights is a
matter of prefixes: ``ConvBertForMaskedLM`` files prefix the body with
``convbert.``; a body can be loaded out of a masked-LM file (the head is then
ignored). Every mismatch is reported by tensor name, with both shapes.

Every model directory we write holds ``checksums.sha256`` (``CHECKSUM_FILE``), in ``sha256sum``'s format
(one ``<64 hex digits>  <file name>`` line per file, so ``sha256sum -c checksums.sha256`` checks it too):
the sha256 of each file but ``README.md`` (a model card people edit). Reading a file that it lists checks
it, so a flipped byte that leaves the file parseable (inside a tensor, inside a vocabulary string) is
one line naming the file, not a silently different model. Directories from elsewhere have none and are
read as they are.
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
from convbert_ds.fsutil import file_sha256, read_json, write_dir_atomically
from convbert_ds.model.tied import fill_tied, untie

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Buffers transformers may write that carry no weights.
_IGNORED = ("embeddings.position_ids", "embeddings.token_type_ids")
_BODY_PREFIX = "convbert."


class WeightsError(UserError, ValueError):
    """A model directory or weights file that does not fit: missing files or tensors, unexpected ones, shapes."""


CHECKSUM_FILE = "checksums.sha256"
_UNCHECKED = ("README.md", CHECKSUM_FILE)


def write_checksums(directory: Path) -> None:
    """Record the sha256 of every file in ``directory`` but the model card (see the module docstring)."""
    lines = [f"{file_sha256(path)}  {path.name}" for path in sorted(directory.iterdir())
             if path.is_file() and path.name not in _UNCHECKED]
    (directory / CHECKSUM_FILE).write_text("\n".join(lines) + "\n")


def check_recorded_sha256(directory: Path, names) -> None:
    """Each of ``names`` that ``directory``'s ``CHECKSUM_FILE`` lists still hashes to what it recorded (nothing
    to check where there is no record)."""
    record = directory / CHECKSUM_FILE
    if not record.is_file():
        return
    recorded = {}
    for number, line in enumerate(record.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest) or not (directory / name).is_file():
            raise WeightsError(f"{record}: line {number} is not '<sha256>  <a file of this directory>': the "
                               "record is damaged; copy or convert the model again")
        recorded[name] = digest
    if not recorded:
        raise WeightsError(f"{record}: empty (it lists each file's sha256): the record is damaged; copy or "
                           "convert the model again")
    for name in names:
        if name in recorded and file_sha256(directory / name) != recorded[name]:
            raise WeightsError(f"{directory / name}: its bytes differ from the sha256 recorded in {CHECKSUM_FILE} "
                               "when it was written (bit rot, an interrupted copy or an edit): copy or convert the "
                               "model again")


def read_config(directory, **overrides) -> ModelConfig:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise WeightsError(f"{path} not found: not a transformers model directory")
    check_recorded_sha256(path.parent, [path.name])
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
    (a flipped byte inside a vocabulary string only where ``CHECKSUM_FILE`` lists the file)."""
    from transformers import AutoTokenizer  # seconds to import: only where a tokenizer is read

    directory = Path(directory)
    model_files = (*WEIGHT_FILES, "config.json")  # the rest of the directory is the tokenizer's
    check_recorded_sha256(directory, [path.name for path in directory.iterdir() if path.is_file()
                                      and path.name not in model_files and path.suffix != ".safetensors"])
    for path in (directory / name for name in TOKENIZER_JSON_FILES):
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
            check_recorded_sha256(directory, [name])
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
        write_checksums(tmp)

    return write_dir_atomically(directory, fill)
