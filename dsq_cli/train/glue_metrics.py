"""The GLUE leaderboard metrics in numpy, as the GLUE trainer scores its dev set.

Decisions (``GlueTask.metrics``; the first is result.json's ``value``)
- SST-2, RTE, QNLI, MNLI: accuracy. CoLA: Matthews correlation (``mcc``).
- MRPC, QQP: F1 of class 1 (the leaderboard lists F1 first), then accuracy.
- STS-B: Pearson, then Spearman.
- ``glue_score`` is the mean of a task's leaderboard numbers (all of ``metrics``), which is what
  the GLUE average uses: the mean of F1 and accuracy for MRPC and QQP, of Pearson and Spearman
  for STS-B, the single metric otherwise.
- Values are fractions (accuracy and F1 in 0..1, correlations in -1..1), not percentages.
  A correlation that is undefined (a constant side) is 0.0; F1 with no positive prediction or
  label is 0.0. Non-finite STS-B predictions (a diverged model) give NaN correlations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dsq_cli.data.glue import GlueTask


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(predictions == labels))


def _binary_counts(predictions: np.ndarray, labels: np.ndarray) -> tuple[int, int, int, int]:
    """(tp, fp, fn, tn) with class 1 positive, as Python ints (products cannot overflow)."""
    positive, actual = predictions == 1, labels == 1
    tp = int(np.sum(positive & actual))
    fp = int(np.sum(positive & ~actual))
    fn = int(np.sum(~positive & actual))
    return tp, fp, fn, len(labels) - tp - fp - fn


def binary_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
    """F1 of class 1; 0.0 when neither predictions nor labels hold a 1."""
    tp, fp, fn, _ = _binary_counts(predictions, labels)
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def matthews_corrcoef(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Binary Matthews correlation; 0.0 when undefined (a constant side)."""
    tp, fp, fn, tn = _binary_counts(predictions, labels)
    denominator = (tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)
    if denominator == 0:
        return 0.0
    return (tp * tn - fp * fn) / math.sqrt(denominator)


def pearson(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Pearson correlation; 0.0 when a side is constant, NaN when a value is not finite."""
    x, y = predictions.astype(np.float64), labels.astype(np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return math.nan
    # Exact test: the centred values of a constant side need not be exactly 0 in floating point.
    if np.all(x == x[0]) or np.all(y == y[0]):
        return 0.0
    x, y = x - x.mean(), y - y.mean()
    r = float(np.dot(x, y) / (np.sqrt(np.dot(x, x)) * np.sqrt(np.dot(y, y))))
    return min(1.0, max(-1.0, r))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing the average of the ranks they span."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts_run = np.empty(len(values), dtype=bool)
    starts_run[:1] = True
    starts_run[1:] = ordered[1:] != ordered[:-1]
    run_starts = np.flatnonzero(starts_run)
    run_ends = np.append(run_starts[1:], len(values))  # exclusive
    run_rank = (run_starts + run_ends + 1) / 2  # mean of the 1-based ranks start+1..end
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = run_rank[np.cumsum(starts_run) - 1]
    return ranks


def spearman(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Spearman correlation: Pearson of the average ranks."""
    x, y = predictions.astype(np.float64), labels.astype(np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return math.nan
    return pearson(average_ranks(x), average_ranks(y))


METRIC_FUNCTIONS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": accuracy,
    "f1": binary_f1,
    "mcc": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}


def _class_indices(values: Sequence, num_classes: int, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind == "f" and np.all(np.isfinite(array)) and np.all(array == np.round(array)):
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{what} must be class indices (integers), got dtype {array.dtype}")
    if np.any(array < 0) or np.any(array >= num_classes):
        raise ValueError(f"{what} must lie in 0..{num_classes - 1}")
    return array


def compute_metrics(task: GlueTask, predictions: Sequence, labels: Sequence) -> dict[str, float]:
    """The task's leaderboard metrics of ``predictions`` (class indices; floats for STS-B)
    against ``labels``, plus ``glue_score`` (their mean) and ``value`` (the task's metric)."""
    shapes = np.shape(predictions), np.shape(labels)
    if len(shapes[0]) != 1 or shapes[0] != shapes[1] or shapes[0][0] == 0:
        raise ValueError(
            f"predictions and labels must be two non-empty 1-D sequences of the same length, "
            f"got shapes {shapes[0]} and {shapes[1]} (take the argmax of logits first)"
        )
    if task.is_regression:
        y_pred = np.asarray(predictions, dtype=np.float64)
        y_true = np.asarray(labels, dtype=np.float64)
        if not np.all(np.isfinite(y_true)):
            raise ValueError("labels must be finite scores")
    else:
        y_pred = _class_indices(predictions, task.num_classes, "predictions")
        y_true = _class_indices(labels, task.num_classes, "labels")
    scores = {name: float(METRIC_FUNCTIONS[name](y_pred, y_true)) for name in task.metrics}
    scores["glue_score"] = float(np.mean([scores[name] for name in task.metrics]))
    scores["value"] = scores[task.metric]
    return scores
