"""The model card (``README.md``) the converter writes into OUT and each model directory.

It opens with the YAML front matter the Hugging Face Hub reads (``library_name``, ``license`` to fill
in, ``tags``, ``datasets`` from the shards' manifests, ``pipeline_tag`` per directory), then says what
the directories hold, how the model was trained (the recipe from the checkpoint's own config, tokens
seen), its last validation metrics and transfer-probe score when the run's metrics log is readable, the
model config, and the conversion command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from convbert_ds.config import ConfigError, ElectraConfig, ModelConfig
from convbert_ds.formats.checkpoint.run_state import RunState
from convbert_ds.formats.train_config import TrainConfig
from convbert_ds.fsutil import file_sha256

RTD_HEAD_FILE = "rtd_head.safetensors"
PIPELINE_TAGS = {"discriminator": "feature-extraction", "generator": "fill-mask"}


@dataclass
class CardFacts:
    """What the model card says about where the weights came from."""

    source: str
    command: str
    trainer_state: RunState | None = None  # None: weights from memory, not a checkpoint
    notes: list[str] = field(default_factory=list)


def model_card(electra: ElectraConfig, facts: CardFacts, dtype: str, report: dict | None,
               pipeline_tag: str = "feature-extraction") -> str:
    state = facts.trainer_state
    lines = [_front_matter(state, pipeline_tag), "", "# ConvBERT pretrained with convbert_ds", "",
             f"Converted from {facts.source}.", "", *_contents(electra), "", "## Training", ""]
    lines += _training(state)
    lines += _results(state)
    lines += ["", "## Model config", "", "| | " + " | ".join(_models(electra)) + " |",
              "|---|" + "---|" * len(_models(electra))]
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_ratio",
                 "intermediate_size", "embedding_size", "conv_kernel_size", "num_groups", "hidden_act",
                 "max_position_embeddings", "pad_token_id"):
        lines.append(f"| {name} | " + " | ".join(str(getattr(c, name)) for c in _models(electra).values()) + " |")
    lines += ["", "## Conversion", "", f"```\n{facts.command}\n```", "",
              f"Weights: {dtype}. {' '.join(facts.notes)}".rstrip(), ""]
    if report:
        lines.append("Verified against transformers (max abs difference, fp32): "
                     + ", ".join(f"{k} {v:.2e}" for k, v in report.items()) + ".")
    lines += ["", "## Publishing", "", "Set `license` above first, then: `hf upload ORG/NAME "
              f"{'discriminator' if pipeline_tag == PIPELINE_TAGS['discriminator'] else 'generator'} .` "
              "(the `hf` command comes with `huggingface_hub`; `hf auth login` once)."]
    return "\n".join(lines) + "\n"


def _front_matter(state: RunState | None, pipeline_tag: str) -> str:
    meta = {"library_name": "transformers", "license": "other",
            "tags": ["convbert", "electra", "convbert_ds", "pretraining"],
            "datasets": _dataset_names(state), "pipeline_tag": pipeline_tag}
    text = yaml.safe_dump({k: v for k, v in meta.items() if v}, sort_keys=False).rstrip()
    # A license is the publisher's decision (the data's terms decide it), so the card asks for it.
    text = text.replace("license: other", "license: other  # set the license your data and use allow, e.g. "
                                          "apache-2.0 (https://huggingface.co/docs/hub/repositories-licenses)")
    return f"---\n{text}\n---"


def _dataset_names(state: RunState | None) -> list[str]:
    """The sources each training set was sharded from (their file or dataset names), from its manifest."""
    names = []
    for path, _ in state.sets if state is not None else []:
        manifest = Path(path) / "manifest.json"
        if manifest.is_file():
            for source in json.loads(manifest.read_text()).get("sources", []):
                name = Path(str(source.get("path", ""))).name
                if name and name not in names:
                    names.append(name)
    return names


def _contents(electra: ElectraConfig) -> list[str]:
    if electra.objective != "electra":
        return ["- `generator/`: `ConvBertForMaskedLM` (objective `mlm`: the main model is a masked LM; there is "
                "no discriminator)."] + _loading()
    lines = ["- `discriminator/`: `ConvBertModel` (the model to fine-tune); its replaced-token-detection head "
             f"is in `discriminator/{RTD_HEAD_FILE}` under ELECTRA's names (`discriminator_predictions."
             "dense`, `discriminator_predictions.dense_prediction`): `logits = dense_prediction(act(dense("
             "hidden))).squeeze(-1)`, `act` = `hidden_act`."]
    if electra.generator.not_in_transformers() is None:
        lines.append("- `generator/`: `ConvBertForMaskedLM`, the ELECTRA generator (embeddings shared with the "
                     "discriminator; LM head = word embeddings, written out).")
    return lines + _loading()


def _loading() -> list[str]:
    return ["- Both load offline: `AutoModel.from_pretrained(dir, local_files_only=True)`, "
            "`AutoTokenizer.from_pretrained(dir, local_files_only=True)`."]


def _training(state: RunState | None) -> list[str]:
    if state is None:
        return []
    lines = []
    config = _config(state)
    if config is not None:
        t, d, m = config.train, config.data, config.model
        lines.append(f"- recipe: {m.objective} from preset `{m.preset}`, masking `{m.masking}`, sequences of "
                     f"{d.seq_len} tokens, global batch {t.global_batch_size}, AdamW peak lr {t.lr:g} "
                     f"(betas {t.adam_beta1:g}/{t.adam_beta2:g}, eps {t.adam_eps:g}, weight decay "
                     f"{t.weight_decay:g}), {t.warmup_steps:,} warm-up steps then linear decay over "
                     f"{t.steps:,} steps, gradient clipping {t.grad_clip:g}")
    phase = state.phase
    if phase.index > 1:
        lines.append(f"- phase {phase.index}, continued from `{phase.continued_from}` (its step {phase.from_step})")
    for label, value in (("steps", state.step), ("tokens seen", state.tokens_seen),
                         ("samples seen", state.samples_seen), ("precision", state.precision),
                         ("ZeRO stage", state.zero_stage), ("pipeline stages", state.pipeline_stages),
                         ("ranks", state.world_size)):
        lines.append(f"- {label}: {value:,}" if isinstance(value, int) else f"- {label}: {value}")
    for path, weight in state.sets:
        manifest = Path(path) / "manifest.json"
        digest = file_sha256(manifest) if manifest.is_file() else "not found at conversion time"
        lines.append(f"- data: `{path}` (weight {weight}, manifest.json sha256 {digest})")
    tok = state.tokenizer or {}
    if tok:
        lines.append(f"- tokenizer: {tok.get('kind')}, vocab {tok.get('vocab_size')}, special ids "
                     f"{tok.get('special_ids')}, sha256 {tok.get('sha256')}")
    return lines


def _results(state: RunState | None) -> list[str]:
    """The last validation row at or before the checkpoint's step, and its step's transfer probe."""
    config = _config(state)
    if config is None:
        return []
    step = state.step
    metrics = config.log_dir / "metrics.jsonl"
    if not metrics.is_file():
        return ["", "## Results", "", f"The run's metrics log ({metrics}) was not readable at conversion time."]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    valid = [row for row in rows if row.get("split") == "valid" and row["step"] <= step]
    probe = [row for row in rows if row.get("split") == "downstream" and row["step"] == step]
    lines = ["", "## Results", ""]
    if valid:
        last = valid[-1]
        shown = ", ".join(f"{key} {last[key]:.4f}" for key in ("loss", "mlm_loss", "mlm_accuracy", "rtd_loss",
                                                                 "rtd_accuracy", "rtd_auc") if key in last)
        lines.append(f"- validation at step {last['step']:,} ({config.eval.samples:,} held-out samples): {shown}")
    else:
        lines.append("- no validation pass before this checkpoint (eval.interval)")
    if probe:
        row, down = probe[-1], config.eval.downstream
        task = down.glue_task or down.train or "the configured task"
        baseline = f" against {row['random_init']:.4f} from random init" if "random_init" in row else ""
        lines.append(f"- transfer probe at this step (fine-tuned on {task}, median over seeds): "
                     f"{row['score']:.4f}{baseline}")
    return lines


def _config(state: RunState | None) -> TrainConfig | None:
    try:
        return TrainConfig.from_dict(state.config) if state is not None and state.config else None
    except ConfigError:  # a checkpoint from another version of the config: the card goes without the recipe
        return None


def _models(electra: ElectraConfig) -> dict[str, ModelConfig]:
    if electra.objective == "electra":
        return {"discriminator": electra.discriminator, "generator": electra.generator}
    return {"generator (mlm)": electra.discriminator}
