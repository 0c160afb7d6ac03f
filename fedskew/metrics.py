"""Classification metrics for single-label and multi-label predictions.

Classes absent from the evaluated labels have no defined AUC; they are left out of the
macro averages (and reported as NaN per class) instead of crashing or counting as 0.5.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import average_precision_score, balanced_accuracy_score, f1_score, recall_score, roc_auc_score


def _per_class(score, y_true_binary: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Apply a binary metric per class column; NaN where the class has only one label value."""
    values = np.full(y_true_binary.shape[1], np.nan)
    for k in range(y_true_binary.shape[1]):
        column = y_true_binary[:, k]
        if 0 < column.sum() < len(column):
            values[k] = score(column, scores[:, k])
    return values


def _nanmean(values: np.ndarray) -> float:
    return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")


def single_label_metrics(y_true: np.ndarray, probs: np.ndarray) -> dict[str, float | list[float]]:
    """Accuracy, balanced accuracy, macro one-vs-rest AUROC and per-class recall.

    y_true: (N,) class ids; probs: (N, K) class probabilities.
    """
    y_true = np.asarray(y_true, dtype=np.int64)
    num_classes = probs.shape[1]
    pred = probs.argmax(axis=1)
    one_hot = np.eye(num_classes, dtype=np.int64)[y_true]
    per_class_auc = _per_class(roc_auc_score, one_hot, probs)
    recall = recall_score(y_true, pred, labels=np.arange(num_classes), average=None, zero_division=0)
    return {
        "accuracy": float((pred == y_true).mean()),
        "balanced_accuracy": float(balanced_accuracy_score(y_true, pred)),
        "auroc_macro": _nanmean(per_class_auc),
        "per_class_recall": [float(r) for r in recall],
    }


def multilabel_metrics(y_true: np.ndarray, probs: np.ndarray, threshold: float = 0.5) -> dict[str, float | list[float]]:
    """Macro/micro AUC, macro/micro F1 at `threshold`, mAP, per-class AUC and F1.

    y_true: (N, K) multi-hot; probs: (N, K) per-label probabilities.
    """
    y_true = np.asarray(y_true).astype(np.int64)
    pred = (probs > threshold).astype(np.int64)
    per_class_auc = _per_class(roc_auc_score, y_true, probs)
    per_class_ap = _per_class(average_precision_score, y_true, probs)
    per_class_f1 = f1_score(y_true, pred, average=None, zero_division=0)
    return {
        "auc_macro": _nanmean(per_class_auc),
        "auc_micro": float(roc_auc_score(y_true.ravel(), probs.ravel())),
        "f1_macro": float(per_class_f1.mean()),
        "f1_micro": float(f1_score(y_true, pred, average="micro", zero_division=0)),
        "map": _nanmean(per_class_ap),
        # MedMNIST's multi-label ACC (medmnist.evaluator.getACC): per-label accuracy at the threshold,
        # averaged over labels, so numbers compare with MedMNIST's ChestMNIST benchmarks.
        "accuracy_medmnist": float((pred == y_true).mean()),
        "per_class_auc": [float(v) for v in per_class_auc],
        "per_class_f1": [float(v) for v in per_class_f1],
    }


def headline_metric(multilabel: bool) -> str:
    """The metric that picks the best round: macro F1 for multi-label (as in the FedNCA-ML paper), accuracy otherwise."""
    return "f1_macro" if multilabel else "accuracy"
