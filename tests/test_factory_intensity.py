"""Histogram matching of synthetic classes onto the sites' real pixel histograms (fedskew.factory.intensity)."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict

from fedskew.factory.intensity import INTENSITY_BINS, check_histograms, class_histograms, match_intensity, quantile_function
from fedskew.factory.library import UploadRejected
from fedskew.protocol import INTENSITY_KEY
from fedskew.strategies.factory_flow import SiteIdentity, uploaded_histograms

BIN = 1 / INTENSITY_BINS


def test_histograms_count_every_pixel_of_each_held_class():
    rng = np.random.default_rng(0)
    images = rng.random((7, 3, 5, 4), dtype=np.float32)
    images[0, 0, 0, 0], images[1, 1, 0, 0] = 0.0, 1.0  # both ends of [0, 1] are counted
    labels = np.array([2, 2, 0, 2, 0, 0, 2])
    counts = class_histograms(images, labels, num_classes=4)
    assert counts.shape == (4, 3, INTENSITY_BINS)
    np.testing.assert_array_equal(counts.sum(-1)[[0, 2]], [[3 * 20] * 3, [4 * 20] * 3])
    assert counts[[1, 3]].sum() == 0
    # Pooling two sites' histograms is the histogram of their union.
    split = class_histograms(images[:3], labels[:3], 4) + class_histograms(images[3:], labels[3:], 4)
    np.testing.assert_array_equal(split, counts)


def test_quantile_function_inverts_the_histogram():
    histogram = np.zeros(INTENSITY_BINS)
    histogram[0], histogram[-1] = 60, 40  # 60 % black, 40 % white
    values = quantile_function(histogram, np.array([0.0, 0.3, 0.8, 1.0]))
    np.testing.assert_allclose(values, [0.0, BIN / 2, 1 - BIN / 2, 1.0])


def test_matching_gives_the_real_distribution_and_keeps_the_pixel_order():
    rng = np.random.default_rng(1)
    real = (rng.random((50, 1, 6, 6)) < 0.4).astype(np.float32)  # binary digits: ~60 % background
    real_labels = np.zeros(50, dtype=np.int64)
    synthetic = rng.uniform(0.1, 0.5, (80, 1, 6, 6)).astype(np.float32)  # grey, low contrast
    labels = np.zeros(80, dtype=np.int64)
    histograms = class_histograms(real, real_labels, 1)
    matched = match_intensity(synthetic, labels, histograms)
    white_share = histograms[0, 0, -1] / histograms[0, 0].sum()
    # Every matched pixel lies in the first or last bin, in the real proportions (up to one rank of 2,880).
    assert np.all((matched <= BIN) | (matched >= 1 - BIN))
    assert abs((matched >= 1 - BIN).mean() - white_share) <= 1 / matched.size
    # Monotone: a brighter synthetic pixel never ends up darker.
    order = np.argsort(synthetic.ravel(), kind="stable")
    assert np.all(np.diff(matched.ravel()[order]) >= 0)


def test_matching_acts_per_class_and_channel_and_leaves_unknown_classes():
    rng = np.random.default_rng(2)
    real = np.concatenate([np.full((10, 2, 4, 4), 0.2), np.full((10, 2, 4, 4), 0.9)]).astype(np.float32)
    real[:, 1] = 1 - real[:, 1]
    real_labels = np.repeat([0, 1], 10)
    synthetic = rng.random((30, 2, 4, 4), dtype=np.float32)
    labels = np.repeat([0, 1, 2], 10)
    matched = match_intensity(synthetic, labels, class_histograms(real, real_labels, 3))
    for class_id, channel, value in [(0, 0, 0.2), (0, 1, 0.8), (1, 0, 0.9), (1, 1, 0.1)]:
        # Every pixel lands in the bin holding the class's only real value.
        assert np.all(np.abs(matched[labels == class_id, channel] - value) <= BIN)
    np.testing.assert_array_equal(matched[labels == 2], synthetic[labels == 2])


@pytest.mark.parametrize("seed", [0, 1])
def test_matching_a_set_onto_its_own_histogram_moves_pixels_by_at_most_a_bin(seed):
    rng = np.random.default_rng(seed)
    images = rng.beta(0.5, 2.0, (40, 1, 8, 8)).astype(np.float32)
    labels = np.zeros(40, dtype=np.int64)
    matched = match_intensity(images, labels, class_histograms(images, labels, 1))
    assert np.abs(matched - images).max() <= BIN + 1e-6


# --- the upload that carries them ------------------------------------------------------------------------


COUNTS = (3, 0, 2)  # a site's training images per class, as its survey declares
SHAPE = (1, 4, 4)


def honest_histograms() -> np.ndarray:
    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(3), COUNTS)
    return class_histograms(rng.random((len(labels), *SHAPE), dtype=np.float32), labels, 3)


def test_the_server_accepts_histograms_that_count_the_declared_images():
    check_histograms(honest_histograms(), COUNTS, SHAPE)


@pytest.mark.parametrize(
    "forge, reason",
    [
        (lambda h: h[:2], "shape"),
        (lambda h: np.where(h > 0, h - 0.5, h), "whole, non-negative"),
        (lambda h: np.where(np.arange(INTENSITY_BINS) == 0, -h.sum(-1, keepdims=True), h), "whole, non-negative"),
        (lambda h: h * 2, "do not count every pixel"),
        (lambda h: h + (np.arange(3) == 1)[:, None, None], "do not count every pixel"),  # pixels of a class it lacks
        (lambda h: np.full_like(h, np.nan), "whole, non-negative"),
    ],
)
def test_the_server_refuses_histograms_that_contradict_the_survey(forge, reason):
    with pytest.raises(ValueError, match=reason):
        check_histograms(forge(honest_histograms()), COUNTS, SHAPE)


def test_an_upload_without_its_histograms_is_rejected_with_the_reason():
    identity = SiteIdentity(node=5, site_id=0, label_counts=COUNTS)
    content = RecordDict({INTENSITY_KEY: ArrayRecord({INTENSITY_KEY: Array(honest_histograms())})})
    np.testing.assert_array_equal(uploaded_histograms(content, identity, SHAPE), honest_histograms())
    with pytest.raises(UploadRejected, match="no 'intensity' histogram array"):
        uploaded_histograms(RecordDict(), identity, SHAPE)
    as_text = RecordDict({INTENSITY_KEY: ArrayRecord({INTENSITY_KEY: Array(np.zeros((3, 1, 4), dtype=np.uint8))})})
    with pytest.raises(UploadRejected, match="one 3-d float array"):
        uploaded_histograms(as_text, identity, SHAPE)
