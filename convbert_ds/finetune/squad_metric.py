"""SQuAD's official metric (v1.1 and v2.0), as the official evaluation scripts define it.

An answer is normalised before comparing: lower case, punctuation (``string.punctuation``) removed, the
articles "a", "an" and "the" removed as words, whitespace collapsed. Exact match (EM) is 1 when the
normalised prediction equals a normalised gold answer; F1 is the harmonic mean of precision and recall of the
prediction's tokens (whitespace-split, normalised) against a gold answer's, counted as multisets. Each
question takes the best over its gold answers; the scores are means over questions, x 100.

v2.0: an unanswerable question's gold answers are ``[""]`` (as are golds that normalise to nothing); its EM
and F1 are 1 only for the empty prediction. The scores are also given over the answerable questions
(``HasAns_``) and the unanswerable ones (``NoAns_``), and, with each question's null odds (how much more the
model prefers "no answer" than its best span), the best threshold on those odds for EM and F1 as the
official script chooses it (``best_exact``/``best_f1`` and their ``_thresh``).
"""

from __future__ import annotations

import collections
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not predicted or not expected:  # "no answer" on either side: right only if both are empty
        return float(predicted == expected)
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def gold_texts(answers: list[str]) -> list[str]:
    """The golds a question is scored against: its answers that normalise to something, else ``[""]``."""
    return [a for a in answers if normalize_answer(a)] or [""]


def _per_question(golds: dict[str, list[str]], predictions: dict[str, str]) -> tuple[dict, dict]:
    missing = sorted(set(golds) - set(predictions))
    if missing:
        raise ValueError(f"no prediction for {len(missing)} question(s), e.g. {missing[0]!r}")
    exact = {q: max(exact_match(predictions[q], g) for g in gold_texts(a)) for q, a in golds.items()}
    overlap = {q: max(f1(predictions[q], g) for g in gold_texts(a)) for q, a in golds.items()}
    return exact, overlap


def _mean(scores: dict, questions) -> float:
    questions = list(questions)
    return 100.0 * sum(scores[q] for q in questions) / len(questions) if questions else 0.0


def squad_v1(golds: dict[str, list[str]], predictions: dict[str, str]) -> dict:
    """``{"exact_match", "f1"}`` over ``golds`` (question id -> gold answer texts)."""
    exact, overlap = _per_question(golds, predictions)
    return {"exact_match": _mean(exact, golds), "f1": _mean(overlap, golds)}


def best_threshold(scores: dict, null_odds: dict, has_answer: dict, predictions: dict) -> tuple[float, float]:
    """The official script's search: predict "no answer" for every question whose null odds are above a
    threshold; returns the best mean score (x 100) over thresholds at the questions' own odds, and that
    threshold (0.0 when answering nothing is best)."""
    current = best = sum(1 for q in scores if not has_answer[q])  # every question "no answer"
    threshold = 0.0
    for q in sorted(scores, key=lambda q: null_odds[q]):
        current += scores[q] if has_answer[q] else (-1 if predictions[q] else 0)
        if current > best:
            best, threshold = current, null_odds[q]
    return 100.0 * best / len(scores), threshold


def squad_v2(golds: dict[str, list[str]], predictions: dict[str, str], null_odds: dict[str, float] | None = None
             ) -> dict:
    """The official v2.0 report over ``golds`` (an empty list: unanswerable)."""
    exact, overlap = _per_question(golds, predictions)
    has_answer = {q: bool(gold_texts(a)[0]) for q, a in golds.items()}
    answerable = [q for q in golds if has_answer[q]]
    unanswerable = [q for q in golds if not has_answer[q]]
    report = {"exact": _mean(exact, golds), "f1": _mean(overlap, golds), "total": len(golds)}
    if answerable:
        report.update(HasAns_exact=_mean(exact, answerable), HasAns_f1=_mean(overlap, answerable),
                      HasAns_total=len(answerable))
    if unanswerable:
        report.update(NoAns_exact=_mean(exact, unanswerable), NoAns_f1=_mean(overlap, unanswerable),
                      NoAns_total=len(unanswerable))
    if null_odds is not None:
        report["best_exact"], report["best_exact_thresh"] = best_threshold(exact, null_odds, has_answer, predictions)
        report["best_f1"], report["best_f1_thresh"] = best_threshold(overlap, null_odds, has_answer, predictions)
    return report
