"""What the papers report, and how: the metric of each task, the two GLUE averages, and the ConvBERT paper's
numbers for its model sizes.

The papers' GLUE score (ConvBERT section 4.2, as ELECTRA): the mean of 8 tasks, WNLI left out, with Matthews
correlation for CoLA, Spearman correlation for STS-B and accuracy for the rest (MNLI: matched). The
leaderboard's score is another number: all 9 tasks, the F1/accuracy pairs of MRPC and QQP, Pearson/Spearman
of STS-B and MNLI matched/mismatched each averaged into one task score first. Both are given, labelled.
"""

from __future__ import annotations

GLUE = ("mnli", "qnli", "qqp", "rte", "sst2", "mrpc", "cola", "stsb", "wnli")  # the paper's column order, then WNLI
SQUAD = ("squad", "squad_v2")
PAPER_AVERAGE_TASKS = GLUE[:8]
TITLES = {"mnli": "MNLI-m", "qnli": "QNLI", "qqp": "QQP", "rte": "RTE", "sst2": "SST-2", "mrpc": "MRPC",
          "cola": "CoLA", "stsb": "STS-B", "wnli": "WNLI", "squad": "SQuAD v1.1", "squad_v2": "SQuAD v2.0"}

# task -> (split, metric) of fine-tuning's results, in the papers' convention; GLUE's 0-1 metrics are shown x100.
PAPER_METRIC = {"mnli": ("dev_matched", "accuracy"), "qnli": ("dev", "accuracy"), "qqp": ("dev", "accuracy"),
                "rte": ("dev", "accuracy"), "sst2": ("dev", "accuracy"), "mrpc": ("dev", "accuracy"),
                "cola": ("dev", "mcc"), "stsb": ("dev", "spearman"), "wnli": ("dev", "accuracy"),
                "squad": ("validation", "f1"), "squad_v2": ("validation", "f1")}
# Shown beside the paper metric: MNLI mismatched, and SQuAD's exact match (Table 4 gives EM and F1).
SECOND_METRIC = {"mnli": ("dev_mismatched", "accuracy"), "squad": ("validation", "exact_match"),
                 "squad_v2": ("validation", "exact")}
# The leaderboard's task score: the mean of these.
LEADERBOARD_METRICS = {"mnli": (("dev_matched", "accuracy"), ("dev_mismatched", "accuracy")),
                       "mrpc": (("dev", "f1"), ("dev", "accuracy")), "qqp": (("dev", "f1"), ("dev", "accuracy")),
                       "stsb": (("dev", "pearson"), ("dev", "spearman"))}

# ConvBERT paper, Table 3: GLUE *test* set (the GLUE server), the models trained for the paper's 1M updates.
TABLE_3_TEST = {
    "small": {"mnli": 81.5, "qnli": 88.5, "qqp": 88.0, "rte": 62.2, "sst2": 89.2, "mrpc": 83.3, "cola": 54.8,
              "stsb": 83.4, "average": 78.9},
    "medium-small": {"mnli": 82.1, "qnli": 88.7, "qqp": 88.4, "rte": 65.3, "sst2": 89.2, "mrpc": 84.6, "cola": 56.4,
                     "stsb": 82.9, "average": 79.7},
    "base": {"mnli": 85.3, "qnli": 92.4, "qqp": 89.6, "rte": 74.7, "sst2": 95.0, "mrpc": 88.2, "cola": 66.0,
             "stsb": 88.2, "average": 84.9},
}
# ConvBERT paper, Table 4: SQuAD *dev* sets, (EM, F1).
TABLE_4_DEV = {
    "small": {"squad": (77.1, 84.1), "squad_v2": (68.7, 70.5)},
    "medium-small": {"squad": (79.4, 86.0), "squad_v2": (71.7, 74.3)},
    "base": {"squad": (84.7, 90.9), "squad_v2": (80.6, 83.1)},
}


def scale(task: str) -> float:
    """GLUE's metrics are fractions, shown as percentages as the papers do; SQuAD's are percentages already."""
    return 1.0 if task in SQUAD else 100.0


def metric_label(task: str) -> str:
    split, metric = PAPER_METRIC[task]
    return {"mcc": "MCC", "spearman": "Spearman", "accuracy": "acc", "f1": "F1"}.get(metric, metric)
