"""SQuAD v1.1 / v2.0 question answering: the official JSON files in, windows of tokens, spans back out.

The files are read as the official ones are laid out (``{"data": [{"title", "paragraphs": [{"context",
"qas": [{"id", "question", "answers": [{"text", "answer_start"}], "is_impossible"}]}]}]}``); any file in
that shape works. A context longer than one window is split into overlapping windows of
``max_seq_length`` tokens (``[CLS] question [SEP] context piece [SEP]``), consecutive ones sharing
``doc_stride`` context tokens (transformers' ``stride``). A training window whose piece holds the whole first
answer is labelled with its first and last token, found through the tokenizer's character offsets; any
other window (and every window of an unanswerable question) points at ``[CLS]``.

Decoding takes, per question and over its windows, the ``n_best`` highest start and end scores, keeps spans
inside the context, in order and at most ``max_answer_length`` tokens long, and answers with the context's
characters under the best one. Its null score is the smallest ``[CLS]`` start + end score over the windows;
``null_odds`` = null score - best span score (infinite when no span qualifies). v2.0 answers "" when the odds
are above a threshold: the dev set's best-F1 one (``squad_metric.best_threshold``), which later splits
reuse; on dev, the written predictions score the reported ``best_f1``. ``write_predictions`` writes
``predictions.json`` (threshold applied) and ``null_odds.json``, and the report gives the threshold as
``null_threshold``: the official v2.0 script run with ``--na-prob-file null_odds.json --na-prob-thresh
THRESHOLD`` prints the reported ``exact``/``f1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from convbert_ds.finetune.errors import FinetuneError, utf8_text
from convbert_ds.finetune.squad_metric import answers_nothing, squad_v1, squad_v2
from convbert_ds.fsutil import write_dir_atomically

SQUAD_TASKS = ("squad", "squad_v2")


@dataclass
class Question:
    id: str
    question: str
    context: str
    answers: list[tuple[str, int]]  # (text, character offset in context); empty: unanswerable


@dataclass
class QATask:
    name: str  # "squad" or "squad_v2"
    train: list[Question]
    evals: dict[str, list[Question]]
    source: dict
    doc_stride: int = 128  # context tokens consecutive windows share
    n_best: int = 20  # start and end candidates per window
    max_answer_length: int = 30  # tokens
    task_type: str = "question_answering"
    label_names: list[str] = field(default_factory=list)

    @property
    def metric(self) -> str:
        return "f1"

    @property
    def version_2(self) -> bool:
        return self.name == "squad_v2"


def read_squad(path, version_2: bool) -> list[Question]:
    """Every question of an official-format file, checked: each answer's text must be in its context at its
    offset; v1.1 questions need an answer; v2.0 ones are answerable or ``is_impossible``."""
    path = Path(path)
    if not path.is_file():
        raise FinetuneError(f"{path}: no such file; pass the SQuAD JSON (train-v1.1.json, dev-v2.0.json, ...)")
    try:
        articles = json.loads(utf8_text(path))["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise FinetuneError(f"{path}: not a SQuAD JSON file ({type(error).__name__}: {error}); it needs "
                            f"{SQUAD_SHAPE}") from None
    questions, seen = [], set()
    for a, article in enumerate(_objects(articles, f"{path}: data")):
        for p, paragraph in enumerate(_objects(article.get("paragraphs", []), f"{path}: data[{a}].paragraphs")):
            where = f"{path}: data[{a}].paragraphs[{p}]"
            context = paragraph.get("context")
            if not isinstance(context, str) or not context.strip():
                raise FinetuneError(f"{where}: no context text; a paragraph's 'context' is the text its questions "
                                    f"are asked about")
            for question in _objects(paragraph.get("qas", []), f"{where}.qas"):
                questions.append(_question(question, context, where, version_2))
                if questions[-1].id in seen:
                    raise FinetuneError(f"{where}: question id {questions[-1].id!r} appears twice; ids must be unique")
                seen.add(questions[-1].id)
    if not questions:
        raise FinetuneError(f"{path}: holds no questions")
    return questions


SQUAD_SHAPE = ('{"data": [{"paragraphs": [{"context": "...", "qas": [{"id", "question", "answers": [{"text", '
               '"answer_start"}]}]}]}]}')


def _objects(value, where: str) -> list[dict]:
    """``value`` when it is a list of JSON objects, as SQuAD nests them; else the one line saying where the
    file's structure is not SQuAD's (a file of JSON lines, a dict where a list belongs, ...)."""
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        got = type(value).__name__ if not isinstance(value, list) else \
            f"a list holding {type(next(i for i in value if not isinstance(i, dict))).__name__}"
        raise FinetuneError(f"{where}: expected a list of objects, got {got}; a SQuAD file is {SQUAD_SHAPE}")
    return value


def _question(record: dict, context: str, where: str, version_2: bool) -> Question:
    qid = record.get("id")
    where = f"{where}, question {qid!r}"
    if not isinstance(qid, str) or not isinstance(record.get("question"), str):
        raise FinetuneError(f"{where}: a question needs a string 'id' and 'question'")
    impossible = record.get("is_impossible", False)
    if not isinstance(impossible, bool):  # "false" is a true value to Python
        raise FinetuneError(f"{where}: is_impossible is {impossible!r}; it is true or false (JSON booleans)")
    if impossible and not version_2:
        raise FinetuneError(f"{where}: is_impossible is a SQuAD v2.0 field; use --task squad_v2")
    answers = [] if impossible else _objects(record.get("answers") or [], f"{where}: answers")
    if not impossible and not answers:
        raise FinetuneError(f"{where}: no answer; give 'answers': [{{'text', 'answer_start'}}]"
                            + (" or 'is_impossible': true" if version_2 else ""))
    spans = []
    for answer in answers:
        text, start = answer.get("text"), answer.get("answer_start")
        if isinstance(text, str) and not text.strip():
            raise FinetuneError(f"{where}: answer {text!r} is empty; an answer is a span of the context's words"
                                + (", or mark the question 'is_impossible': true" if version_2 else ""))
        # bool is an int to Python, and a negative offset slices from the end: neither is a place in the context
        offset = isinstance(start, int) and not isinstance(start, bool) and start >= 0
        if not isinstance(text, str) or not offset or context[start:start + len(text)] != text:
            found = context[start:start + len(text)] if offset and isinstance(text, str) else None
            raise FinetuneError(f"{where}: answer {text!r} is not at answer_start={start!r} in the context "
                                f"(there: {found!r}); fix the offset")
        spans.append((text, start))
    return Question(qid, record["question"], context, spans)


@dataclass
class Windows:
    """The tokenized windows of some questions; ``offsets[i][t]`` is the context characters under token t of
    window i, None for question, special and padding tokens."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    offsets: list[list[tuple[int, int] | None]]
    question: list[int]  # window -> index of its question
    labels: list[tuple[int, int]]  # (start token, end token); (0, 0): [CLS], no answer in the window

    def __len__(self) -> int:
        return len(self.input_ids)


MAX_QUERY_TOKENS = 64  # BERT's and ELECTRA's max_query_length


def windows(tokenizer, questions: list[Question], max_seq_length: int, doc_stride: int) -> Windows:
    """The windows of ``questions``; a question longer than ``MAX_QUERY_TOKENS`` (or than a third of the
    window) is cut to that many tokens, as BERT's recipe does."""
    if not getattr(tokenizer, "is_fast", False):
        raise FinetuneError("question answering needs a fast tokenizer (tokenizer.json) for character offsets")
    query_tokens = min(MAX_QUERY_TOKENS, (max_seq_length - 3) // 3)
    room = max_seq_length - 3 - query_tokens
    if doc_stride >= room:
        raise FinetuneError(f"--doc-stride={doc_stride}: windows of --max-seq-length={max_seq_length} hold at least "
                            f"{room} context tokens, and consecutive ones must share fewer; use a smaller "
                            f"--doc-stride or a longer --max-seq-length")
    asked = [q.question.lstrip() for q in questions]
    cut = tokenizer(asked, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    asked = [text[:offsets[query_tokens - 1][1]] if len(offsets) > query_tokens else text
             for text, offsets in zip(asked, cut)]
    out = tokenizer(asked, [q.context for q in questions],
                    truncation="only_second", max_length=max_seq_length, stride=doc_stride,
                    return_overflowing_tokens=True, return_offsets_mapping=True, return_token_type_ids=True)
    result = Windows([], [], [], [], [])
    for i, ids in enumerate(out["input_ids"]):
        q = out["overflow_to_sample_mapping"][i]
        sequence = out.sequence_ids(i)
        offsets = [tuple(o) if s == 1 else None for o, s in zip(out["offset_mapping"][i], sequence)]
        result.input_ids.append(ids)
        result.token_type_ids.append(out["token_type_ids"][i])
        result.offsets.append(offsets)
        result.question.append(q)
        result.labels.append(_label(offsets, questions[q].answers))
    return result


def _label(offsets: list, answers: list[tuple[str, int]]) -> tuple[int, int]:
    if not answers:
        return 0, 0
    text, start = answers[0]
    end = start + len(text)
    inside = [t for t, o in enumerate(offsets) if o is not None]
    if not inside or offsets[inside[0]][0] > start or offsets[inside[-1]][1] < end:
        return 0, 0  # the answer is not (wholly) in this window's piece of the context
    first = next(t for t in inside if offsets[t][1] > start)
    last = next(t for t in reversed(inside) if offsets[t][0] < end)
    return first, last


@dataclass
class Decoded:
    predictions: dict[str, str]
    null_odds: dict[str, float]


def decode(questions: list[Question], data: Windows, start_logits: list, end_logits: list, n_best: int = 20,
           max_answer_length: int = 30) -> Decoded:
    """Every question's best span (see the module docstring); the caller applies the null threshold."""
    best: dict[int, tuple[float, str]] = {}
    null: dict[int, float] = {}
    for w in range(len(data)):
        q, offsets, starts, ends = data.question[w], data.offsets[w], start_logits[w], end_logits[w]
        null[q] = min(null.get(q, float("inf")), starts[0] + ends[0])
        top_starts = sorted(range(len(starts)), key=lambda t: -starts[t])[:n_best]
        top_ends = sorted(range(len(ends)), key=lambda t: -ends[t])[:n_best]
        for s in top_starts:
            for e in top_ends:
                if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                    continue
                score = starts[s] + ends[e]
                if q not in best or score > best[q][0]:
                    # .strip(): a sentencepiece token's offsets include the space it stands for
                    best[q] = (score, questions[q].context[offsets[s][0]:offsets[e][1]].strip())
    predictions = {question.id: best[i][1] if i in best else "" for i, question in enumerate(questions)}
    odds = {question.id: null[i] - best[i][0] if i in best else float("inf") for i, question in enumerate(questions)}
    return Decoded(predictions, odds)


def apply_threshold(decoded: Decoded, threshold: float) -> dict[str, str]:
    """v2.0: "" for every question whose null odds are above ``threshold`` (the metric's own comparison)."""
    return {q: "" if answers_nothing(decoded.null_odds[q], threshold) else text
            for q, text in decoded.predictions.items()}


def score(task: QATask, questions: list[Question], decoded: Decoded, threshold: float | None = None
          ) -> tuple[dict, dict[str, str], float | None]:
    """The split's metrics, its final predictions and (v2.0) the null threshold used: ``threshold``, or the
    best-F1 one on these questions when None (the dev set's own, as the official recipe chooses it). v2.0's
    ``exact``/``f1`` are the final predictions' under that threshold; ``best_*`` are searched over the spans
    before it, so on dev ``f1`` is ``best_f1`` and on a later split ``best_f1`` is the most any threshold gives."""
    golds = {q.id: [text for text, _ in q.answers] for q in questions}
    if not task.version_2:
        return squad_v1(golds, decoded.predictions), decoded.predictions, None
    if threshold is None:
        threshold = squad_v2(golds, decoded.predictions, decoded.null_odds)["best_f1_thresh"]
    # Scoring the spans under the threshold scores the final predictions: above it, both count as "no answer".
    report = squad_v2(golds, decoded.predictions, decoded.null_odds, threshold)
    return {**report, "null_threshold": threshold}, apply_threshold(decoded, threshold), threshold


def write_predictions(directory: Path, predictions: dict[str, str], null_odds: dict[str, float] | None) -> None:
    """``predictions.json`` (and v2.0's ``null_odds.json``, question id -> null odds, the official v2.0
    script's ``--na-prob-file``) as the official evaluation scripts read them; infinite odds (no span) are
    written as 1e9, which is above any threshold the dev set can choose. The directory is replaced whole: the
    two files are always of the same evaluation."""
    def fill(tmp: Path) -> None:
        (tmp / "predictions.json").write_text(json.dumps(predictions, indent=2) + "\n")
        if null_odds is not None:
            (tmp / "null_odds.json").write_text(json.dumps({q: min(v, 1e9) for q, v in null_odds.items()},
                                                           indent=2) + "\n")

    write_dir_atomically(directory, fill)

