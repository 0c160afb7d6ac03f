"""Image data sources: scikit-learn digits, MedMNIST, MedMNIST-layout npz files and CIFAR-10.

Every source is returned as an `ImageDataset` of (N, C, H, W) images with int64 class ids (N,) or
float32 multi-hot labels (N, K). Images are float32 in [0, 1], or uint8 0-255 where the source stores
8-bit pixels (MedMNIST, most npz files; see fedskew/data/pixels.py).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import zipfile
from pathlib import Path
from typing import IO

import numpy as np
import torch
import torch.nn.functional as F
from medmnist import INFO as MEDMNIST_INFO
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import download_url

from fedskew.config import GENERATED_DATASETS
from fedskew.data.image_dataset import ImageDataset, load_digits_source
from fedskew.data.pixels import unit_float
from fedskew.data.synthetic import load_synthetic

MEDMNIST_SIZES = (28, 64, 128, 224)
MEDMNIST_2D_NAMES = tuple(name for name in MEDMNIST_INFO if not name.endswith("3d"))
NPZ_SPLITS = ("train", "val", "test")
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
DATASET_FORMS = (
    "'digits', 'cifar10', 'medmnist:<name>' (name one of " + ", ".join(MEDMNIST_2D_NAMES) + ") "
    "'npz:<path>' (a file in MedMNIST npz layout; a relative path is taken under data-root) or a generated set: "
    + ", ".join(GENERATED_DATASETS)
)


class DataSourceError(ValueError):
    """A dataset cannot be loaded: unknown name, missing or corrupt file, malformed content."""


def load_source(
    dataset: str, *, data_root: str | Path, image_size: int = 0, allow_download: bool = False, seed: int = 0
) -> ImageDataset:
    """Load `dataset` ('digits', 'cifar10', 'medmnist:<name>', 'npz:<path>').

    image_size 0 keeps the native size; otherwise images are resized to image_size x image_size
    (MedMNIST reads its native file of that size when one exists; generated sets are drawn at that
    size). `seed` only affects `digits`, the one source without an official test split, and the
    generated sets. MedMNIST and npz sources merge their val split
    into train: sites carve their own validation split out of their training share.
    """
    if image_size < 0:
        raise DataSourceError(f"image_size={image_size} is negative; valid: 0 (native size) or a positive pixel count")
    kind, _, argument = dataset.partition(":")
    if dataset == "digits":
        source = load_digits_source(seed)
    elif dataset == "cifar10":
        source = _load_cifar10(Path(data_root).expanduser(), allow_download)
    elif kind == "medmnist" and argument:
        source = _load_medmnist(argument, Path(data_root).expanduser(), image_size, allow_download)
    elif kind == "npz" and argument:
        path = Path(argument).expanduser()
        source = load_npz(path if path.is_absolute() else Path(data_root).expanduser() / path)
    elif dataset in GENERATED_DATASETS:
        source = load_synthetic(dataset, image_size, seed)  # drawn at image_size: the resize below is a no-op
    else:
        raise DataSourceError(f"unknown dataset {dataset!r}; valid forms: {DATASET_FORMS}")
    return resize_dataset(source, image_size)


def resize_images(images: np.ndarray, size: int, batch_size: int = 2048) -> np.ndarray:
    """Bilinear, antialiased resize of (N, C, H, W) images to (N, C, size, size), in batches to bound memory."""
    resized = np.empty((len(images), images.shape[1], size, size), dtype=np.float32)
    for start in range(0, len(images), batch_size):
        batch = unit_float(torch.from_numpy(np.ascontiguousarray(images[start : start + batch_size])))
        resized[start : start + batch_size] = F.interpolate(
            batch, size=(size, size), mode="bilinear", antialias=True, align_corners=False
        ).numpy()
    # The filter is a convex combination, but its float weights can step a hair outside [0, 1].
    return np.clip(resized, 0.0, 1.0, out=resized)


def resize_dataset(dataset: ImageDataset, image_size: int) -> ImageDataset:
    """`dataset` with both splits resized to image_size x image_size; 0 or the current size is a no-op."""
    _, height, width = dataset.image_shape
    if image_size == 0 or (height, width) == (image_size, image_size):
        return dataset
    return ImageDataset(
        train_images=resize_images(dataset.train_images, image_size),
        train_labels=dataset.train_labels,
        test_images=resize_images(dataset.test_images, image_size),
        test_labels=dataset.test_labels,
        num_classes=dataset.num_classes,
        class_names=dataset.class_names,
        name=dataset.name,
    )


def _load_cifar10(root: Path, allow_download: bool) -> ImageDataset:
    try:
        train = CIFAR10(root=str(root), train=True, download=allow_download)
        test = CIFAR10(root=str(root), train=False, download=False)
    except (RuntimeError, OSError) as err:
        # torchvision raises RuntimeError for missing/corrupt files and URLError (an OSError) for failed downloads.
        how = "downloading failed; place it by hand" if allow_download else "or allow downloading to fetch it"
        raise DataSourceError(
            f"CIFAR-10 is not available under {root} ({err}): extract {CIFAR10_URL} so that the folder "
            f"{root / 'cifar-10-batches-py'} exists ({how})"
        ) from err
    return ImageDataset(
        train_images=np.ascontiguousarray(_images_to_nchw(train.data, "cifar10", "train images")),
        train_labels=np.asarray(train.targets, dtype=np.int64),
        test_images=np.ascontiguousarray(_images_to_nchw(test.data, "cifar10", "test images")),
        test_labels=np.asarray(test.targets, dtype=np.int64),
        num_classes=len(train.classes),
        class_names=tuple(train.classes),
        name="cifar10",
    )


def medmnist_file(name: str, data_root: str | Path, image_size: int) -> Path:
    """The MedMNIST file for `name` at `image_size`: <root>/<name>.npz (28 px) or <root>/<name>_<size>.npz."""
    size = image_size if image_size in MEDMNIST_SIZES else 28
    return Path(data_root) / (f"{name}.npz" if size == 28 else f"{name}_{size}.npz")


def _load_medmnist(name: str, data_root: Path, image_size: int, allow_download: bool) -> ImageDataset:
    if name not in MEDMNIST_2D_NAMES:
        raise DataSourceError(f"unknown MedMNIST dataset {name!r}; valid 2D names: {', '.join(MEDMNIST_2D_NAMES)}")
    info = MEDMNIST_INFO[name]
    path = medmnist_file(name, data_root, image_size)
    size_suffix = path.stem.removeprefix(name)  # "" for 28 px, "_64" ...
    url, expected_md5 = info[f"url{size_suffix}"], info[f"MD5{size_suffix}"]
    if not path.exists():
        if not allow_download:
            raise DataSourceError(
                f"MedMNIST file {path} not found: download {url} (MD5 {expected_md5}) and place it at exactly "
                "that path, or allow downloading to fetch it"
            )
        _download(url, path)
    actual_md5 = _file_md5(str(path), *_file_version(path))
    if actual_md5 != expected_md5:
        raise DataSourceError(
            f"{path} has MD5 {actual_md5} but the official {path.name} has MD5 {expected_md5} (corrupt, truncated "
            f"or a different version): delete it and download it again from {url}, or place the official file there"
        )
    class_names = tuple(info["label"][key] for key in sorted(info["label"], key=int))
    return _npz_dataset(str(path), *_file_version(path), name=f"medmnist:{name}", class_names=class_names)


def _download(url: str, path: Path) -> None:
    """torchvision's download utility (a progress bar, redirects followed) into a partial file, then renamed;
    the caller checks the MD5 with its own message."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")  # parallel site processes may download at once
    try:
        download_url(url, str(path.parent), partial.name)
    except (OSError, ValueError, RuntimeError) as err:  # URLError is an OSError; a malformed URL a ValueError
        partial.unlink(missing_ok=True)
        raise DataSourceError(f"downloading {url} to {path} failed ({err}): place the file there by hand") from err
    partial.replace(path)


def _file_version(path: Path) -> tuple[int, int]:
    """(mtime_ns, size): part of the cache keys so a replaced file is read again."""
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=8)
def _file_md5(path: str, mtime_ns: int, size: int) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an npz archive (not cached: the datasets built from it are).

    Every member's header is checked against the bytes the member holds before any array is allocated
    (`_checked_headers`). When train and val images are both uint8 of one shape they are read straight into
    one buffer and returned merged, as 'train_images' and 'train_labels' with empty val arrays: the merge
    every caller makes then costs no second copy of the largest array (what keeps a 5,000-image 224 px site
    under 2 GB)."""
    try:
        with zipfile.ZipFile(path) as archive:
            headers = _checked_headers(archive, os.path.getsize(path))
            images = _train_val_images(archive, headers)
        with np.load(path, allow_pickle=False) as npz:
            merged = () if images is None else ("train_images", "val_images")
            arrays = {key: npz[key] for key in npz.files if key not in merged}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise DataSourceError(f"cannot read {path} as an npz archive: {err}") from err
    if images is None:
        return arrays
    labels = np.concatenate([arrays["train_labels"], arrays["val_labels"]])
    return arrays | {"train_images": images, "val_images": images[:0], "train_labels": labels, "val_labels": labels[:0]}


# zlib's deflate expands at most 1032:1; a member claiming more than that over its stored bytes is forged.
DEFLATE_MAX_RATIO = 1032
NpyHeader = tuple[tuple[int, ...], bool, np.dtype]


def _checked_headers(archive: zipfile.ZipFile, archive_size: int) -> dict[str, NpyHeader]:
    """(shape, fortran order, dtype) of every member, by member name without '.npy'. ValueError naming the
    member when it is not a numeric .npy array (np.savez writes nothing else), or when the size its header
    declares is not the size of the data it holds: a header is read before anything is allocated, and a
    1 KB file must not make the reader allocate what its header claims."""
    headers = {}
    for info in archive.infolist():
        name = info.filename
        if not name.endswith(".npy"):
            raise ValueError(f"member {name!r} is not a .npy array; valid: an archive of arrays written by numpy.savez")
        stored_limit = {zipfile.ZIP_STORED: info.compress_size, zipfile.ZIP_DEFLATED: DEFLATE_MAX_RATIO * info.compress_size}
        if info.compress_type not in stored_limit:
            raise ValueError(f"member {name!r} uses zip compression method {info.compress_type}; valid: stored or "
                             "deflated (numpy.savez, numpy.savez_compressed)")  # fmt: skip
        if info.compress_size > archive_size or info.file_size > stored_limit[info.compress_type]:
            raise ValueError(
                f"member {name!r} claims {info.file_size} bytes from {info.compress_size} stored bytes in a "
                f"{archive_size}-byte file, more than the file can hold (a damaged or forged archive)"
            )
        with archive.open(info) as member:
            shape, _, dtype = header = _npy_header(member)
            data_bytes = info.file_size - member.tell()
        if dtype.hasobject:
            raise ValueError(f"member {name!r} holds Python objects (dtype {dtype}); valid: numeric arrays")
        if any(side < 0 for side in shape) or math.prod(shape) * dtype.itemsize != data_bytes:
            raise ValueError(
                f"member {name!r} declares a {shape} {dtype} array ({math.prod(shape) * dtype.itemsize} bytes) but "
                f"holds {data_bytes} bytes of data (a damaged or forged archive); valid: arrays written by numpy.savez"
            )
        headers[name.removesuffix(".npy")] = header
    return headers


def _train_val_images(archive: zipfile.ZipFile, headers: dict[str, NpyHeader]) -> np.ndarray | None:
    """train then val images in one uint8 buffer, read in place; None when they are not both uint8 arrays of
    one image shape with matching label rows (the general path then reads them and names what is wrong)."""
    names = ("train_images", "val_images", "train_labels", "val_labels")
    if not all(name in headers for name in names):
        return None
    (train, train_fortran, train_dtype), (val, val_fortran, val_dtype) = headers["train_images"], headers["val_images"]
    train_labels, val_labels = headers["train_labels"][0], headers["val_labels"][0]
    if (train_dtype != np.uint8 or val_dtype != np.uint8 or train_fortran or val_fortran or len(train) < 3
            or train[1:] != val[1:] or train_labels[:1] != train[:1] or val_labels[:1] != val[:1]
            or train_labels[1:] != val_labels[1:]):  # fmt: skip
        return None
    images = np.empty((train[0] + val[0], *train[1:]), dtype=np.uint8)
    _read_npy_into(archive, "train_images.npy", images[: train[0]])
    _read_npy_into(archive, "val_images.npy", images[train[0] :])
    return images


def _npy_header(member: IO[bytes]) -> NpyHeader:
    """(shape, fortran order, dtype) of an open .npy member, which is left at the start of its data."""
    version = np.lib.format.read_magic(member)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return read(member)


def _read_npy_into(archive: zipfile.ZipFile, name: str, out: np.ndarray) -> None:
    """The data of .npy member `name` into the C-contiguous `out`, in 4 MiB reads (no full-size temporary)."""
    with archive.open(name) as member:
        _npy_header(member)
        buffer = memoryview(out.reshape(-1))
        while buffer:
            read = member.readinto(buffer[: 1 << 22])
            if not read:
                raise ValueError(f"{name} ends before its {out.shape} array does (truncated archive)")
            buffer = buffer[read:]


@functools.lru_cache(maxsize=2)
def _npz_dataset(
    path: str, mtime_ns: int, size: int, *, name: str, class_names: tuple[str, ...] | None = None
) -> ImageDataset:
    """The dataset of an npz file, cached per file version: simulated sites in one process share it.
    Its arrays are read-only because they are shared."""
    dataset = _dataset_from_npz_arrays(read_npz(path), path, name=name, class_names=class_names)
    for array in (dataset.train_images, dataset.train_labels, dataset.test_images, dataset.test_labels):
        array.setflags(write=False)
    return dataset


def load_npz(path: str | Path) -> ImageDataset:
    """A file in MedMNIST npz layout: {train,val,test}_{images,labels}, optional class_names; val merged into train."""
    path = Path(path)
    if not path.is_file():
        raise DataSourceError(f"npz dataset file {path} not found; give an existing file in MedMNIST npz layout")
    return _npz_dataset(str(path), *_file_version(path), name=f"npz:{path.name}")


def _dataset_from_npz_arrays(
    arrays: dict[str, np.ndarray], source: str, *, name: str, class_names: tuple[str, ...] | None = None
) -> ImageDataset:
    """Validate MedMNIST-layout arrays and build the dataset (val merged into train)."""
    required = [f"{split}_{part}" for split in NPZ_SPLITS for part in ("images", "labels")]
    missing = [key for key in required if key not in arrays]
    if missing:
        raise DataSourceError(
            f"{source}: missing key(s) {', '.join(missing)}; the file has {sorted(arrays)} but needs "
            "{train,val,test}_{images,labels}"
        )
    images = same_pixel_type({split: _images_to_nchw(arrays[f"{split}_images"], source, f"{split}_images") for split in NPZ_SPLITS})
    labels = {split: _checked_labels(arrays[f"{split}_labels"], source, f"{split}_labels") for split in NPZ_SPLITS}
    for split in NPZ_SPLITS:
        if len(images[split]) != len(labels[split]):
            raise DataSourceError(
                f"{source}: '{split}_labels' has {len(labels[split])} rows but '{split}_images' has "
                f"{len(images[split])} images; each image needs exactly one label row"
            )
        if images[split].shape[1:] != images["train"].shape[1:]:
            raise DataSourceError(
                f"{source}: '{split}_images' has image shape {images[split].shape[1:]} (C, H, W) but "
                f"'train_images' has {images['train'].shape[1:]}; all splits need the same image shape"
            )
        if labels[split].ndim != labels["train"].ndim or labels[split].shape[1:] != labels["train"].shape[1:]:
            raise DataSourceError(
                f"{source}: '{split}_labels' has shape {arrays[f'{split}_labels'].shape} but 'train_labels' has "
                f"{arrays['train_labels'].shape}; all splits need the same label kind and number of labels"
            )
    for split in ("train", "test"):
        if len(images[split]) == 0:
            raise DataSourceError(f"{source}: '{split}_images' is empty; the train and test splits need samples")
    multilabel = labels["train"].ndim == 2
    found_classes = (
        labels["train"].shape[1] if multilabel else 1 + max(int(split.max(initial=0)) for split in labels.values())
    )
    if class_names is None:
        class_names = _npz_class_names(arrays, source, found_classes)
    if found_classes > len(class_names) or (multilabel and found_classes != len(class_names)):
        raise DataSourceError(
            f"{source}: labels need {found_classes} classes but the dataset defines {len(class_names)} "
            f"({', '.join(class_names)})"
        )
    return ImageDataset(
        train_images=joined(images["train"], images["val"]),
        train_labels=joined(labels["train"], labels["val"]),
        test_images=np.ascontiguousarray(images["test"]),
        test_labels=labels["test"],
        num_classes=len(class_names),
        class_names=class_names,
        name=name,
    )


def joined(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """first then second along axis 0; `first` itself (no copy, a view) when second is empty (see read_npz)."""
    return first if len(second) == 0 else np.concatenate([first, second])


def same_pixel_type(images: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Splits kept uint8 only when all are: concatenating uint8 with float would read 0-255 as float pixels."""
    if len({array.dtype for array in images.values()}) == 1:
        return images
    return {split: unit_float(array) for split, array in images.items()}


def _npz_class_names(arrays: dict[str, np.ndarray], source: str, num_classes: int) -> tuple[str, ...]:
    if "class_names" not in arrays:
        return tuple(str(k) for k in range(num_classes))
    names = arrays["class_names"]
    if names.ndim != 1 or len(names) != num_classes:
        raise DataSourceError(
            f"{source}: 'class_names' has shape {names.shape}; expected ({num_classes},), one name per class"
        )
    return tuple(str(name) for name in names)


def _images_to_nchw(images: np.ndarray, source: str, key: str) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) uint8 / [0, 1] float images as (N, C, H, W): uint8 kept (see `unit_float`),
    float as float32. A view where possible: the caller's concatenation makes the one contiguous copy."""
    if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[3] not in (1, 3)):
        raise DataSourceError(
            f"{source}: '{key}' has shape {images.shape}; expected (N, H, W) or (N, H, W, C) with C = 1 (grey) or 3 (RGB)"
        )
    if images.dtype == np.uint8:
        scaled = images
    elif np.issubdtype(images.dtype, np.floating):
        if not np.isfinite(images).all():
            raise DataSourceError(f"{source}: '{key}' contains NaN or infinite values; expected values in [0, 1]")
        if images.size and (images.min() < 0 or images.max() > 1):
            raise DataSourceError(
                f"{source}: '{key}' values span [{images.min()}, {images.max()}]; float images must lie in [0, 1] "
                "(or store uint8 0-255)"
            )
        scaled = images.astype(np.float32)
    else:
        raise DataSourceError(f"{source}: '{key}' has dtype {images.dtype}; expected uint8 (0-255) or float in [0, 1]")
    return scaled[:, None] if scaled.ndim == 3 else scaled.transpose(0, 3, 1, 2)


def _checked_labels(labels: np.ndarray, source: str, key: str) -> np.ndarray:
    """(N,) / (N, 1) class ids as int64 (N,); (N, K > 1) 0/1 multi-hot as float32 (N, K)."""
    if labels.ndim not in (1, 2):
        raise DataSourceError(
            f"{source}: '{key}' has shape {labels.shape}; expected (N, 1) class ids or (N, K) multi-hot"
        )
    numeric = np.issubdtype(labels.dtype, np.integer) or np.issubdtype(labels.dtype, np.floating)
    if not (numeric or labels.dtype == bool):
        raise DataSourceError(f"{source}: '{key}' has dtype {labels.dtype}; expected integer or float labels")
    if np.issubdtype(labels.dtype, np.floating) and not np.isfinite(labels).all():
        raise DataSourceError(f"{source}: '{key}' contains NaN or infinite values")
    if labels.ndim == 2 and labels.shape[1] > 1:
        if not np.isin(labels, (0, 1)).all():
            bad = np.unique(labels[~np.isin(labels, (0, 1))])[:5]
            raise DataSourceError(
                f"{source}: '{key}' is multi-hot (N, K) but holds values {bad.tolist()}; expected 0/1"
            )
        return labels.astype(np.float32)
    class_ids = labels.reshape(len(labels))
    if np.issubdtype(class_ids.dtype, np.floating) and (class_ids != np.round(class_ids)).any():
        raise DataSourceError(f"{source}: '{key}' holds non-integer class ids; expected whole numbers >= 0")
    if class_ids.size and class_ids.min() < 0:
        raise DataSourceError(f"{source}: '{key}' holds negative class id {class_ids.min()}; expected ids >= 0")
    return class_ids.astype(np.int64)
