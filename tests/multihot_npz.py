"""A multi-label dataset written the way a hospital would export one, with numpy alone (not by
fedskew's mosaics): an npz in MedMNIST layout whose labels are multi-hot (N, K) rows."""

from pathlib import Path

import numpy as np

CLASS_NAMES = ("effusion", "nodule", "edema", "fracture", "opacity", "atelectasis")


def write_multihot_npz(path: Path, side: int = 12, sizes=(240, 30, 90), seed: int = 0) -> Path:
    """Each class draws its own bright square at a fixed place; an image holds the squares of its
    labels (each present with probability 0.35) over noise, so the labels are learnable from pixels."""
    rng = np.random.default_rng(seed)
    k = len(CLASS_NAMES)
    corners = rng.integers(0, side - 4, size=(k, 2))
    arrays = {}
    for split, n in zip(("train", "val", "test"), sizes):
        labels = (rng.random((n, k)) < 0.35).astype(np.uint8)
        images = rng.random((n, side, side)) * 0.3
        for c, (row, col) in enumerate(corners):
            images[labels[:, c] == 1, row : row + 4, col : col + 4] += 0.7
        arrays[f"{split}_images"] = np.rint(np.clip(images, 0, 1) * 255).astype(np.uint8)
        arrays[f"{split}_labels"] = labels
    np.savez(path, class_names=np.array(CLASS_NAMES), **arrays)
    return path
