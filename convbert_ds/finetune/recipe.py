"""The fine-tuning recipe: ConvBERT's Table 6, with ELECTRA's ``configure_finetuning.py`` for what it leaves out.

Table 6: Adam (beta 0.9 / 0.999, eps 1e-6), layer-wise LR decay 0.8, linear decay, warm-up fraction 0.1,
dropout 0.1, batch 32. ELECTRA: learning rate by model size (3e-4 small, 1e-4 base, 5e-5 large), weight
decay 0.01, 3 epochs (10 for RTE and STS-B, the small tasks), max length 128, gradient clipping at 1.0.
Every field can be set on the command line; ``None`` means "the default for this task and model", which
``resolve`` fills in once, so results.json records the numbers that actually ran.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from convbert_ds.cli import bounded
from convbert_ds.config import ModelConfig
from convbert_ds.finetune.errors import FinetuneError

PRECISIONS = ("auto", "fp32", "bf16")
_LONG_TASKS = ("rte", "stsb")  # ELECTRA trains these small sets for 10 epochs instead of 3
_TWO_EPOCH_TASKS = ("squad", "squad_v2")  # and SQuAD for 2
# ELECTRA's max lengths where not 128: SQuAD's contexts in windows of 512, tagging's sentences ("chunk") 256.
_MAX_SEQ_LENGTHS = {"squad": 512, "squad_v2": 512, "conll": 256, "tokens": 256}


# The valid range of every numeric field (None, where a field allows it, is always valid: "the default").
RANGES = {
    "learning_rate": bounded(float, above=0), "layerwise_lr_decay": bounded(float, above=0, max=1),
    "weight_decay": bounded(float, min=0), "warmup_fraction": bounded(float, min=0, below=1),
    "epochs": bounded(float, above=0), "batch_size": bounded(int, min=1), "eval_batch_size": bounded(int, min=1),
    "max_seq_length": bounded(int, min=4),  # room for [CLS] and [SEP]
    "dropout": bounded(float, min=0, below=1), "adam_beta1": bounded(float, min=0, below=1),
    "adam_beta2": bounded(float, min=0, below=1), "adam_epsilon": bounded(float, above=0),
    "grad_clip": bounded(float, min=0),  # 0 turns clipping off
    "seeds": bounded(int, min=1), "first_seed": bounded(int, min=0), "examples_per_class": bounded(int, min=1),
    "max_train_examples": bounded(int, min=1), "save_steps": bounded(int, min=1),
    "eval_every_epochs": bounded(int, min=0),  # 0: only after the last epoch
    "group_by_length": bounded(int, min=0),  # 0: batches drawn without regard to length
}


@dataclass
class Recipe:
    learning_rate: float | None = None
    layerwise_lr_decay: float = 0.8
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    epochs: float | None = None
    batch_size: int = 32
    eval_batch_size: int = 128
    max_seq_length: int | None = None
    dropout: float | None = None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-6
    grad_clip: float = 1.0
    seeds: int = 1
    first_seed: int = 0
    precision: str = "auto"
    examples_per_class: int | None = None
    max_train_examples: int | None = None
    save_steps: int = 200
    eval_every_epochs: int = 1
    group_by_length: int = 0

    def validate(self) -> None:
        """Each field against its range in ``RANGES`` (the command line's parser uses the same ones)."""
        for name, in_range in RANGES.items():
            value = getattr(self, name)
            if value is not None and (wrong := in_range.check(value)):
                raise FinetuneError(f"--{name.replace('_', '-')}={value!r}: {wrong}")
        if self.precision not in PRECISIONS:
            raise FinetuneError(f"--precision={self.precision!r}: must be one of {PRECISIONS}")

    def resolve(self, task_name: str, model: ModelConfig, cuda: bool) -> "Recipe":
        """Fill the task- and model-dependent defaults; check the result against the model."""
        self.validate()
        resolved = dataclasses.replace(
            self,
            learning_rate=self.learning_rate or default_learning_rate(model.hidden_size),
            epochs=self.epochs or (10.0 if task_name in _LONG_TASKS else 2.0 if task_name in _TWO_EPOCH_TASKS else 3.0),
            # the task's default length, no longer than the model's positions; a length asked for is checked below
            max_seq_length=self.max_seq_length or min(task_max_seq_length(task_name), model.max_position_embeddings),
            dropout=model.hidden_dropout_prob if self.dropout is None else self.dropout,
            precision=("bf16" if cuda else "fp32") if self.precision == "auto" else self.precision)
        if resolved.max_seq_length > model.max_position_embeddings:
            raise FinetuneError(f"--max-seq-length={resolved.max_seq_length}: the model has only "
                                f"max_position_embeddings={model.max_position_embeddings}; use at most that")
        if resolved.precision == "bf16" and not cuda:
            raise FinetuneError("--precision=bf16 needs a CUDA GPU; use fp32 (the default) on CPU")
        return resolved


def task_max_seq_length(task_name: str) -> int:
    """The recipe's length for a task: 128, or ELECTRA's own where it differs."""
    return _MAX_SEQ_LENGTHS.get(task_name, 128)


def default_learning_rate(hidden_size: int) -> float:
    """ELECTRA's fine-tuning rates: small (256) 3e-4, base (768) 1e-4, large (1024) 5e-5."""
    if hidden_size < 512:
        return 3e-4
    return 1e-4 if hidden_size <= 768 else 5e-5


def add_recipe_options(parser: argparse.ArgumentParser) -> None:
    """The recipe's fields as command-line options (fine-tuning's and the evaluation's)."""
    group = parser.add_argument_group("recipe (defaults: ConvBERT Table 6 and ELECTRA's fine-tuning settings)")
    helps = {
        "learning_rate": "peak LR (None: by model width, 3e-4 below 512 wide, 1e-4 up to 768, else 5e-5)",
        "layerwise_lr_decay": "LR factor per layer below the top (1 turns the decay off)",
        "weight_decay": "AdamW weight decay (not on biases and LayerNorm weights)",
        "warmup_fraction": "share of the steps with linear LR warm-up",
        "epochs": "training epochs (None: 3, or 10 for RTE and STS-B, 2 for SQuAD)",
        "batch_size": "training examples per step, over all ranks",
        "eval_batch_size": "examples per evaluation batch",
        "max_seq_length": "tokens per example (longer ones are truncated; None: 128, 512 for SQuAD's windows, "
                          "256 for tagging, at most the model's positions)",
        "dropout": "classifier and body dropout (None: the model's hidden_dropout_prob)",
        "adam_beta1": "AdamW beta1",
        "adam_beta2": "AdamW beta2",
        "adam_epsilon": "AdamW epsilon",
        "grad_clip": "max gradient norm (0 turns clipping off)",
        "first_seed": "the first fine-tuning seed",
        "precision": f"{PRECISIONS}; auto = bf16 on a GPU, fp32 on CPU",
        "seeds": "fine-tune this many seeds (first-seed, first-seed+1, ...) and report the median",
        "examples_per_class": "low-resource runs: this many training examples per class (one seeded subset)",
        "max_train_examples": "train on at most this many examples (one seeded subset)",
        "save_steps": "write the resumable state every N steps (and after every epoch)",
        "eval_every_epochs": "evaluate after every N-th epoch and after the last (0: after the last only; "
                             "training is the same either way, so the final metrics are too)",
        "group_by_length": "sort every N consecutive batches' examples by length before cutting them, then "
                           "shuffle the batches: less padding, so faster on texts of mixed length (0: off)",
    }
    for field in dataclasses.fields(Recipe):
        choices = PRECISIONS if field.name == "precision" else None
        group.add_argument(f"--{field.name.replace('_', '-')}", type=RANGES.get(field.name, str), choices=choices,
                           default=field.default, help=helps[field.name])
