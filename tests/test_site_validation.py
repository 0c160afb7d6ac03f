"""Sites judge the server classifier on their real validation images: the class-level sums, the prior
correction, the epoch choice and calibration, and the classifier's stop on convergence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import fedskew.factory.classifier as classifier_module
from fedskew.factory.classifier import ClassifierRecipe, checkpoint_epochs, holdout_score, train_classifier
from fedskew.factory.site_validation import (
    ClassScores,
    balanced_accuracy,
    class_scores,
    pooled,
    prior_correction,
    select_and_calibrate,
)
from fedskew.models.backbones import Classifier

CPU = torch.device("cpu")


class Identity2D(nn.Module):
    """Features = the two input values (images of shape (2, 1, 1)), so the head alone is the classifier."""

    feature_dim = 2

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return x


def linear_classifier(weight, bias) -> Classifier:
    model = Classifier(Identity2D(), 2)
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor(weight, dtype=torch.float32))
        model.head.bias.copy_(torch.tensor(bias, dtype=torch.float32))
    return model


def two_blobs(n_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.array([[1.0, 0.0], [0.0, 1.0]])
    labels = np.repeat([0, 1], n_per_class)
    points = centres[labels] + 0.1 * rng.standard_normal((2 * n_per_class, 2))
    return points.astype(np.float32)[:, :, None, None], labels


def test_class_scores_are_per_true_class_sums_that_pool_by_addition():
    images, labels = two_blobs(5, 0)
    model = linear_classifier([[1, 0], [0, 1]], [0, 0])
    site_a = class_scores(model, images[labels == 0], labels[labels == 0], 2, CPU)
    site_b = class_scores(model, images[labels == 1], labels[labels == 1], 2, CPU)
    total = pooled([site_a, site_b], 2)
    assert total.counts.tolist() == [5, 5] and total.correct.tolist() == [5, 5]
    np.testing.assert_allclose(total.prob_sums.sum(1), [5, 5], rtol=1e-6)
    assert site_a.prob_sums[1].sum() == 0  # site a holds no image of class 1
    assert balanced_accuracy(total) == 1.0


def test_prior_correction_raises_the_under_predicted_class_by_log_of_its_share():
    # Every image of both classes gets p = (0.9, 0.1): class shares 0.9 and 0.1 of a balanced set.
    scores = ClassScores(np.array([4.0, 6.0]), np.array([4.0, 0.0]), np.array([[3.6, 0.4], [5.4, 0.6]]))
    np.testing.assert_allclose(prior_correction(scores), [-math.log(1.8), -math.log(0.2)])
    # A class without validation images gets no step; the others are judged among themselves.
    partial = ClassScores(np.array([2.0, 0.0, 2.0]), np.zeros(3), np.array([[1.0, 0.5, 0.5], [0, 0, 0], [0.5, 0.5, 1.0]]))
    # Mean predicted probability of class 0 over a balanced mix of classes 0 and 2: (0.5 + 0.25) / 2.
    np.testing.assert_allclose(prior_correction(partial), [-math.log(0.375 * 2), 0.0, -math.log(0.375 * 2)])


def test_sites_pick_the_better_checkpoint_and_calibration_repairs_a_class_never_predicted():
    images, labels = two_blobs(20, 1)
    # Epoch 1 predicts class 0 for everything (a bias of +2 outweighs the features); epoch 2 has the
    # classes swapped. Only epoch 1 can be repaired by a bias.
    candidates = {
        1: linear_classifier([[1, 0], [0, 1]], [2, 0]).state_dict(),
        2: linear_classifier([[0, 1], [1, 0]], [0, 0]).state_dict(),
    }
    asked = []

    def ask_sites(state):
        asked.append(state)
        model = Classifier(Identity2D(), 2)
        model.load_state_dict(state)
        return pooled([class_scores(model, images[labels == c], labels[labels == c], 2, CPU) for c in (0, 1)], 2)

    state, report = select_and_calibrate(candidates, 2, ask_sites, rounds=3)
    assert report["chosen_epoch"] == 1
    assert report["site_val_balanced_accuracy_by_epoch"] == {"1": 0.5, "2": 0.0}
    assert report["site_val_balanced_accuracy"] == 1.0
    assert len(asked) == 2 + 3  # each candidate once, then one evaluation per calibration round
    model = Classifier(Identity2D(), 2)
    model.load_state_dict(state)
    assert (model(torch.from_numpy(images)).argmax(1).numpy() == labels).all()
    # The calibrated weights differ from the candidate's only in the output bias.
    assert all(torch.equal(state[k], candidates[1][k]) for k in state if k != "head.bias")


@pytest.mark.parametrize(
    "metrics",
    [
        {"counts": [1.0, 1.0], "correct": [1.0, 0.0]},  # no probability sums
        {"counts": [1.0], "correct": [1.0], "prob-sums": [1.0]},  # wrong class count
        {"counts": [1.0, 1.0], "correct": [2.0, 0.0], "prob-sums": [1.0, 0.0, 0.0, 1.0]},  # more hits than images
        {"counts": [1.0, 1.0], "correct": [1.0, 0.0], "prob-sums": [5.0, 0.0, 0.0, 1.0]},  # sums exceed images
        {"counts": [1.0, 1.0], "correct": [1.0, 0.0], "prob-sums": [float("nan"), 0.0, 0.0, 1.0]},
    ],
)
def test_a_malformed_site_reply_is_refused_naming_the_site(metrics):
    with pytest.raises(ValueError, match="site node 7"):
        ClassScores.from_metrics(metrics, 2, "site node 7")


def test_checkpoint_epochs_are_powers_of_two_best_and_last():
    assert checkpoint_epochs(5, 12) == [1, 2, 4, 5, 8, 12]
    assert checkpoint_epochs(1, 1) == [1]


def test_held_out_score_is_accuracy_and_mean_log_likelihood():
    class Fixed(nn.Module):  # logits that give probabilities 0.8 / 0.2 for the first class of every image
        def forward(self, x):
            return torch.tensor([[math.log(4.0), 0.0]]).repeat(len(x), 1)

    images, labels = np.zeros((4, 1, 8, 8), dtype=np.float32), np.array([0, 0, 0, 1])
    accuracy, log_likelihood = holdout_score(Fixed(), images, labels, CPU)
    assert accuracy == 0.75
    assert log_likelihood == pytest.approx((3 * math.log(0.8) + math.log(0.2)) / 4, rel=1e-6)
    assert holdout_score(Fixed(), images[:0], labels[:0], CPU) == (0.0, 0.0)


def test_classifier_keeps_the_best_score_breaking_accuracy_ties_by_likelihood_and_stops_after_patience(monkeypatch):
    # Scripted held-out scores: epoch 3 ties epoch 2 on accuracy with a better likelihood; 4 and 5 improve
    # neither, so patience 2 stops after epoch 5 and the weights of epoch 3 come back.
    scores = iter([(0.90, -0.5), (0.95, -0.4), (0.95, -0.2), (0.95, -0.3), (0.94, -0.1), (0.99, -0.01)])
    monkeypatch.setattr(classifier_module, "holdout_score", lambda *args: next(scores))
    rng = np.random.default_rng(0)
    images, labels = rng.random((20, 1, 8, 8), dtype=np.float32), np.arange(20) % 2
    recipe = ClassifierRecipe("small-cnn", 8, 50, 0.05, 0.9, 1e-4, 20, "none", patience=2)
    checkpoints = {}
    model, stats = train_classifier(images, labels, 2, recipe, val_fraction=0.2, seed=0, device=CPU, checkpoints=checkpoints)
    assert (stats["best_epoch"], stats["last_epoch"]) == (3, 5)
    assert (stats["val_accuracy"], stats["val_nll"]) == (0.95, 0.2)
    assert sorted(checkpoints) == [1, 2, 3, 4, 5]
    assert all(torch.equal(v, checkpoints[3][k]) for k, v in model.state_dict().items())
