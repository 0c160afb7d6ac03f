"""Formula-driven pretraining: the backbone learns to tell apart images drawn from random iterated function
systems (IFS fractals) before any site trains it (Kataoka et al., "Pre-training without Natural Images",
ACCV 2020). No site's data and no download: the server draws the images from the run seed at the data's own
size and channels, so every run, simulated or deployed, gets the same start (`fractal-pretrain-epochs`).

A category is one IFS of 2-4 contractive affine maps; its images are the IFS's attractor, drawn by the chaos
game, with the maps jittered, mirrored at random, in a random colour on a random background with pixel noise.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.progress import ProgressReporter
from fedskew.training import make_loader

MAX_MAPS = 4  # affine maps per IFS, at most; a category draws 2 to 4
POINTS = 1000  # chaos-game points per image
BURN_IN = 20  # first points dropped: the orbit has not reached the attractor yet
MIN_FILL = 0.08  # share of pixels a category's attractor must light, so that it is a shape, not a speck
CATEGORIES = 64
PER_CATEGORY = 100
BATCH_SIZE = 64
LR = 1e-3


def ifs_category(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Matrices (MAX_MAPS, 2, 2), shifts (MAX_MAPS, 2) and probabilities (MAX_MAPS,) of 2-4 affine maps whose
    largest singular value is below 0.95 (contractive, so the attractor exists), chosen in proportion to
    |det A| + 0.02; unused maps are zero with probability 0."""
    while True:
        count = int(rng.integers(2, MAX_MAPS + 1))
        matrices, shifts = rng.uniform(-1, 1, (count, 2, 2)), rng.uniform(-1, 1, (count, 2))
        if (np.linalg.svd(matrices, compute_uv=False)[:, 0] < 0.95).all():
            padded = np.zeros((MAX_MAPS, 2, 2)), np.zeros((MAX_MAPS, 2)), np.zeros(MAX_MAPS)
            padded[0][:count], padded[1][:count] = matrices, shifts
            weights = np.abs(np.linalg.det(matrices)) + 0.02
            padded[2][:count] = weights / weights.sum()
            return padded


def chaos_game(matrices: np.ndarray, shifts: np.ndarray, probabilities: np.ndarray, side: int,
               generator: torch.Generator) -> torch.Tensor:
    """One binary (side x side) image per IFS: the orbit of randomly chosen maps, fitted to the frame."""
    count = len(matrices)
    a, b, p = (torch.as_tensor(v, dtype=torch.float32) for v in (matrices, shifts, probabilities))
    choice = torch.multinomial(p, POINTS + BURN_IN, replacement=True, generator=generator)
    point, rows = torch.zeros(count, 2), torch.arange(count)
    orbit = torch.empty(count, POINTS, 2)
    for step in range(POINTS + BURN_IN):
        picked = choice[:, step]
        point = torch.einsum("mij,mj->mi", a[rows, picked], point) + b[rows, picked]
        if step >= BURN_IN:
            orbit[:, step - BURN_IN] = point
    low = orbit.amin(1, keepdim=True)
    span = (orbit.amax(1, keepdim=True) - low).amax(2, keepdim=True).clamp_min(1e-6)
    pixel = ((orbit - low) / span * (side - 1)).round().long().clamp(0, side - 1)
    images = torch.zeros(count, side * side)
    images.scatter_(1, pixel[..., 1] * side + pixel[..., 0], 1.0)
    return images.view(count, side, side)


def fractal_images(categories: int, per_category: int, channels: int, side: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (categories x per_category, channels, side, side) and their category ids, from `seed`."""
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    systems = []
    while len(systems) < categories:
        system = ifs_category(rng)
        if chaos_game(*(v[None] for v in system), side, generator).mean() >= MIN_FILL:
            systems.append(system)
    matrices, shifts, probabilities = (np.repeat(np.stack(part), per_category, axis=0) for part in zip(*systems))
    masks = chaos_game(matrices * rng.uniform(0.9, 1.1, matrices.shape), shifts + rng.normal(0, 0.05, shifts.shape),
                       probabilities, side, generator)
    mirrored = torch.as_tensor(rng.random(len(masks)) < 0.5)
    masks[mirrored] = masks[mirrored].flip(-1)
    count = len(masks)
    background = torch.as_tensor(rng.uniform(0, 1, (count, channels, 1, 1)), dtype=torch.float32)
    colour = torch.as_tensor(rng.uniform(0, 1, (count, channels, 1, 1)), dtype=torch.float32)
    noise = torch.randn(count, channels, side, side, generator=generator) * 0.05
    images = (background + (colour - background) * masks[:, None] + noise).clamp(0, 1)
    return (images * 255).round().to(torch.uint8).numpy(), np.repeat(np.arange(categories), per_category)


def fractal_pretrain(backbone: nn.Module, channels: int, side: int, epochs: int, seed: int,
                     categories: int = CATEGORIES, per_category: int = PER_CATEGORY,
                     device: torch.device | None = None) -> dict[str, float]:
    """Train `backbone` in place on `device` (default CPU) to classify the fractal categories: a linear head
    (discarded afterwards) on its average-pooled features, AdamW, cross-entropy, a progress line every 20 s and a
    last one with the final epoch's mean training loss and accuracy, which it also returns."""
    device = device or torch.device("cpu")
    images, labels = fractal_images(categories, per_category, channels, side, seed)
    head = nn.Linear(backbone.feature_dim, categories)
    backbone.to(device).train()
    head.to(device)
    optimizer = torch.optim.AdamW(list(backbone.parameters()) + list(head.parameters()), lr=LR, weight_decay=0.01)
    loader = make_loader(images, labels.astype(np.int64), BATCH_SIZE, shuffle=True, seed=seed)
    progress = ProgressReporter(f"fractal pretraining ({categories} categories, {len(images)} images)", BATCH_SIZE)
    total = epochs * len(loader)
    for epoch in range(epochs):
        loss_sum = correct = 0.0
        for step, (x, y) in enumerate(loader, start=epoch * len(loader) + 1):
            x, y = x.to(device), y.to(device)
            logits = head(backbone.forward_features(x).mean(dim=(2, 3)))
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(x)
            correct += (logits.argmax(1) == y).sum().item()
            progress(step, total, loss.item())
    result = {"fractal_loss": round(loss_sum / len(images), 4), "fractal_accuracy": round(correct / len(images), 4)}
    print(f"fractal pretraining done: last epoch's loss {result['fractal_loss']}, accuracy {result['fractal_accuracy']}",
          flush=True)
    return result
