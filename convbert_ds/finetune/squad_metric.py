"""SQuAD's official metric (v1.1 and v2.0), as the official scripts ``evaluate-v1.1.py`` and
``evaluate-v2.0.py`` compute it.

Both normalise an answer before comparing: lower case, punctuation (``string.punctuation``) removed, the
articles "a", "an" and "the" removed as words, whitespace collapsed. Exact match (EM) is 1 when the
normalised prediction equals the normalised gold; F1 is the harmonic mean of precision and recall of the
prediction's tokens (whitespace-split, normalised) against the gold's, counted as multisets. Each question
takes the best over its golds; the scores are means over questions, x 100. The versions differ in the golds
and in F1 without tokens:

- v1.1: every gold answer counts as given, one that normalises to "" too; F1 is 0 whenever no token is
  shared, so an empty prediction's F1 is 0 even against an empty gold (its EM is 1).
- v2.0: the golds are the answers that normalise to something, else ``[""]``; when the prediction or the
  gold has no tokens, F1 is 1 if both have none, else 0. A question is answerable (``HasAns_``) when its
  answers list is not empty and unanswerable (``NoAns_``) when it is, whatever the answers normalise to.

v2.0's null odds are, per question, how much more the model prefers "no answer" than its best span (a logit
difference: any real number). Under a threshold, a question whose odds are above it counts as "no answer":
right (1) when unanswerable, wrong (0) when answerable, as the official script's ``--na-prob-file ODDS
--na-prob-thresh THRESHOLD`` scores it. ``best_exact``/``best_f1`` are the best such scores over thresholds
and ``best_exact_thresh``/``best_f1_thresh`` a threshold reaching them: predictions with that threshold
applied (``odds > threshold`` -> "") score exactly that. The search is the official one (questions by
increasing odds), with three changes so that the returned threshold does reach the returned score:
"answer nothing" returns a threshold below every question's odds (the official 0.0 is that only for
probabilities), questions with equal odds are answered together, and a prediction that normalises to
nothing (e.g. "the") on an unanswerable question counts as right, as the official scoring counts it (its
search counts it wrong). Without these the numbers equal the official script's.
"""

from __future__ import annotations

import collections
import math
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str, version_2: bool = True) -> float:
    """Token F1; ``version_2``: v2.0's rule when either side has no tokens (v1.1 has none: 0)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if version_2 and (not predicted or not expected):  # "no answer" on a side: right only if on both
        return float(predicted == expected)
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def gold_texts(answers: list[str]) -> list[str]:
    """v2.0's golds for a question: its answers that normalise to something, else ``[""]``."""
    return [a for a in answers if normalize_answer(a)] or [""]


def _raw_scores(golds: dict[str, list[str]], predictions: dict[str, str], version_2: bool) -> tuple[dict, dict]:
    """Each question's EM and F1 against its golds, before any null threshold."""
    missing = sorted(set(golds) - set(predictions))
    if missing:
        raise ValueError(f"no prediction for {len(missing)} question(s), e.g. {missing[0]!r}")
    if not version_2:
        unanswerable = sorted(q for q, answers in golds.items() if not answers)
        if unanswerable:  # the v1.1 script has nothing to score these against
            raise ValueError(f"question {unanswerable[0]!r} has no gold answer; v1.1 needs one (use squad_v2)")
    texts = {q: gold_texts(answers) if version_2 else answers for q, answers in golds.items()}
    exact = {q: max(exact_match(predictions[q], g) for g in texts[q]) for q in golds}
    overlap = {q: max(f1(predictions[q], g, version_2) for g in texts[q]) for q in golds}
    return exact, overlap


def _mean(scores: dict, questions) -> float:
    questions = list(questions)
    return 100.0 * sum(scores[q] for q in questions) / len(questions) if questions else 0.0


def squad_v1(golds: dict[str, list[str]], predictions: dict[str, str]) -> dict:
    """``{"exact_match", "f1"}`` over ``golds`` (question id -> gold answer texts, at least one each)."""
    exact, overlap = _raw_scores(golds, predictions, version_2=False)
    return {"exact_match": _mean(exact, golds), "f1": _mean(overlap, golds)}


def answers_nothing(null_odds: float, threshold: float) -> bool:
    """v2.0: whether a question with these null odds is answered "" under ``threshold`` (the official
    script's ``na_prob > na_prob_thresh``); the one comparison the metric and the written predictions share."""
    return null_odds > threshold


def _thresholded(scores: dict, null_odds: dict, has_answer: dict, threshold: float) -> dict:
    """``scores`` with every question above ``threshold`` counted as "no answer" (official scoring)."""
    return {q: float(not has_answer[q]) if answers_nothing(null_odds[q], threshold) else s
            for q, s in scores.items()}


def best_threshold(scores: dict, null_odds: dict, has_answer: dict) -> tuple[float, float]:
    """The best mean (x 100) of ``scores`` (per question, before any threshold) with a null threshold
    applied, and that threshold; see the module docstring for how it differs from the official search."""
    order = sorted(scores, key=lambda q: null_odds[q])
    finite = [null_odds[q] for q in order if math.isfinite(null_odds[q])]
    threshold = math.floor(finite[0]) - 1.0 if finite else -1.0  # below every odds: every question ""
    gain = best = 0.0  # over answering nothing
    for i, q in enumerate(order):
        gain += scores[q] - float(not has_answer[q])  # answered rather than "no answer"
        odds = null_odds[q]
        tie_ends = i + 1 == len(order) or null_odds[order[i + 1]] != odds  # no threshold splits a tie
        if tie_ends and math.isfinite(odds) and gain > best:  # infinite odds (no span): no JSON threshold
            best, threshold = gain, odds
    # Scored as squad_v2 scores it under this threshold, so the two agree to the last bit.
    return _mean(_thresholded(scores, null_odds, has_answer, threshold), scores), threshold


def _split_report(exact: dict, overlap: dict, has_answer: dict) -> dict:
    answerable = [q for q in exact if has_answer[q]]
    unanswerable = [q for q in exact if not has_answer[q]]
    report = {"exact": _mean(exact, exact), "f1": _mean(overlap, exact), "total": len(exact)}
    if answerable:
        report.update(HasAns_exact=_mean(exact, answerable), HasAns_f1=_mean(overlap, answerable),
                      HasAns_total=len(answerable))
    if unanswerable:
        report.update(NoAns_exact=_mean(exact, unanswerable), NoAns_f1=_mean(overlap, unanswerable),
                      NoAns_total=len(unanswerable))
    return report


def squad_v2(golds: dict[str, list[str]], predictions: dict[str, str], null_odds: dict[str, float] | None = None,
             threshold: float | None = None) -> dict:
    """The official v2.0 report over ``golds`` (question id -> answer texts; an empty list: unanswerable).
    With ``null_odds``, also ``best_exact``/``best_f1`` and their thresholds; with ``threshold`` too, every
    score counts a question whose odds are above it as "no answer" (``--na-prob-thresh``)."""
    if threshold is not None and null_odds is None:
        raise ValueError("squad_v2: a threshold needs the null_odds it is applied to; pass null_odds")
    missing = sorted(set(golds) - set(null_odds)) if null_odds is not None else []
    if missing:
        raise ValueError(f"no null odds for {len(missing)} question(s), e.g. {missing[0]!r}")
    exact, overlap = _raw_scores(golds, predictions, version_2=True)
    has_answer = {q: bool(answers) for q, answers in golds.items()}  # the official script's qid_to_has_ans
    if threshold is None:
        report = _split_report(exact, overlap, has_answer)
    else:
        report = _split_report(_thresholded(exact, null_odds, has_answer, threshold),
                               _thresholded(overlap, null_odds, has_answer, threshold), has_answer)
    if null_odds is not None:
        report["best_exact"], report["best_exact_thresh"] = best_threshold(exact, null_odds, has_answer)
        report["best_f1"], report["best_f1_thresh"] = best_threshold(overlap, null_odds, has_answer)
    return report
