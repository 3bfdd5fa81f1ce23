"""Examples -> token ids (through the model directory's own transformers tokenizer) -> padded batches.

Tokenising with ``AutoTokenizer`` from the model directory is what a transformers user does with
``best/``, so the ids we train and evaluate on are the ids they get.

Evaluation batches hold examples of one length only. transformers' ConvBERT does not mask padding in
its convolution branch (padded positions leak into the last K/2 real tokens), so a padded example's
logits depend on its batch-mates; unpadded batches make every prediction equal to running that
example alone, which is what transformers reproduces from ``best/``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from convbert_ds.finetune.tasks import Example, TaskData


@dataclass
class Encoded:
    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    labels: list[float] | list[int]

    def __len__(self) -> int:
        return len(self.labels)


def label_ids(task: TaskData, examples: list[Example]) -> list:
    if task.task_type == "regression":
        return [float(e.label) for e in examples]
    index = {name: i for i, name in enumerate(task.label_names)}
    return [index[e.label] for e in examples]


def encode(tokenizer, task: TaskData, examples: list[Example], max_seq_length: int) -> Encoded:
    texts = [e.text for e in examples]
    pairs = [e.text_pair for e in examples] if examples and examples[0].text_pair is not None else None
    out = tokenizer(texts, pairs, truncation=True, max_length=max_seq_length, return_token_type_ids=True)
    return Encoded(out["input_ids"], out["token_type_ids"], label_ids(task, examples))


IGNORED_LABEL = -100  # CrossEntropyLoss's ignore_index


def collate(data: Encoded, indices: list[int], pad_id: int, regression: bool, per_token: bool = False
            ) -> dict[str, torch.Tensor]:
    """Pad ``indices``' examples to the longest of them; labels float for regression, long otherwise;
    ``per_token``: a label per token (tagging), padded with ``IGNORED_LABEL``."""
    longest = max(len(data.input_ids[i]) for i in indices)
    ids = torch.full((len(indices), longest), pad_id, dtype=torch.long)
    types = torch.zeros((len(indices), longest), dtype=torch.long)
    mask = torch.zeros((len(indices), longest), dtype=torch.long)
    for row, i in enumerate(indices):
        n = len(data.input_ids[i])
        ids[row, :n] = torch.tensor(data.input_ids[i])
        types[row, :n] = torch.tensor(data.token_type_ids[i])
        mask[row, :n] = 1
    if per_token:
        labels = torch.full((len(indices), longest), IGNORED_LABEL, dtype=torch.long)
        for row, i in enumerate(indices):
            labels[row, :len(data.labels[i])] = torch.tensor(data.labels[i])
    else:
        labels = torch.tensor([data.labels[i] for i in indices], dtype=torch.float if regression else torch.long)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}


def epoch_batches(n_examples: int, batch_size: int, seed: int, epoch: int, world_size: int,
                  lengths: list[int] | None = None, group_by_length: int = 0) -> list[list[int]]:
    """The global batches of one epoch: a permutation drawn from (seed, epoch), so a resumed run sees
    the same order. A partial batch too small to give every rank an example is dropped.

    ``group_by_length`` N > 0 (``lengths`` given): every N consecutive batches of the permutation are sorted by
    length before they are cut, so batch-mates are of similar length and far fewer positions are padding (on
    the AWS reference task, most of the padding goes at N = 4), and the batches are then shuffled, so that an
    epoch does not run short to long. Batch-mates still come from a random window."""
    if group_by_length and (lengths is None or len(lengths) != n_examples):
        raise ValueError(f"group_by_length={group_by_length} needs one length per example ({n_examples})")
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n_examples, generator=generator).tolist()
    if group_by_length:
        window = group_by_length * batch_size
        order = [i for start in range(0, n_examples, window)
                 for i in sorted(order[start:start + window], key=lengths.__getitem__)]
    batches = [order[i:i + batch_size] for i in range(0, n_examples, batch_size)]
    if group_by_length:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return [batch for batch in batches if len(batch) >= world_size]


def eval_batches(data: Encoded, batch_size: int) -> list[list[int]]:
    """Batches of equal-length examples (no padding), in a fixed order."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(data.input_ids):
        by_length[len(ids)].append(i)
    return [group[i:i + batch_size] for _, group in sorted(by_length.items()) for i in range(0, len(group), batch_size)]
