"""Question answering in the fine-tuning loop: the span objective over SQuAD windows (``squad.py``).

The loss is transformers' and the official BERT/ELECTRA code's: the mean of the cross-entropies of the
answer's first and last token over the window's positions (``[CLS]`` when the window holds no answer).
Evaluation runs every window unpadded (``batches.eval_batches``), decodes each question's best span over its
windows, scores the split with the official metric and, with ``write_to`` set, writes ``predictions.json``
(and v2.0's ``null_odds.json``) per split there.
"""

from __future__ import annotations

from pathlib import Path

import torch

from convbert_ds.finetune.batches import collate, eval_batches
from convbert_ds.finetune.loop import autocast
from convbert_ds.finetune.recipe import Recipe
from convbert_ds.finetune.squad import QATask, Question, Windows, decode, score, write_predictions


class SpanObjective:
    def __init__(self, task: QATask, questions: dict[str, list[Question]]):
        self.task, self.questions = task, questions
        self.write_to: Path | None = None  # set per seed by the run
        self._loss = torch.nn.CrossEntropyLoss(reduction="sum")

    def collate(self, data: Windows, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        return collate(data, indices, pad_id, regression=False)  # labels: [B, 2] (first, last token)

    def loss_sum(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        return (self._loss(logits[..., 0], labels[:, 0]) + self._loss(logits[..., 1], labels[:, 1])) / 2

    @torch.no_grad()
    def span_logits(self, model, data: Windows, recipe: Recipe, device: torch.device) -> tuple[list, list]:
        """Every window's start and end scores (lists of floats), in window order."""
        was_training = model.training
        model.eval()
        starts, ends = [None] * len(data), [None] * len(data)
        for indices in eval_batches(data, recipe.eval_batch_size):
            batch = {k: v.to(device) for k, v in self.collate(data, indices, model.config.pad_token_id).items()}
            with autocast(recipe, device):
                logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).float()
            for row, w in enumerate(indices):
                starts[w], ends[w] = logits[row, :, 0].tolist(), logits[row, :, 1].tolist()
        model.train(was_training)
        return starts, ends

    def evaluate(self, model, evals: dict[str, Windows], recipe: Recipe, device: torch.device) -> dict:
        """Metrics per split; v2.0's null threshold is chosen on the first split (dev) and used for the rest."""
        metrics, threshold = {}, None
        for split, data in evals.items():
            starts, ends = self.span_logits(model, data, recipe, device)
            decoded = decode(self.questions[split], data, starts, ends, self.task.n_best, self.task.max_answer_length)
            metrics[split], final, chosen = score(self.task, self.questions[split], decoded, threshold)
            threshold = chosen if threshold is None else threshold
            if self.write_to is not None:
                write_predictions(self.write_to / split, final, decoded.null_odds if self.task.version_2 else None)
        return metrics
