"""One seed of fine-tuning: AdamW with layer-wise LR decay, linear warm-up/decay, evaluation after every
epoch (or every N-th, and the last), and a resumable state.

State on disk (``STATE_DIR/state.pt``, replaced atomically; rank 0 writes, every rank reads it weights-only
through the project's allow-list, ``formats/safe_pickle.py``, so it holds tensors, numbers, strings, lists
and dicts only): ``{"step", "model", "optimizer", "rng", "history"}`` where ``history`` holds one entry per
evaluated epoch ``{"epoch", "step", "metrics": {split: {metric: value}}}``. A killed run restarts from the
last state: the data order comes from (seed, epoch) and the RNG state is restored, so it continues as if
never stopped. The per-step log (JSON lines ``{"step", "loss", "lr"}``) is cut back to the saved step on
resume (a line a full disk cut short with it). A write that finds the disk full (the log, the state, question
answering's predictions) ends the run in one line naming the file, the space free and the state kept.

``train_seed`` runs one seed from its parts: ``Schedule`` (steps, epochs, learning rate), ``EpochBatches``
(the data order), ``load_state`` / ``save_state`` (resume), ``data_parallel`` (DDP), ``train_step`` (one
optimizer step) and ``evaluation_due`` / ``evaluate`` (when and what it evaluates).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from convbert_ds.disk_full import full_disk_says
from convbert_ds.errors import UserError
from convbert_ds.finetune.batches import Encoded, collate, epoch_batches, eval_batches
from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.finetune.metrics import compute_metrics
from convbert_ds.finetune.recipe import Recipe
from convbert_ds.finetune.tasks import TaskData
from convbert_ds.formats.checkpoint.rng import rng_state, set_rng_state
from convbert_ds.formats.safe_pickle import safe_load
from convbert_ds.fsutil import truncate_jsonl, write_bytes_atomically
from convbert_ds.log import get_logger
from convbert_ds.model.optim import layerwise_param_groups, linear_warmup_decay

log = get_logger(__name__)
_LAYER = re.compile(r"^convbert\.encoder\.layer\.(\d+)\.")


@dataclass
class Placement:
    device: torch.device
    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def depth_of(num_layers: int):
    """ELECTRA's depths: embeddings 0, encoder layer i -> i + 1, the task head (any parameter outside the
    body: a classifier, a span head) num_layers + 2."""
    def depth(name: str) -> int:
        if not name.startswith("convbert."):
            return num_layers + 2
        if match := _LAYER.match(name):
            return int(match.group(1)) + 1
        if name.startswith(("convbert.embeddings.", "convbert.embeddings_project.")):
            return 0
        raise ValueError(f"no layer-wise learning-rate depth for parameter {name}")
    return depth


def build_optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    layers = model.config.num_hidden_layers
    groups = layerwise_param_groups(model, recipe.learning_rate, recipe.weight_decay, recipe.layerwise_lr_decay,
                                    depth_of(layers), max_depth=layers + 2)
    return torch.optim.AdamW(groups, lr=recipe.learning_rate, betas=(recipe.adam_beta1, recipe.adam_beta2),
                             eps=recipe.adam_epsilon)


def autocast(recipe: Recipe, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if recipe.precision == "bf16" else contextlib.nullcontext()


@torch.no_grad()
def predict(model, data: Encoded, recipe: Recipe, device: torch.device, regression: bool) -> list:
    """Class indices (or regression values) for every example, in input order."""
    was_training = model.training
    model.eval()
    predictions: list = [None] * len(data)
    pad = model.config.pad_token_id
    for indices in eval_batches(data, recipe.eval_batch_size):
        batch = {k: v.to(device) for k, v in collate(data, indices, pad, regression).items()}
        with autocast(recipe, device):
            logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).float()
        values = logits[:, 0] if regression else logits.argmax(-1)
        for i, value in zip(indices, values.tolist()):
            predictions[i] = value
    model.train(was_training)
    return predictions


class Classification:
    """What the loop needs of a task (the objective): sentence(-pair) classification or regression. Another
    kind of task (``qa.py``: question answering) has the same three methods."""

    def __init__(self, task: TaskData):
        self.task, self.regression = task, task.task_type == "regression"
        self._loss = torch.nn.MSELoss(reduction="sum") if self.regression else torch.nn.CrossEntropyLoss(reduction="sum")

    def collate(self, data: Encoded, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        return collate(data, indices, pad_id, self.regression)

    def loss_sum(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's loss summed over its examples."""
        return self._loss(logits[:, 0] if self.regression else logits, batch["labels"])

    def evaluate(self, model, evals: dict[str, Encoded], recipe: Recipe, device: torch.device) -> dict:
        return {split: compute_metrics(self.task, predict(model, data, recipe, device, self.regression), data.labels)
                for split, data in evals.items()}


STATE_FILE = "state.pt"


@dataclass(frozen=True)
class Schedule:
    """How one seed's steps fall into epochs, and its learning rate's linear warm-up and decay over them."""
    steps_per_epoch: int
    total: int
    warmup: int

    @classmethod
    def of(cls, steps_per_epoch: int, recipe: Recipe) -> "Schedule":
        total = max(1, math.ceil(recipe.epochs * steps_per_epoch))
        return cls(steps_per_epoch, total, int(recipe.warmup_fraction * total))

    def lr_factor(self, step: int) -> float:
        return linear_warmup_decay(step, self.warmup, self.total)

    def epochs_ended_at(self, step: int) -> int | None:
        """The epochs done when ``step`` ends one (the last epoch maybe partial), else None."""
        if step % self.steps_per_epoch == 0 or step == self.total:
            return math.ceil(step / self.steps_per_epoch)
        return None


class EpochBatches:
    """Each epoch's global batches (example indices), drawn from (seed, epoch) once per epoch."""

    def __init__(self, train, recipe: Recipe, seed: int, world_size: int):
        lengths = [len(ids) for ids in train.input_ids]
        self._draw = lambda epoch: epoch_batches(len(train), recipe.batch_size, seed, epoch, world_size, lengths,
                                                 recipe.group_by_length)
        self._drawn: tuple[int, list[list[int]]] = (-1, [])

    def of(self, epoch: int) -> list[list[int]]:
        if self._drawn[0] != epoch:
            self._drawn = (epoch, self._draw(epoch))
        return self._drawn[1]


def load_state(state_dir: Path, seed: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """Restore the model, optimizer and RNG states saved in ``state_dir``; return (step, history), (0, [])
    when there is none. Read weights-only through the project's allow-list (``safe_load``): a state file
    is data, and one that asks to run code (or was cut short) is refused in one line naming it."""
    state_file = state_dir / STATE_FILE
    if not state_file.is_file():
        return 0, []
    try:
        state = safe_load(state_file)
    except UserError as error:
        raise FinetuneError(f"seed {seed} cannot resume: {error}; or delete {state_dir} to restart that seed "
                            "from its first step") from None
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return state["step"], state["history"]


def save_state(state_dir: Path, step: int, model, optimizer, history: list[dict], place: Placement) -> None:
    """Rank 0 replaces the state atomically (tensors, numbers, lists and dicts only: ``load_state`` reads it
    weights-only); every rank waits for it."""
    if place.main:
        buffer = io.BytesIO()
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "rng": rng_state(), "history": history}, buffer)
        write_bytes_atomically(state_dir / STATE_FILE, buffer.getvalue())
    place.barrier()


def data_parallel(model: torch.nn.Module, place: Placement) -> torch.nn.Module:
    """What the forward pass runs: DDP over the ranks, or the model itself in one process."""
    if place.world_size == 1:
        return model
    ids = [place.device.index] if place.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def train_step(wrapped, model, optimizer, objective, train, global_batch: list[int], lr_factor: float,
               recipe: Recipe, place: Placement) -> float:
    """One optimizer step on this rank's share of ``global_batch``; returns the global batch's mean loss."""
    mine = global_batch[place.rank::place.world_size]
    batch = {k: v.to(place.device) for k, v in objective.collate(train, mine, model.config.pad_token_id).items()}
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * lr_factor
    with autocast(recipe, place.device):
        logits = wrapped(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).float()
    loss_sum = objective.loss_sum(logits, batch)
    # DDP averages gradients over ranks: scaling by world / global batch makes that the global mean.
    (loss_sum * place.world_size / len(global_batch)).backward()
    if recipe.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    logged = loss_sum.detach()
    if place.world_size > 1:
        dist.all_reduce(logged)  # the log shows the global batch's loss, whatever the rank count
    return logged.item() / len(global_batch)


def evaluation_due(epochs_done: int, step: int, schedule: Schedule, recipe: Recipe) -> bool:
    """After the last step always; otherwise after every ``eval_every_epochs``-th epoch (0: never)."""
    return step == schedule.total or bool(recipe.eval_every_epochs and epochs_done % recipe.eval_every_epochs == 0)


def evaluate(model, objective, evals: dict, recipe: Recipe, seed: int, epochs_done: int, step: int,
             place: Placement, bar: tqdm) -> dict:
    """The history entry of an evaluation; rank 0 evaluates and says so, the other ranks record no metrics."""
    entry = {"epoch": epochs_done, "step": step, "metrics": {}}
    if not place.main:
        return entry
    entry["metrics"] = metrics = objective.evaluate(model, evals, recipe, place.device)
    primary = next(iter(metrics))
    with bar.external_write_mode():  # a line above the progress bar, not through it
        log.info(f"seed {seed} epoch {epochs_done} step {step}: "
                 + ", ".join(f"{k} {v:.4f}" for k, v in metrics[primary].items()))
    return entry


def append_log_line(log_path: Path, row: dict) -> None:
    """One JSON line at the per-step log's end. The file is opened per line: a line a full disk refused would
    stay in an open file's buffer, and its close raise again. A line the disk cut short (it took what fit) is
    dropped on resume (``fsutil.truncate_jsonl``)."""
    with open(log_path, "a") as log_file:
        log_file.write(json.dumps(row) + "\n")


def kept_state(state_dir: Path, seed: int, saved_step: int) -> str:
    """What a full disk during seed ``seed`` leaves a rerun: its last saved state, whole, to resume from."""
    if saved_step:
        return f"seed {seed}'s state of step {saved_step} is kept whole in {state_dir}: a rerun resumes there"
    return f"seed {seed} has no saved state yet: a rerun starts it from its first step"


def train_seed(model: torch.nn.Module, objective, train, evals: dict, recipe: Recipe, seed: int, place: Placement,
               state_dir: Path, log_path: Path) -> list[dict]:
    """Fine-tune ``model`` in place on ``objective`` (``Classification``, ``qa.SpanObjective``); returns the
    per-epoch history (the last entry is the final result)."""
    model.to(place.device)
    optimizer = build_optimizer(model, recipe)
    batches = EpochBatches(train, recipe, seed, place.world_size)
    if not batches.of(0):
        raise ValueError(f"{len(train)} training examples cannot fill a batch across {place.world_size} ranks")
    schedule = Schedule.of(len(batches.of(0)), recipe)
    step, history = load_state(state_dir, seed, model, optimizer)
    saved = step

    def full_disk(path):  # a write of this seed that finds its disk full: one line, naming the state kept
        return full_disk_says(path, kept_state(state_dir, seed, saved))

    if place.main:
        with full_disk(state_dir):
            state_dir.mkdir(parents=True, exist_ok=True)
        with full_disk(log_path):
            truncate_jsonl(log_path, step)
    wrapped = data_parallel(model, place)
    model.train()
    bar = tqdm(total=schedule.total, initial=step, desc=f"seed {seed}", disable=not place.main, dynamic_ncols=True)
    predictions = getattr(objective, "write_to", None)  # question answering writes its predictions there
    with bar:
        while step < schedule.total:
            epoch, position = divmod(step, schedule.steps_per_epoch)
            factor = schedule.lr_factor(step)
            loss = train_step(wrapped, model, optimizer, objective, train, batches.of(epoch)[position], factor,
                              recipe, place)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if place.main:
                with full_disk(log_path):
                    append_log_line(log_path, {"step": step, "loss": loss, "lr": recipe.learning_rate * factor})
            epochs_done = schedule.epochs_ended_at(step)
            if epochs_done is not None and evaluation_due(epochs_done, step, schedule, recipe):
                with full_disk(predictions) if predictions else contextlib.nullcontext():
                    history.append(evaluate(model, objective, evals, recipe, seed, epochs_done, step, place, bar))
            if epochs_done is not None or step % recipe.save_steps == 0:
                with full_disk(state_dir / STATE_FILE):
                    save_state(state_dir, step, model, optimizer, history, place)
                saved = step
    return history
