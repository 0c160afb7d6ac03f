"""Offline image sets the project generates itself, deterministic from the run seed.

* ``deformed-digits``: scikit-learn's 8x8 digits drawn at a larger size (default 28 px) through a
  seeded random affine map (rotation, scale, shear, shift) plus a smooth elastic displacement, with
  clutter strokes, a background level and pixel noise. Single-label, 10 classes, exactly balanced.
  Train images come from the digits' train split only and test images from its test split only.
* ``shapes``: one procedurally drawn shape (10 classes: circle, square, triangle, plus, ring, star,
  crescent, half-disc, bar, frame) of random size, position, rotation and colour on a textured
  colour background with noise. Single-label RGB, default 32 px, exactly balanced.
* ``shapes-multi``: 1-3 shapes of distinct classes per image, drawn one over another. A shape is
  labelled only if at least ``VISIBLE_FRACTION`` of its area stays visible after occlusion, so the
  multi-hot label is what the image shows.

Everything is vectorised in torch (float32, CPU) and generated in chunks; a few thousand images take
seconds. ``image_size`` sets the side the images are *drawn* at (no resampling afterwards).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from fedskew.config import GENERATED_DATASETS
from fedskew.data.image_dataset import ImageDataset, load_digits_source

SHAPE_CLASSES = (
    "circle", "square", "triangle", "plus", "ring", "star", "crescent", "half-disc", "bar", "frame"
)
DEFAULT_SIDE = {"deformed-digits": 28, "shapes": 32, "shapes-multi": 32}
SPLIT_SIZES = (2000, 800)  # (train, test) images per generated dataset
MIN_SIDE = 12
VISIBLE_FRACTION = 0.4
MAX_SHAPES_PER_IMAGE = 3
SUPERSAMPLE = 2  # shapes are drawn at 2x and averaged down: anti-aliased edges
CHUNK = 512


def load_synthetic(name: str, image_size: int, seed: int, sizes: tuple[int, int] = SPLIT_SIZES) -> ImageDataset:
    """Generate synthetic dataset `name` at `image_size` px (0 = its default side) from `seed`."""
    if name not in GENERATED_DATASETS:
        raise ValueError(f"unknown synthetic dataset {name!r}; valid: {', '.join(GENERATED_DATASETS)}")
    side = image_size or DEFAULT_SIDE[name]
    if side < MIN_SIDE:
        raise ValueError(f"{name} at image-size {side} px: the shapes and digits need at least {MIN_SIDE} px")
    train_seed, test_seed = np.random.SeedSequence([seed, GENERATED_DATASETS.index(name)]).spawn(2)
    if name == "deformed-digits":
        digits = load_digits_source(seed)
        train_images, train_labels = deformed_digits(
            digits.train_images, digits.train_labels, sizes[0], side, np.random.default_rng(train_seed)
        )
        test_images, test_labels = deformed_digits(
            digits.test_images, digits.test_labels, sizes[1], side, np.random.default_rng(test_seed)
        )
        class_names = tuple(str(digit) for digit in range(10))
    else:
        per_image = MAX_SHAPES_PER_IMAGE if name == "shapes-multi" else 1
        train_images, train_labels = shapes(sizes[0], side, per_image, np.random.default_rng(train_seed))
        test_images, test_labels = shapes(sizes[1], side, per_image, np.random.default_rng(test_seed))
        class_names = SHAPE_CLASSES
    return ImageDataset(
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        num_classes=len(class_names),
        class_names=class_names,
        name=f"{name}@{side}",
    )


# --------------------------------------------------------------------------------------------
# Shared primitives
# --------------------------------------------------------------------------------------------

def balanced_labels(count: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """`count` class ids, every class count//K or count//K + 1 times, in random order."""
    return rng.permutation(np.arange(count) % num_classes).astype(np.int64)


def pixel_grid(side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, x) pixel-centre coordinates in [-1, 1], each (side, side)."""
    axis = (torch.arange(side, dtype=torch.float32) + 0.5) / side * 2 - 1
    return torch.meshgrid(axis, axis, indexing="ij")


def smooth_noise(count: int, channels: int, side: int, cells: int, generator: torch.Generator) -> torch.Tensor:
    """(count, channels, side, side) noise in about [-1, 1] that varies over `cells` cells per side."""
    coarse = torch.rand(count, channels, cells, cells, generator=generator) * 2 - 1
    return F.interpolate(coarse, size=(side, side), mode="bicubic", align_corners=False)


def _torch_generator(rng: np.random.Generator) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def _chunks(count: int):
    for start in range(0, count, CHUNK):
        yield start, min(count, start + CHUNK)


# --------------------------------------------------------------------------------------------
# Deformed digits
# --------------------------------------------------------------------------------------------

def deformed_digits(
    digits: np.ndarray, digit_labels: np.ndarray, count: int, side: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """`count` (count, 1, side, side) images drawn from (N, 1, 8, 8) `digits`, class-balanced, and their class ids."""
    labels = balanced_labels(count, 10, rng)
    by_class = [np.flatnonzero(digit_labels == k) for k in range(10)]
    sources = np.array([rng.choice(by_class[k]) for k in labels])
    generator = _torch_generator(rng)
    out = np.empty((count, 1, side, side), dtype=np.float32)
    for start, stop in _chunks(count):
        batch = torch.from_numpy(digits[sources[start:stop]])
        out[start:stop] = _deform_and_clutter(batch, side, generator).numpy()
    return out, labels


def _deform_and_clutter(digits: torch.Tensor, side: int, generator: torch.Generator) -> torch.Tensor:
    n = len(digits)

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, generator=generator)

    angle, scale, shear = uniform(-0.35, 0.35), uniform(0.85, 1.25), uniform(-0.3, 0.3)
    shift = (torch.rand(n, 2, generator=generator) * 2 - 1) * 0.12
    cos, sin = torch.cos(angle), torch.sin(angle)
    # Output -> source coordinates: a scale > 1 samples a wider window, so the digit shrinks.
    theta = torch.stack(
        [torch.stack([cos * scale, (-sin + shear * cos) * scale, shift[:, 0]], 1),
         torch.stack([sin * scale, (cos + shear * sin) * scale, shift[:, 1]], 1)], 1
    )
    grid = F.affine_grid(theta, [n, 1, side, side], align_corners=False)
    grid = grid + 0.08 * smooth_noise(n, 2, side, 4, generator).permute(0, 2, 3, 1)  # elastic displacement
    # The 8x8 digit fills its frame edge to edge; pad it so the deformed digit keeps a margin.
    padded = F.pad(digits, (2, 2, 2, 2))
    image = F.grid_sample(padded, grid, mode="bicubic", padding_mode="zeros", align_corners=False).clamp(0, 1)
    image = torch.maximum(image, _clutter_strokes(n, side, generator))
    background = uniform(0.0, 0.25).view(n, 1, 1, 1)
    noise = 0.08 * torch.randn(n, 1, side, side, generator=generator)
    return (background + (1 - background) * image + noise).clamp(0, 1)


def _clutter_strokes(count: int, side: int, generator: torch.Generator, strokes: int = 2) -> torch.Tensor:
    """Faint short line segments (count, 1, side, side): distractors that are not digits."""
    y, x = pixel_grid(side)
    points = torch.stack([x, y], -1).view(1, 1, side * side, 2)
    start = torch.rand(count, strokes, 1, 2, generator=generator) * 2 - 1
    direction = torch.rand(count, strokes, 1, 2, generator=generator) * 0.8 - 0.4
    along = ((points - start) * direction).sum(-1) / direction.pow(2).sum(-1).clamp_min(1e-6)
    nearest = start + along.clamp(0, 1).unsqueeze(-1) * direction
    distance = (points - nearest).norm(dim=-1) * side / 2  # in pixels
    intensity = 0.2 + 0.35 * torch.rand(count, strokes, 1, generator=generator)
    stroke = intensity * (1 - distance.clamp(max=1.0))
    return stroke.amax(1).view(count, 1, side, side)


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------

def _triangle(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    edges = [math.pi / 2 + k * 2 * math.pi / 3 for k in range(3)]  # outward normals of an equilateral triangle
    return torch.stack([u * math.cos(a) + v * math.sin(a) for a in edges]).amax(0) <= 0.5


def _star(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    outline = 0.45 + 0.55 * ((1 + torch.cos(5 * torch.atan2(v, u))) / 2) ** 2  # five points
    return u * u + v * v <= outline * outline


def _box(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.maximum(u.abs(), v.abs())


def _disc(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return u * u + v * v <= 1.0


SHAPE_MASKS = {  # class name -> mask of the unit-radius shape at local coordinates (u, v)
    "circle": _disc,
    "square": lambda u, v: _box(u, v) <= 0.8,
    "triangle": _triangle,
    "plus": lambda u, v: (torch.minimum(u.abs(), v.abs()) <= 0.28) & (_box(u, v) <= 1.0),
    "ring": lambda u, v: _disc(u, v) & (u * u + v * v >= 0.55**2),
    "star": _star,
    "crescent": lambda u, v: _disc(u, v) & ((u - 0.45) ** 2 + v * v >= 0.75**2),
    "half-disc": lambda u, v: _disc(u, v) & (v >= -0.1),
    "bar": lambda u, v: (u.abs() <= 1.0) & (v.abs() <= 0.3),
    "frame": lambda u, v: (_box(u, v) <= 0.85) & (_box(u, v) >= 0.5),
}


def shape_masks(classes: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Boolean masks (n, H, W) of shapes `classes` (n,) at local coordinates u, v (n, H, W)."""
    masks = torch.zeros(u.shape, dtype=torch.bool)
    for class_id in classes.unique().tolist():
        rows = classes == class_id
        masks[rows] = SHAPE_MASKS[SHAPE_CLASSES[class_id]](u[rows], v[rows])
    return masks


def shapes(count: int, side: int, per_image: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`count` RGB images (count, 3, side, side) with 1..per_image shapes of distinct classes.

    per_image == 1: class ids (count,), exactly balanced. per_image > 1: float32 multi-hot
    (count, K) of the shapes that stay at least VISIBLE_FRACTION visible.
    """
    k = len(SHAPE_CLASSES)
    if per_image == 1:
        classes = balanced_labels(count, k, rng)[:, None]
        present = np.ones((count, 1), dtype=bool)
    else:
        classes = np.argsort(rng.random((count, k)), axis=1)[:, :per_image]  # distinct classes per image
        present = np.arange(per_image)[None] < rng.integers(1, per_image + 1, size=count)[:, None]
    generator = _torch_generator(rng)
    images = np.empty((count, 3, side, side), dtype=np.float32)
    visible = np.empty((count, classes.shape[1]), dtype=bool)
    for start, stop in _chunks(count):
        batch_images, batch_visible = _draw_shapes(
            torch.from_numpy(classes[start:stop]), torch.from_numpy(present[start:stop]), side, generator
        )
        images[start:stop], visible[start:stop] = batch_images.numpy(), batch_visible.numpy()
    if per_image == 1:
        return images, classes[:, 0]
    multi_hot = np.zeros((count, k), dtype=np.float32)
    rows, slots = np.nonzero(visible & present)
    multi_hot[rows, classes[rows, slots]] = 1.0
    return images, multi_hot


def _draw_shapes(
    classes: torch.Tensor, present: torch.Tensor, side: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    n, slots = classes.shape
    fine = side * SUPERSAMPLE
    y, x = pixel_grid(fine)
    canvas = _textured_background(n, fine, generator)
    # Radii relative to the half-side: one shape fills a good part of the image, several share it.
    low, high = (0.35, 0.7) if slots == 1 else (0.22, 0.42)
    owner = torch.full((n, fine, fine), -1, dtype=torch.long)
    areas = torch.zeros(n, slots)
    for slot in range(slots):
        radius = low + (high - low) * torch.rand(n, generator=generator)
        centre = (torch.rand(n, 2, generator=generator) * 2 - 1) * (1 - radius.unsqueeze(1))
        angle = torch.rand(n, generator=generator) * 2 * math.pi
        dx = (x - centre[:, 0, None, None]) / radius[:, None, None]
        dy = (y - centre[:, 1, None, None]) / radius[:, None, None]
        cos, sin = torch.cos(angle)[:, None, None], torch.sin(angle)[:, None, None]
        mask = shape_masks(classes[:, slot], cos * dx + sin * dy, -sin * dx + cos * dy) & present[:, slot, None, None]
        colour = _contrasting_colour(canvas, generator)
        canvas = torch.where(mask.unsqueeze(1), colour[:, :, None, None], canvas)
        owner = torch.where(mask, slot, owner)
        areas[:, slot] = mask.flatten(1).sum(1)
    shown = torch.stack([(owner == slot).flatten(1).sum(1) for slot in range(slots)], 1)
    visible = shown >= VISIBLE_FRACTION * areas.clamp_min(1)
    image = F.avg_pool2d(canvas, SUPERSAMPLE)
    image = image + 0.05 * torch.randn(image.shape, generator=generator)
    return image.clamp(0, 1), visible & (areas > 0)


def _textured_background(count: int, side: int, generator: torch.Generator) -> torch.Tensor:
    """A random base colour modulated by a random oriented grating and smooth blotches (count, 3, side, side)."""
    y, x = pixel_grid(side)
    base = 0.2 + 0.6 * torch.rand(count, 3, 1, 1, generator=generator)
    angle = torch.rand(count, 1, 1, generator=generator) * math.pi
    frequency = 3 + 6 * torch.rand(count, 1, 1, generator=generator)
    phase = torch.rand(count, 1, 1, generator=generator) * 2 * math.pi
    grating = torch.sin(frequency * math.pi * (torch.cos(angle) * x + torch.sin(angle) * y) + phase)
    texture = 0.08 * grating.unsqueeze(1) + 0.1 * smooth_noise(count, 3, side, 6, generator)
    return (base + texture).clamp(0, 1)


def _contrasting_colour(canvas: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random RGB colour (n, 3) whose mean brightness differs from the canvas mean by at least 0.25."""
    n = len(canvas)
    colour = torch.rand(n, 3, generator=generator)
    background = canvas.mean(dim=(1, 2, 3))
    shift = 0.25 - (colour.mean(1) - background).abs()
    direction = torch.where(background < 0.5, 1.0, -1.0)
    adjust = torch.where(shift > 0, direction * shift, torch.zeros_like(shift))
    return (colour + adjust.unsqueeze(1)).clamp(0, 1)
