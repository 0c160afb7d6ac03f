"""Partition figures: per-site label counts and per-site label co-occurrence.

Figures are drawn on matplotlib's object API (no pyplot), so nothing touches the global backend
or needs a display.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

COOCCURRENCE_COLUMNS = 5


def plot_label_counts(counts: np.ndarray, class_names: Sequence[str], path: str | Path, title: str) -> Path:
    """Heatmap of samples per (site, class) with the count written in every cell."""
    counts = np.asarray(counts)
    num_sites, num_classes = _check_matrix_labels(counts, class_names, "counts")
    figure = Figure(figsize=(max(4.5, 0.55 * num_classes + 2.5), max(3.0, 0.4 * num_sites + 1.8)), layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(counts, cmap="viridis", aspect="auto", vmin=0)
    _label_class_axis(axes, class_names, axis="x")
    axes.set_yticks(range(num_sites), labels=[f"site {site}" for site in range(num_sites)])
    axes.set_xlabel("class")
    axes.set_title(title)
    threshold = 0.6 * max(int(counts.max()), 1)
    font_size = 8 if num_classes <= 12 else 6
    for site in range(num_sites):
        for label in range(num_classes):
            value = int(counts[site, label])
            # Dark text on the bright end of viridis, light text on the dark end.
            color = "black" if value > threshold else "white"
            axes.text(label, site, str(value), ha="center", va="center", color=color, fontsize=font_size)
    figure.colorbar(image, ax=axes, label="samples")
    return _save(figure, path)


def plot_cooccurrence(matrices: Sequence[np.ndarray], class_names: Sequence[str], path: str | Path) -> Path:
    """One (K, K) co-occurrence heatmap per site on a shared colour scale, so sites compare directly."""
    if len(matrices) == 0:
        raise ValueError("no co-occurrence matrices to plot; expected one (K, K) matrix per site")
    matrices = [np.asarray(matrix) for matrix in matrices]
    for site, matrix in enumerate(matrices):
        rows, cols = _check_matrix_labels(matrix, class_names, f"co-occurrence matrix of site {site}")
        if rows != cols:
            raise ValueError(f"co-occurrence matrix of site {site} has shape {matrix.shape}; expected square (K, K)")
    columns = min(COOCCURRENCE_COLUMNS, len(matrices))
    rows = math.ceil(len(matrices) / columns)
    figure = Figure(figsize=(2.6 * columns + 1.2, 2.6 * rows + 0.6), layout="constrained")
    grid = figure.subplots(rows, columns, squeeze=False)
    vmax = max(max(int(matrix.max()) for matrix in matrices), 1)
    for site, axes in enumerate(grid.flat):
        if site >= len(matrices):
            axes.set_axis_off()
            continue
        image = axes.imshow(matrices[site], cmap="magma", vmin=0, vmax=vmax)
        axes.set_title(f"site {site}", fontsize=9)
        _label_class_axis(axes, class_names, axis="x", font_size=6)
        _label_class_axis(axes, class_names, axis="y", font_size=6)
    figure.colorbar(image, ax=grid.ravel().tolist(), label="samples carrying both labels", shrink=0.8)
    figure.suptitle("label co-occurrence per site (diagonal: samples per label)")
    return _save(figure, path)


def _check_matrix_labels(matrix: np.ndarray, class_names: Sequence[str], what: str) -> tuple[int, int]:
    if matrix.ndim != 2:
        raise ValueError(f"{what} has shape {matrix.shape}; expected a 2-D matrix")
    if matrix.shape[1] != len(class_names):
        raise ValueError(f"{what} has {matrix.shape[1]} class columns but {len(class_names)} class names were given")
    return matrix.shape


def _label_class_axis(axes: Axes, class_names: Sequence[str], axis: str, font_size: float = 8) -> None:
    long_names = max(len(str(name)) for name in class_names) > 3
    positions, names = range(len(class_names)), [str(name) for name in class_names]
    if axis == "x":
        axes.set_xticks(positions, labels=names, fontsize=font_size, rotation=45 if long_names else 0,
                        ha="right" if long_names else "center")
    else:
        axes.set_yticks(positions, labels=names, fontsize=font_size)


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
