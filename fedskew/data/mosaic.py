"""Multi-label data from a single-label source: each image is a grid x grid mosaic of source
images, labelled with the multi-hot union of their classes."""

from __future__ import annotations

import numpy as np

from fedskew.data.pixels import unit_float
from fedskew.data.sources import ImageDataset


def mosaic_grid(
    images: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    grid: int,
    count: int,
    seed: int | np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """`count` composites (count, C, grid*H, grid*W) and their float32 multi-hot labels (count, num_classes).

    Tile (row r, column c) of composite i is source image `picks[i, r * grid + c]`; sources are
    drawn as concatenated random permutations, so every source image is used equally often (+-1).
    """
    _check_grid(grid)
    if images.ndim != 4:
        raise ValueError(f"images have shape {images.shape}; expected (N, C, H, W)")
    if labels.ndim != 1:
        raise ValueError(f"labels have shape {labels.shape}; a mosaic needs single-label class ids shaped (N,)")
    if len(images) != len(labels) or len(images) == 0:
        raise ValueError(f"{len(images)} images and {len(labels)} labels; expected the same non-zero number")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"class ids span [{labels.min()}, {labels.max()}]; expected ids in [0, {num_classes - 1}]")
    if count < 1:
        raise ValueError(f"count={count}; expected at least 1 composite")
    rng = np.random.default_rng(seed)
    tiles = grid * grid
    picks = _balanced_draws(len(images), count * tiles, rng).reshape(count, tiles)
    _, channels, height, width = images.shape
    composites = np.empty((count, channels, grid * height, grid * width), dtype=np.float32)
    for tile in range(tiles):
        row, col = divmod(tile, grid)
        composites[:, :, row * height : (row + 1) * height, col * width : (col + 1) * width] = images[picks[:, tile]]
    multi_hot = np.zeros((count, num_classes), dtype=np.float32)
    multi_hot[np.arange(count)[:, None], labels[picks]] = 1.0
    return composites, multi_hot


def mosaic_dataset(dataset: ImageDataset, grid: int, seed: int) -> ImageDataset:
    """Mosaic both splits: train composites from train images only, test composites from test images only,
    as many composites per split as it has source images."""
    _check_grid(grid)
    if dataset.multilabel:
        raise ValueError(f"mosaic needs a single-label source; {dataset.name} is already multi-label")
    train_rng, test_rng = np.random.default_rng(seed).spawn(2)
    train_images, train_labels = mosaic_grid(
        unit_float(dataset.train_images), dataset.train_labels, dataset.num_classes, grid, len(dataset.train_images), train_rng
    )
    test_images, test_labels = mosaic_grid(
        unit_float(dataset.test_images), dataset.test_labels, dataset.num_classes, grid, len(dataset.test_images), test_rng
    )
    return ImageDataset(
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        num_classes=dataset.num_classes,
        class_names=dataset.class_names,
        name=f"{dataset.name}+mosaic{grid}",
    )


def _check_grid(grid: int) -> None:
    if grid < 2:
        raise ValueError(f"mosaic grid={grid}; expected >= 2 (a 1 x 1 mosaic is the source image itself)")


def _balanced_draws(population: int, total: int, rng: np.random.Generator) -> np.ndarray:
    permutations = -(-total // population)
    return np.concatenate([rng.permutation(population) for _ in range(permutations)])[:total]
