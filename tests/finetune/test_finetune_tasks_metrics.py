"""Fine-tuning metrics (GLUE's definitions), against values derived by hand."""

from __future__ import annotations

import math

import pytest

from convbert_ds.finetune.metrics import accuracy, compute_metrics, f1, matthews_corrcoef, pearson, spearman
from convbert_ds.finetune.tasks import TaskData

# references [1,1,1,1,0,0,0], predictions [1,1,1,0,0,0,1]: TP=3, FN=1, TN=2, FP=1.
BINARY_REFERENCES = [1, 1, 1, 1, 0, 0, 0]
BINARY_PREDICTIONS = [1, 1, 1, 0, 0, 0, 1]


def test_binary_classification_metrics():
    assert accuracy(BINARY_PREDICTIONS, BINARY_REFERENCES) == pytest.approx(5 / 7)
    # F1 = 2TP / (2TP + FP + FN) = 6 / 8.
    assert f1(BINARY_PREDICTIONS, BINARY_REFERENCES) == pytest.approx(0.75)
    # MCC = (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (6 - 1) / sqrt(4*4*3*3) = 5/12.
    assert matthews_corrcoef(BINARY_PREDICTIONS, BINARY_REFERENCES) == pytest.approx(5 / 12)
    assert f1([0, 0], [0, 0]) == 0.0  # no positives at all


def test_multiclass_mcc_and_undefined_mcc():
    # references [0,0,1,1,2,2], predictions [0,1,1,1,2,0]: true counts t=(2,2,2), predicted p=(2,3,1),
    # correct c=4, total s=6. MCC = (c*s - t.p) / sqrt((s^2 - p.p)(s^2 - t.t)) = (24-12) / sqrt(22*24) = 3/sqrt(33).
    assert matthews_corrcoef([0, 1, 1, 1, 2, 0], [0, 0, 1, 1, 2, 2]) == pytest.approx(3 / math.sqrt(33))
    assert matthews_corrcoef([1, 1, 1], [0, 1, 0]) == 0.0  # one predicted class: undefined


def test_correlations():
    # x=(1,2,3), y=(1,3,2): centred (-1,0,1) and (-1,1,0); sum of products 1, sums of squares 2 and 2: r = 1/2.
    assert pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    # x=(1,2,2,3) ranks (1,2.5,2.5,4), y=(1,3,2,4) ranks (1,3,2,4); centred (-1.5,0,0,1.5) and
    # (-1.5,.5,-.5,1.5): products 4.5, squares 4.5 and 5, so rho = 4.5/sqrt(22.5) = sqrt(0.9).
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(math.sqrt(0.9))
    # Spearman only sees order: a monotone but non-linear relation is a perfect 1.
    assert spearman([1, 10, 100, 1000], [0.1, 0.2, 0.3, 0.4]) == pytest.approx(1.0)
    assert pearson([0.1, 0.1, 0.1], [1, 2, 3]) == 0.0  # constant predictions: undefined
    assert math.isnan(pearson([1.0, float("nan"), 2.0], [1, 2, 3]))


def task(name, labels, task_type="classification"):
    return TaskData(name, task_type, labels, [], {"dev": []}, "accuracy", {})


@pytest.mark.parametrize("name, labels, keys", [
    ("sst2", ["0", "1"], {"accuracy"}),
    ("mrpc", ["0", "1"], {"accuracy", "f1"}),
    ("qqp", ["0", "1"], {"accuracy", "f1"}),
    ("cola", ["0", "1"], {"accuracy", "mcc"}),
    ("custom", ["neg", "pos"], {"accuracy", "f1", "mcc"}),
])
def test_compute_metrics_binary_keys(name, labels, keys):
    metrics = compute_metrics(task(name, labels), BINARY_PREDICTIONS, BINARY_REFERENCES)
    assert set(metrics) == keys
    assert all(type(value) is float for value in metrics.values())
    assert metrics["accuracy"] == pytest.approx(5 / 7)


def test_compute_metrics_multiclass_and_regression():
    mnli = compute_metrics(task("mnli", ["contradiction", "entailment", "neutral"]), [0, 1, 2], [0, 1, 1])
    assert mnli == {"accuracy": pytest.approx(2 / 3)}
    custom = compute_metrics(task("custom", ["a", "b", "c"]), [0, 1, 1, 1, 2, 0], [0, 0, 1, 1, 2, 2])
    assert set(custom) == {"accuracy", "mcc"}
    stsb = compute_metrics(task("stsb", [], "regression"), [1.0, 3.0, 2.0], [1.0, 2.0, 3.0])
    # errors (0, 1, -1): mse = 2/3; pearson of (1,3,2) and (1,2,3) is 1/2 as above, and so is spearman.
    assert stsb == {"pearson": pytest.approx(0.5), "spearman": pytest.approx(0.5), "mse": pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="class indices from 0 to 2"):
        compute_metrics(task("mnli", ["contradiction", "entailment", "neutral"]), [3], [0])
