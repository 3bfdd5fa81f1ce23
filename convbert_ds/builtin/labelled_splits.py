"""A labelled text task written as files: balanced, disjoint train and validation splits of a pool of examples.

Shared by the built-in tasks (``docstring_summaries``, ``aws_api_passages``): each builds a pool (label -> its
examples, deduplicated, in a fixed order) and writes it here, so that every task's files have one layout,
``train.jsonl`` and ``validation.jsonl`` with a ``text`` and a ``label`` a line, which
``python -m convbert_ds.finetune --text-column text --label-column label`` reads.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from convbert_ds.fsutil import write_text_atomically

_TOKEN = re.compile(r"[a-z0-9]+")


def dedup_key(text: str) -> str:
    """Case and punctuation are ignored when deciding that two examples are the same."""
    return " ".join(_TOKEN.findall(text.lower()))


def unambiguous_pool(labelled: Iterable[tuple[str, str]], labels: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """(label, text) pairs -> label -> its texts, deduplicated (``dedup_key``) and sorted. A text found under
    two labels is dropped from both: it cannot be classified, and keeping it would put one text in train and dev."""
    labels_of: dict[str, set[str]] = defaultdict(set)
    text_of: dict[str, str] = {}
    for label, text in labelled:
        key = dedup_key(text)
        labels_of[key].add(label)
        text_of.setdefault(key, text)
    pool: dict[str, list[str]] = {label: [] for label in labels}
    for key, found in labels_of.items():
        if len(found) == 1:
            pool[found.pop()].append(text_of[key])
    return {label: tuple(sorted(texts)) for label, texts in pool.items()}


def write_balanced_task(pool: dict[str, tuple[str, ...]], out_dir: str | os.PathLike, train_per_class: int,
                        dev_per_class: int, seed: int) -> dict[str, int]:
    """Write ``train.jsonl`` and ``validation.jsonl`` ({"text", "label"} per line) from ``pool``, balanced by class.

    Each class's pool is shuffled with ``seed``; dev takes the first
    ``dev_per_class`` examples and train the next ``train_per_class``, so the
    two splits are disjoint. Returns the number of examples per split.
    """
    short = {label: len(texts) for label, texts in pool.items() if len(texts) < train_per_class + dev_per_class}
    if short:
        raise ValueError(f"not enough examples for {train_per_class}+{dev_per_class} per class: {short}")
    rng = random.Random(seed)
    splits: dict[str, list[dict[str, str]]] = {"train": [], "validation": []}
    for label, texts in pool.items():
        shuffled = list(texts)
        rng.shuffle(shuffled)
        splits["validation"] += [{"text": t, "label": label} for t in shuffled[:dev_per_class]]
        splits["train"] += [{"text": t, "label": label}
                            for t in shuffled[dev_per_class:dev_per_class + train_per_class]]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        rng.shuffle(rows)
        write_text_atomically(out_dir / f"{split}.jsonl",
                              "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return {split: len(rows) for split, rows in splits.items()}
