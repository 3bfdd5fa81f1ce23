"""SQuAD-format question sets built from real prose (the tests' corpus of docstrings), no download.

Each context is real text: one document, or three joined (longer than a window). A question is one of the
context's own sentences with a word of it replaced by "what" (a cloze), and its answer is that word, a real
span at its real offset, chosen to occur once in the context. v2.0's unanswerable questions are clozes of
another context whose answer word this context does not contain.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from convbert_ds.builtin.docstring_questions import cloze


def _clozes(context: str, sentences: list[str], rng: random.Random, per_context: int) -> list[tuple[str, str, int]]:
    """Up to ``per_context`` questions, each from another sentence (the built-in QA task's ``cloze``)."""
    found = []
    for sentence in rng.sample(sentences, len(sentences)):
        if question := cloze(sentence, context, rng):
            found.append(question)
            if len(found) == per_context:
                break
    return found


def build(documents: list[list[str]], version_2: bool, seed: int, contexts: int, long_every: int = 4) -> dict:
    """The official JSON layout; every ``long_every``-th context is three documents joined."""
    rng = random.Random(seed)
    usable = [d for d in documents if sum(len(line.split()) for line in d) >= 12]
    rng.shuffle(usable)
    paragraphs, pool, at = [], [], 0
    while len(paragraphs) < contexts and at + 3 <= len(usable):
        take = 3 if len(paragraphs) % long_every == 0 else 1
        sentences = [line for doc in usable[at:at + take] for line in doc]
        at += take
        context = " ".join(sentences)
        qas = [{"id": f"q{seed}-{len(paragraphs)}-{i}", "question": q, "answers": [{"text": a, "answer_start": s}]}
               for i, (q, a, s) in enumerate(_clozes(context, sentences, rng, per_context=2))]
        if qas:
            paragraphs.append({"context": context, "qas": qas})
            pool.extend((q["question"], q["answers"][0]["text"]) for q in qas)
    if version_2:
        for p, paragraph in enumerate(paragraphs):
            for question, answer in rng.sample(pool, len(pool)):
                if not re.search(rf"\b{answer}\b", paragraph["context"]):
                    paragraph["qas"].append({"id": f"q{seed}-{p}-none", "question": question, "answers": [],
                                             "is_impossible": True})
                    break
    return {"version": "v2.0" if version_2 else "1.1", "data": [{"title": "docstrings", "paragraphs": paragraphs}]}


def write(path: Path, squad: dict) -> Path:
    path.write_text(json.dumps(squad))
    return path
