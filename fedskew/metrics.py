"""Classification metrics for single-label and multi-label predictions.

Classes absent from the evaluated labels have no defined AUC; they are left out of the
macro averages (and reported as NaN per class) instead of crashing or counting as 0.5.

Multi-label decisions use one threshold shared by all classes. With run-config `threshold =
"validation"` it is chosen each round on validation data from per-class true-positive /
false-positive / false-negative counts at every threshold of THRESHOLD_GRID: each site counts on
its own validation split (only the counts leave it), the server sums the counts and takes the
threshold with the best macro-F1 of the sums, which is the macro-F1 of the pooled predictions.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import average_precision_score, f1_score, recall_score, roc_auc_score


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

    y_true: (N,) class ids; probs: (N, K) class probabilities. Balanced accuracy is the mean recall over
    the classes present in y_true, scikit-learn's definition; computed from the recalls here because a
    site's split under label skew often lacks classes the model predicts, and scikit-learn warns on
    every such evaluation.
    """
    y_true = np.asarray(y_true, dtype=np.int64)
    num_classes = probs.shape[1]
    pred = probs.argmax(axis=1)
    one_hot = np.eye(num_classes, dtype=np.int64)[y_true]
    per_class_auc = _per_class(roc_auc_score, one_hot, probs)
    recall = recall_score(y_true, pred, labels=np.arange(num_classes), average=None, zero_division=0)
    return {
        "accuracy": float((pred == y_true).mean()),
        "balanced_accuracy": float(recall[np.bincount(y_true, minlength=num_classes) > 0].mean()),
        "auroc_macro": _nanmean(per_class_auc),
        "per_class_recall": [float(r) for r in recall],
    }


DEFAULT_THRESHOLD = 0.5  # a sigmoid's own decision point; the F1 of earlier runs
THRESHOLD_GRID = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 0.05, 0.10, ..., 0.95
TIE_TOLERANCE = 1e-12  # macro-F1 values closer than this are equal (the same counts give the same float)


def counted_thresholds(setting: str | float) -> tuple[float, ...]:
    """The thresholds validation counts are taken at for run-config `threshold`: the grid to choose from
    ("validation"), else the fixed threshold and 0.5 (for the F1 at 0.5 that old runs report)."""
    if setting == "validation":
        return THRESHOLD_GRID
    return tuple(sorted({float(setting), DEFAULT_THRESHOLD}))


def threshold_counts(y_true: np.ndarray, probs: np.ndarray, thresholds: tuple[float, ...]) -> np.ndarray:
    """(T, K, 3) int64: per threshold and class, the true positives, false positives and false negatives of
    predicting every label whose probability is > the threshold. Sums of these over sites are the counts of
    the sites' pooled predictions."""
    positive = np.asarray(y_true).astype(bool)[None]
    predicted = np.asarray(probs)[None] > np.asarray(thresholds, dtype=np.float64)[:, None, None]
    tp = (predicted & positive).sum(axis=1)
    fp = (predicted & ~positive).sum(axis=1)
    fn = (~predicted & positive).sum(axis=1)
    return np.stack([tp, fp, fn], axis=-1).astype(np.int64)


def f1_from_counts(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(macro-F1, micro-F1) over the last two axes of (..., K, 3) counts. A class with no positive and no
    prediction scores 0, as scikit-learn's f1_score(zero_division=0) that multilabel_metrics uses."""
    counts = np.asarray(counts, dtype=np.float64)
    tp, fp, fn = counts[..., 0], counts[..., 1], counts[..., 2]

    def f1(tp, fp, fn):
        denominator = 2 * tp + fp + fn
        return np.divide(2 * tp, denominator, out=np.zeros_like(denominator), where=denominator > 0)

    return f1(tp, fp, fn).mean(axis=-1), f1(tp.sum(-1), fp.sum(-1), fn.sum(-1))


def choose_threshold(counts: np.ndarray, thresholds: tuple[float, ...]) -> float:
    """The threshold whose counts give the best macro-F1. Equally good thresholds go to the one nearest
    0.5 (the lower of two equally near): validation moves the decision away from the sigmoid's own
    point only on evidence, and a model that separates nothing (the same F1 everywhere) keeps 0.5."""
    macro, _ = f1_from_counts(counts)
    if len(macro) != len(thresholds):
        raise ValueError(f"counts hold {len(macro)} thresholds, expected {len(thresholds)}")
    best = macro.max()
    tied = [t for t, score in zip(thresholds, macro) if score >= best - TIE_TOLERANCE]
    return float(min(tied, key=lambda t: (abs(t - DEFAULT_THRESHOLD), t)))


def counted_f1(counts: np.ndarray, thresholds: tuple[float, ...], threshold: float) -> dict[str, float]:
    """Macro/micro F1 at `threshold` and macro F1 at 0.5 from counts taken at `thresholds` (both must be among them)."""
    macro, micro = f1_from_counts(counts)
    at = {t: k for k, t in enumerate(thresholds)}
    return {"f1_macro": float(macro[at[threshold]]), "f1_micro": float(micro[at[threshold]]),
            "f1_macro_at_0.5": float(macro[at[DEFAULT_THRESHOLD]])}  # fmt: skip


def multilabel_metrics(
    y_true: np.ndarray, probs: np.ndarray, threshold: float = DEFAULT_THRESHOLD
) -> dict[str, float | list[float]]:
    """Macro/micro AUC, macro/micro F1 at `threshold` (and at 0.5), mAP, per-class AUC and F1.

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
        # The fixed 0.5 of runs before the threshold was chosen on validation, so their numbers compare.
        "f1_macro_at_0.5": float(f1_score(y_true, (probs > DEFAULT_THRESHOLD).astype(np.int64), average="macro", zero_division=0)),
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
