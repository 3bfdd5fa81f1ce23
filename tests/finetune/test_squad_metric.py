"""SQuAD's official metric (``squad_metric``) on hand-computed cases: v1.1 and v2.0 as their official scripts
score them, and v2.0's null threshold, which the written predictions must reach."""

import pytest

from convbert_ds.finetune.squad import Decoded, QATask, Question, apply_threshold, score
from convbert_ds.finetune.squad_metric import f1, normalize_answer, squad_v1, squad_v2


def test_answers_are_normalised_as_the_official_script_does():
    assert normalize_answer("  The Quick,  brown fox!! ") == "quick brown fox"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("Theory") == "theory"  # "the" only as a word
    assert normalize_answer("U.S.-based") == "usbased"


def test_exact_match_and_f1_by_hand_with_several_gold_answers():
    golds = {"q1": ["the Eiffel Tower", "Eiffel Tower in Paris"], "q2": ["1889"], "q3": ["Gustave Eiffel"]}
    predictions = {"q1": "Eiffel tower.", "q2": "in 1889", "q3": "Alexandre Gustave Eiffel's firm"}
    # q1: EM with the first gold. q2: tokens {in, 1889} vs {1889}: P 1/2, R 1: F1 2/3.
    # q3: {alexandre, gustave, eiffels, firm} vs {gustave, eiffel}: one common token: P 1/4, R 1/2: F1 1/3.
    assert f1("in 1889", "1889") == pytest.approx(2 / 3)
    report = squad_v1(golds, predictions)
    assert report["exact_match"] == pytest.approx(100 / 3)
    assert report["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 / 3) / 3)


def test_v1_keeps_every_gold_and_has_no_empty_answer_rule():
    # v1.1 keeps golds that normalise to "": q1's "the" and q2's "!" are both "" once normalised.
    golds = {"q1": ["the"], "q2": ["Paris", "!"]}
    predictions = {"q1": "", "q2": ""}
    # EM: "" == "" for q1 (with "the") and q2 (with "!"): 2 of 2 = 100. F1: no common token anywhere: 0.
    # (v2.0's rules would give q1 EM 1 / F1 1 and q2, whose only gold is then "Paris", 0 / 0: 50 and 50.)
    assert squad_v1(golds, predictions) == {"exact_match": 100.0, "f1": 0.0}
    assert f1("", "the", version_2=False) == 0.0 and f1("", "the") == 1.0
    with pytest.raises(ValueError, match=r"^question 'q3' has no gold answer; v1.1 needs one \(use squad_v2\)$"):
        squad_v1({"q3": []}, {"q3": ""})


def test_v2_answerable_is_a_non_empty_answers_list_as_the_official_script_decides():
    # d's only answer normalises to "": its gold is "" (the empty prediction scores 1), yet it is answerable.
    golds = {"a": ["Paris"], "d": ["the"], "c": []}
    predictions = {"a": "Paris", "d": "", "c": ""}
    report = squad_v2(golds, predictions)
    assert (report["exact"], report["f1"]) == (100.0, 100.0)  # a, d, c: 1 each
    assert (report["HasAns_total"], report["NoAns_total"]) == (2, 1)  # a, d | c
    # Under --na-prob-thresh 0, d (odds 2 > 0) counts as "no answer" on an answerable question: 0. a (odds -1)
    # keeps 1, c (odds 3) "no answer" on an unanswerable one: 1. EM 2 of 3; HasAns 1 of 2; NoAns 1 of 1.
    applied = squad_v2(golds, predictions, {"a": -1.0, "d": 2.0, "c": 3.0}, threshold=0.0)
    assert applied["exact"] == pytest.approx(200 / 3) and applied["HasAns_exact"] == 50.0
    assert applied["NoAns_exact"] == 100.0


def test_v2_scores_split_answerable_from_unanswerable_and_find_the_null_threshold():
    golds = {"a": ["Paris"], "b": ["1889"], "c": [], "d": ["", "!"]}  # c unanswerable; d answerable, gold ""
    predictions = {"a": "Paris", "b": "", "c": "", "d": "Lyon"}
    report = squad_v2(golds, predictions, null_odds={"a": -3.0, "b": 2.0, "c": 5.0, "d": 1.0})
    # Right: a, c. HasAns a, b, d: 1 of 3; NoAns c: 1 of 1.
    assert report["exact"] == 50.0 and report["HasAns_exact"] == pytest.approx(100 / 3)
    assert report["NoAns_exact"] == 100.0
    assert (report["HasAns_total"], report["NoAns_total"]) == (3, 1)
    # Answer nothing: c right = 1. By increasing odds: a answered (+1) = 2, d ("Lyon" wrong, as "no answer"
    # was: +0) = 2, b ("": +0) = 2, c ("" right, as "no answer" was: +0) = 2. The best, 2 of 4, answers only
    # questions with odds <= -3.
    assert (report["best_exact"], report["best_exact_thresh"]) == (50.0, -3.0)


def _reaches(golds: dict, predictions: dict, null_odds: dict, best: float, threshold: float) -> None:
    """The written predictions (``threshold`` applied by squad.py) score ``best``, as a file and as the official
    script does with ``--na-prob-file`` and ``--na-prob-thresh``."""
    written = apply_threshold(Decoded(predictions, null_odds), threshold)
    assert squad_v2(golds, written)["f1"] == pytest.approx(best)
    assert squad_v2(golds, written, null_odds, threshold)["f1"] == best


def test_v2_when_answering_nothing_is_best_with_negative_odds_the_threshold_answers_nothing():
    golds = {"u1": [], "u2": [], "a": ["Paris"]}
    predictions = {"u1": "Lyon", "u2": "Rome", "a": "Berlin"}
    null_odds = {"u1": -2.0, "u2": -1.0, "a": -0.5}  # logit differences: all below 0
    report = squad_v2(golds, predictions, null_odds)
    # Answer nothing: u1, u2 right = 2 of 3. Answering u1 (-1) = 1, then u2 (-1) = 0, then a (+0) = 0.
    # The threshold must be below -2 (the official 0.0 would answer all three: F1 0).
    assert report["best_f1"] == pytest.approx(200 / 3) and report["best_f1_thresh"] < -2.0
    _reaches(golds, predictions, null_odds, report["best_f1"], report["best_f1_thresh"])
    # Through the fine-tuning loop's scoring: the dev threshold, the written predictions, the reported numbers.
    questions = [Question(q, "Q?", "Paris.", [(a, 0) for a in answers]) for q, answers in golds.items()]
    task = QATask("squad_v2", [], {"validation": questions}, {})
    metrics, written, threshold = score(task, questions, Decoded(predictions, null_odds))
    assert written == {"u1": "", "u2": "", "a": ""} and threshold == report["best_f1_thresh"]
    assert metrics["f1"] == metrics["best_f1"] == pytest.approx(200 / 3)
    assert squad_v2(golds, written)["f1"] == metrics["f1"]


@pytest.mark.parametrize("golds, predictions, null_odds, best", [
    # Equal odds answer together: a (+1) and u ("Lyon" wrong: -1) = no gain over answering nothing (u right:
    # 1 of 2). The official search stops between them and reports 100, which no threshold gives.
    ({"a": ["Paris"], "u": []}, {"a": "Paris", "u": "Lyon"}, {"a": 1.0, "u": 1.0}, 50.0),
    # "the" normalises to "": right on unanswerable u (as the official scoring has it), so answering u costs
    # nothing and a gains 1: 2 of 2 at threshold 1.0. The official search counts "the" wrong and reports 50.
    ({"u": [], "a": ["Paris"]}, {"u": "the", "a": "Paris"}, {"u": 0.5, "a": 1.0}, 100.0),
], ids=["tied-odds", "prediction-normalises-to-nothing"])
def test_v2_best_threshold_reaches_the_best_score(golds, predictions, null_odds, best):
    report = squad_v2(golds, predictions, null_odds)
    assert report["best_f1"] == best
    _reaches(golds, predictions, null_odds, best, report["best_f1_thresh"])


def test_v2_dev_f1_is_best_f1_when_an_answerable_gold_normalises_away():
    # d is answerable (its answers list is not empty) but its gold "the" normalises to "": the span "the" and
    # the empty answer both score 1 against it, yet the official --na-prob-thresh scoring counts "no answer"
    # on an answerable question as 0.
    golds = {"a": ["Paris"], "u": [], "d": ["the"]}
    spans = {"a": "Paris", "u": "Lyon", "d": "the"}
    null_odds = {"a": -1.0, "u": 0.5, "d": 2.0}
    # Answer nothing: u = 1. a (+1) = 2 at -1; u ("Lyon" wrong: -1) = 1; d (+1 - 0) = 2, not better: -1.
    questions = [Question(q, "Q?", "the Paris.", [(a, 0) for a in answers]) for q, answers in golds.items()]
    task = QATask("squad_v2", [], {"validation": questions}, {})
    metrics, written, threshold = score(task, questions, Decoded(spans, null_odds))
    assert threshold == -1.0 and written == {"a": "Paris", "u": "", "d": ""}
    # Under -1: a right, u "no answer" right, d "no answer" on an answerable question: 2 of 3.
    assert metrics["f1"] == metrics["best_f1"] == pytest.approx(200 / 3)
    assert squad_v2(golds, written, null_odds, threshold)["f1"] == metrics["f1"]
