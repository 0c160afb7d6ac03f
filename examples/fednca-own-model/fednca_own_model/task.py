"""The user's own part: a small CNN backbone and a data loader of noisy 8x8 images in which each of
three classes, when present, lights its own region (multi-label, so an image holds any set of them).
Each site sees the classes with its own skewed frequencies; the server's test set sees each with
probability 1/2, so a model blind to the images labels at most half of the test decisions right."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedskew.fednca_site import FedNCAModel, fednca_loss, fednca_optimizer

NUM_CLASSES = 3
PATTERNS = torch.zeros(NUM_CLASSES, 1, 8, 8)
PATTERNS[0, 0, :4, :4] = PATTERNS[1, 0, :4, 4:] = PATTERNS[2, 0, 4:, 2:6] = 1.0  # top left, top right, bottom


class Backbone(nn.Module):
    """What FedNCAModel needs of a backbone: `feature_dim` and `forward_features(x) -> (B, feature_dim, h, w)`."""

    feature_dim = 16

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build_model(etf: torch.Tensor) -> FedNCAModel:
    return FedNCAModel(Backbone(), etf)


def load_data(seed: int, size: int, frequencies: list[float]) -> DataLoader:
    """`size` images; class k is present in each with probability `frequencies[k]`."""
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.rand(size, NUM_CLASSES, generator=generator) < torch.tensor(frequencies)).float()
    images = torch.einsum("nk,kchw->nchw", labels, PATTERNS) + 0.5 * torch.randn(size, 1, 8, 8, generator=generator)
    return DataLoader(TensorDataset(images, labels), batch_size=16, shuffle=True, generator=generator)


def site_data(partition_id: int) -> DataLoader:
    """Label skew: site p sees class p (mod 3) in 80 % of its images, the others in 20 %."""
    return load_data(seed=1 + partition_id, size=256, frequencies=[0.8 if k == partition_id % NUM_CLASSES else 0.2
                                                                   for k in range(NUM_CLASSES)])


def train(model: FedNCAModel, loader: DataLoader, epochs: int, lr: float) -> float:
    """FedNCA-ML's loss and optimiser (AdamW, no warm-up); the mean loss of the last epoch."""
    optimizer, scheduler = fednca_optimizer(model, total_steps=epochs * len(loader), lr=lr)
    model.train()
    for _ in range(epochs):
        losses = []
        for x, y in loader:
            optimizer.zero_grad()
            loss = fednca_loss(model, x, y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
    return sum(losses) / len(losses)


@torch.no_grad()
def label_accuracy(model: FedNCAModel, loader: DataLoader) -> float:
    """The share of (image, class) decisions right, a class predicted present where its logit is > 0."""
    model.eval()
    right = sum(((model(x) > 0).float() == y).sum().item() for x, y in loader)
    return right / (len(loader.dataset) * NUM_CLASSES)
