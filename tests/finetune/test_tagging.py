"""Token tagging (``--task conll``, ``--task tokens``): entity-level scores by hand for IOB1 and IOB2, the
reader's one-line errors, labels on each word's first sub-token, and a fine-tuning run on real sentences
whose saved model transformers reloads and tags the same."""

import json
import re

import pytest
import torch

from convbert_ds.errors import UserError
from convbert_ds.finetune.__main__ import main as finetune_main
from convbert_ds.finetune.tagging import (IGNORED, Sentence, TaggingTask, chunks, encode_tags, entity_scores,
                                          label_set, read_conll)
from shard_factory import read_text_documents

FAST = ["--epochs", "1", "--batch-size", "8", "--max-seq-length", "48", "--save-steps", "1000"]


def test_entities_are_read_from_iob2_and_iob1_tags_as_conlleval_reads_them():
    assert chunks(["B-PER", "I-PER", "O", "B-LOC"]) == {("PER", 0, 1), ("LOC", 3, 3)}
    # IOB1 (CoNLL-2003's own files): I- opens a chunk after O or another type; B- only splits two alike.
    assert chunks(["I-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-ORG"]) == {
        ("PER", 0, 1), ("LOC", 3, 3), ("LOC", 4, 4), ("ORG", 5, 5)}
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-ORG"]]
    predicted = [["B-PER", "O", "O", "B-LOC"], ["O", "B-ORG"]]  # PER cut short: a wrong entity, not half right
    scores = entity_scores(gold, predicted)
    # gold 3 entities, predicted 3 (PER 0-0, LOC, ORG), 2 exact: P = R = F1 = 2/3; 5 of 6 tokens right.
    assert scores == pytest.approx({"precision": 2 / 3, "recall": 2 / 3, "f1": 2 / 3, "accuracy": 5 / 6})


def test_conll_files_are_read_with_the_tag_last_and_a_bad_line_is_named(tmp_path):
    good = tmp_path / "train.txt"
    good.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\nPeter NNP B-NP B-PER\n")
    sentences = read_conll(good)
    assert [(s.words, s.tags) for s in sentences] == [(["EU", "rejects"], ["B-ORG", "O"]), (["Peter"], ["B-PER"])]
    assert label_set(sentences, {}, good) == ["O", "B-ORG", "B-PER"]
    bad = tmp_path / "dev.txt"
    bad.write_text("EU B-ORG\nrejects\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(bad))}:2: 'rejects' has no tag; a line is a token and "
                                        "its tag"):
        read_conll(bad)
    with pytest.raises(UserError, match=r"tag\(s\) \['B-MISC'\] do not occur in"):
        label_set(sentences, {"validation": [Sentence(["x"], ["B-MISC"])]}, good)


@pytest.fixture(scope="module")
def tokenizer(tiny_corpus):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_corpus["tokenizer"]), local_files_only=True)


def test_a_word_is_labelled_on_its_first_sub_token_only(tokenizer):
    sentence = Sentence(["Serialization", "of", "dictionaries"], ["B-X", "O", "B-X"])
    task = TaggingTask("tokens", ["O", "B-X"], [sentence], {}, {})
    data = encode_tags(tokenizer, task, [sentence], max_seq_length=32)
    labelled = [t for t, label in enumerate(data.labels[0]) if label != IGNORED]
    assert labelled == data.first[0] and len(data.input_ids[0]) > len(labelled) + 2  # sub-tokens left out
    assert [data.labels[0][t] for t in labelled] == [1, 0, 1]


def _tagged_lines(sentence: str) -> list[str]:
    """Real words tagged by a rule a model can learn: runs of capitalised words are CAP entities (IOB2),
    numbers NUM."""
    lines, previous = [], "O"
    for word in sentence.split()[:30]:
        if re.fullmatch(r"\d+", word):
            tag = "B-NUM"
        elif word[:1].isupper():
            tag = "I-CAP" if previous.endswith("CAP") else "B-CAP"
        else:
            tag = "O"
        lines.append(f"{word} {tag}")
        previous = tag
    return lines


@pytest.mark.slow
def test_tagging_fine_tunes_and_transformers_tags_the_same(tiny_corpus, tokenizer, tmp_path):
    from transformers import AutoModelForTokenClassification

    from convbert_ds.config import ElectraConfig
    from convbert_ds.convert import export_model
    from convbert_ds.model import ElectraForPretraining

    sentences = [line for doc in read_text_documents(tiny_corpus["corpus"]) for line in doc
                 if len(line.split()) >= 5][:360]
    for name, part in (("train.txt", sentences[:300]), ("valid.txt", sentences[300:])):
        (tmp_path / name).write_text("\n\n".join("\n".join(_tagged_lines(s)) for s in part) + "\n")
    torch.manual_seed(1234)
    export_model(ElectraForPretraining(ElectraConfig.from_preset("tiny", vocab_size=len(tokenizer))),
                 tmp_path / "hf", tiny_corpus["tokenizer"])
    out = tmp_path / "run"
    assert finetune_main(["--model", str(tmp_path / "hf" / "discriminator"), "--task", "conll", "--train",
                          str(tmp_path / "train.txt"), "--validation", str(tmp_path / "valid.txt"), "--out", str(out),
                          "--learning-rate", "1e-3", *FAST]) == 0
    results = json.loads((out / "results.json").read_text())
    final = results["seeds"][0]["final"]["validation"]
    assert results["primary"] == {"split": "validation", "metric": "f1"} and final["f1"] > 0.3, final

    model = AutoModelForTokenClassification.from_pretrained(str(out / "best"), local_files_only=True).eval()
    dev = read_conll(tmp_path / "valid.txt")
    task = TaggingTask("conll", [model.config.id2label[i] for i in range(model.config.num_labels)], [], {}, {})
    data = encode_tags(tokenizer, task, dev, max_seq_length=48)
    predicted = []
    with torch.no_grad():
        for i, sentence in enumerate(dev):
            best = model(input_ids=torch.tensor([data.input_ids[i]]),
                         token_type_ids=torch.tensor([data.token_type_ids[i]])).logits[0].argmax(-1)
            predicted.append([task.label_names[int(best[t])] if t is not None else "O" for t in data.first[i]])
    assert entity_scores([s.tags for s in dev], predicted)["f1"] == pytest.approx(final["f1"])
