"""Checkpoint conversion: DeepSpeed checkpoints -> transformers ConvBERT directories, and back.

    python -m convbert_ds.convert --checkpoint CKPT_DIR [--tag TAG] --out HF_DIR [--dtype fp32|bf16|fp16]
                                  [--verify] [--force] [--tokenizer DIR]
                                  [--license ID [--license-name NAME] [--license-link LINK]]
    python -m convbert_ds.convert --from-hf HF_DIR [--from-hf-generator GEN_DIR] [--objective electra|mlm]
                                  [--tokenizer DIR] --out INIT_DIR [--force]

``reader``: any checkpoint the trainer writes -> one fp32 state dict under ``ElectraForPretraining`` names;
``to_hf``: that state dict -> ``discriminator/`` + ``generator/`` transformers directories (layout there);
``verify``: ``--verify``, our model against transformers on the output;
``from_hf``: a transformers directory -> an INIT_DIR the trainer starts from (format and readers:
``convbert_ds.formats.init_dir``).
"""

from convbert_ds.convert.from_hf import convert_from_hf
from convbert_ds.convert.reader import open_checkpoint, read_state_dict
from convbert_ds.convert.to_hf import RTD_HEAD_FILE, convert_checkpoint, export_model, write_hf
from convbert_ds.formats.init_dir import (ConvertError, init_generator_config, init_model_config, load_init_weights,
                                          read_init)

__all__ = [
    "RTD_HEAD_FILE", "ConvertError", "convert_checkpoint", "convert_from_hf", "export_model", "init_generator_config",
    "init_model_config", "load_init_weights", "open_checkpoint", "read_init", "read_state_dict", "write_hf",
]
