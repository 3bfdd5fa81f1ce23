"""``--verify``: our model on the checkpoint's weights against transformers on the converted directory.

Inputs: sentence pairs tokenized by the converted tokenizer (whose ids must equal the training
tokenizer's) and random ids with padding. Compared: the discriminator's hidden states, the RTD head
(side file applied as ELECTRA applies it) and the generator's MLM logits. For a bf16/fp16 output our
model gets the same rounding, so every dtype is held to ``TOLERANCE`` in fp32 arithmetic.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from convbert_ds.config import ElectraConfig
from convbert_ds.formats.init_dir import ConvertError
from convbert_ds.model import ElectraForPretraining
from preprocessing.tokenizer import load_tokenizer

TOLERANCE = 1e-4
_SAMPLE_TEXT = [("The quick brown fox jumps over the lazy dog.", "It was not amused."),
                ("Checkpoints are converted once and loaded many times.", "Numbers like 3.14159 and 2048 too.")]


@torch.no_grad()
def verify_output(out: Path, weights: dict[str, torch.Tensor], electra: ElectraConfig, dtype: torch.dtype,
                  tokenizer_dir: Path, rtd_head_file: str) -> dict[str, float]:
    """Our model on the checkpoint's weights (rounded to OUT's ``dtype``) vs transformers on OUT, on tokenized
    text and random ids; ``rtd_head_file``: the RTD head's file in ``OUT/discriminator``."""
    import transformers  # here: slow to import, and only --verify needs it

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    reference = ElectraForPretraining(ElectraConfig(**{
        **electra.to_dict(),
        "discriminator": electra.discriminator.replace(sdconv_impl="torch"),
        "generator": electra.generator.replace(sdconv_impl="torch") if electra.generator else None}))
    reference.load_state_dict({k: v.to(dtype).float() for k, v in weights.items()})
    reference.eval()
    first = "discriminator" if electra.objective == "electra" else "generator"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out / first), local_files_only=True)
    ours = load_tokenizer(tokenizer_dir)
    for text, pair in _SAMPLE_TEXT:
        for piece in (text, pair):
            if hf_tokenizer(piece, add_special_tokens=False)["input_ids"] != ours.encode(piece):
                raise ConvertError(f"verify: the converted tokenizer encodes {piece!r} differently from "
                                   f"{tokenizer_dir}")
    config = electra.discriminator
    length = min(config.max_position_embeddings, 48)
    batches = [dict(hf_tokenizer([t for t, _ in _SAMPLE_TEXT], [p for _, p in _SAMPLE_TEXT], padding=True,
                                 truncation=True, max_length=length, return_tensors="pt"))]
    ids = torch.randint(0, config.vocab_size, (3, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, length // 2:] = 0
    ids[mask == 0] = config.pad_token_id
    types = torch.zeros_like(ids)
    types[:, length // 3:] = 1
    batches.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": types})

    diffs = {}

    def record(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        diffs[name] = max(diffs.get(name, 0.0), float((a - b).abs().max()))

    kw = {"local_files_only": True, "dtype": torch.float32}
    # No generator/ when transformers cannot hold it (the official generator heads; to_hf says so).
    hf_mlm = transformers.AutoModelForMaskedLM.from_pretrained(str(out / "generator"), **kw).eval() \
        if (out / "generator").is_dir() else None
    if electra.objective == "electra":
        hf_body = transformers.AutoModel.from_pretrained(str(out / "discriminator"), **kw).eval()
        head = {k: v.float() for k, v in load_file(str(out / "discriminator" / rtd_head_file)).items()}
        act = transformers.activations.ACT2FN[config.hidden_act]
    for batch in batches:
        args = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        if hf_mlm is not None:
            record("generator_logits", reference.generator(*args), hf_mlm(**batch).logits)
        if electra.objective == "electra":
            hidden = hf_body(**batch).last_hidden_state
            record("discriminator_hidden", reference.discriminator.convbert(*args), hidden)
            p = "discriminator_predictions."
            rtd = torch.nn.functional.linear(
                act(torch.nn.functional.linear(hidden, head[p + "dense.weight"], head[p + "dense.bias"])),
                head[p + "dense_prediction.weight"], head[p + "dense_prediction.bias"]).squeeze(-1)
            record("rtd_logits", reference.discriminator(*args), rtd)
    worst = max(diffs, key=diffs.get)
    if diffs[worst] > TOLERANCE:
        raise ConvertError(f"verify failed: {worst} differ by {diffs[worst]:.3e} (> {TOLERANCE}) between our model "
                           "and transformers on the converted output; nothing was written")
    return diffs
