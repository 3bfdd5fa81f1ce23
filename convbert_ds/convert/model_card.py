"""The model card (``README.md``) the converter writes into OUT and each model directory.

It opens with the YAML front matter the Hugging Face Hub reads (its spec:
https://github.com/huggingface/hub-docs/blob/main/modelcard.md), these keys in this order, each only when
it has a value::

    library_name: transformers
    license: ID              # --license: a Hub license id (apache-2.0, ...) or other; absent when not given
    license_name: NAME       # --license-name, with license other (the Hub requires it then)
    license_link: LINK       # --license-link, with license other: a URL, or LICENSE for a file in the repo
    tags: [convbert, electra, convbert_ds, pretraining]
    datasets: [OWNER/NAME]   # Hub dataset ids only: the shards' sources read from the Hub's cache
    pipeline_tag: feature-extraction | fill-mask   # per directory

then says what the directories hold, how the model was trained (the recipe from the checkpoint's own config,
tokens seen, every source file the shards were made from, as their manifests record it), its last
validation metrics and transfer-probe score when the run's metrics log is readable, the model config, and
the conversion command.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from convbert_ds.config import ConfigError, ElectraConfig, ModelConfig
from convbert_ds.formats.checkpoint.run_state import RunState
from convbert_ds.formats.init_dir import ConvertError
from convbert_ds.formats.train_config import TrainConfig
from convbert_ds.fsutil import file_sha256
from convbert_ds.model.optim import pretraining_warmup_steps

RTD_HEAD_FILE = "rtd_head.safetensors"
PIPELINE_TAGS = {"discriminator": "feature-extraction", "generator": "fill-mask"}
HUB_LICENSES = "https://huggingface.co/docs/hub/repositories-licenses"
# The Hub's license ids and the ids it asks for in license_name (its example: my-license-1.0).
_LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # one part of a Hub repo id (owner or name)
SOURCES_LISTED = 20  # per shard directory; the manifest lists them all


@dataclass(frozen=True)
class CardLicense:
    """The card's license: a Hub license id, or ``other`` with the ``name`` (and ``link``) the Hub then needs.
    Checked when made: each refusal is one line naming the option and the fix."""

    id: str
    name: str | None = None
    link: str | None = None

    def __post_init__(self):
        if not _LICENSE_ID.fullmatch(self.id):
            raise ConvertError(f"--license {self.id!r}: not a Hub license id; use one from {HUB_LICENSES} "
                               "(e.g. apache-2.0), or --license other with --license-name NAME")
        if self.id != "other" and (self.name or self.link):
            raise ConvertError(f"--license-name and --license-link go with --license other, not --license {self.id} "
                               "(a license the Hub knows by its id); drop them or pass --license other")
        if self.id == "other" and not self.name:
            raise ConvertError("--license other needs --license-name NAME (an id such as my-license-1.0, and "
                               "--license-link URL, or LICENSE for a file beside the card): the Hub lists a license "
                               f"outside {HUB_LICENSES} by that name")
        if self.name and not _LICENSE_ID.fullmatch(self.name):
            raise ConvertError(f"--license-name {self.name!r}: use an id of lower-case letters, digits, '.', '+' "
                               "and '-', e.g. my-license-1.0")

    def front_matter(self) -> dict:
        return {"license": self.id, "license_name": self.name, "license_link": self.link}


@dataclass
class CardFacts:
    """What the model card says about where the weights came from, and under which license."""

    source: str
    command: str
    trainer_state: RunState | None = None  # None: weights from memory, not a checkpoint
    notes: list[str] = field(default_factory=list)
    license: CardLicense | None = None  # None: the card has no license key, and says to add one


def model_card(electra: ElectraConfig, facts: CardFacts, dtype: str, report: dict | None,
               pipeline_tag: str = "feature-extraction") -> str:
    state = facts.trainer_state
    lines = [_front_matter(state, pipeline_tag, facts.license), "", "# ConvBERT pretrained with convbert_ds", "",
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
    folder = "discriminator" if pipeline_tag == PIPELINE_TAGS["discriminator"] else "generator"
    upload = f"`hf upload ORG/NAME {folder} .` (the `hf` command comes with `huggingface_hub`; `hf auth login` once)."
    # A license is the publisher's decision (the data's terms decide it): without --license the card asks.
    lines += ["", "## Publishing", "", f"Upload with {upload}" if facts.license else
              f"No license was given at conversion (`--license`): add `license:` to the front matter above first "
              f"(an id from {HUB_LICENSES}, or `other` with `license_name` and `license_link`), then: {upload}"]
    return "\n".join(lines) + "\n"


def _front_matter(state: RunState | None, pipeline_tag: str, card_license: CardLicense | None) -> str:
    meta = {"library_name": "transformers", **(card_license.front_matter() if card_license else {}),
            "tags": ["convbert", "electra", "convbert_ds", "pretraining"],
            "datasets": _hub_datasets(state), "pipeline_tag": pipeline_tag}
    text = yaml.safe_dump({k: v for k, v in meta.items() if v}, sort_keys=False).rstrip()
    return f"---\n{text}\n---"


def _sources(set_path: str) -> list[dict]:
    """The files a shard directory was made from, as its manifest records them (empty when not readable)."""
    manifest = Path(set_path) / "manifest.json"
    if not manifest.is_file():
        return []
    return [s for s in json.loads(manifest.read_text()).get("sources", []) if isinstance(s, dict)]


def hub_dataset_id(path: str) -> str | None:
    """The Hub dataset a source file was read from, when its path is in the Hub's cache
    (``.../datasets--OWNER--NAME/snapshots/REVISION/...`` -> ``OWNER/NAME``; ``datasets--NAME``: a canonical id
    without owner); None for any other file. Hub repo names cannot hold ``--``, so the split is unambiguous."""
    for part in Path(path).parts:
        pieces = part.split("--")
        if pieces[0] == "datasets" and len(pieces) in (2, 3) and all(_HUB_NAME.fullmatch(p) for p in pieces[1:]):
            return "/".join(pieces[1:])
    return None


def _hub_datasets(state: RunState | None) -> list[str]:
    """``datasets:`` holds Hub dataset ids only (the Hub links them); local files go in the card's text."""
    ids = []
    for path, _ in state.sets if state is not None else []:
        for source in _sources(path):
            hub_id = hub_dataset_id(str(source.get("path", "")))
            if hub_id and hub_id not in ids:
                ids.append(hub_id)
    return ids


def _source_lines(set_path: str) -> list[str]:
    """Where a shard directory's text came from: each source as its manifest records it (at most
    ``SOURCES_LISTED``), and the Hub dataset when the file is in the Hub's cache."""
    sources = _sources(set_path)
    lines = []
    for source in sources[:SOURCES_LISTED]:
        hub_id = hub_dataset_id(str(source.get("path", "")))
        facts = [str(source.get("format", "?")) + (f", {source['compression']}" if source.get("compression") else "")]
        facts += [f"{source[key]:,} {key}" for key in ("bytes", "documents") if isinstance(source.get(key), int)]
        lines.append(f"  - from `{source.get('path')}` ({', '.join(facts)})"
                     + (f", the Hub dataset `{hub_id}`" if hub_id else ""))
    if len(sources) > SOURCES_LISTED:
        lines.append(f"  - and {len(sources) - SOURCES_LISTED:,} more files, listed in its manifest.json")
    return lines


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
        # The warm-up that ran (engine.plan.lr_schedule), and what was asked where they differ.
        warmup = pretraining_warmup_steps(t.warmup_steps, t.steps)
        asked = f" (train.warmup_steps={t.warmup_steps}: at most steps - 1)" if warmup != t.warmup_steps else ""
        lines.append(f"- recipe: {m.objective} from preset `{m.preset}`, masking `{m.masking}`, sequences of "
                     f"{d.seq_len} tokens, global batch {t.global_batch_size}, AdamW peak lr {t.lr:g} "
                     f"(betas {t.adam_beta1:g}/{t.adam_beta2:g}, eps {t.adam_eps:g}, weight decay "
                     f"{t.weight_decay:g}), {warmup:,} warm-up steps{asked} then linear decay over "
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
        lines += _source_lines(path)
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
