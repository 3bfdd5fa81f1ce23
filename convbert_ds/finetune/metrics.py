"""GLUE's metrics in numpy, defined as sklearn and scipy define them (neither is a dependency).

Where a correlation is undefined (a constant prediction, as a model often gives early in
training) it is 0.0 rather than scipy's NaN: "no correlation" is what it means for model
selection, and NaN would poison comparisons of runs and the JSON results. Only NaN predictions
(a diverged model) give NaN.
"""

from __future__ import annotations

import numpy as np

from convbert_ds.finetune.tasks import TaskData, default_positive_label

_F1_TASKS = ("mrpc", "qqp")
_MCC_TASKS = ("cola", "custom")


def accuracy(predictions, references) -> float:
    predictions, references = _arrays(predictions, references)
    return float(np.mean(predictions == references))


def f1(predictions, references, positive: int = 1) -> float:
    """Binary F1 of class ``positive`` (1: GLUE's "1" of MRPC and QQP); 0.0 without any positive."""
    predictions, references = _arrays(predictions, references)
    true_positives = np.sum((predictions == positive) & (references == positive))
    false_positives = np.sum((predictions == positive) & (references != positive))
    false_negatives = np.sum((predictions != positive) & (references == positive))
    denominator = 2 * true_positives + false_positives + false_negatives
    return float(2 * true_positives / denominator) if denominator else 0.0


def matthews_corrcoef(predictions, references) -> float:
    """Matthews correlation for any number of classes (Gorodkin's R_K, as sklearn computes it).

    0.0 when undefined, i.e. when either the predictions or the references are all one class.
    """
    predictions, references = _arrays(predictions, references)
    classes = int(max(predictions.max(), references.max())) + 1
    # Classes absent from both vectors add nothing to any sum, so counting up to the largest is enough.
    true_counts = np.bincount(references, minlength=classes).astype(np.float64)
    predicted_counts = np.bincount(predictions, minlength=classes).astype(np.float64)
    correct = float(np.sum(predictions == references))
    total = float(len(references))
    covariance = correct * total - true_counts @ predicted_counts
    variance_predicted = total**2 - predicted_counts @ predicted_counts
    variance_true = total**2 - true_counts @ true_counts
    if variance_predicted * variance_true == 0:
        return 0.0
    return float(covariance / np.sqrt(variance_predicted * variance_true))


def pearson(predictions, references) -> float:
    predictions, references = _arrays(predictions, references, np.float64)
    # Tested on the values, not on the centred sums: a constant's float mean can leave tiny residues.
    if np.all(predictions == predictions[0]) or np.all(references == references[0]):
        return 0.0
    x = predictions - predictions.mean()
    y = references - references.mean()
    # Rounding can step just outside [-1, 1]; np.clip keeps a NaN (from NaN predictions) visible.
    return float(np.clip(x @ y / np.sqrt((x @ x) * (y @ y)), -1.0, 1.0))


def spearman(predictions, references) -> float:
    """Pearson correlation of the ranks; tied values share the average of their ranks."""
    predictions, references = _arrays(predictions, references, np.float64)
    if np.isnan(predictions).any() or np.isnan(references).any():
        return float("nan")  # NaN has no rank; as in pearson, a diverged model must not look correlated
    return pearson(_average_ranks(predictions), _average_ranks(references))


def compute_metrics(task: TaskData, predictions, references) -> dict[str, float]:
    """Every metric the task reports, keyed as ``task.metric`` names the primary one.

    Classification: ``predictions``/``references`` are class indices into ``task.label_names``;
    "accuracy" always, "f1" for MRPC, QQP and binary custom tasks (of ``task.positive_label``), "mcc" for CoLA
    and custom tasks.
    Regression: floats; "pearson", "spearman" and "mse".
    """
    if task.task_type == "regression":
        predicted, true = _arrays(predictions, references, np.float64)
        return {"pearson": pearson(predicted, true), "spearman": spearman(predicted, true),
                "mse": float(np.mean((predicted - true) ** 2))}
    predicted, true = _arrays(predictions, references)
    for name, values in (("predictions", predicted), ("references", true)):
        if values.min() < 0 or values.max() >= len(task.label_names):
            raise ValueError(f"{name} must be class indices from 0 to {len(task.label_names) - 1} "
                             f"({', '.join(task.label_names)}), got {values.min()} to {values.max()}")
    metrics = {"accuracy": accuracy(predicted, true)}
    if task.name in _F1_TASKS or (task.name == "custom" and len(task.label_names) == 2):
        metrics["f1"] = f1(predicted, true, positive=_positive_class(task))
    if task.name in _MCC_TASKS:
        metrics["mcc"] = matthews_corrcoef(predicted, true)
    return metrics


def _positive_class(task: TaskData) -> int:
    """The index of the class F1 counts: ``task.positive_label``, or for a TaskData made without one (by hand,
    not by the readers) the default the readers would choose ("1" for MRPC and QQP)."""
    label = task.positive_label or default_positive_label(task.label_names)[0]
    return task.label_names.index(label)


def _arrays(predictions, references, dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    predictions = np.asarray(predictions, dtype=dtype)
    references = np.asarray(references, dtype=dtype)
    if predictions.ndim != 1 or predictions.shape != references.shape or len(predictions) == 0:
        raise ValueError(f"predictions and references must be equally long, non-empty vectors; got shapes "
                         f"{predictions.shape} and {references.shape}")
    return predictions, references


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given the mean of the ranks they span (scipy's rankdata 'average')."""
    ordered = np.sort(values)
    # A value's ties fill sorted positions [start, end): the mean of the 1-based ranks start+1 .. end.
    return (np.searchsorted(ordered, values, "left") + 1 + np.searchsorted(ordered, values, "right")) / 2
