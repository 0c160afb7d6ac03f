"""The user's own part: noisy 8x8 grey images of three classes, each a bright bar of its own (a row, a
column, a diagonal), and the settings the server's strategy and every site share. Site p holds class p
only, the extreme of label skew FederatedFactory is made for; the server's test set holds every class
equally, so a classifier blind to the images is right on a third of it."""

import numpy as np

from fedskew.config import FactorySection
from fedskew.data.sites import SiteData
from fedskew.factory.run import FactoryRun

CLASS_NAMES = ("row", "column", "diagonal")
IMAGE_SHAPE = (1, 8, 8)
PATTERNS = np.zeros((3, *IMAGE_SHAPE), np.float32)
PATTERNS[0, 0, 3, :] = PATTERNS[1, 0, :, 3] = 1.0
PATTERNS[2, 0][np.eye(8, dtype=bool)] = 1.0


def settings(generator_steps: int) -> FactoryRun:
    """What both sides derive the generators, their seeds and the classifier from (tiny, for a CPU)."""
    factory = FactorySection(generator_steps=generator_steps, audit_samples=8, sampler_steps=8, samples_per_class=80,
                             classifier_epochs=10, classifier_batch_size=16)
    return FactoryRun(factory=factory, seed=0)


def images_of(labels: np.ndarray, seed: int) -> np.ndarray:
    """The classes' bars on a grey background with noise, pixels in [0, 1]."""
    noise = np.random.default_rng(seed).normal(0.0, 0.1, (len(labels), *IMAGE_SHAPE)).astype(np.float32)
    return np.clip(0.2 + 0.6 * PATTERNS[labels] + noise, 0.0, 1.0)


def site_data(partition_id: int, num_sites: int) -> SiteData:
    """Site p: 40 training and 10 validation images of class p."""
    labels = np.full(50, partition_id % len(CLASS_NAMES), np.int64)
    images = images_of(labels, seed=1 + partition_id)
    return SiteData(partition_id, num_sites, images[:40], labels[:40], images[40:], labels[40:], len(CLASS_NAMES),
                    CLASS_NAMES)


def test_set() -> tuple[np.ndarray, np.ndarray]:
    """20 images of each class."""
    labels = np.repeat(np.arange(len(CLASS_NAMES)), 20)
    return images_of(labels, seed=0), labels
