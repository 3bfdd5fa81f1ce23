"""Token tagging (``--task conll``, ``--task tokens``): entity-level scores by hand for IOB1, IOB2, IOBES and
BILOU, the reader's one-line errors (a line without a tag, a tag of no scheme), labels on each word's first
sub-token, and a fine-tuning run on real sentences whose saved model transformers reloads and tags the same."""

import json
import re

import pytest
import torch

from convbert_ds.errors import UserError
from convbert_ds.finetune.__main__ import main as finetune_main
from convbert_ds.finetune.tagging import (IGNORED, TAG_SCHEMES, Sentence, TaggingTask, chunks, encode_tags,
                                          entity_scores, label_set, read_conll)
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


# Each case: tags -> the chunks (type, first word, last word) worked out by hand from the chunk rules in
# tagging.py's docstring (conlleval's, with S-, as seqeval's default mode reads them).
CHUNK_CASES = [
    # IOB2: B- opens, I- of the same type goes on; B- after B- of the same type is a new chunk.
    (["B-PER", "I-PER", "O", "B-LOC", "B-LOC"], {("PER", 0, 1), ("LOC", 3, 3), ("LOC", 4, 4)}),
    # IOB1: I- after O opens; I- of another type opens another chunk.
    (["O", "I-ORG", "I-ORG", "I-PER"], {("ORG", 1, 2), ("PER", 3, 3)}),
    # IOBES: S-X alone is a one-word chunk (the old reader found none).
    (["S-PER"], {("PER", 0, 0)}),
    (["O", "S-PER", "O"], {("PER", 1, 1)}),
    # B-X I-X E-X is one chunk ending at E-X; B-X E-X one two-word chunk (the old reader cut both at B-X).
    (["B-ORG", "I-ORG", "E-ORG"], {("ORG", 0, 2)}),
    (["B-ORG", "E-ORG", "O"], {("ORG", 0, 1)}),
    # E-X after O opens (and, being an end, closes) a one-word chunk.
    (["O", "E-LOC", "O"], {("LOC", 1, 1)}),
    # Adjacent S-X S-X are two chunks, as are E-X E-X: a chunk ends after E- and S-.
    (["S-PER", "S-PER"], {("PER", 0, 0), ("PER", 1, 1)}),
    (["E-PER", "E-PER"], {("PER", 0, 0), ("PER", 1, 1)}),
    # I-X after S-X opens a new chunk, which the sentence's end closes without an E-.
    (["S-PER", "I-PER", "I-PER"], {("PER", 0, 0), ("PER", 1, 2)}),
    # A change of type ends a chunk even inside B- ... E-.
    (["B-PER", "E-LOC"], {("PER", 0, 0), ("LOC", 1, 1)}),
    (["B-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "O"], {("PER", 0, 1), ("PER", 2, 2), ("LOC", 3, 5)}),
    # BILOU: U- is S-, L- is E-.
    (["U-PER", "B-LOC", "I-LOC", "L-LOC", "U-LOC"], {("PER", 0, 0), ("LOC", 1, 3), ("LOC", 4, 4)}),
    (["O", "O"], set()),
]


@pytest.mark.parametrize(("tags", "expected"), CHUNK_CASES, ids=[" ".join(t) for t, _ in CHUNK_CASES])
def test_chunks_of_iob1_iob2_iobes_and_bilou_tags_by_hand(tags, expected):
    assert chunks(tags) == expected


def test_iobes_entity_scores_by_hand():
    gold = [["B-PER", "I-PER", "E-PER", "O", "S-LOC"], ["S-ORG", "S-ORG"]]
    predicted = [["B-PER", "E-PER", "O", "O", "S-LOC"], ["B-ORG", "E-ORG"]]
    # gold chunks: PER 0-2, LOC 4-4 | ORG 0-0, ORG 1-1            -> 4
    # predicted:   PER 0-1, LOC 4-4 | ORG 0-1                     -> 3
    # exact: LOC 4-4 only -> P = 1/3, R = 1/4, F1 = 2PR/(P+R) = (1/6)/(7/12) = 2/7
    # tokens: B=B, I/E, E/O, O=O, S=S | S/B, S/E -> 3 of 7 right
    scores = entity_scores(gold, predicted)
    assert scores == pytest.approx({"precision": 1 / 3, "recall": 1 / 4, "f1": 2 / 7, "accuracy": 3 / 7})


def test_iob1_and_iob2_entity_scores_by_hand():
    gold = [["I-PER", "I-PER", "O", "I-LOC", "B-LOC"], ["B-ORG", "I-ORG", "O"]]
    predicted = [["B-PER", "I-PER", "O", "I-LOC", "I-LOC"], ["B-ORG", "I-ORG", "B-MISC"]]
    # gold (IOB1 | IOB2): PER 0-1, LOC 3-3, LOC 4-4 | ORG 0-1       -> 4
    # predicted:          PER 0-1, LOC 3-4          | ORG 0-1, MISC 2-2 -> 4
    # exact: PER 0-1, ORG 0-1 -> P = 2/4, R = 2/4, F1 = 1/2
    # tokens: I/B, I=I, O=O, I=I, B/I | B=B, I=I, O/B -> 5 of 8 right
    scores = entity_scores(gold, predicted)
    assert scores == pytest.approx({"precision": 1 / 2, "recall": 1 / 2, "f1": 1 / 2, "accuracy": 5 / 8})


def test_iobes_and_bilou_files_are_read(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("Peter S-PER\nsaw O\nNew B-LOC\nYork E-LOC\n\nAnn U-PER\nBlack L-PER\n")
    assert [s.tags for s in read_conll(path)] == [["S-PER", "O", "B-LOC", "E-LOC"], ["U-PER", "L-PER"]]


@pytest.mark.parametrize(("tag", "problem"), [
    ("X-PER", "tag 'X-PER' has the prefix 'X-', which no tag scheme read here uses"),
    ("M-LOC", "tag 'M-LOC' has the prefix 'M-', which no tag scheme read here uses"),
    ("b-PER", "tag 'b-PER' has the prefix 'b-', which no tag scheme read here uses"),
    ("B-", "tag 'B-' has no type after its prefix"),
    ("PER", "tag 'PER' has no prefix, so no entity type can be read from it; write it B-PER/I-PER (IOB2) or "
            "S-PER for a one-word entity, or O for none"),
])
def test_a_tag_of_no_scheme_is_refused_naming_file_line_and_the_schemes(tmp_path, tag, problem):
    path = tmp_path / "train.txt"
    path.write_text(f"Peter B-PER\nsaw O\n\nAnn {tag}\n")
    with pytest.raises(UserError) as refused:
        read_conll(path)
    message = str(refused.value)
    assert message == f"{path}:4: {problem}; tags are {TAG_SCHEMES}" and "\n" not in message
    assert TAG_SCHEMES == ("O, or B-, I-, E- or S- and a type, e.g. B-PER (IOB1, IOB2, IOBES/BIOES; BILOU's L-/U- "
                           "as E-/S-)")


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


def test_a_file_in_another_encoding_is_one_line_naming_its_line_and_a_bom_is_read(tmp_path):
    latin1 = tmp_path / "train.txt"
    latin1.write_bytes("EU B-ORG\n\nM\u00fcller B-PER\n".encode("latin-1"))  # ü is 0xfc in Latin-1
    with pytest.raises(UserError, match=rf"^{re.escape(str(latin1))}:3: not UTF-8 \(byte 0xfc\); convert the file "
                                        r"first, e.g. iconv -f latin1 -t utf-8 train.txt > train.utf8.txt") as caught:
        read_conll(latin1)
    assert "\n" not in str(caught.value)
    with_bom = tmp_path / "bom.txt"
    with_bom.write_bytes("\ufeffM\u00fcller B-PER\r\n".encode("utf-8"))  # as editors on Windows save it
    assert [(s.words, s.tags) for s in read_conll(with_bom)] == [(["M\u00fcller"], ["B-PER"])]


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
