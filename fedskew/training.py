"""Plain local training and evaluation: no Flower types, so they are testable on their own
and shared by every method (the Flower handlers and the centralised bound call them)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from fedskew.data.pixels import unit_float
from fedskew.metrics import DEFAULT_THRESHOLD, multilabel_metrics, single_label_metrics

EVAL_BATCH_SIZE = 256  # evaluation and prediction batches (no gradients: larger than training's)
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def pick_device(requested: str = "auto") -> torch.device:
    """CUDA when present (auto) or asked for; asking for CUDA without one is an error, not a silent CPU run."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but torch sees no CUDA device; valid here: auto, cpu")
    return torch.device(requested)


def make_loader(images: np.ndarray, labels: np.ndarray, batch_size: int, shuffle: bool, seed: int = 0) -> DataLoader:
    """Batches of float32 images in [0, 1]; uint8 images stay uint8 in memory and are scaled per batch."""
    with warnings.catch_warnings():  # shared read-only arrays (a cached dataset): the loader only reads them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        dataset = TensorDataset(*(torch.from_numpy(np.ascontiguousarray(array)) for array in (images, labels)))
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator, collate_fn=_unit_float_batch)


def _unit_float_batch(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = default_collate(samples)
    return unit_float(images), labels


def classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for class ids, summed-over-labels BCE for multi-hot targets."""
    logits = model(x)
    if y.ndim == 2:
        return F.binary_cross_entropy_with_logits(logits, y.float(), reduction="sum") / len(x)
    return F.cross_entropy(logits, y)


def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to `max_shift` px in each axis (zero fill): pad, then crop per image."""
    n, channels, height, width = x.shape
    padded = F.pad(x, (max_shift,) * 4)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, n), generator=generator).to(x.device)
    rows = (dy[:, None] + torch.arange(height, device=x.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(width, device=x.device))[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chans = torch.arange(channels, device=x.device)[None, :, None, None]
    return padded[batch, chans, rows, cols]


AUGMENTATIONS = ("none", "shift", "shift-flip")


def augmented(loss_fn: LossFn, augment: str, seed: int) -> LossFn:
    """`loss_fn` on randomly shifted training images (up to 1/8 of the side, zero fill) and, for
    "shift-flip", mirrored ones (each image with probability 1/2); `loss_fn` itself for "none"."""
    if augment not in AUGMENTATIONS:
        raise ValueError(f"augment must be one of {AUGMENTATIONS}, got {augment!r}")
    if augment == "none":
        return loss_fn
    generator = torch.Generator().manual_seed(seed)

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = random_shift(x, max(1, x.shape[-1] // 8), generator)
        if augment == "shift-flip":
            mirror = (torch.rand(len(x), generator=generator) < 0.5).to(x.device)
            x = torch.where(mirror[:, None, None, None], x.flip(3), x)
        return loss_fn(model, x, y)

    return loss


def sgd(model: nn.Module, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def proximal_term(model: nn.Module, anchor: list[torch.Tensor]) -> torch.Tensor:
    """FedProx: squared distance of the trainable weights to the round's global weights."""
    return sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))


def train_local(
    model: nn.Module,
    loader: DataLoader,
    *,
    epochs: int,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    loss_fn: LossFn = classification_loss,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    proximal_mu: float = 0.0,
    before_step: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Train in place; returns mean loss, examples seen per epoch and wall time. `before_step` runs
    between backward() and optimizer.step() (SCAFFOLD's and FedDyn's gradient corrections)."""
    model.to(device).train()
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else None
    total_loss, total_seen = 0.0, 0
    start = time.perf_counter()
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model, x, y)
            if anchor is not None:
                loss = loss + 0.5 * proximal_mu * proximal_term(model, anchor)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"training loss became {loss.item()}; lower `lr` or check the data")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if before_step is not None:
                before_step()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            total_loss += loss.item() * len(x)
            total_seen += len(x)
    return {
        "train_loss": total_loss / max(total_seen, 1),
        "num_examples": len(loader.dataset),
        "train_seconds": time.perf_counter() - start,
    }


@torch.no_grad()
def predict(model: nn.Module, loader: DataLoader, device: torch.device, multilabel: bool) -> tuple[np.ndarray, np.ndarray]:
    """Labels and probabilities (sigmoid for multi-label, softmax otherwise) over a loader."""
    model.to(device).eval()
    labels, probs = [], []
    for x, y in loader:
        logits = model(x.to(device)).float()
        probs.append((torch.sigmoid(logits) if multilabel else torch.softmax(logits, dim=1)).cpu().numpy())
        labels.append(y.numpy())
    return np.concatenate(labels), np.concatenate(probs)


def evaluate(
    model: nn.Module, images: np.ndarray, labels: np.ndarray, *, device: torch.device, threshold: float = DEFAULT_THRESHOLD
) -> dict[str, float | list[float]]:
    """Metrics of `model` on (images, labels); the label shape says which metric family applies.
    Multi-label F1 and accuracy are taken at the decision `threshold`."""
    multilabel = labels.ndim == 2
    y_true, probs = predict(model, make_loader(images, labels, EVAL_BATCH_SIZE, shuffle=False), device, multilabel)
    return multilabel_metrics(y_true, probs, threshold) if multilabel else single_label_metrics(y_true, probs)
