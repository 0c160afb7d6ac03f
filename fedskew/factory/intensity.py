"""Match the pixel-intensity distribution of each synthetic class to the sites' real images of it.

Short generator training leaves synthetic images with grainy backgrounds and a compressed intensity
range (brighter, lower contrast than the real images), one visible part of the synthetic-to-real
gap. Each site returns, per class it holds and per channel, a histogram of its real training
images' pixel values (INTENSITY_BINS equal bins over [0, 1]: counts of pixels, never an image); the
server adds the sites' histograms and maps every synthetic pixel of a class through the monotone
transform that gives that class's synthetic pixels the pooled real distribution (histogram
specification: a synthetic pixel at rank r of n in its class and channel becomes the real
quantile at (r + 0.5) / n). Ranks are shared by tied values, so the map is monotone and equal
pixels stay equal; the images' spatial structure is untouched.
"""

from __future__ import annotations

import numpy as np

from fedskew.data.pixels import unit_float

INTENSITY_BINS = 256


def class_histograms(images: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Site side: (classes, channels, INTENSITY_BINS) counts of pixel values in [0, 1] per class held
    (zeros for classes the site lacks); uint8 images (0-255) are counted at their [0, 1] values."""
    channels = images.shape[1]
    counts = np.zeros((num_classes, channels, INTENSITY_BINS))
    for class_id in np.unique(labels):
        members = images[labels == class_id]
        for channel in range(channels):
            # One class's channel at a time is scaled: the site's images stay in their storage type.
            values = unit_float(members[:, channel])
            counts[class_id, channel] = np.histogram(values, bins=INTENSITY_BINS, range=(0.0, 1.0))[0]
    return counts


def check_histograms(histograms: np.ndarray, label_counts: list[int] | tuple[int, ...], image_shape: tuple[int, int, int]) -> None:
    """Server side: a site's histograms must be (classes, channels, INTENSITY_BINS) whole, non-negative
    counts with exactly (its training images of the class) x height x width pixels per class and
    channel, as its survey declared; ValueError says what is wrong."""
    channels, height, width = image_shape
    expected = (len(label_counts), channels, INTENSITY_BINS)
    if histograms.shape != expected:
        raise ValueError(f"the intensity histograms have shape {histograms.shape}; expected {expected}")
    if not (np.isfinite(histograms).all() and (histograms >= 0).all() and (histograms == np.round(histograms)).all()):
        raise ValueError("the intensity histograms must hold whole, non-negative pixel counts")
    pixels = np.asarray(label_counts, dtype=np.float64)[:, None] * height * width
    if not np.array_equal(histograms.sum(-1), np.broadcast_to(pixels, histograms.shape[:2])):
        raise ValueError("the intensity histograms do not count every pixel of the training images the site's "
                         "survey declared, per class and channel")


def quantile_function(histogram: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Pixel values at cumulative shares `levels` of a histogram over [0, 1], linear within each bin."""
    cumulative = np.concatenate([[0.0], np.cumsum(histogram)]) / histogram.sum()
    edges = np.linspace(0.0, 1.0, len(histogram) + 1)
    # Empty bins make flat runs in `cumulative`: keep only both edges of every non-empty bin, so a level
    # is interpolated inside the bin that holds it, never across empty ones.
    filled = np.diff(cumulative) > 0
    keep = np.concatenate([filled, [False]]) | np.concatenate([[False], filled])
    return np.interp(levels, cumulative[keep], edges[keep])


def match_intensity(images: np.ndarray, labels: np.ndarray, real_histograms: np.ndarray) -> np.ndarray:
    """Synthetic images with each class's pixels, per channel, mapped onto the real histogram of that
    class; classes without real pixels are left as they are."""
    matched = images.copy()
    for class_id in np.unique(labels):
        members = labels == class_id
        for channel in range(images.shape[1]):
            histogram = real_histograms[class_id, channel]
            if histogram.sum() <= 0:
                continue
            values = images[members, channel]
            flat = values.ravel()
            order = np.sort(flat)
            # Mid-rank of every value among its class (ties share one rank): a monotone map.
            ranks = (np.searchsorted(order, flat, "left") + np.searchsorted(order, flat, "right")) / 2
            mapped = quantile_function(histogram, ranks / len(flat))
            matched[members, channel] = mapped.reshape(values.shape).astype(images.dtype)
    return matched
