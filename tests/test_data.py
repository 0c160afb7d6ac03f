"""Data sources, mosaics, partitions and partition plots."""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from medmnist import INFO as MEDMNIST_INFO

from fedskew.data.mosaic import mosaic_dataset, mosaic_grid
from fedskew.data.partition import (
    Partition,
    classes_per_site,
    dirichlet_label_skew,
    iid,
    label_cooccurrence,
    label_counts,
    make_partition,
    multilabel_skew,
    partition_summary,
    split_site_validation,
)
from fedskew.data.plots import plot_cooccurrence, plot_label_counts
from fedskew.data.sources import (
    MEDMNIST_2D_NAMES,
    MEDMNIST_SIZES,
    DataSourceError,
    ImageDataset,
    load_source,
    medmnist_file,
)
from fedskew.training import make_loader

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def digits() -> ImageDataset:
    return load_source("digits", data_root="unused")


@pytest.fixture(scope="module")
def digits_mosaic(digits) -> ImageDataset:
    return mosaic_dataset(digits, grid=2, seed=0)


def balanced_class_ids(num_classes: int, per_class: int) -> np.ndarray:
    return np.repeat(np.arange(num_classes), per_class).astype(np.int64)


def mean_distance_from_global(labels: np.ndarray, sites, num_classes: int) -> float:
    """Mean total-variation distance between each site's label distribution and the pooled one."""
    counts = label_counts(labels, sites, num_classes).astype(float)
    pooled = counts.sum(axis=0) / counts.sum()
    per_site = counts / counts.sum(axis=1, keepdims=True)
    return float(0.5 * np.abs(per_site - pooled).sum(axis=1).mean())


def cooccurrence_spread(multi_hot: np.ndarray, sites) -> float:
    """Mean over site pairs of the mean |P_s(b | a) - P_t(b | a)| over label pairs a != b present at both."""
    present = label_counts(multi_hot, sites, multi_hot.shape[1]) > 0
    conditionals = []
    for site in sites:
        matrix = label_cooccurrence(multi_hot, site).astype(float)
        conditionals.append(matrix / np.maximum(np.diag(matrix)[:, None], 1))
    off_diagonal = ~np.eye(multi_hot.shape[1], dtype=bool)
    gaps = []
    for s in range(len(sites)):
        for t in range(s + 1, len(sites)):
            shared = present[s] & present[t]
            gaps.append(np.abs(conditionals[s] - conditionals[t])[np.outer(shared, shared) & off_diagonal].mean())
    return float(np.mean(gaps))


def partition_of(labels, scheme, seed, num_sites=10, **overrides) -> Partition:
    settings = dict(alpha=0.1, classes_per_site=1, missing_classes=3, seed=seed, min_site_size=10) | overrides
    return make_partition(labels, scheme, num_sites, **settings)


# ---------------------------------------------------------------- partitions: shared invariants

SCHEMES_AND_DATA = [("iid", "single"), ("dirichlet", "single"), ("classes-per-site", "single"),
                    ("iid", "multi"), ("multilabel-skew", "multi")]


@pytest.mark.parametrize("scheme,kind", SCHEMES_AND_DATA)
def test_partition_is_deterministic_disjoint_and_covers_every_index(scheme, kind, digits, digits_mosaic):
    labels = digits.train_labels if kind == "single" else digits_mosaic.train_labels
    first, again, other = (partition_of(labels, scheme, seed) for seed in (0, 0, 1))
    assert all(np.array_equal(a, b) for a, b in zip(first.site_indices, again.site_indices, strict=True))
    assert np.array_equal(first.unassigned, again.unassigned)
    assert any(not np.array_equal(a, b) for a, b in zip(first.site_indices, other.site_indices))
    every = np.concatenate([*first.site_indices, first.unassigned])
    assert len(every) == len(np.unique(every)), "sites (and unassigned) must be disjoint"
    assert np.array_equal(np.sort(every), np.arange(len(labels)))
    assert all(site.dtype == np.int64 for site in first.site_indices)
    assert first.scheme == scheme


def test_only_multilabel_skew_leaves_samples_unassigned(digits):
    for scheme in ("iid", "dirichlet", "classes-per-site"):
        assert len(partition_of(digits.train_labels, scheme, seed=0).unassigned) == 0


def test_iid_sizes_differ_by_at_most_one():
    sizes = [len(site) for site in iid(103, 10, seed=0)]
    assert sum(sizes) == 103 and max(sizes) - min(sizes) == 1


# ---------------------------------------------------------------- dirichlet

def test_smaller_alpha_gives_more_label_skew():
    labels = balanced_class_ids(num_classes=10, per_class=200)
    skew = {
        alpha: mean_distance_from_global(labels, dirichlet_label_skew(labels, 5, alpha, seed=3), 10)
        for alpha in (0.05, 1.0, 100.0)
    }
    assert skew[0.05] > skew[1.0] > skew[100.0]
    assert skew[0.05] > 0.5 and skew[100.0] < 0.1


def test_dirichlet_respects_min_site_size_and_fails_clearly_when_impossible():
    labels = balanced_class_ids(num_classes=10, per_class=30)
    for seed in range(5):
        sites = dirichlet_label_skew(labels, 8, alpha=0.05, seed=seed, min_site_size=25)
        assert min(len(site) for site in sites) >= 25
    with pytest.raises(ValueError, match="min-site-size"):
        dirichlet_label_skew(labels, 8, alpha=0.05, seed=0, min_site_size=38)  # 8 x 38 > 300 samples
    with pytest.raises(ValueError, match="no draw in"):
        dirichlet_label_skew(labels, 10, alpha=0.001, seed=0, min_site_size=29)  # needs near-perfect balance


# ---------------------------------------------------------------- classes-per-site

def test_one_class_per_site_gives_single_class_silos(digits):
    labels = digits.train_labels
    sites = classes_per_site(labels, num_sites=10, k=1, seed=0)
    site_classes = [np.unique(labels[site]) for site in sites]
    assert all(len(classes) == 1 for classes in site_classes)
    assert sorted(int(classes[0]) for classes in site_classes) == list(range(10))
    assert sum(len(site) for site in sites) == len(labels)


def test_shared_classes_are_split_evenly_among_their_sites():
    labels = balanced_class_ids(num_classes=6, per_class=31)
    sites = classes_per_site(labels, num_sites=4, k=3, seed=1)  # 12 slots over 6 classes: 2 holders each
    counts = label_counts(labels, sites, 6)
    assert ((counts > 0).sum(axis=1) == 3).all(), "each site holds exactly k classes"
    assert ((counts > 0).sum(axis=0) == 2).all(), "every class has a holder; holders balanced"
    assert set(counts[counts > 0].tolist()) == {15, 16}, "31 samples split 16 / 15"


def test_classes_per_site_rejects_too_few_slots():
    with pytest.raises(ValueError, match=r"4 class slots .* 10 classes"):
        classes_per_site(balanced_class_ids(10, 5), num_sites=2, k=2, seed=0)


# ---------------------------------------------------------------- multilabel-skew

def test_multilabel_skew_missing_labels_and_site_specific_cooccurrence(digits_mosaic):
    labels = digits_mosaic.train_labels
    partition = partition_of(labels, "multilabel-skew", seed=0, missing_classes=3, min_site_size=40)
    counts = label_counts(labels, partition.site_indices, 10)
    absent = counts == 0
    assert (absent.sum(axis=1) == 3).all(), "exactly missing-classes labels absent per site"
    assert (counts > 0).any(axis=0).all(), "every label present at some site"
    assert min(len(site) for site in partition.site_indices) >= 40
    # Unassigned samples really had no site: each carries a label absent at every site.
    unassigned_labels = labels[partition.unassigned] > 0
    assert len(partition.unassigned) < 0.1 * len(labels)
    assert (unassigned_labels.astype(int) @ absent.T.astype(int) > 0).all()
    # Site-specific co-occurrence: P(b | a) differs between sites far more than under iid sampling.
    iid_sites = partition_of(labels, "iid", seed=0).site_indices
    assert cooccurrence_spread(labels, partition.site_indices) > 2 * cooccurrence_spread(labels, iid_sites)


def test_multilabel_skew_smaller_alpha_gives_more_skew(digits_mosaic):
    labels = digits_mosaic.train_labels
    skew = {
        alpha: mean_distance_from_global(labels, multilabel_skew(labels, 10, alpha, 0, seed=2), 10)
        for alpha in (0.1, 100.0)
    }
    assert skew[0.1] > skew[100.0] + 0.1


def test_multilabel_skew_places_a_rare_label_at_every_site_where_it_is_not_missing():
    labels = np.eye(4, dtype=np.float32)[np.arange(300) % 3]
    labels[:3] = [0, 0, 0, 1]  # label 3 is carried by three samples only
    for seed in range(3):
        sites = multilabel_skew(labels, num_sites=3, alpha=0.01, missing_classes=0, seed=seed)
        assert (label_counts(labels, sites, 4)[:, 3] == 1).all()


def test_multilabel_skew_tolerates_a_label_no_sample_carries():
    labels = np.eye(5, dtype=np.float32)[np.arange(400) % 4]  # label 4 never occurs
    counts = label_counts(labels, multilabel_skew(labels, 4, alpha=1.0, missing_classes=1, seed=0), 5)
    assert (counts[:, 4] == 0).all() and ((counts[:, :4] == 0).sum(axis=1) <= 1).all()


def test_multilabel_skew_rejects_a_label_missing_everywhere():
    labels = np.eye(4, dtype=np.float32)[np.arange(400) % 4]
    with pytest.raises(ValueError, match="missing everywhere"):
        multilabel_skew(labels, num_sites=1, alpha=1.0, missing_classes=1, seed=0)
    sites = multilabel_skew(labels, num_sites=4, alpha=1.0, missing_classes=3, seed=0)  # one label per site
    assert sorted(np.flatnonzero(labels[site].sum(axis=0))[0] for site in sites) == [0, 1, 2, 3]
    assert all(len(np.flatnonzero(labels[site].sum(axis=0))) == 1 for site in sites)


def test_make_partition_rejects_schemes_that_do_not_fit_the_labels(digits, digits_mosaic):
    with pytest.raises(ValueError, match="'dirichlet' needs single-label"):
        partition_of(digits_mosaic.train_labels, "dirichlet", seed=0)
    with pytest.raises(ValueError, match="'multilabel-skew' needs multi-label"):
        partition_of(digits.train_labels, "multilabel-skew", seed=0)
    with pytest.raises(ValueError, match="valid: iid, dirichlet, classes-per-site, multilabel-skew"):
        partition_of(digits.train_labels, "shards", seed=0)
    with pytest.raises(ValueError, match="min-site-size 200"):
        partition_of(digits.train_labels, "classes-per-site", seed=0, min_site_size=200)


# ---------------------------------------------------------------- validation split, counts, summary

def test_split_site_validation():
    indices = np.arange(100, 150)
    train, val = split_site_validation(indices, 0.2, seed=4)
    assert len(val) == 10 and len(train) == 40
    assert np.array_equal(np.sort(np.concatenate([train, val])), indices)
    again = split_site_validation(indices, 0.2, seed=4)
    assert np.array_equal(val, again[1]) and not np.array_equal(val, split_site_validation(indices, 0.2, seed=5)[1])
    assert [len(part) for part in split_site_validation(np.arange(3), 0.01, seed=0)] == [2, 1]
    assert [len(part) for part in split_site_validation(np.arange(3), 0.0, seed=0)] == [3, 0]
    with pytest.raises(ValueError, match="val-fraction=1.0"):
        split_site_validation(indices, 1.0, seed=0)


def test_label_counts_and_cooccurrence_on_a_hand_made_case():
    class_ids = np.array([0, 2, 2, 1, 0, 2])
    assert label_counts(class_ids, [np.array([0, 1, 2]), np.array([3, 4, 5])], 4).tolist() == [
        [1, 0, 2, 0],
        [1, 1, 1, 0],
    ]
    multi_hot = np.array([[1, 1, 0], [1, 0, 1], [1, 1, 1], [0, 0, 0]], dtype=np.float32)
    assert label_counts(multi_hot, [np.array([0, 1, 2, 3])], 3).tolist() == [[3, 2, 2]]
    assert label_cooccurrence(multi_hot, np.array([0, 1, 2, 3])).tolist() == [[3, 2, 2], [2, 2, 1], [2, 1, 2]]
    assert label_cooccurrence(multi_hot, np.array([0, 3])).tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0]]


def test_partition_summary_is_json_and_reports_unassigned():
    multi_hot = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], dtype=np.float32)
    partition = Partition(site_indices=(np.array([0, 3]), np.array([1])), unassigned=np.array([2]), scheme="manual")
    summary = json.loads(json.dumps(partition_summary(multi_hot, partition, 2, ("a", "b"))))
    assert summary["site_sizes"] == [2, 1]
    assert summary["label_counts"] == [[1, 0], [0, 1]]
    assert summary["unassigned"] == 1 and summary["unassigned_label_counts"] == [1, 1]
    assert summary["cooccurrence"] == [[[1, 0], [0, 0]], [[0, 0], [0, 1]]]
    single = partition_summary(np.array([0, 1, 1, 0]), partition, 2, ("a", "b"))
    assert "cooccurrence" not in single and single["label_counts"] == [[2, 0], [0, 1]]


# ---------------------------------------------------------------- mosaics

def constant_images(values: np.ndarray, size: int = 3) -> np.ndarray:
    return np.broadcast_to(values.astype(np.float32)[:, None, None, None], (len(values), 1, size, size)).copy()


def tile_values(composites: np.ndarray, grid: int, size: int) -> np.ndarray:
    """(count, grid*grid) value of each tile, read in row-major tile order."""
    return composites[:, 0, ::size, ::size].reshape(len(composites), grid * grid)


def test_mosaic_labels_are_the_union_of_the_tiles():
    labels = np.arange(40) % 5
    images = constant_images(labels / 10)  # each source image is a constant encoding its class
    composites, multi_hot = mosaic_grid(images, labels, num_classes=6, grid=3, count=25, seed=0)
    assert composites.shape == (25, 1, 9, 9) and composites.dtype == np.float32
    assert multi_hot.shape == (25, 6) and multi_hot.dtype == np.float32
    tile_classes = np.rint(tile_values(composites, 3, 3) * 10).astype(int)
    expected = np.zeros((25, 6), dtype=np.float32)
    for row, classes in enumerate(tile_classes):
        expected[row, classes] = 1
    assert np.array_equal(multi_hot, expected)
    assert multi_hot[:, 5].sum() == 0


def test_mosaic_uses_every_source_equally_and_is_deterministic():
    source_ids = np.arange(30)
    images = constant_images(source_ids / 100)
    composites, _ = mosaic_grid(images, source_ids % 3, 3, grid=2, count=30, seed=7)
    used = np.rint(tile_values(composites, 2, 3) * 100).astype(int)
    assert np.array_equal(np.bincount(used.ravel(), minlength=30), np.full(30, 4))
    again, _ = mosaic_grid(images, source_ids % 3, 3, grid=2, count=30, seed=7)
    other, _ = mosaic_grid(images, source_ids % 3, 3, grid=2, count=30, seed=8)
    assert np.array_equal(composites, again) and not np.array_equal(composites, other)


def test_mosaic_dataset_keeps_test_composites_to_test_images():
    train_ids, test_ids = np.arange(60), np.arange(60, 80)
    source = ImageDataset(
        train_images=constant_images(train_ids / 100),
        train_labels=train_ids % 4,
        test_images=constant_images(test_ids / 100),
        test_labels=test_ids % 4,
        num_classes=4,
        class_names=("a", "b", "c", "d"),
        name="toy",
    )
    mosaic = mosaic_dataset(source, grid=2, seed=0)
    assert mosaic.name == "toy+mosaic2" and mosaic.class_names == source.class_names and mosaic.multilabel
    assert mosaic.train_images.shape == (60, 1, 6, 6) and mosaic.test_images.shape == (20, 1, 6, 6)
    assert set(np.rint(tile_values(mosaic.train_images, 2, 3) * 100).astype(int).ravel()) <= set(train_ids)
    assert set(np.rint(tile_values(mosaic.test_images, 2, 3) * 100).astype(int).ravel()) <= set(test_ids)
    assert np.array_equal(mosaic_dataset(source, 2, seed=0).test_images, mosaic.test_images)
    with pytest.raises(ValueError, match="grid=1"):
        mosaic_dataset(source, grid=1, seed=0)
    with pytest.raises(ValueError, match="already multi-label"):
        mosaic_dataset(mosaic, grid=2, seed=0)


# ---------------------------------------------------------------- sources

def test_digits_loads_with_a_stratified_deterministic_split(digits):
    assert digits.train_images.shape == (1437, 1, 8, 8) and digits.test_images.shape == (360, 1, 8, 8)
    assert digits.train_images.dtype == np.float32 and digits.train_labels.dtype == np.int64
    assert digits.train_images.min() == 0 and digits.train_images.max() == 1
    assert digits.num_classes == 10 and not digits.multilabel and digits.image_shape == (1, 8, 8)
    per_class = np.bincount(np.concatenate([digits.train_labels, digits.test_labels]))
    assert np.abs(np.bincount(digits.test_labels) - 0.2 * per_class).max() <= 1
    same = load_source("digits", data_root="unused", seed=0)
    other = load_source("digits", data_root="unused", seed=1)
    assert np.array_equal(same.test_images, digits.test_images)
    assert not np.array_equal(other.test_images, digits.test_images)


def test_digits_resize():
    resized = load_source("digits", data_root="unused", image_size=20)
    assert resized.image_shape == (1, 20, 20) and resized.test_images.shape == (360, 1, 20, 20)
    assert resized.train_images.min() >= 0 and resized.train_images.max() <= 1


def write_npz(path, **overrides):
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (12, 5, 5), dtype=np.uint8),
        "train_labels": (np.arange(12) % 3)[:, None],
        "val_images": rng.integers(0, 256, (4, 5, 5), dtype=np.uint8),
        "val_labels": np.array([[0], [1], [2], [3]]),
        "test_images": rng.integers(0, 256, (6, 5, 5), dtype=np.uint8),
        "test_labels": (np.arange(6) % 3)[:, None],
    } | overrides
    np.savez(path, **{key: value for key, value in arrays.items() if value is not None})
    return path


def test_npz_loader_reads_a_valid_file_and_merges_val_into_train(tmp_path):
    dataset = load_source(f"npz:{write_npz(tmp_path / 'toy.npz')}", data_root=tmp_path)
    assert dataset.train_images.shape == (16, 1, 5, 5) and dataset.test_images.shape == (6, 1, 5, 5)
    assert dataset.num_classes == 4 and dataset.class_names == ("0", "1", "2", "3")
    assert dataset.train_labels.dtype == np.int64 and dataset.train_labels[-1] == 3
    # 8-bit pixels stay uint8 (a quarter of float32's memory) until a loader scales them per batch.
    with np.load(tmp_path / "toy.npz") as raw:
        np.testing.assert_array_equal(dataset.train_images[:, 0], np.concatenate([raw["train_images"], raw["val_images"]]))
    assert dataset.train_images.dtype == np.uint8
    batch, _ = next(iter(make_loader(dataset.train_images, dataset.train_labels, 16, shuffle=False)))
    assert batch.dtype == torch.float32
    np.testing.assert_array_equal(batch.numpy(), dataset.train_images.astype(np.float32) / np.float32(255))
    rgb_multilabel = write_npz(
        tmp_path / "rgb.npz",
        train_images=np.zeros((3, 4, 4, 3), dtype=np.uint8),
        train_labels=np.array([[1, 0], [0, 1], [1, 1]]),
        val_images=np.zeros((0, 4, 4, 3), dtype=np.uint8),
        val_labels=np.zeros((0, 2)),
        test_images=np.ones((2, 4, 4, 3), dtype=np.float32),
        test_labels=np.array([[0, 0], [1, 0]]),
        class_names=np.array(["cat", "dog"]),
    )
    dataset = load_source("npz:rgb.npz", data_root=tmp_path)  # relative paths resolve under data_root
    assert dataset.multilabel and dataset.image_shape == (3, 4, 4) and dataset.class_names == ("cat", "dog")
    assert dataset.train_labels.dtype == np.float32 and dataset.test_images.max() == 1
    # uint8 train beside float test: every split becomes float in [0, 1], so no 0-255 value reads as a float pixel.
    assert dataset.train_images.dtype == dataset.test_images.dtype == np.float32 and dataset.train_images.max() == 0
    assert rgb_multilabel.exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"val_labels": None}, "missing key.*val_labels"),
        ({"test_labels": np.zeros((5, 1), dtype=np.int64)}, "'test_labels' has 5 rows but 'test_images' has 6"),
        ({"train_labels": -(np.arange(12) % 3)[:, None]}, "'train_labels' holds negative class id"),
        ({"val_labels": np.array([[0, 2], [1, 0], [0, 1], [1, 1]])}, "'val_labels' is multi-hot .* values \\[2\\]"),
        ({"train_images": np.full((12, 5, 5), np.nan)}, "'train_images' contains NaN"),
        ({"train_images": np.full((12, 5, 5), 2.0)}, "'train_images' values span"),
        ({"test_images": np.zeros((6, 4, 4), dtype=np.uint8)}, "'test_images' has image shape"),
        ({"train_images": np.zeros((12, 5), dtype=np.uint8)}, "'train_images' has shape \\(12, 5\\)"),
    ],
)
def test_npz_loader_names_the_bad_key(tmp_path, overrides, message):
    path = write_npz(tmp_path / "bad.npz", **overrides)
    with pytest.raises(DataSourceError, match=message):
        load_source(f"npz:{path}", data_root=tmp_path)


def test_npz_loader_rejects_a_missing_or_unreadable_file(tmp_path):
    with pytest.raises(DataSourceError, match="nowhere.npz not found"):
        load_source("npz:nowhere.npz", data_root=tmp_path)
    (tmp_path / "junk.npz").write_bytes(b"not an archive")
    with pytest.raises(DataSourceError, match="cannot read .*junk.npz"):
        load_source("npz:junk.npz", data_root=tmp_path)


def test_medmnist_missing_file_names_the_path_and_url(tmp_path):
    with pytest.raises(DataSourceError, match="pathmnist_64.npz not found") as error:
        load_source("medmnist:pathmnist", data_root=tmp_path, image_size=64)
    assert str(tmp_path / "pathmnist_64.npz") in str(error.value)
    assert MEDMNIST_INFO["pathmnist"]["url_64"] in str(error.value)
    assert medmnist_file("pathmnist", tmp_path, 0).name == "pathmnist.npz"
    assert medmnist_file("pathmnist", tmp_path, 32).name == "pathmnist.npz"  # resized from 28 px
    assert medmnist_file("chestmnist", tmp_path, 224).name == "chestmnist_224.npz"


def test_medmnist_wrong_md5_is_rejected_and_the_official_checksum_accepted(tmp_path, monkeypatch):
    path = write_npz(tmp_path / "breastmnist.npz", train_labels=(np.arange(12) % 2)[:, None],
                     val_labels=np.array([[0], [1], [1], [0]]), test_labels=(np.arange(6) % 2)[:, None])
    actual = hashlib.md5(path.read_bytes()).hexdigest()
    official = MEDMNIST_INFO["breastmnist"]["MD5"]
    with pytest.raises(DataSourceError, match=f"MD5 {actual} but the official .* {official}"):
        load_source("medmnist:breastmnist", data_root=tmp_path)
    monkeypatch.setitem(MEDMNIST_INFO["breastmnist"], "MD5", actual)
    dataset = load_source("medmnist:breastmnist", data_root=tmp_path, image_size=10)
    assert dataset.class_names == ("malignant", "normal, benign")
    assert dataset.image_shape == (1, 10, 10) and dataset.name == "medmnist:breastmnist"


@pytest.fixture
def http_folder(tmp_path):
    """A local HTTP server publishing tmp_path/published (the download goes through real HTTP)."""
    folder = tmp_path / "published"
    folder.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_medmnist_downloads_only_when_allowed_and_verifies_the_download(tmp_path, monkeypatch, http_folder):
    folder, base_url = http_folder
    published = write_npz(folder / "pneumoniamnist.npz", train_labels=(np.arange(12) % 2)[:, None],
                          val_labels=np.array([[0], [1], [1], [0]]), test_labels=(np.arange(6) % 2)[:, None])
    monkeypatch.setitem(MEDMNIST_INFO["pneumoniamnist"], "url", f"{base_url}/pneumoniamnist.npz")
    monkeypatch.setitem(MEDMNIST_INFO["pneumoniamnist"], "MD5", hashlib.md5(published.read_bytes()).hexdigest())
    root = tmp_path / "root"
    with pytest.raises(DataSourceError, match="not found"):
        load_source("medmnist:pneumoniamnist", data_root=root)
    dataset = load_source("medmnist:pneumoniamnist", data_root=root, allow_download=True)
    assert (root / "pneumoniamnist.npz").read_bytes() == published.read_bytes()
    assert dataset.num_classes == 2 and dataset.train_images.shape == (16, 1, 5, 5)
    monkeypatch.setitem(MEDMNIST_INFO["pneumoniamnist"], "url", f"{base_url}/gone.npz")
    with pytest.raises(DataSourceError, match="downloading .*gone.npz to .* failed"):
        load_source("medmnist:pneumoniamnist", data_root=tmp_path / "other", allow_download=True)


@pytest.mark.parametrize("size", MEDMNIST_SIZES)
def test_every_2d_medmnist_dataset_has_its_file_url_and_checksum_at_every_size(size, tmp_path):
    for name in MEDMNIST_2D_NAMES:
        path = medmnist_file(name, tmp_path, size)
        suffix = path.stem.removeprefix(name)
        assert path.name == (f"{name}.npz" if size == 28 else f"{name}_{size}.npz")
        assert MEDMNIST_INFO[name][f"url{suffix}"].startswith("https://") and len(MEDMNIST_INFO[name][f"MD5{suffix}"]) == 32


@pytest.mark.parametrize("name, size, channels, label_width", [("pneumoniamnist", 64, 1, 1), ("chestmnist", 224, 1, 14),
                                                                ("pathmnist", 224, 3, 1)])  # fmt: skip
def test_an_official_layout_file_at_64_or_224_px_loads_with_its_info(name, size, channels, label_width, tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    shape = (size, size) if channels == 1 else (size, size, 3)
    k = len(MEDMNIST_INFO[name]["label"])

    def labels(n):
        return (rng.random((n, 14)) < 0.2).astype(np.uint8) if label_width == 14 else rng.integers(0, k, (n, 1), dtype=np.uint8)

    arrays = {f"{split}_{part}": rng.integers(0, 256, (n, *shape), dtype=np.uint8) if part == "images" else labels(n)
              for split, n in (("train", 6), ("val", 2), ("test", 3)) for part in ("images", "labels")}  # fmt: skip
    path = medmnist_file(name, tmp_path, size)
    np.savez(path, **arrays)
    # The file is synthetic: its own MD5 stands in for the published one.
    monkeypatch.setitem(MEDMNIST_INFO[name], f"MD5_{size}", hashlib.md5(path.read_bytes()).hexdigest())
    dataset = load_source(f"medmnist:{name}", data_root=tmp_path, image_size=size)
    assert dataset.image_shape == (channels, size, size) and len(dataset.train_labels) == 8
    assert dataset.multilabel == (label_width == 14) and dataset.num_classes == k
    assert dataset.class_names == tuple(MEDMNIST_INFO[name]["label"][str(c)] for c in range(k))
    first = arrays["test_images"][0]  # (H, W) or (H, W, 3) as stored; kept uint8 (see fedskew/data/pixels.py)
    np.testing.assert_array_equal(dataset.test_images[0, 0], first[..., 0] if channels == 3 else first)


def test_unknown_sources_list_the_valid_choices(tmp_path):
    with pytest.raises(DataSourceError, match="valid 2D names: pathmnist, chestmnist") as error:
        load_source("medmnist:organmnist3d", data_root=tmp_path)
    assert "3d" not in str(error.value).split("valid 2D names")[1]
    with pytest.raises(DataSourceError, match="valid forms: 'digits', 'cifar10', 'medmnist:<name>'"):
        load_source("mnist", data_root=tmp_path)
    with pytest.raises(DataSourceError, match="cifar-10-batches-py"):
        load_source("cifar10", data_root=tmp_path)


# ---------------------------------------------------------------- plots

def test_plots_write_png_files(tmp_path):
    counts = np.array([[5, 0, 3], [1, 7, 0]])
    heatmap = plot_label_counts(counts, ("a", "b", "c"), tmp_path / "out" / "counts.png", "labels per site")
    matrices = [np.array([[3, 1, 0], [1, 2, 0], [0, 0, 0]])] * 7
    cooccurrence = plot_cooccurrence(matrices, ("a", "b", "c"), tmp_path / "cooc.png")
    for path in (heatmap, cooccurrence):
        assert path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="2 class names"):
        plot_label_counts(counts, ("a", "b"), tmp_path / "bad.png", "x")
