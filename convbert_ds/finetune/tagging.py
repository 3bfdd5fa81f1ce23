"""Token tagging (``--task conll``, ``--task tokens``): CoNLL-style files in, entity-level F1 out.

A file holds one token a line, its tag in the last whitespace-separated column (CoNLL-2003's four columns
``word POS chunk NER`` or just ``word TAG``), a blank line between sentences; ``-DOCSTART-`` lines are skipped.
Words are tokenized by the model's tokenizer; a word's tag trains and is predicted on its first sub-token
only (the others are ignored), and words past ``--max-seq-length`` are predicted ``O``.

The metric is the field's: entities (chunks) are read from the tags as seqeval's default mode and conlleval
(its IOBES-aware versions, conlleval.py among them) read them, so IOB1 (CoNLL-2003's original files), IOB2 and
IOBES (BIOES) all work, and BILOU, whose ``L-``/``U-`` are read as ``E-``/``S-``. A chunk starts at ``B-X`` or
``S-X``, and at ``I-X`` or ``E-X`` after ``O``, after a chunk's end (``E-``, ``S-``) or after another type; it
goes on while ``I-X`` or ``E-X`` follows ``B-X`` or ``I-X``, and ends after ``E-X`` or ``S-X``, before ``B-``,
``S-`` or ``O``, or where the type changes. So ``S-X`` is a one-word chunk and ``B-X I-X E-X`` one chunk
ending at ``E-X``. Precision, recall and F1 are over whole chunks (type and boundaries exact), micro-averaged
over the split; token accuracy is reported too.

A tag is ``O`` or one of those prefixes and a type (``B-PER``); any other is refused when the file is read,
naming the file and line: another prefix (``X-PER``, ``M-LOC``), and a tag without one (``PER``), from which
conlleval reads a type-less chunk tag and seqeval the prefix ``P`` of a type ``ER``: no entity either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from convbert_ds.finetune.batches import IGNORED_LABEL as IGNORED  # later sub-tokens, special tokens, padding
from convbert_ds.finetune.batches import collate, eval_batches
from convbert_ds.finetune.errors import FinetuneError, utf8_text
from convbert_ds.finetune.loop import autocast

TAGGING_TASKS = ("conll", "tokens")


@dataclass
class Sentence:
    words: list[str]
    tags: list[str]


@dataclass
class TaggingTask:
    name: str
    label_names: list[str]
    train: list[Sentence]
    evals: dict[str, list[Sentence]]
    source: dict
    task_type: str = "token_classification"
    metric: str = "f1"


def read_conll(path) -> list[Sentence]:
    path = Path(path)
    if not path.is_file():
        raise FinetuneError(f"{path}: no such file; pass a CoNLL-style file (a token and its tag a line)")
    sentences, words, tags = [], [], []
    # Decoded whole first, so that a byte of another encoding is named by its line (not a traceback).
    for number, line in enumerate(utf8_text(path).split("\n"), 1):
        columns = line.split()
        if not columns or columns[0] == "-DOCSTART-":
            if words:
                sentences.append(Sentence(words, tags))
                words, tags = [], []
            continue
        if len(columns) < 2:
            raise FinetuneError(f"{path}:{number}: {line.strip()!r} has no tag; a line is a token and its tag "
                                "(the tag last), a blank line between sentences")
        words.append(columns[0])
        tags.append(_checked_tag(path, number, columns[-1]))
    if words:
        sentences.append(Sentence(words, tags))
    if not sentences:
        raise FinetuneError(f"{path}: holds no sentences")
    return sentences


def label_set(train: list[Sentence], evals: dict[str, list[Sentence]], train_path) -> list[str]:
    """The training split's tags, sorted ("O" first); a validation tag never seen in training is refused."""
    seen = {tag for s in train for tag in s.tags}
    for split, sentences in evals.items():
        unknown = sorted({tag for s in sentences for tag in s.tags} - seen)
        if unknown:
            raise FinetuneError(f"--validation: tag(s) {unknown[:5]} do not occur in {train_path}; the model "
                                "cannot learn them")
    return sorted(seen, key=lambda tag: (tag != "O", tag))


@dataclass
class Tagged:
    """Tokenized sentences: ``labels[i]`` per token (``IGNORED`` where no word starts), ``first[i]`` the token
    index of each word's first sub-token (None for words cut off)."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    labels: list[list[int]]
    first: list[list[int | None]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


def encode_tags(tokenizer, task: TaggingTask, sentences: list[Sentence], max_seq_length: int) -> Tagged:
    if not getattr(tokenizer, "is_fast", False):
        raise FinetuneError("token tagging needs a fast tokenizer (tokenizer.json) to map words to tokens")
    index = {tag: i for i, tag in enumerate(task.label_names)}
    out = tokenizer([s.words for s in sentences], is_split_into_words=True, truncation=True,
                    max_length=max_seq_length, return_token_type_ids=True)
    data = Tagged([], [], [], [])
    for i, sentence in enumerate(sentences):
        word_of = out.word_ids(i)
        labels, first, previous = [IGNORED] * len(word_of), [None] * len(sentence.words), None
        for t, word in enumerate(word_of):
            if word is not None and word != previous:
                labels[t], first[word] = index[sentence.tags[word]], t
            previous = word
        data.input_ids.append(out["input_ids"][i])
        data.token_type_ids.append(out["token_type_ids"][i])
        data.labels.append(labels)
        data.first.append(first)
    return data


# The prefixes read, as IOBES letters: BILOU's L- (last) and U- (unit) are IOBES's E- (end) and S- (single).
_PREFIXES = {"B": "B", "I": "I", "E": "E", "S": "S", "L": "E", "U": "S"}
TAG_SCHEMES = "O, or B-, I-, E- or S- and a type, e.g. B-PER (IOB1, IOB2, IOBES/BIOES; BILOU's L-/U- as E-/S-)"


def split_tag(tag: str) -> tuple[str, str]:
    """A tag's (IOBES prefix, type), ("O", "") for ``O``; a ValueError saying what is wrong with any other."""
    if tag == "O":
        return "O", ""
    prefix, dash, kind = tag.partition("-")
    if not dash:
        raise ValueError(f"tag {tag!r} has no prefix, so no entity type can be read from it; write it "
                         f"B-{tag}/I-{tag} (IOB2) or S-{tag} for a one-word entity, or O for none")
    if prefix not in _PREFIXES:
        raise ValueError(f"tag {tag!r} has the prefix {prefix + '-'!r}, which no tag scheme read here uses")
    if not kind:
        raise ValueError(f"tag {tag!r} has no type after its prefix")
    return _PREFIXES[prefix], kind


def _checked_tag(path: Path, number: int, tag: str) -> str:
    try:
        split_tag(tag)
    except ValueError as problem:
        raise FinetuneError(f"{path}:{number}: {problem}; tags are {TAG_SCHEMES}") from None
    return tag


# conlleval's endOfChunk and startOfChunk with S- (seqeval's default mode), for prefixes already read as IOBES
# letters; ``previous`` is the tag before (O before the first word), ``kind`` a type ("" for O).
def _chunk_ends(previous: str, prefix: str, previous_kind: str, kind: str) -> bool:
    """Whether a chunk ended on the word before this one."""
    if previous in ("E", "S"):
        return True
    if previous in ("B", "I") and prefix in ("B", "S", "O"):
        return True
    return previous != "O" and previous_kind != kind


def _chunk_starts(previous: str, prefix: str, previous_kind: str, kind: str) -> bool:
    """Whether a chunk starts on this word."""
    if prefix in ("B", "S"):
        return True
    if prefix in ("I", "E") and previous in ("O", "E", "S"):
        return True
    return prefix != "O" and previous_kind != kind


def chunks(tags: list[str]) -> set[tuple[str, int, int]]:
    """The (type, first word, last word) of every entity in ``tags`` (IOB1, IOB2, IOBES or BILOU, see the module);
    a tag of no scheme is a ValueError (the reader refuses it first)."""
    found, previous, previous_kind, start = set(), "O", "", 0
    for i, tag in enumerate([*tags, "O"]):  # the trailing O ends a chunk still open at the sentence's end
        prefix, kind = split_tag(tag)
        if _chunk_ends(previous, prefix, previous_kind, kind):
            found.add((previous_kind, start, i - 1))
        if _chunk_starts(previous, prefix, previous_kind, kind):
            start = i
        previous, previous_kind = prefix, kind
    return found


def entity_scores(gold: list[list[str]], predicted: list[list[str]]) -> dict:
    right = expected = given = tokens = correct_tokens = 0
    for g, p in zip(gold, predicted):
        gold_chunks, predicted_chunks = chunks(g), chunks(p)
        right += len(gold_chunks & predicted_chunks)
        expected, given = expected + len(gold_chunks), given + len(predicted_chunks)
        tokens, correct_tokens = tokens + len(g), correct_tokens + sum(a == b for a, b in zip(g, p))
    precision = right / given if given else 0.0
    recall = right / expected if expected else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"f1": f1, "precision": precision, "recall": recall, "accuracy": correct_tokens / tokens if tokens else 0.0}


class TagObjective:
    """The loop's objective for token tagging: the mean cross-entropy over the batch's labelled tokens."""

    def __init__(self, task: TaggingTask, sentences: dict[str, list[Sentence]]):
        self.task, self.sentences = task, sentences
        self._loss = torch.nn.CrossEntropyLoss(ignore_index=IGNORED)

    def collate(self, data: Tagged, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        return collate(data, indices, pad_id, regression=False, per_token=True)

    def loss_sum(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per labelled token, scaled to the batch's examples (the loop divides by the global batch)."""
        return self._loss(logits.flatten(0, 1), batch["labels"].flatten()) * len(batch["labels"])

    @torch.no_grad()
    def predict(self, model, data: Tagged, sentences: list[Sentence], recipe, device) -> list[list[str]]:
        was_training = model.training
        model.eval()
        predicted = [["O"] * len(s.words) for s in sentences]
        for indices in eval_batches(data, recipe.eval_batch_size):
            batch = {k: v.to(device) for k, v in self.collate(data, indices, model.config.pad_token_id).items()}
            with autocast(recipe, device):
                best = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).argmax(-1)
            for row, i in enumerate(indices):
                for word, t in enumerate(data.first[i]):
                    if t is not None:
                        predicted[i][word] = self.task.label_names[int(best[row, t])]
        model.train(was_training)
        return predicted

    def evaluate(self, model, evals: dict[str, Tagged], recipe, device: torch.device) -> dict:
        return {split: entity_scores([s.tags for s in self.sentences[split]],
                                     self.predict(model, data, self.sentences[split], recipe, device))
                for split, data in evals.items()}
