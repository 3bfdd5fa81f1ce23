"""A small GLUE download made of real prose: the 9 task folders with the official file names, headers and
column orders, each row's label a rule of its text (does the first text hold "the"?), so that they can be
learnt."""

from __future__ import annotations

from pathlib import Path

MNLI_TRAIN_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
                     "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]
# folder, its files, header (None: CoLA's file has none), (text, pair, label) columns, label names (None: STS-B)
LAYOUTS = {
    "cola": ("CoLA", ("train", "dev"), None, (3, None, 1), ("0", "1")),
    "sst2": ("SST-2", ("train", "dev"), ["sentence", "label"], (0, None, 1), ("0", "1")),
    "mrpc": ("MRPC", ("train", "dev"), ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"], (3, 4, 0), ("0", "1")),
    "qqp": ("QQP", ("train", "dev"), ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"], (3, 4, 5),
            ("0", "1")),
    "stsb": ("STS-B", ("train", "dev"), ["index", "genre", "filename", "year", "old_index", "source1", "source2",
                                         "sentence1", "sentence2", "score"], (7, 8, 9), None),
    "mnli": ("MNLI", ("train", "dev_matched", "dev_mismatched"), None, (8, 9, -1),
             ("contradiction", "entailment", "neutral")),
    "qnli": ("QNLI", ("train", "dev"), ["index", "question", "sentence", "label"], (1, 2, 3),
             ("entailment", "not_entailment")),
    "rte": ("RTE", ("train", "dev"), ["index", "sentence1", "sentence2", "label"], (1, 2, 3),
            ("entailment", "not_entailment")),
    "wnli": ("WNLI", ("train", "dev"), ["index", "sentence1", "sentence2", "label"], (1, 2, 3), ("0", "1")),
}


def write_glue_download(root: Path, sentences: list[str], train: int = 16, dev: int = 8) -> Path:
    for task, (folder, files, header, (text, pair, label), names) in LAYOUTS.items():
        directory = root / folder
        directory.mkdir(parents=True, exist_ok=True)
        start = 0
        for split in files:
            count = train if split == "train" else dev
            if task == "mnli":
                header = MNLI_TRAIN_HEADER if split == "train" else MNLI_DEV_HEADER
            lines = [] if header is None else ["\t".join(header)]
            for i in range(start, start + count):
                first, second = sentences[i % len(sentences)], sentences[(i + 7) % len(sentences)]
                row = [f"x{i}"] * (len(header) if header else 4)
                row[text] = first
                if pair is not None:
                    row[pair] = second
                holds_the = " the " in f" {first.lower()} "
                if names is None:
                    row[label] = f"{4.0 if holds_the else 1.0 + (i % 3) * 0.5:.1f}"
                else:
                    row[label] = names[1] if holds_the else names[i % len(names)] if len(names) > 2 else names[0]
                if task == "mnli":
                    for column, name in enumerate(header):
                        if name.startswith("label"):
                            row[column] = row[label]
                lines.append("\t".join(row))
            (directory / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
            start += count
    return root
