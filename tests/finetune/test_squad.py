"""SQuAD v1.1 / v2.0 question answering (``--task squad``, ``--task squad_v2``): the reader's one-line errors,
windows of long contexts mapped to token spans and back, and a fine-tuning run on questions built from real
prose whose saved model transformers reloads and scores the same. The metric itself: test_squad_metric.py."""

import json

import pytest
import torch

from convbert_ds.errors import UserError
from convbert_ds.finetune.__main__ import main as finetune_main
from convbert_ds.finetune.squad import QATask, decode, read_squad, score, windows
from convbert_ds.finetune.squad_metric import squad_v2
from shard_factory import read_text_documents
from squad_factory import build, write

FAST = ["--epochs", "1", "--batch-size", "8", "--max-seq-length", "64", "--doc-stride", "16", "--save-steps", "1000"]


# --- reading ------------------------------------------------------------------------------------------------

def _one(context: str, **qa) -> dict:
    return {"data": [{"title": "t", "paragraphs": [{"context": context, "qas": [{"id": "q1", "question": "Q?",
                                                                                  **qa}]}]}]}


@pytest.mark.parametrize("squad, version_2, says", [
    (_one("Paris is big.", answers=[{"text": "Paris", "answer_start": 3}]), False,
     r"data\[0\].paragraphs\[0\], question 'q1': answer 'Paris' is not at answer_start=3 in the context "
     r"\(there: 'is is'\); fix the offset"),
    (_one("Paris is big.", answers=[]), False, r"question 'q1': no answer; give 'answers'"),
    (_one("Paris is big.", answers=[], is_impossible=True), False, r"is_impossible is a SQuAD v2.0 field; use "
                                                                   r"--task squad_v2"),
    ({"version": "1.1"}, False, r"not a SQuAD JSON file \(KeyError"),
    ({"data": {"paragraphs": []}}, False, r": data: expected a list of objects, got dict; a SQuAD file is "),
    ({"data": [["Paris"]]}, False, r": data: expected a list of objects, got a list holding list"),
    ({"data": [{"paragraphs": "Paris is big."}]}, False, r"data\[0\].paragraphs: expected a list of objects, "
                                                        r"got str"),
    ({"data": [{"paragraphs": [{"context": "Paris.", "qas": {"id": "q1"}}]}]}, False,
     r"data\[0\].paragraphs\[0\].qas: expected a list of objects, got dict"),
    (_one("Paris is big.", answers={"text": "Paris", "answer_start": 0}), False,
     r"question 'q1': answers: expected a list of objects, got dict"),
    (_one("Paris is big.", answers=["Paris"]), False, r"question 'q1': answers: expected a list of objects, got a "
                                                      r"list holding str"),
    (_one(" \n", answers=[{"text": " ", "answer_start": 0}]), False, r"data\[0\].paragraphs\[0\]: no context text"),
    (_one("Paris is big.", answers=[{"text": " ", "answer_start": 5}]), True,
     r"question 'q1': answer ' ' is empty; an answer is a span of the context's words, or mark the question "
     r"'is_impossible': true"),
    (_one("Paris is big.", answers=[{"text": "a", "answer_start": True}]), False,
     r"answer 'a' is not at answer_start=True in the context \(there: None\)"),
    (_one("Paris is big.", answers=[{"text": ".", "answer_start": -1}]), False,
     r"answer '.' is not at answer_start=-1 in the context \(there: None\)"),
    (_one("Paris is big.", answers=[], is_impossible="false"), True,
     r"question 'q1': is_impossible is 'false'; it is true or false \(JSON booleans\)"),
], ids=["offset", "no-answer", "impossible-in-v1", "no-data", "data-dict", "data-of-lists", "paragraphs-text",
        "qas-dict", "answers-dict", "answers-of-strings", "blank-context", "blank-answer", "bool-offset",
        "negative-offset", "impossible-as-text"])
def test_bad_squad_files_are_one_line_naming_the_file_and_the_record(tmp_path, squad, version_2, says):
    path = write(tmp_path / "dev.json", squad)
    with pytest.raises(UserError, match=says) as caught:
        read_squad(path, version_2)
    assert str(caught.value).startswith(str(path)) and "\n" not in str(caught.value)


def test_a_file_of_json_lines_is_one_line(tmp_path):
    path = tmp_path / "dev.jsonl"
    path.write_text('{"id": "q1", "question": "Q?"}\n{"id": "q2", "question": "R?"}\n')
    with pytest.raises(UserError, match=r"not a SQuAD JSON file \(JSONDecodeError: Extra data") as caught:
        read_squad(path, version_2=False)
    assert "\n" not in str(caught.value)


# --- windows and spans ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_corpus):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_corpus["tokenizer"]), local_files_only=True)


@pytest.fixture(scope="module")
def squad_files(tiny_corpus, tmp_path_factory):
    documents = read_text_documents(tiny_corpus["corpus"])
    root = tmp_path_factory.mktemp("squad")
    files = {}
    for version, v2 in (("v1.1", False), ("v2.0", True)):
        files[version] = (write(root / f"train-{version}.json", build(documents[:600], v2, seed=1, contexts=50)),
                          write(root / f"dev-{version}.json", build(documents[600:], v2, seed=2, contexts=12)))
    return files


def test_long_contexts_become_windows_whose_labels_are_the_answer_and_decode_back(squad_files, tokenizer):
    questions = read_squad(squad_files["v2.0"][1], version_2=True)
    data = windows(tokenizer, questions, max_seq_length=64, doc_stride=16)
    per_question = [data.question.count(q) for q in range(len(questions))]
    assert max(per_question) >= 3 and min(per_question) == 1  # long contexts span several windows
    assert any(not q.answers for q in questions)
    for w in range(len(data)):
        start, end = data.labels[w]
        question = questions[data.question[w]]
        if (start, end) != (0, 0):  # a window holding the whole answer: its tokens' characters are the answer
            text, _ = question.answers[0]
            span = question.context[data.offsets[w][start][0]:data.offsets[w][end][1]]
            assert span.strip() == text, (span, text)
        assert len(data.input_ids[w]) <= 64
    # Scores that put every labelled window's answer first decode to the gold answers, and "no answer" for
    # unanswerable questions once the threshold is chosen on these questions: 100 EM.
    starts = [[0.0] * len(ids) for ids in data.input_ids]
    ends = [[0.0] * len(ids) for ids in data.input_ids]
    for w, (s, e) in enumerate(data.labels):
        if (s, e) != (0, 0):
            starts[w][s], ends[w][e] = 10.0, 10.0
        else:
            starts[w][0], ends[w][0] = 5.0, 5.0
    task = QATask("squad_v2", [], {"validation": questions}, {})
    report, final, threshold = score(task, questions, decode(questions, data, starts, ends))
    assert report["exact"] == report["f1"] == 100.0, report
    assert all(final[q.id] == (q.answers[0][0] if q.answers else "") for q in questions)


def test_a_context_the_tokenizer_reads_as_nothing_is_a_window_without_an_answer(tmp_path, tokenizer):
    """A zero-width space or a byte-order mark is text to the reader and no token to the tokenizer: the window
    has no context token, so its label is [CLS] and decoding answers "", where it was an IndexError."""
    path = write(tmp_path / "train.json", _one("\u200b\ufeff", answers=[{"text": "\u200b", "answer_start": 0}]))
    questions = read_squad(path, version_2=False)
    data = windows(tokenizer, questions, max_seq_length=64, doc_stride=16)
    assert data.labels == [(0, 0)] and not any(data.offsets[0])
    scores = [[1.0] * len(data.input_ids[0])]
    assert decode(questions, data, scores, scores).predictions == {"q1": ""}


# --- fine-tuning ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_squad_v2_fine_tunes_writes_the_official_files_and_transformers_scores_the_same(squad_files, tiny_corpus,
                                                                                        tmp_path, tokenizer):
    from convbert_ds.config import ElectraConfig
    from convbert_ds.convert import export_model
    from convbert_ds.model import ElectraForPretraining

    torch.manual_seed(1234)
    export_model(ElectraForPretraining(ElectraConfig.from_preset("tiny", vocab_size=len(tokenizer))),
                 tmp_path / "hf", tiny_corpus["tokenizer"])
    train, dev = squad_files["v2.0"]
    out = tmp_path / "run"
    assert finetune_main(["--model", str(tmp_path / "hf" / "discriminator"), "--task", "squad_v2", "--train",
                          str(train), "--validation", str(dev), "--out", str(out), *FAST]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["primary"] == {"split": "validation", "metric": "f1"}
    final = results["seeds"][0]["final"]["validation"]
    assert {"exact", "f1", "HasAns_f1", "NoAns_f1", "best_f1", "null_threshold"} <= set(final)
    predictions = json.loads((out / "predictions" / "seed0" / "validation" / "predictions.json").read_text())
    null_odds = json.loads((out / "predictions" / "seed0" / "validation" / "null_odds.json").read_text())
    questions = read_squad(dev, version_2=True)
    assert set(predictions) == set(null_odds) == {q.id for q in questions}
    golds = {q.id: [t for t, _ in q.answers] for q in questions}
    # The files score as reported, as the official script does with --na-prob-file and --na-prob-thresh, and
    # on dev the reported F1 is the best threshold's.
    assert squad_v2(golds, predictions, null_odds, final["null_threshold"])["f1"] == pytest.approx(final["f1"])
    assert final["f1"] == final["best_f1"]

    # transformers' own class on best/, one window at a time (unpadded), decodes to the same predictions.
    from transformers import ConvBertForQuestionAnswering

    hf = ConvBertForQuestionAnswering.from_pretrained(str(out / "best"), local_files_only=True).eval()
    data = windows(tokenizer, questions, max_seq_length=64, doc_stride=16)
    starts, ends = [], []
    with torch.no_grad():
        for ids, types in zip(data.input_ids, data.token_type_ids):
            logits = hf(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types]))
            starts.append(logits.start_logits[0].tolist())
            ends.append(logits.end_logits[0].tolist())
    task = QATask("squad_v2", [], {"validation": questions}, {})
    report, again, _ = score(task, questions, decode(questions, data, starts, ends))
    assert again == predictions and report["f1"] == pytest.approx(final["f1"])
