"""The in-memory dataset every source loads into, and the one source bundled with scikit-learn (digits),
which the generated sets (fedskew.data.synthetic) also draw on; both sit below fedskew.data.sources."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

DIGITS_TEST_FRACTION = 0.2


@dataclass(frozen=True, eq=False)
class ImageDataset:
    train_images: np.ndarray  # (N, C, H, W): float32 in [0, 1] or uint8 0-255 (see fedskew/data/pixels.py)
    train_labels: np.ndarray  # int64 (N,) class ids or float32 (N, K) multi-hot
    test_images: np.ndarray
    test_labels: np.ndarray
    num_classes: int
    class_names: tuple[str, ...]
    name: str

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            images, labels = getattr(self, f"{split}_images"), getattr(self, f"{split}_labels")
            if images.ndim != 4 or len(images) != len(labels):
                raise ValueError(
                    f"{self.name}: {split} images {images.shape} and labels {labels.shape}; "
                    "expected (N, C, H, W) images and N label rows"
                )
        if self.train_labels.ndim != self.test_labels.ndim or self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise ValueError(f"{self.name}: train and test splits differ in label kind or image shape")
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"{self.name}: {len(self.class_names)} class names for {self.num_classes} classes")

    @property
    def multilabel(self) -> bool:
        return self.train_labels.ndim == 2

    @property
    def image_shape(self) -> tuple[int, int, int]:
        channels, height, width = self.train_images.shape[1:]
        return channels, height, width


def load_digits_source(seed: int) -> ImageDataset:
    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None]
    labels = bunch.target.astype(np.int64)
    train_images, test_images, train_labels, test_labels = train_test_split(
        images, labels, test_size=DIGITS_TEST_FRACTION, stratify=labels, random_state=seed
    )
    return ImageDataset(
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        num_classes=10,
        class_names=tuple(str(digit) for digit in range(10)),
        name="digits",
    )
