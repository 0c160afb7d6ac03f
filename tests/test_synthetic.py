"""Generated datasets: determinism, shapes, label kinds, class balance, the drawn shapes themselves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedskew.config import ConfigError, RunConfig
from fedskew.data.mosaic import mosaic_dataset
from fedskew.data.sources import load_source
from fedskew.data.synthetic import MAX_SHAPES_PER_IMAGE, SHAPE_CLASSES, load_synthetic, shape_masks

SMALL = (60, 20)  # (train, test): every class 6 resp. 2 times in the single-label sets


@pytest.mark.parametrize("name", ["deformed-digits", "shapes", "shapes-multi"])
def test_same_seed_same_images_other_seed_other_images(name):
    first, again, other = (load_synthetic(name, 16, seed, sizes=SMALL) for seed in (3, 3, 4))
    for split in ("train_images", "train_labels", "test_images", "test_labels"):
        np.testing.assert_array_equal(getattr(first, split), getattr(again, split))
    assert not np.array_equal(first.train_images, other.train_images)
    assert not np.array_equal(first.train_images, first.test_images[: len(first.train_images)])


@pytest.mark.parametrize(
    ("name", "size", "channels"),
    [("deformed-digits", 0, 1), ("deformed-digits", 20, 1), ("shapes", 0, 3), ("shapes-multi", 24, 3)],
)
def test_images_are_float32_in_unit_range_at_the_asked_size(name, size, channels):
    data = load_synthetic(name, size, 0, sizes=SMALL)
    side = size or {"deformed-digits": 28, "shapes": 32, "shapes-multi": 32}[name]
    assert data.train_images.shape == (SMALL[0], channels, side, side)
    assert data.test_images.shape == (SMALL[1], channels, side, side)
    assert data.train_images.dtype == np.float32
    assert data.train_images.min() >= 0.0 and data.train_images.max() <= 1.0
    assert data.num_classes == len(data.class_names) == 10


@pytest.mark.parametrize("name", ["deformed-digits", "shapes"])
def test_single_label_sets_are_exactly_class_balanced(name):
    data = load_synthetic(name, 16, 1, sizes=SMALL)
    assert data.train_labels.dtype == np.int64 and data.train_labels.ndim == 1
    assert np.bincount(data.train_labels, minlength=10).tolist() == [6] * 10
    assert np.bincount(data.test_labels, minlength=10).tolist() == [2] * 10


def test_multi_label_rows_hold_one_to_three_distinct_shapes_and_classes_are_balanced():
    count = 600
    data = load_synthetic("shapes-multi", 12, 2, sizes=(count, 10))
    labels = data.train_labels
    assert labels.dtype == np.float32 and labels.shape == (count, 10)
    assert set(np.unique(labels)) <= {0.0, 1.0}
    per_image = labels.sum(1)
    # The shape drawn last is never occluded, so every image keeps at least one label.
    assert per_image.min() >= 1 and per_image.max() <= MAX_SHAPES_PER_IMAGE
    assert len(np.unique(per_image)) == MAX_SHAPES_PER_IMAGE
    # Classes are exchangeable by construction: each count is a sum of `count` Bernoulli draws with a
    # common mean; 5 binomial standard deviations bound the spread for any seed with overwhelming probability.
    per_class = labels.sum(0)
    mean = per_class.mean()
    assert np.abs(per_class - mean).max() <= 5 * math.sqrt(mean * (1 - mean / count))


def test_shape_masks_on_hand_picked_points():
    names = list(SHAPE_CLASSES)
    u = torch.tensor([[[0.0, 0.9, 0.75, 0.0]]]).expand(len(names), 1, 4)
    v = torch.tensor([[[0.0, 0.9, 0.0, 0.7]]]).expand(len(names), 1, 4)
    masks = shape_masks(torch.arange(len(names)), u, v)[:, 0]
    inside = {name: masks[k].tolist() for k, name in enumerate(names)}
    # points: centre, far corner (outside every round shape), right of centre, above centre
    assert inside["circle"] == [True, False, True, True]
    assert inside["square"] == [True, False, True, True]
    assert inside["ring"] == [False, False, True, True]
    assert inside["frame"] == [False, False, True, True]
    assert inside["bar"] == [True, False, True, False]
    assert inside["plus"] == [True, False, True, True]
    assert inside["crescent"][0] is False and inside["half-disc"][0] is True


def test_load_source_draws_generated_sets_at_image_size_and_mosaics_them():
    data = load_source("deformed-digits", data_root="unused", image_size=14, seed=0)
    assert data.train_images.shape[1:] == (1, 14, 14) and not data.multilabel
    mosaic = mosaic_dataset(data, 2, 0)
    assert mosaic.train_images.shape[1:] == (1, 28, 28) and mosaic.multilabel


def test_config_knows_which_generated_sets_are_multi_label():
    assert RunConfig(dataset="shapes-multi", mosaic_grid=0).label_kind == "multi"
    assert RunConfig(dataset="shapes", mosaic_grid=2).label_kind == "multi"
    with pytest.raises(ConfigError, match="mosaic-grid"):
        RunConfig.from_run_config({"dataset": "shapes-multi", "mosaic-grid": 2})
    with pytest.raises(ConfigError, match="method"):
        RunConfig.from_run_config({"dataset": "shapes", "mosaic-grid": 0})
