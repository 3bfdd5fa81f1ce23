"""A held-out extractive QA task in SQuAD's format, built from the same text as the transfer task.

The text is the transfer task's (``docstring_summaries.py``): summaries of the docstrings of seven pinned
packages that the pretraining corpus leaves out. A context is three summaries joined; each question is one of its
summaries with a word (five letters or more, found once in the context) replaced by "what", and the answer is
that word at its offset: a real span of real prose, found by matching the question against the context.
The validation split is built from the transfer task's validation summaries and the training split from its
training ones, so the two share no text.

    python -m convbert_ds.builtin.docstring_questions --out runs/qa   # train.json, validation.json (SQuAD v1.1)
"""

from __future__ import annotations

import json
import random
import re
import sys
import tempfile
from pathlib import Path

from convbert_ds.builtin.docstring_summaries import write_transfer_task
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.fsutil import write_text_atomically

SUMMARIES_PER_CONTEXT = 3
_WORD = re.compile(r"\b[A-Za-z]{5,}\b")


def cloze(sentence: str, context: str, rng: random.Random) -> tuple[str, str, int] | None:
    """A question from ``sentence`` (a part of ``context``): one of its words that occurs once in the context
    replaced by "what"; returns (question, answer word, its offset in the context), or None without such a word."""
    words = [w for w in _WORD.findall(sentence) if len(re.findall(rf"\b{w}\b", context)) == 1]
    if not words:
        return None
    word = rng.choice(words)
    question = re.sub(rf"\b{word}\b", "what", sentence, count=1).rstrip(".") + "?"
    return question, word, re.search(rf"\b{word}\b", context).start()


def cloze_questions(summaries: list[str], seed: int, split: str) -> dict:
    """SQuAD v1.1's layout: the summaries in contexts of ``SUMMARIES_PER_CONTEXT``, a question for each."""
    rng = random.Random(seed)
    # A summary that says "what" already would make its question ambiguous.
    summaries = [s for s in summaries if len(s.split()) >= 5 and not re.search(r"\bwhat\b", s, re.IGNORECASE)]
    paragraphs = []
    for first in range(0, len(summaries) - SUMMARIES_PER_CONTEXT + 1, SUMMARIES_PER_CONTEXT):
        parts = summaries[first:first + SUMMARIES_PER_CONTEXT]
        context = " ".join(parts)
        qas = []
        for k, summary in enumerate(parts):
            if found := cloze(summary, context, rng):
                question, word, start = found
                qas.append({"id": f"{split}-{first}-{k}", "question": question,
                            "answers": [{"text": word, "answer_start": start}]})
        if qas:
            paragraphs.append({"context": context, "qas": qas})
    return {"version": "1.1", "data": [{"title": f"docstring summaries ({split})", "paragraphs": paragraphs}]}


def write_qa_task(out_dir, train_per_class: int = 500, dev_per_class: int = 100, seed: int = 0) -> dict:
    """Write ``train.json`` and ``validation.json``; returns the number of questions per split."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    with tempfile.TemporaryDirectory(dir=out_dir) as summaries:
        write_transfer_task(summaries, train_per_class, dev_per_class, seed)
        for split in ("train", "validation"):
            texts = [json.loads(line)["text"] for line in (Path(summaries) / f"{split}.jsonl").read_text().splitlines()]
            squad = cloze_questions(texts, seed, split)
            write_text_atomically(out_dir / f"{split}.json", json.dumps(squad, ensure_ascii=False))
            counts[split] = sum(len(p["qas"]) for p in squad["data"][0]["paragraphs"])
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write train.json and validation.json to")
    parser.add_argument("--train-per-class", type=bounded(int, min=1), default=500,
                        help="summaries per package for training")
    parser.add_argument("--dev-per-class", type=bounded(int, min=1), default=100,
                        help="summaries per package for validation")
    parser.add_argument("--seed", type=bounded(int, min=0), default=0, help="seed of the draw and the questions")
    args = parser.parse_args(argv)
    counts = write_qa_task(args.out, args.train_per_class, args.dev_per_class, args.seed)
    print(f"wrote {args.out}/train.json ({counts['train']:,} questions) and validation.json "
          f"({counts['validation']:,})")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
