"""One seed of fine-tuning: AdamW with layer-wise LR decay, linear warm-up/decay, evaluation after every
epoch (or every N-th, and the last), and a resumable state.

State on disk (``STATE_DIR/state.pt``, replaced atomically; rank 0 writes, every rank reads):
``{"step", "model", "optimizer", "rng", "history"}`` where ``history`` holds one entry per evaluated epoch
``{"epoch", "step", "metrics": {split: {metric: value}}}``. A killed run restarts from the last state: the
data order comes from (seed, epoch) and the RNG state is restored, so it continues as if never stopped.
The per-step log ``LOG`` (JSON lines ``{"step", "loss", "lr"}``) is cut back to the saved step on resume.
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

from convbert_ds.finetune.batches import Encoded, collate, epoch_batches, eval_batches
from convbert_ds.finetune.metrics import compute_metrics
from convbert_ds.finetune.recipe import Recipe
from convbert_ds.finetune.tasks import TaskData
from convbert_ds.formats.checkpoint.rng import rng_state, set_rng_state
from convbert_ds.fsutil import truncate_jsonl, write_bytes_atomically
from convbert_ds.model.optim import layerwise_param_groups, linear_warmup_decay

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


def train_seed(model: torch.nn.Module, objective, train, evals: dict, recipe: Recipe, seed: int, place: Placement,
               state_dir: Path, log: Path) -> list[dict]:
    """Fine-tune ``model`` in place on ``objective`` (``Classification``, ``qa.SpanObjective``); returns the
    per-epoch history (the last entry is the final result)."""
    model.to(place.device)
    optimizer = build_optimizer(model, recipe)
    lengths = [len(ids) for ids in train.input_ids]

    def batches_of(epoch: int) -> list[list[int]]:
        return epoch_batches(len(train), recipe.batch_size, seed, epoch, place.world_size, lengths,
                             recipe.group_by_length)

    steps_per_epoch = len(batches_of(0))
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train)} training examples cannot fill a batch across {place.world_size} ranks")
    total = max(1, math.ceil(recipe.epochs * steps_per_epoch))
    warmup = int(recipe.warmup_fraction * total)
    state_file = state_dir / "state.pt"
    step, history = 0, []
    if state_file.is_file():
        state = torch.load(state_file, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        set_rng_state(state["rng"])
    if place.main:
        state_dir.mkdir(parents=True, exist_ok=True)
        truncate_jsonl(log, step)
    wrapped = model
    if place.world_size > 1:
        ids = [place.device.index] if place.device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def save() -> None:
        if place.main:
            buffer = io.BytesIO()
            torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "rng": rng_state(), "history": history}, buffer)
            write_bytes_atomically(state_file, buffer.getvalue())
        place.barrier()

    epoch_order: tuple[int, list[list[int]]] = (-1, [])  # (epoch, its batches): drawn once per epoch
    model.train()
    bar = tqdm(total=total, initial=step, desc=f"seed {seed}", disable=not place.main, dynamic_ncols=True)
    with bar, open(log, "a") if place.main else contextlib.nullcontext() as log_file:
        while step < total:
            epoch, position = divmod(step, steps_per_epoch)
            if epoch_order[0] != epoch:
                epoch_order = (epoch, batches_of(epoch))
            global_batch = epoch_order[1][position]
            mine = global_batch[place.rank::place.world_size]
            batch = {k: v.to(place.device) for k, v in objective.collate(train, mine, model.config.pad_token_id).items()}
            factor = linear_warmup_decay(step, warmup, total)
            for group in optimizer.param_groups:
                group["lr"] = group["base_lr"] * factor
            with autocast(recipe, place.device):
                logits = wrapped(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).float()
            loss_sum = objective.loss_sum(logits, batch)
            # DDP averages gradients over ranks: scaling by world / global batch makes that the global mean.
            (loss_sum * place.world_size / len(global_batch)).backward()
            if recipe.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            logged = loss_sum.detach()
            if place.world_size > 1:
                dist.all_reduce(logged)  # the log shows the global batch's loss, whatever the rank count
            loss = logged.item() / len(global_batch)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if place.main:
                log_file.write(json.dumps({"step": step, "loss": loss, "lr": recipe.learning_rate * factor}) + "\n")
                log_file.flush()
            if step % steps_per_epoch == 0 or step == total:
                finished = math.ceil(step / steps_per_epoch)  # epochs done, the last maybe partial
                if step == total or (recipe.eval_every_epochs and finished % recipe.eval_every_epochs == 0):
                    metrics = objective.evaluate(model, evals, recipe, place.device) if place.main else {}
                    history.append({"epoch": finished, "step": step, "metrics": metrics})
                    if place.main:
                        primary = next(iter(metrics))
                        bar.write(f"seed {seed} epoch {finished} step {step}: "
                                  + ", ".join(f"{k} {v:.4f}" for k, v in metrics[primary].items()))
                save()
            elif step % recipe.save_steps == 0:
                save()
    return history
