"""Tiny image sets in the layouts a user brings, drawn with numpy alone: a MedMNIST-layout npz (uint8 0-255 or
float [0, 1] pixels, grey (N, H, W) or RGB (N, H, W, 3), single-label (N, 1) or multi-hot (N, K) labels) and
PNG site folders (images/ + labels.csv + classes.txt). Class k is a bright square in its own cell of the image
over dim noise, so a model that learns anything from the pixels tells the classes apart; and the floors a test
asserts are derived from the labels written (`chance_score`, `learnt_floor`)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

CLASS_NAMES = ("north-west", "north-east", "south-west", "south-east", "centre")
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class PatternSet:
    """Images (N, C, H, W) float in [0, 1] and labels (N,) class ids or (N, K) multi-hot, per split."""

    images: dict[str, np.ndarray]
    labels: dict[str, np.ndarray]
    class_names: tuple[str, ...]

    @property
    def multilabel(self) -> bool:
        return self.labels["test"].ndim == 2


def _cells(num_classes: int, side: int) -> list[tuple[slice, slice]]:
    """Non-overlapping squares of a quarter of the side, one per class (so a multi-label image's squares
    never hide each other): the four corners, then the centre."""
    size, far = side // 4, side - side // 4 - side // 8
    near, mid = side // 8, (side - side // 4) // 2
    corners = [(near, near), (near, far), (far, near), (far, far), (mid, mid)]
    return [(slice(r, r + size), slice(c, c + size)) for r, c in corners[:num_classes]]


def pattern_set(num_classes: int, sizes: dict[str, int], side: int = 28, channels: int = 1, multilabel: bool = False,
                label_rate: float = 0.4, seed: int = 0) -> PatternSet:  # fmt: skip
    """`sizes[split]` images per split. Single-label: every class equally often in every split (shuffled).
    Multi-label: each label present with probability `label_rate`, independently."""
    if not 2 <= num_classes <= len(CLASS_NAMES):
        raise ValueError(f"num_classes={num_classes}; the pattern has 2-{len(CLASS_NAMES)} cells")
    rng = np.random.default_rng(seed)
    cells = _cells(num_classes, side)
    images, labels = {}, {}
    for split in SPLITS:
        n = sizes[split]
        if multilabel:
            present = rng.random((n, num_classes)) < label_rate
            labels[split] = present.astype(np.uint8)
        else:
            if n % num_classes:
                raise ValueError(f"{split}: {n} images do not split evenly over {num_classes} classes")
            ids = rng.permutation(np.repeat(np.arange(num_classes), n // num_classes))
            present = np.eye(num_classes, dtype=bool)[ids]
            labels[split] = ids
        pixels = rng.random((n, channels, side, side)) * 0.3
        for k, (rows, cols) in enumerate(cells):
            pixels[present[:, k], :, rows, cols] += 0.6
        images[split] = pixels.astype(np.float32)
    return PatternSet(images, labels, CLASS_NAMES[:num_classes])


def write_npz(data: PatternSet, path: Path, pixels: str = "uint8") -> Path:
    """The MedMNIST layout: {split}_images (N, H, W) grey or (N, H, W, 3) RGB, as uint8 0-255 (MedMNIST's own
    files) or float32 in [0, 1]; {split}_labels (N, 1) class ids or (N, K) multi-hot; class_names."""
    arrays = {}
    for split in SPLITS:
        channels_last = data.images[split].transpose(0, 2, 3, 1)
        images = channels_last[..., 0] if channels_last.shape[-1] == 1 else channels_last
        if pixels == "uint8":
            images = np.rint(images * 255).astype(np.uint8)
        elif pixels != "float32":
            raise ValueError(f"pixels={pixels!r}; valid: uint8, float32")
        labels = data.labels[split]
        arrays[f"{split}_images"] = images
        arrays[f"{split}_labels"] = labels if labels.ndim == 2 else labels[:, None]
    np.savez(path, class_names=np.array(data.class_names), **arrays)
    return path


def write_png_folder(images: np.ndarray, labels: np.ndarray, class_names: tuple[str, ...], folder: Path) -> Path:
    """A site folder written by hand the way a hospital would export one: images/NNN.png (8-bit grey or RGB),
    labels.csv (header file,labels; one class id, or ids joined by '|'), classes.txt."""
    (folder / "images").mkdir(parents=True)
    rows = []
    for index, (image, label) in enumerate(zip(images, labels)):
        name = f"{index:04d}.png"
        pixels = np.rint(image.transpose(1, 2, 0) * 255).astype(np.uint8)
        Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(folder / "images" / name)
        rows.append([name, "|".join(str(k) for k in np.flatnonzero(label)) if labels.ndim == 2 else str(label)])
    with (folder / "labels.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([["file", "labels"], *rows])
    (folder / "classes.txt").write_text("".join(f"{name}\n" for name in class_names))
    return folder


def site_shares(labels: np.ndarray, num_sites: int, seed: int = 0) -> list[np.ndarray]:
    """Label-skewed site shares of `labels` (indices): an image carrying class k < num_sites goes to site k with
    four times the odds of another site, so each site holds mostly its own classes and every class is everywhere."""
    rng = np.random.default_rng(seed)
    present = labels.astype(bool) if labels.ndim == 2 else np.eye(labels.max() + 1, dtype=bool)[labels]
    odds = 1 + 3 * present[:, :num_sites]
    sites = np.array([rng.choice(num_sites, p=row / row.sum()) for row in odds])
    return [np.flatnonzero(sites == k) for k in range(num_sites)]


def write_site_folders(data: PatternSet, root: Path, num_sites: int) -> tuple[Path, Path]:
    """`root`/sites/site-K (K < num_sites: label-skewed shares of the train and val splits) and `root`/test (the
    test split), all PNG site folders; returns (sites, test)."""
    images = np.concatenate([data.images["train"], data.images["val"]])
    labels = np.concatenate([data.labels["train"], data.labels["val"]])
    for k, share in enumerate(site_shares(labels, num_sites)):
        write_png_folder(images[share], labels[share], data.class_names, root / "sites" / f"site-{k}")
    write_png_folder(data.images["test"], data.labels["test"], data.class_names, root / "test")
    return root / "sites", root / "test"


def chance_score(test_labels: np.ndarray) -> float:
    """The best score a model that ignores the pixels can expect on these labels. Single-label accuracy: the
    largest class's share. Multi-label macro-F1: a label of frequency p predicted present with probability q
    independently of the image scores F1 = 2pq / (p + q), largest at q = 1 (always present): 2p / (1 + p)."""
    if test_labels.ndim == 1:
        return float(np.bincount(test_labels).max() / len(test_labels))
    p = test_labels.mean(axis=0)
    return float(np.mean(2 * p / (1 + p)))


def learnt_floor(test_labels: np.ndarray) -> float:
    """Halfway from chance to a perfect score. The classes' squares are far brighter than the noise, so a
    model that has learnt them scores near 1 and one that has not scores about chance: halfway separates the
    two with the widest margin on either side. For single-label accuracy it is also far outside what luck
    gives an image-blind model: at least 4 binomial standard deviations of chance on this test split."""
    chance = chance_score(test_labels)
    floor = (chance + 1) / 2
    if test_labels.ndim == 1:
        sigma = np.sqrt(chance * (1 - chance) / len(test_labels))
        assert floor - chance >= 4 * sigma, f"test split of {len(test_labels)} images too small for the floor {floor:.3f}"
    return floor
