"""Fine-tuning data: GLUE's official file layouts and custom files (TSV, CSV, JSONL, save_to_disk)."""

from __future__ import annotations

import csv
import json

import pytest
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.finetune.tasks import GLUE_TASKS, Example, read_custom, read_glue


def write_tsv(path, rows):
    """Rows joined with tabs and nothing else, as the GLUE files are (quotes are plain characters)."""
    path.write_text("".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# GLUE, one small file set per task in the official layout

MNLI_TRAIN_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                     "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]


def mnli_row(index, sentence1, sentence2, *labels):
    """MNLI rows carry parse trees before the sentences; the label votes and gold label come last."""
    parse = ["( ( parse ) tree )", "( ( parse ) tree )", "(ROOT (S parse))", "(ROOT (S parse))"]
    return [str(index), "31193", f"{index}n", "fiction", *parse, sentence1, sentence2, *labels]


GLUE_CASES = {
    "cola": {
        "files": {
            "train.tsv": [["gj04", "1", "", "Our friends won't buy this analysis, let alone the next one we propose."],
                          ["gj04", "0", "*", "They drank the pub."]],
            "dev.tsv": [["gj04", "0", "*", "The more we study verbs, the crazier they get get."]],
        },
        "train": [("Our friends won't buy this analysis, let alone the next one we propose.", None, "1"),
                  ("They drank the pub.", None, "0")],
        "dev": [("The more we study verbs, the crazier they get get.", None, "0")],
        "labels": ["0", "1"], "metric": "mcc",
    },
    "sst2": {
        "files": {
            "train.tsv": [["sentence", "label"], ["hide new secretions from the parental units ", "0"],
                          ["that loves its characters and communicates something rather beautiful ", "1"]],
            "dev.tsv": [["sentence", "label"], ['it \'s a charming and often affecting " journey . "', "1"]],
        },
        "train": [("hide new secretions from the parental units ", None, "0"),
                  ("that loves its characters and communicates something rather beautiful ", None, "1")],
        "dev": [('it \'s a charming and often affecting " journey . "', None, "1")],
        "labels": ["0", "1"], "metric": "accuracy",
    },
    "mrpc": {
        "files": {
            "train.tsv": [["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
                          ["1", "702876", "702977",
                           'Amrozi accused his brother , whom he called " the witness " , of deliberately '
                           "distorting his evidence .",
                           'Referring to him as only " the witness " , Amrozi accused his brother .']],
            "dev.tsv": [["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
                        ["0", "2108705", "2108831", "Yucaipa owned Dominick 's before selling the chain .",
                         "Yucaipa bought Dominick 's in 1995 for $ 693 million ."]],
        },
        "train": [('Amrozi accused his brother , whom he called " the witness " , of deliberately distorting his '
                   "evidence .", 'Referring to him as only " the witness " , Amrozi accused his brother .', "1")],
        "dev": [("Yucaipa owned Dominick 's before selling the chain .",
                 "Yucaipa bought Dominick 's in 1995 for $ 693 million .", "0")],
        "labels": ["0", "1"], "metric": "f1",
    },
    "qqp": {
        "files": {
            "train.tsv": [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
                          ["402555", "536040", "536041", 'What does "namaste" mean?',
                           'What is the meaning of the word "namaste"?', "1"],
                          ["133273", "213221", "213222", '"Be yourself" - is it good advice?',
                           "How do I learn French fast?", "0"]],
            "dev.tsv": [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
                        ["201359", "303345", "303346", "Why are African-Americans so beautiful?",
                         "Why are hispanics so beautiful?", "0"]],
        },
        "train": [('What does "namaste" mean?', 'What is the meaning of the word "namaste"?', "1"),
                  ('"Be yourself" - is it good advice?', "How do I learn French fast?", "0")],
        "dev": [("Why are African-Americans so beautiful?", "Why are hispanics so beautiful?", "0")],
        "labels": ["0", "1"], "metric": "f1",
    },
    "stsb": {
        "files": {
            "train.tsv": [["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1",
                           "sentence2", "score"],
                          ["0", "main-captions", "MSRvid", "2012test", "0001", "none", "none",
                           "A plane is taking off.", "An air plane is taking off.", "5.000"],
                          ["1", "main-captions", "MSRvid", "2012test", "0004", "none", "none",
                           "A man is playing a large flute.", "A man is playing a flute.", "3.800"]],
            "dev.tsv": [["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1",
                         "sentence2", "score"],
                        ["0", "main-captions", "MSRvid", "2012test", "0000", "none", "none",
                         "A man with a hard hat is dancing.", "A man wearing a hard hat is dancing.", "0.000"]],
        },
        "train": [("A plane is taking off.", "An air plane is taking off.", 5.0),
                  ("A man is playing a large flute.", "A man is playing a flute.", 3.8)],
        "dev": [("A man with a hard hat is dancing.", "A man wearing a hard hat is dancing.", 0.0)],
        "labels": [], "metric": "pearson",
    },
    "mnli": {
        "files": {
            "train.tsv": [MNLI_TRAIN_HEADER,
                          mnli_row(0, "Conceptually cream skimming has two basic dimensions - product and geography.",
                                   "Product and geography are what make cream skimming work. ", "neutral",
                                   "neutral"),
                          mnli_row(1, '"I don\'t know," he said, "what you mean."', "He understood.",
                                   "contradiction", "contradiction")],
            "dev_matched.tsv": [MNLI_DEV_HEADER,
                                mnli_row(2, "The new rights are nice enough", "Everyone really likes the newest "
                                         "benefits ", "neutral", "entailment", "neutral", "neutral", "neutral",
                                         "neutral")],
            "dev_mismatched.tsv": [MNLI_DEV_HEADER,
                                   mnli_row(3, 'Your contribution helped make it possible for us to provide "the '
                                            'best".', "Your contributions were of no help.", "contradiction",
                                            "contradiction", "contradiction", "contradiction", "contradiction",
                                            "contradiction")],
        },
        "train": [("Conceptually cream skimming has two basic dimensions - product and geography.",
                   "Product and geography are what make cream skimming work. ", "neutral"),
                  ('"I don\'t know," he said, "what you mean."', "He understood.", "contradiction")],
        "dev_matched": [("The new rights are nice enough", "Everyone really likes the newest benefits ", "neutral")],
        "dev_mismatched": [('Your contribution helped make it possible for us to provide "the best".',
                            "Your contributions were of no help.", "contradiction")],
        "labels": ["contradiction", "entailment", "neutral"], "metric": "accuracy",
    },
    "qnli": {
        "files": {
            "train.tsv": [["index", "question", "sentence", "label"],
                          ["0", "When did the third Digimon series begin?",
                           "Unlike the two seasons before it, Digimon Tamers takes a darker approach.",
                           "not_entailment"]],
            "dev.tsv": [["index", "question", "sentence", "label"],
                        ["0", "What came into force after the new constitution was herald?",
                         "As of that day, the new constitution heralding the Second Republic came into force.",
                         "entailment"]],
        },
        "train": [("When did the third Digimon series begin?",
                   "Unlike the two seasons before it, Digimon Tamers takes a darker approach.", "not_entailment")],
        "dev": [("What came into force after the new constitution was herald?",
                 "As of that day, the new constitution heralding the Second Republic came into force.",
                 "entailment")],
        "labels": ["entailment", "not_entailment"], "metric": "accuracy",
    },
    "rte": {
        "files": {
            "train.tsv": [["index", "sentence1", "sentence2", "label"],
                          ["0", "No Weapons of Mass Destruction Found in Iraq Yet.",
                           "Weapons of Mass Destruction Found in Iraq.", "not_entailment"]],
            "dev.tsv": [["index", "sentence1", "sentence2", "label"],
                        ["0", "Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer.",
                         "Christopher Reeve had an accident.", "not_entailment"]],
        },
        "train": [("No Weapons of Mass Destruction Found in Iraq Yet.", "Weapons of Mass Destruction Found in Iraq.",
                   "not_entailment")],
        "dev": [("Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer.",
                 "Christopher Reeve had an accident.", "not_entailment")],
        "labels": ["entailment", "not_entailment"], "metric": "accuracy",
    },
    "wnli": {
        "files": {
            "train.tsv": [["index", "sentence1", "sentence2", "label"],
                          ["0", "I stuck a pin through a carrot. When I pulled the pin out, it had a hole.",
                           "The carrot had a hole.", "1"]],
            "dev.tsv": [["index", "sentence1", "sentence2", "label"],
                        ["0", "The drain is clogged with hair. It has to be cleaned.", "The hair has to be cleaned.",
                         "0"]],
        },
        "train": [("I stuck a pin through a carrot. When I pulled the pin out, it had a hole.",
                   "The carrot had a hole.", "1")],
        "dev": [("The drain is clogged with hair. It has to be cleaned.", "The hair has to be cleaned.", "0")],
        "labels": ["0", "1"], "metric": "accuracy",
    },
}


def write_glue(root, task):
    root.mkdir(parents=True, exist_ok=True)
    for name, rows in GLUE_CASES[task]["files"].items():
        write_tsv(root / name, rows)
    return root


def test_every_glue_task_has_a_case():
    assert set(GLUE_CASES) == set(GLUE_TASKS)


@pytest.mark.parametrize("task", GLUE_TASKS)
def test_read_glue_parses_the_official_layout(tmp_path, task):
    case = GLUE_CASES[task]
    data = read_glue(task, write_glue(tmp_path / task, task))
    eval_splits = [name[:-len(".tsv")] for name in case["files"] if name != "train.tsv"]
    assert data.name == task
    assert data.task_type == ("regression" if task == "stsb" else "classification")
    assert data.label_names == case["labels"]
    assert data.metric == case["metric"]
    assert data.positive_label == ("1" if task in ("mrpc", "qqp") else None)  # the benchmark's F1 class; no F1 else
    assert list(data.evals) == eval_splits  # the primary split first
    assert data.train == [Example(*fields) for fields in case["train"]]
    for split in eval_splits:
        assert data.evals[split] == [Example(*fields) for fields in case[split]]
    json.dumps(data.source)
    assert data.source["task"] == task and data.source["skipped_malformed_rows"]["train"] == 0


@pytest.mark.parametrize("alias, name", [("SST-2", "sst2"), ("STS-B", "stsb"), ("CoLA", "cola"), (" RTE ", "rte")])
def test_read_glue_accepts_the_benchmarks_spellings(tmp_path, alias, name):
    assert read_glue(alias, write_glue(tmp_path, name)).name == name


def test_mrpc_header_with_byte_order_mark(tmp_path):
    root = write_glue(tmp_path, "mrpc")
    (root / "train.tsv").write_text("\ufeff" + (root / "train.tsv").read_text(encoding="utf-8"), encoding="utf-8")
    assert read_glue("mrpc", root).train[0].label == "1"


def qqp_rows(good, malformed):
    rows = [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]]
    rows += [[str(i), str(2 * i), str(2 * i + 1), f'Is "question {i}" a duplicate?', f"Question {i}?", str(i % 2)]
             for i in range(good)]
    # A question with a line break splits into two short rows, as in the official file.
    rows += [["9999", "1", "2", "How do I", ""] for _ in range(malformed)]
    return rows


def test_qqp_skips_a_few_malformed_rows_and_counts_them(tmp_path):
    root = write_glue(tmp_path, "qqp")
    write_tsv(root / "train.tsv", qqp_rows(good=150, malformed=1))
    data = read_glue("qqp", root)
    assert len(data.train) == 150
    assert data.train[3] == Example('Is "question 3" a duplicate?', "Question 3?", "1")
    assert data.source["skipped_malformed_rows"] == {"train": 1, "dev": 0}


def test_qqp_fails_when_more_than_one_percent_is_malformed(tmp_path):
    root = write_glue(tmp_path, "qqp")
    write_tsv(root / "train.tsv", qqp_rows(good=150, malformed=2))
    with pytest.raises(FinetuneError, match=r"train\.tsv: 2 of 152 rows have fewer than 6 fields"):
        read_glue("qqp", root)


def assert_one_line(error: pytest.ExceptionInfo, *names: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    for name in names:
        assert name in message, (name, message)


def test_unknown_glue_task(tmp_path):
    with pytest.raises(FinetuneError) as error:
        read_glue("mnli-mm", tmp_path)
    assert_one_line(error, "--glue-task mnli-mm", "cola, sst2")


def test_missing_data_dir(tmp_path):
    with pytest.raises(FinetuneError) as error:
        read_glue("rte", tmp_path / "RTE")
    assert_one_line(error, f"--data-dir {tmp_path / 'RTE'}", "not found", "train.tsv and dev.tsv")


@pytest.mark.parametrize("task, missing", [("rte", "dev.tsv"), ("mnli", "dev_mismatched.tsv"), ("cola", "train.tsv")])
def test_missing_glue_file(tmp_path, task, missing):
    root = write_glue(tmp_path, task)
    (root / missing).unlink()
    with pytest.raises(FinetuneError) as error:
        read_glue(task, root)
    assert_one_line(error, f"--data-dir {root}", f"{missing} not found", "official GLUE download")


@pytest.mark.parametrize("task, name, rows, expected", [
    ("rte", "dev.tsv", [["index", "sentence 1", "sentence2", "label"], ["0", "A b.", "C d.", "entailment"]],
     ["column 'sentence1' not found", "index, sentence 1, sentence2, label"]),
    ("rte", "train.tsv", [["index", "sentence1", "sentence2", "label"], ["0", "A b.", "C d.", "contradiction"]],
     ["line 2", "column 'label'", "'contradiction'", "entailment, not_entailment"]),
    ("stsb", "dev.tsv", [GLUE_CASES["stsb"]["files"]["dev.tsv"][0], ["0", "g", "f", "y", "o", "s", "s", "A.", "B.",
                                                                    "high"]],
     ["line 2", "column 'score'", "'high'", "from 0 to 5"]),
    ("mnli", "train.tsv", [MNLI_TRAIN_HEADER[:-2] + ["gold_label", "label1"],
                           mnli_row(0, "A.", "B.", "neutral", "neutral")],
     ["column 'gold_label' must be the last column"]),
    ("sst2", "train.tsv", [["sentence", "label"], ["a fine film", "1"], ["missing its label"]],
     ["line 3 has 1 tab-separated fields", "sentence, label"]),
    ("cola", "dev.tsv", [["gj04", "1", "The book was read."]], ["line 1 has 3", "source, label, original_mark"]),
    ("wnli", "dev.tsv", [["index", "sentence1", "sentence2", "label"]], ["no examples"]),
])
def test_bad_glue_file_names_the_file_and_column(tmp_path, task, name, rows, expected):
    root = write_glue(tmp_path, task)
    write_tsv(root / name, rows)
    with pytest.raises(FinetuneError) as error:
        read_glue(task, root)
    assert_one_line(error, str(root / name), *expected, "official GLUE download")


def test_empty_glue_file(tmp_path):
    root = write_glue(tmp_path, "qnli")
    (root / "train.tsv").write_text("")
    with pytest.raises(FinetuneError) as error:
        read_glue("qnli", root)
    assert_one_line(error, str(root / "train.tsv"), "the file is empty")


def test_a_glue_file_in_another_encoding_names_the_line(tmp_path):
    root = write_glue(tmp_path, "rte")
    text = (root / "dev.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    (root / "dev.tsv").write_bytes("".join(text[:2]).encode() + "Café au lait.\tIt is coffee.\tentailment\n"
                                   .encode("latin-1"))
    with pytest.raises(FinetuneError) as error:
        read_glue("rte", root)
    assert_one_line(error, f"{root / 'dev.tsv'}:3: not UTF-8 (byte 0xe9); convert the file first, e.g. iconv")


# ---------------------------------------------------------------------------------------------
# Custom tasks

def write_delimited(path, rows, delimiter):
    with path.open("w", encoding="utf-8", newline="") as handle:
        csv.writer(handle, delimiter=delimiter).writerows(rows)
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def test_custom_tsv_with_text_pair_and_quotes(tmp_path):
    header = ["premise", "hypothesis", "label"]
    train = write_delimited(tmp_path / "train.tsv", [header, ['She said "yes".', "She agreed.", "1"],
                                                     ["007", "NA", "0"]], "\t")
    dev = write_delimited(tmp_path / "dev.tsv", [header, ["It rained\tall day.", "It was dry.", "0"]], "\t")
    data = read_custom(train, dev, "premise", "label", text_pair_column="hypothesis")
    assert data.name == "custom" and data.task_type == "classification" and data.metric == "accuracy"
    assert data.label_names == ["0", "1"]
    # Every column is text: digits and "NA" are not turned into a number and a missing value.
    assert data.train == [Example('She said "yes".', "She agreed.", "1"), Example("007", "NA", "0")]
    assert data.evals == {"validation": [Example("It rained\tall day.", "It was dry.", "0")]}
    assert data.source["formats"] == {"train": "tsv", "validation": "tsv"}
    assert data.source["task_type_inferred"] is True
    json.dumps(data.source)


def test_custom_csv_string_labels_are_sorted(tmp_path):
    rows = [["text", "sentiment"], ["Loved it, truly.", "positive"], ["Meh.", "neutral"], ["Awful, just awful.",
                                                                                          "negative"]]
    path = write_delimited(tmp_path / "reviews.csv", rows, ",")
    data = read_custom(path, path, "text", "sentiment")
    assert data.label_names == ["negative", "neutral", "positive"]
    assert data.train[0] == Example("Loved it, truly.", None, "positive")


def test_custom_jsonl_regression_is_inferred_from_fractional_scores(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"s1": "A cat sleeps.", "s2": "A cat naps.", "score": 4.5},
                                                   {"s1": "A dog runs.", "s2": "The sun sets.", "score": 0}])
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"s1": "Kids play.", "s2": "Children play.", "score": 5}])
    data = read_custom(train, dev, "s1", "score", text_pair_column="s2")
    assert data.task_type == "regression" and data.metric == "pearson" and data.label_names == []
    assert [e.label for e in data.train] == [4.5, 0.0]
    assert data.evals["validation"] == [Example("Kids play.", "Children play.", 5.0)]


def test_custom_whole_numbers_stay_classes_unless_told(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "one", "stars": 1}, {"text": "two", "stars": 2.0},
                                                 {"text": "five", "stars": 5}])
    classes = read_custom(path, path, "text", "stars")
    assert classes.task_type == "classification" and classes.label_names == ["1", "2", "5"]
    scores = read_custom(path, path, "text", "stars", task_type="regression")
    assert scores.task_type == "regression" and [e.label for e in scores.train] == [1.0, 2.0, 5.0]


def test_custom_save_to_disk_uses_class_label_names(tmp_path):
    features = Features({"sentence": Value("string"), "label": ClassLabel(names=["unacceptable", "acceptable"])})
    train = Dataset.from_dict({"sentence": ["The cat sat.", "Sat cat the."], "label": [1, 0]}, features=features)
    train.save_to_disk(tmp_path / "train")
    train.select([0]).save_to_disk(tmp_path / "validation")
    data = read_custom(tmp_path / "train", tmp_path / "validation", "sentence", "label")
    assert data.label_names == ["acceptable", "unacceptable"]
    assert data.train == [Example("The cat sat.", None, "acceptable"), Example("Sat cat the.", None, "unacceptable")]
    assert data.source["formats"]["train"] == "save_to_disk"


def custom_error(tmp_path, train, validation=None, **options) -> pytest.ExceptionInfo:
    options = {"text_column": "text", "label_column": "label", **options}
    with pytest.raises(FinetuneError) as error:
        read_custom(train, validation or train, **options)
    return error


def test_custom_missing_file_and_unsupported_extension(tmp_path):
    assert_one_line(custom_error(tmp_path, tmp_path / "nope.jsonl"), f"--train {tmp_path / 'nope.jsonl'}",
                    "file not found")
    text = tmp_path / "train.txt"
    text.write_text("a sentence\n")
    assert_one_line(custom_error(tmp_path, text), f"--train {text}", "unsupported extension '.txt'", ".tsv, .csv")


def test_custom_missing_column_lists_the_columns(tmp_path):
    path = write_delimited(tmp_path / "train.csv", [["sentence", "label"], ["Fine.", "1"]], ",")
    assert_one_line(custom_error(tmp_path, path), f"--train {path}", "column 'text' not found",
                    "columns: sentence, label", "--text-column")
    good = write_delimited(tmp_path / "good.csv", [["text", "label"], ["Fine.", "1"]], ",")
    assert_one_line(custom_error(tmp_path, good, text_pair_column="second"), "column 'second' not found",
                    "--text-pair-column")


def test_custom_empty_splits(tmp_path):
    train = write_delimited(tmp_path / "train.csv", [["text", "label"], ["Fine.", "1"]], ",")
    header_only = write_delimited(tmp_path / "dev.csv", [["text", "label"]], ",")
    assert_one_line(custom_error(tmp_path, train, header_only), f"--validation {header_only}", "no rows")
    empty = tmp_path / "dev.jsonl"
    empty.write_text("")
    assert_one_line(custom_error(tmp_path, train, empty), f"--validation {empty}", "the file is empty")
    # filter, not from_dict([]): datasets cannot load back a save_to_disk of zero shards.
    Dataset.from_dict({"text": ["Fine."], "label": [1]}).filter(lambda _: False).save_to_disk(tmp_path / "saved")
    assert_one_line(custom_error(tmp_path, tmp_path / "saved"), f"--train {tmp_path / 'saved'}", "no rows")


def test_custom_dataset_dict_asks_for_the_split_directory(tmp_path):
    DatasetDict(train=Dataset.from_dict({"text": ["Fine."], "label": [1]})).save_to_disk(tmp_path / "glue")
    assert_one_line(custom_error(tmp_path, tmp_path / "glue"), "DatasetDict with splits train",
                    f"e.g. {tmp_path / 'glue' / 'train'}")
    (tmp_path / "plain").mkdir()
    assert_one_line(custom_error(tmp_path, tmp_path / "plain"), "not written by datasets' save_to_disk")


def test_custom_validation_labels_must_be_seen_in_train(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "x", "label": "a"}, {"text": "y", "label": "b"}])
    dev = write_jsonl(tmp_path / "dev.jsonl", [{"text": "z", "label": name} for name in "abcdefghi"])
    error = custom_error(tmp_path, train, dev)
    assert_one_line(error, f"--validation {dev}", "column 'label'", "'c', 'd', 'e', 'f', 'g' (+2 more)")
    assert "'h'" not in str(error.value)


def test_custom_regression_needs_numbers(tmp_path):
    path = write_delimited(tmp_path / "train.tsv", [["text", "label"], ["Fine.", "0.5"], ["Odd.", "high"]], "\t")
    assert_one_line(custom_error(tmp_path, path, task_type="regression"), f"--train {path}",
                    "column 'label' row 2 is 'high', not a number")


@pytest.mark.parametrize("records, expected", [
    ([{"text": "Fine.", "label": 1}, {"text": None, "label": 0}], "column 'text' row 2 is empty"),
    ([{"text": "  ", "label": 1}], "column 'text' row 1 is empty"),
    ([{"text": "Fine.", "label": None}], "column 'label' row 1 has no label"),
])
def test_custom_empty_text_or_label(tmp_path, records, expected):
    path = write_jsonl(tmp_path / "train.jsonl", records)
    assert_one_line(custom_error(tmp_path, path), f"--train {path}", expected)


@pytest.mark.parametrize("name, text", [
    ("train.csv", "text,label\nNaïve,1\n"),
    ("train.jsonl", '{"text": "Fine.", "label": 0}\n{"text": "Naïve", "label": 1}\n')])
def test_a_custom_file_in_another_encoding_names_the_line(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text.encode("cp1252"))
    assert_one_line(custom_error(tmp_path, path), f"{path}:2: not UTF-8 (byte 0xef)")


def test_custom_unparseable_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "Fine.", "label": 1}\nnot json\n')
    assert_one_line(custom_error(tmp_path, path), f"--train {path}", "cannot be read as JSON")
