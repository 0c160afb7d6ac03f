"""Sites judge the server's classifier on their own real validation images; only class-level sums
leave a site.

The server's classifier learns from synthetic images only, and its held-out share is synthetic too,
so it cannot see the synthetic-to-real gap. With `factory.site-validation` the server sends its
candidate classifiers (checkpoints of one training run) to the sites; each site returns, per true
class it holds, the image count, the correct predictions and the sum of predicted probabilities
(a K x K table, never an image, a prediction of one image or a label). The server
- picks the candidate with the best balanced accuracy over the sites' pooled validation images, and
- calibrates the output biases of that classifier (prior correction, Saerens et al. 2002): the mean
  predicted probability of each class over a class-balanced real set should be 1 / K; a class the
  classifier under-predicts on real images gets its logit raised by log(K x its share), repeated
  for `factory.calibration-rounds` rounds, each a fresh site evaluation of the updated biases; the
  biases of the round with the best balanced accuracy are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedskew.training import make_loader, predict

# A class predicted with total probability below this (of a class-balanced set) is treated as this
# rare, which bounds one round's bias step at log(K / floor).
SHARE_FLOOR = 1e-3
HEAD_BIAS = "head.bias"  # fedskew.models.backbones.Classifier's output layer


@dataclass(frozen=True)
class ClassScores:
    """What a site returns for one classifier: per true class (K) the image count, the correct
    predictions, and (K x K) the summed predicted probabilities."""

    counts: np.ndarray
    correct: np.ndarray
    prob_sums: np.ndarray

    def __add__(self, other: ClassScores) -> ClassScores:
        return ClassScores(self.counts + other.counts, self.correct + other.correct, self.prob_sums + other.prob_sums)

    def to_metrics(self) -> dict[str, list[float]]:
        return {"counts": self.counts.tolist(), "correct": self.correct.tolist(), "prob-sums": self.prob_sums.ravel().tolist()}

    @classmethod
    def from_metrics(cls, metrics: dict, num_classes: int, source: str) -> ClassScores:
        """Checked parse of a site's reply: lists of the right length, finite, non-negative, at most
        one correct prediction and one unit of probability per image."""
        try:
            counts = np.asarray(metrics["counts"], dtype=np.float64)
            correct = np.asarray(metrics["correct"], dtype=np.float64)
            prob_sums = np.asarray(metrics["prob-sums"], dtype=np.float64)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: site validation reply lacks counts/correct/prob-sums lists ({err})") from None
        if counts.shape != (num_classes,) or correct.shape != (num_classes,) or prob_sums.shape != (num_classes**2,):
            raise ValueError(
                f"{source}: site validation reply has {counts.size} counts, {correct.size} correct and "
                f"{prob_sums.size} probability sums; expected {num_classes}, {num_classes} and {num_classes ** 2}"
            )
        prob_sums = prob_sums.reshape(num_classes, num_classes)
        valid = (
            np.isfinite(prob_sums).all() and (counts >= 0).all() and (correct >= 0).all() and (correct <= counts).all()
            and (prob_sums >= 0).all() and np.allclose(prob_sums.sum(1), counts, atol=1e-3 * np.maximum(counts, 1))
        )  # fmt: skip
        if not valid:
            raise ValueError(f"{source}: site validation reply is inconsistent (negative, non-finite or more hits than images)")
        return cls(counts, correct, prob_sums)


def with_logit_bias(state: dict[str, torch.Tensor], bias: np.ndarray) -> dict[str, torch.Tensor]:
    """Classifier weights with `bias` added to the output layer's bias (what the sites evaluate and what
    the run keeps: an ordinary classifier, no wrapper)."""
    shifted = dict(state)
    shifted[HEAD_BIAS] = state[HEAD_BIAS] + torch.as_tensor(bias, dtype=state[HEAD_BIAS].dtype)
    return shifted


def class_scores(
    model: nn.Module, images: np.ndarray, labels: np.ndarray, num_classes: int, device: torch.device
) -> ClassScores:
    """Site side: the class-level sums of `model` on the site's validation images."""
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    if len(labels) == 0:
        return ClassScores(counts, counts.copy(), np.zeros((num_classes, num_classes)))
    y_true, probs = predict(model, make_loader(images, labels, 256, shuffle=False), device, multilabel=False)
    correct = np.bincount(y_true[probs.argmax(1) == y_true], minlength=num_classes).astype(np.float64)
    prob_sums = np.zeros((num_classes, num_classes))
    np.add.at(prob_sums, y_true, probs.astype(np.float64))
    return ClassScores(counts, correct, prob_sums)


def balanced_accuracy(scores: ClassScores) -> float:
    """Mean recall over the classes with at least one validation image."""
    present = scores.counts > 0
    return float((scores.correct[present] / scores.counts[present]).mean()) if present.any() else float("nan")


def prior_correction(scores: ClassScores) -> np.ndarray:
    """Bias step that makes the mean predicted probability of each validated class, over a class-balanced
    mix of the validation images, equal 1 / (validated classes): -log(share x classes). Classes with no
    validation image get no step."""
    present = scores.counts > 0
    step = np.zeros(len(scores.counts))
    if not present.any():
        return step
    per_class_mean = scores.prob_sums[present] / scores.counts[present, None]  # rows: true classes present
    share = per_class_mean.mean(0)[present]
    step[present] = -np.log(np.maximum(share, SHARE_FLOOR) * present.sum())
    return step


# Sends classifier weights to the sites and returns their pooled ClassScores.
AskSites = Callable[[dict[str, torch.Tensor]], ClassScores]


def select_and_calibrate(
    candidates: dict[int, dict[str, torch.Tensor]], num_classes: int, ask_sites: AskSites, rounds: int
) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, report): the candidate with the best real balanced accuracy at the sites, then `rounds`
    prior-correction steps of its output bias, keeping the round with the best balanced accuracy
    (ties keep the earlier: the smaller correction)."""
    scores = {epoch: ask_sites(state) for epoch, state in sorted(candidates.items())}
    by_epoch = {epoch: balanced_accuracy(s) for epoch, s in scores.items()}
    chosen = max(by_epoch, key=lambda e: (by_epoch[e], e))
    latest, bias, history = scores[chosen], np.zeros(num_classes), []
    best_bias, best_accuracy = bias, by_epoch[chosen]
    for _ in range(rounds):
        bias = bias + prior_correction(latest)
        latest = ask_sites(with_logit_bias(candidates[chosen], bias))
        history.append(balanced_accuracy(latest))
        if history[-1] > best_accuracy:
            best_bias, best_accuracy = bias.copy(), history[-1]
    report = {
        "site_val_balanced_accuracy_by_epoch": {str(e): a for e, a in by_epoch.items()},
        "chosen_epoch": chosen,
        "site_val_balanced_accuracy_by_calibration_round": history,
        "site_val_balanced_accuracy": best_accuracy,
        "class_bias": best_bias.tolist(),
        "site_val_images": int(latest.counts.sum()),
    }
    return with_logit_bias(candidates[chosen], best_bias), report


def pooled(replies: Sequence[ClassScores], num_classes: int) -> ClassScores:
    total = ClassScores(np.zeros(num_classes), np.zeros(num_classes), np.zeros((num_classes, num_classes)))
    for reply in replies:
        total = total + reply
    return total
