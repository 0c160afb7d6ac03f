"""What one site trains on: the source, optional mosaics, the seeded partition, and the
site's local train/validation split. Every node derives the same partition from the run
seed, so a simulated site needs nothing but its partition id."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from fedskew.config import ConfigError, RunConfig, check_label_kind, sites_dir
from fedskew.data.mosaic import mosaic_dataset
from fedskew.data.partition import Partition, make_partition, split_site_validation
from fedskew.data.sources import ImageDataset, load_source


@dataclass(frozen=True)
class SiteData:
    site_id: int
    num_sites: int
    train_images: np.ndarray
    train_labels: np.ndarray
    val_images: np.ndarray
    val_labels: np.ndarray
    num_classes: int
    class_names: tuple[str, ...]

    @property
    def multilabel(self) -> bool:
        return self.train_labels.ndim == 2


def load_task_dataset(cfg: RunConfig) -> ImageDataset:
    """The run's dataset after optional mosaicking (train and test splits); ConfigError when its label
    kind does not fit the run config (with `labels = "auto"` only the data can tell)."""
    if sites_dir(cfg.dataset) is not None:
        raise ConfigError(
            f"key 'dataset' = {cfg.dataset!r} names the sites' own folders, not one dataset to partition or to take a "
            "test split from; valid here: digits, cifar10, medmnist:<name>, npz:<path> or a generated set"
        )
    dataset = _load_task_dataset(cfg.dataset, cfg.data_root, cfg.image_size, cfg.allow_download, cfg.mosaic_grid, cfg.seed)
    check_label_kind(cfg, dataset.multilabel, f"dataset {cfg.dataset!r}")
    return dataset


@functools.lru_cache(maxsize=4)
def _load_task_dataset(
    dataset: str, data_root: str, image_size: int, allow_download: bool, mosaic_grid: int, seed: int
) -> ImageDataset:
    source = load_source(dataset, data_root=data_root, image_size=image_size, allow_download=allow_download, seed=seed)
    if mosaic_grid >= 2 and source.multilabel:
        raise ConfigError(
            f"key 'mosaic-grid' = {mosaic_grid} is invalid for dataset {dataset!r}: it is already multi-label "
            "(mosaics combine single-label images); valid: 0"
        )
    return mosaic_dataset(source, mosaic_grid, seed) if mosaic_grid >= 2 else source


def load_partition(cfg: RunConfig, num_sites: int) -> Partition:
    return _load_partition(cfg, num_sites)


@functools.lru_cache(maxsize=4)
def _load_partition(cfg: RunConfig, num_sites: int) -> Partition:
    dataset = load_task_dataset(cfg)
    return make_partition(
        dataset.train_labels,
        cfg.partition,
        num_sites,
        alpha=cfg.alpha,
        classes_per_site=cfg.classes_per_site,
        missing_classes=cfg.missing_classes,
        seed=cfg.seed,
        min_site_size=cfg.min_site_size,
    )


def site_validation_split(cfg: RunConfig, indices: np.ndarray, site_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) indices of a site; seeded by run seed and site id, so a simulated site
    and the folder prepare-sites writes for it split identically."""
    return split_site_validation(indices, cfg.val_fraction, seed=cfg.seed * 7919 + site_id)


def simulated_site(cfg: RunConfig, site_id: int, num_sites: int) -> SiteData:
    """Site `site_id` of `num_sites`: its partition share, split into local train and validation."""
    if not 0 <= site_id < num_sites:
        raise ValueError(f"partition-id {site_id} is out of range; valid: 0..{num_sites - 1}")
    dataset = load_task_dataset(cfg)
    indices = load_partition(cfg, num_sites).site_indices[site_id]
    train_idx, val_idx = site_validation_split(cfg, indices, site_id)
    return SiteData(
        site_id=site_id,
        num_sites=num_sites,
        train_images=dataset.train_images[train_idx],
        train_labels=dataset.train_labels[train_idx],
        val_images=dataset.train_images[val_idx],
        val_labels=dataset.train_labels[val_idx],
        num_classes=dataset.num_classes,
        class_names=dataset.class_names,
    )
