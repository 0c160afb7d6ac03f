"""Classifiers trained on synthetic (and, in P2P, real) images, and the Product of Experts.

The recipe is the paper's optimiser (SGD lr 0.05, momentum 0.9, weight decay 1e-4, cosine decay to
0, cross-entropy, bf16 autocast on GPU) with the architecture and epochs from the run config; a
held-out share of the training images picks the best epoch, and training stops once that share has
not improved for `patience` epochs (the cosine schedule spans the epoch limit).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.config import RunConfig
from fedskew.factory.library import UploadRejected
from fedskew.models.backbones import Classifier, build_classifier
from fedskew.models.ensemble import LOG_PROB_FLOOR
from fedskew.models.build import weights_mismatch
from fedskew.models.edm2 import augment as flip_rotate
from fedskew.training import EVAL_BATCH_SIZE, LossFn, make_loader, predict, random_shift, train_local

@dataclass(frozen=True)
class ClassifierRecipe:
    arch: str
    feature_side: int  # small-cnn: the run's `feature-side`, so the classifier is the network `model` builds
    epochs: int
    lr: float
    momentum: float
    weight_decay: float
    batch_size: int
    augment: str  # "none" | "flip" | "flip-rot90"; random shifts are always on
    patience: int = 0  # stop after this many epochs without a better validation accuracy (0 = never)

    @staticmethod
    def from_config(cfg: RunConfig) -> ClassifierRecipe:
        factory = cfg.factory
        return ClassifierRecipe(
            factory.classifier, cfg.feature_side, factory.classifier_epochs, factory.classifier_lr, factory.classifier_momentum,
            factory.classifier_weight_decay, factory.classifier_batch_size, factory.augment,
            factory.classifier_patience,
        )  # fmt: skip


def run_classifier(cfg: RunConfig, image_shape: tuple[int, int, int], num_classes: int) -> Classifier:
    """The untrained classifier (server's, or a P2P expert) of a run with `cfg`."""
    return build_classifier(cfg.factory.classifier, image_shape, num_classes, cfg.feature_side)


def stratified_holdout(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_idx, val_idx): a seeded `fraction` of every class held out (at least one image of any class
    with two or more), so the validation set is as class-balanced as the data."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for class_id in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == class_id))
        n_val = min(max(round(len(members) * fraction), 1), len(members) - 1) if len(members) >= 2 else 0
        val.append(members[:n_val])
        train.append(members[n_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def augmented_cross_entropy(augment: str, seed: int) -> LossFn:
    """Cross-entropy on randomly shifted (and flipped / rotated) images; bf16 autocast on CUDA."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = random_shift(x, max(1, x.shape[-1] // 8), generator)
        x = flip_rotate(x, augment != "none", augment == "flip-rot90", rng)
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
            logits = model(x)
        return F.cross_entropy(logits.float(), y)

    return loss_fn


def checkpoint_epochs(best_epoch: int, last_epoch: int) -> list[int]:
    """Epochs whose weights are worth a second opinion: powers of two up to the last epoch, the best on
    the held-out share and the last one."""
    powers = [2**k for k in range(last_epoch.bit_length()) if 2**k <= last_epoch]
    return sorted({*powers, best_epoch, last_epoch})


def holdout_score(model: nn.Module, images: np.ndarray, labels: np.ndarray, device: torch.device) -> tuple[float, float]:
    """(accuracy, minus the mean negative log-likelihood) on a held-out split: larger is better, and
    epochs compare by accuracy first, then by the likelihood. The likelihood breaks ties because a
    synthetic hold-out is easy: on 8 px digits its accuracy sat at 0.9967 (one image of 300 wrong) at
    7 of 20 epochs, and the first of them, taken mid-schedule at a high learning rate, was 2 points
    worse on the sites' real validation images than the annealed ones."""
    if not len(labels):
        return 0.0, 0.0
    y_true, probs = predict(model, make_loader(images, labels, EVAL_BATCH_SIZE, shuffle=False), device, multilabel=False)
    log_likelihood = np.log(np.maximum(probs[np.arange(len(y_true)), y_true], math.exp(LOG_PROB_FLOOR)))
    return float((probs.argmax(axis=1) == y_true).mean()), float(log_likelihood.mean())


def train_classifier(
    images: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    recipe: ClassifierRecipe,
    *,
    val_fraction: float,
    seed: int,
    device: torch.device,
    checkpoints: dict[int, dict[str, torch.Tensor]] | None = None,
) -> tuple[Classifier, dict]:
    """Train from scratch on (images, labels) minus a stratified `val_fraction` until the validation
    score (holdout_score) has not improved for recipe.patience epochs (or recipe.epochs); returns the
    weights of the epoch with the best score, and stats (loss, best and last epoch, its validation
    accuracy and negative log-likelihood, seconds). `checkpoints`, when given, receives {epoch: weights}
    for checkpoint_epochs."""
    train_idx, val_idx = stratified_holdout(labels, val_fraction, seed)
    torch.manual_seed(seed)
    model = build_classifier(recipe.arch, tuple(images.shape[1:]), num_classes, recipe.feature_side).to(device)
    loader = make_loader(images[train_idx], labels[train_idx], recipe.batch_size, shuffle=True, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum, weight_decay=recipe.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=recipe.epochs * len(loader), eta_min=0.0)
    loss_fn = augmented_cross_entropy(recipe.augment, seed)
    best = {"score": (-math.inf, -math.inf)}
    states: dict[int, dict[str, torch.Tensor]] = {}
    seconds = 0.0
    for epoch in range(1, recipe.epochs + 1):
        stats = train_local(model, loader, epochs=1, optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn, device=device)
        seconds += stats["train_seconds"]
        score = holdout_score(model, images[val_idx], labels[val_idx], device)
        if checkpoints is not None:
            states[epoch] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if score > best["score"]:
            best = {"score": score, "best_epoch": epoch, "state": copy.deepcopy(model.state_dict())}
        print(f"classifier epoch {epoch}/{recipe.epochs}: loss {stats['train_loss']:.4f}, val acc {score[0]:.4f}, "
              f"val nll {-score[1]:.4f}", flush=True)
        if recipe.patience and epoch - best["best_epoch"] >= recipe.patience:
            break
        if checkpoints is not None:  # drop what can no longer be a checkpoint epoch, to bound memory
            keep = set(checkpoint_epochs(best["best_epoch"], epoch))
            states = {e: w for e, w in states.items() if e in keep}
    if checkpoints is not None:
        checkpoints.update({e: states[e] for e in checkpoint_epochs(best["best_epoch"], epoch)})
    model.load_state_dict(best.pop("state"))
    val_accuracy, val_log_likelihood = best.pop("score")
    return model, {
        "val_accuracy": val_accuracy,
        "val_nll": -val_log_likelihood,
        "train_loss": stats["train_loss"],
        "train_seconds": seconds,
        "num_examples": len(train_idx),
        "val_examples": len(val_idx),
        "last_epoch": epoch,
        **best,
    }


def check_expert_weights(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """A returned expert must have exactly the reference model's tensors (names, shapes, dtypes) with finite values."""
    problem = weights_mismatch(state, reference)
    if problem:
        raise UploadRejected(f"expert weights: {problem}")
