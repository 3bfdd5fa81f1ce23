"""Writing ``ElectraForPretraining`` weights as standard transformers ConvBERT directories.

    OUT/discriminator/   ConvBertModel: config.json, model.safetensors, rtd_head.safetensors,
                         tokenizer files, README.md
    OUT/generator/       ConvBertForMaskedLM (LM head written explicitly, equal to the word embeddings),
                         tokenizer files, README.md
    OUT/README.md        the model card
    */checksums.sha256   the sha256 of each file of that directory but README.md (``model.hf_io``)

``rtd_head.safetensors`` holds ELECTRA's replaced-token-detection head under ELECTRA's names
(``discriminator_predictions.dense.{weight,bias}`` [H, H], ``discriminator_predictions.dense_prediction.
{weight,bias}`` [1, H]): ``logits = dense_prediction(act(dense(last_hidden_state))).squeeze(-1)`` with
``act`` = config.json's ``hidden_act``. transformers has no ConvBERT class for it, so it sits beside
the body instead of inside ``model.safetensors``. An ``mlm``-objective checkpoint has no discriminator:
OUT holds ``generator/`` alone, a ConvBertForMaskedLM of the main model's size.

Tensors are written straight from the consolidated state dict (no model is built), and OUT appears by
one rename of a finished temporary directory: a failed write (a full disk: one line naming OUT, the space
free there and what it still holds) leaves OUT as it was, never a part of a model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from convbert_ds.config import ElectraConfig
from convbert_ds.convert.model_card import PIPELINE_TAGS, RTD_HEAD_FILE, CardFacts, CardLicense, model_card
from convbert_ds.convert.reader import open_checkpoint, read_state_dict
from convbert_ds.convert.verify import verify_output
from convbert_ds.disk_full import full_disk_says
from convbert_ds.formats.init_dir import ConvertError
from convbert_ds.fsutil import refuse_non_empty, write_dir_atomically
from convbert_ds.model.hf_io import config_json, write_checksums
from convbert_ds.model.tied import untie
from preprocessing.tokenizer import TOKENIZER_FILES, tokenizer_sha256

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DISC, _RTD, _GEN = "discriminator.convbert.", "discriminator.discriminator_predictions.", "generator."


def split_for_hf(weights: dict[str, torch.Tensor], electra: ElectraConfig) -> dict[str, dict[str, torch.Tensor]]:
    """``ElectraForPretraining`` names -> {"discriminator": ConvBertModel names, "rtd_head": ELECTRA's
    names, "generator": ConvBertForMaskedLM names}; the discriminator parts only for ELECTRA."""
    parts = {"generator": {k[len(_GEN):]: v for k, v in weights.items() if k.startswith(_GEN)}}
    if electra.objective == "electra":
        parts["discriminator"] = {k[len(_DISC):]: v for k, v in weights.items() if k.startswith(_DISC)}
        parts["rtd_head"] = {k[len("discriminator."):]: v for k, v in weights.items() if k.startswith(_RTD)}
    return parts


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, dtype: str) -> None:
    """safetensors from views of the consolidated buffers (no copy); a tensor with two names is cloned once."""
    out = untie({name: tensor.detach().to(DTYPES[dtype]).contiguous() for name, tensor in tensors.items()})
    save_file(out, str(path), metadata={"format": "pt"})


def tokenizer_files(directory: Path) -> list[Path]:
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


def write_output(out: Path, fill) -> None:
    """OUT filled by ``fill(tmp)`` and renamed in whole; a full disk is one line saying what OUT still holds."""
    kept = (f"{out} still holds what it held before" if out.is_dir() and any(out.iterdir())
            else f"no part of the output is left in {out} (the partial copy is deleted)")
    with full_disk_says(out, kept):
        write_dir_atomically(out, fill)


def resolve_tokenizer(recorded: dict | None, override=None) -> Path:
    """The tokenizer the checkpoint was trained with: ``override`` or the recorded dir, hash-checked."""
    if not recorded:
        raise ConvertError("trainer_state.json records no tokenizer; pass --tokenizer DIR")
    directory = Path(override if override is not None else recorded["dir"])
    how = "--tokenizer" if override is not None else "the tokenizer dir recorded in trainer_state.json"
    if not directory.is_dir() or not tokenizer_files(directory):
        raise ConvertError(f"{how} {directory} is gone or holds no tokenizer files; pass --tokenizer DIR with a "
                           f"copy of it (sha256 {recorded.get('sha256')})")
    digest = tokenizer_sha256(directory)
    if recorded.get("sha256") and digest != recorded["sha256"]:
        raise ConvertError(f"{how} {directory} has sha256 {digest} but the checkpoint was trained with "
                           f"{recorded['sha256']}; pass --tokenizer DIR with the tokenizer the shards were made with")
    return directory


def write_hf(out, weights: dict[str, torch.Tensor], electra: ElectraConfig, tokenizer_dir, facts: CardFacts,
             dtype: str = "fp32", verify: bool = False, force: bool = False, native_ok: bool = False) -> dict | None:
    """Write OUT (see the module docstring); with ``verify``, compare against transformers before the rename.
    ``native_ok`` (fine-tuning an ablation): bodies transformers cannot express are written in our format
    (``ModelConfig.to_native_dict``) instead of refused; transformers refuses such a directory."""
    out = Path(out)
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    refuse_non_empty(out, force, error=ConvertError)
    parts = split_for_hf(weights, electra)
    tokenizer_dir = Path(tokenizer_dir)
    report = {}

    gen_config = electra.generator if electra.objective == "electra" else electra.discriminator
    unloadable = gen_config.not_in_transformers() if electra.objective == "electra" and not native_ok else None
    if unloadable:  # the discriminator is the model users fine-tune: write it, say why the generator is not
        facts.notes.append(f"generator/ is not written: {unloadable}")
        print(f"note: generator/ is not written: {unloadable}", flush=True)

    def fill(tmp: Path) -> None:
        dirs = {} if unloadable else {"generator": (gen_config, "ConvBertForMaskedLM")}
        if electra.objective == "electra":
            dirs["discriminator"] = (electra.discriminator, "ConvBertModel")
        for name, (config, architecture) in dirs.items():
            target = tmp / name
            target.mkdir()
            save_tensors(parts[name], target / "model.safetensors", dtype)
            hf_config = {**config_json(config, architecture, native_ok),
                         "dtype": str(DTYPES[dtype]).removeprefix("torch.")}
            (target / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
            for path in tokenizer_files(tokenizer_dir):
                shutil.copyfile(path, target / path.name)
        if electra.objective == "electra":
            save_tensors(parts["rtd_head"], tmp / "discriminator" / RTD_HEAD_FILE, dtype)
        if verify:
            report.update(verify_output(tmp, weights, electra, DTYPES[dtype], tokenizer_dir, RTD_HEAD_FILE))
        # The root and discriminator/ describe the model to fine-tune; generator/ is a fill-mask model.
        root_tag = PIPELINE_TAGS["discriminator" if electra.objective == "electra" else "generator"]
        for target, tag in [(tmp, root_tag), *((tmp / name, PIPELINE_TAGS[name]) for name in dirs)]:
            (target / "README.md").write_text(model_card(electra, facts, dtype, report or None, tag))
        for name in dirs:
            write_checksums(tmp / name)

    write_output(out, fill)
    return report or None


def convert_checkpoint(checkpoint_dir, out, tag: str | None = None, dtype: str = "fp32", verify: bool = False,
                       force: bool = False, tokenizer=None, command: str | None = None,
                       native_ok: bool = False, card_license: CardLicense | None = None) -> dict | None:
    """DeepSpeed checkpoint -> OUT (transformers dirs). Returns the verification report (max abs diffs).
    ``card_license``: the model card's license (``--license``); None leaves it to the publisher."""
    out = Path(out)
    refuse_non_empty(out, force, error=ConvertError)
    ckpt = open_checkpoint(checkpoint_dir, tag)
    tokenizer_dir = resolve_tokenizer(ckpt.state.tokenizer, tokenizer)
    weights, source = read_state_dict(ckpt)
    if command is None:
        command = " ".join(["python -m convbert_ds.convert", "--checkpoint", str(ckpt.root), "--tag", ckpt.tag,
                            "--out", str(out), "--dtype", dtype] + (["--verify"] if verify else []))
    facts = CardFacts(source=f"`{ckpt.directory}` ({ckpt.describe()}; weights: {source})", command=command,
                      trainer_state=ckpt.state, license=card_license)
    return write_hf(out, weights, ckpt.electra, tokenizer_dir, facts, dtype=dtype, verify=verify, force=force,
                    native_ok=native_ok)


def export_model(model, out, tokenizer_dir, dtype: str = "fp32", verify: bool = False,
                 force: bool = False) -> dict | None:
    """An in-memory ``ElectraForPretraining`` -> OUT, as ``convert_checkpoint`` writes it."""
    weights = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    facts = CardFacts(source=f"an in-memory {type(model).__name__}", command="convbert_ds.convert.export_model(...)")
    return write_hf(out, weights, model.config, tokenizer_dir, facts, dtype=dtype, verify=verify, force=force)
