"""A deployed site's own data, read from the folder its SuperNode's node config names (`data-dir`).

A data dir holds exactly one of these layouts:

- `images/` (PNG files) plus `labels.csv` with the header `file,labels`: each row names a file under
  `images/` and its labels: one class id, or for multi-label data several ids joined by `|` (an empty
  field is an image without any of the labels). An optional `classes.txt` holds one class name per
  line (line k names class k).
- `site.npz` in MedMNIST layout: `train_images` / `train_labels` (and optionally `val_images` /
  `val_labels`, merged in, and `class_names`); `test_*` arrays, if present, are not used.
- the official MedMNIST file of the run's `medmnist:<name>` dataset (`<name>.npz` or
  `<name>_<size>.npz`), checked against its published MD5: with node config `partition-id` and
  `num-partitions` the site takes that share of it (the simulated partition), otherwise all of its
  training split.

With run-config `dataset = "sites:<dir>"` a simulation reads the same folders: simulated SuperNode k
reads the k-th site folder of <dir> (`site_folders`) exactly as a SuperNode deployed with that folder as
its data-dir and site-id k would, so the sites' own split is kept and the folders deploy unchanged.

The site keeps `val-fraction` of its data for local validation, drawn with the same seed as a
simulated site with the same id, so a folder written by `fedskew prepare-sites` splits exactly like
its simulated twin. Whether labels are multi-label follows run-config `labels`; with `auto` the folder
tells: multi-hot (N, K) npz labels, or a labels.csv row with several `|`-joined ids or none. The site
reports its kind in the site survey and the server refuses a site whose kind differs from the run's.
"""

from __future__ import annotations

import csv
import io
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath

import numpy as np
from PIL import Image, UnidentifiedImageError

from fedskew.config import ConfigError, RunConfig, check_label_kind, sites_dir
from fedskew.data.site_cache import cached_arrays, site_cache_dir
from fedskew.data.sites import SiteData, load_partition, load_task_dataset, simulated_site, site_validation_split
from fedskew.data.sources import (
    DataSourceError,
    ImageDataset,
    _checked_labels,
    _images_to_nchw,
    load_npz,
    medmnist_file,
    read_npz,
    resize_dataset,
    resize_images,
    joined,
    same_pixel_type,
)
from fedskew.data.pixels import unit_float

DATA_DIR_KEY = "data-dir"
IMAGES_DIR, LABELS_FILE, CLASSES_FILE, SITE_NPZ = "images", "labels.csv", "classes.txt", "site.npz"
LABELS_HEADER = ["file", "labels"]
LABEL_SEPARATOR = "|"
CLASS_ID = re.compile(r"[0-9]{1,9}\Z")
FOLDER_LAYOUTS = (
    f"'{IMAGES_DIR}/' + '{LABELS_FILE}' (header 'file,labels'; labels one class id or several joined by "
    f"'{LABEL_SEPARATOR}'; optional '{CLASSES_FILE}') or '{SITE_NPZ}' (MedMNIST layout)"
)
LAYOUTS = f"{FOLDER_LAYOUTS}, or the official MedMNIST file of the run's medmnist:<name> dataset"


class SiteFolderError(ValueError):
    """A site data folder is missing, empty or malformed; the message names the path and what is valid."""


@dataclass(frozen=True, eq=False)
class LabelledImages:
    images: np.ndarray  # (N, C, H, W): float32 in [0, 1] or uint8 0-255 (see fedskew/data/pixels.py)
    labels: np.ndarray  # int64 (N,) class ids or float32 (N, K) multi-hot
    class_names: tuple[str, ...]


@dataclass(frozen=True)
class DeployedSite(SiteData):
    """A site whose data comes from its own folder rather than a simulated partition."""

    data_dir: str


# --- reading ---------------------------------------------------------------------------------------


def read_labelled_folder(
    folder: str | Path, *, multilabel: bool | None, num_classes: int = 0, image_size: int = 0
) -> LabelledImages:
    """All labelled images in `folder` (the labels.csv or site.npz layout); multilabel None reads the
    label kind from the data (see `folder_label_kind`).

    num_classes 0 takes the count from classes.txt / class_names / the multi-hot width; image_size > 0
    resizes every image to image_size x image_size (0 keeps them as stored: they must share one size).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise SiteFolderError(f"site data dir {folder} does not exist or is not a folder; valid: a folder holding {LAYOUTS}")
    has_csv, has_npz = (folder / LABELS_FILE).is_file(), (folder / SITE_NPZ).is_file()
    if has_csv and has_npz:
        raise SiteFolderError(f"{folder} holds both {LABELS_FILE} and {SITE_NPZ}; keep exactly one layout")
    if has_csv:
        images, rows, names = _read_png_layout(folder, multilabel, image_size)
        if multilabel is None:
            multilabel = csv_rows_are_multilabel(rows)
        num_classes = _resolve_num_classes(folder, names, num_classes, multi_hot_width=0)
        labels = _labels_from_rows(rows, num_classes, multilabel, folder / LABELS_FILE)
    elif has_npz:
        images, labels, names = _read_npz_layout(folder / SITE_NPZ, multilabel, image_size)
        multilabel = labels.ndim == 2
        num_classes = _resolve_num_classes(folder, names, num_classes, multi_hot_width=labels.shape[1] if multilabel else 0)
        if not multilabel and labels.max() >= num_classes:
            raise SiteFolderError(
                f"{folder / SITE_NPZ}: labels use class id {labels.max()} but there are {num_classes} classes; "
                f"valid ids: 0..{num_classes - 1}"
            )
    else:
        raise SiteFolderError(f"{folder} has no {LABELS_FILE} and no {SITE_NPZ} (found: {_listing(folder)}); valid: {LAYOUTS}")
    return LabelledImages(images, labels, names or tuple(str(k) for k in range(num_classes)))


def _listing(folder: Path, limit: int = 8) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "") if names else "nothing"


def csv_rows_are_multilabel(rows: list[tuple[int, str, list[int]]]) -> bool:
    """labels.csv rows read as multi-label when any image has several ids or none (an empty field)."""
    return any(len(ids) != 1 for _, _, ids in rows)


def _read_png_layout(folder: Path, multilabel: bool | None, image_size: int) -> tuple[np.ndarray, list, tuple[str, ...]]:
    """(images, labels.csv rows, class names from classes.txt or ())."""
    rows = _read_labels_csv(folder / LABELS_FILE, multilabel)
    image_dir = folder / IMAGES_DIR
    if not image_dir.is_dir():
        raise SiteFolderError(f"{folder} has {LABELS_FILE} but no {IMAGES_DIR}/ folder; put the images it names there")
    listed = {name for _, name, _ in rows}
    unlisted = sorted(
        rel for p in image_dir.rglob("*") if p.is_file() and (rel := p.relative_to(image_dir).as_posix()) not in listed
    )
    if unlisted:
        # Never silently train on a subset: an unlabelled image is a mistake in the export.
        raise SiteFolderError(
            f"{image_dir} holds {len(unlisted)} file(s) that {LABELS_FILE} does not label (e.g. {', '.join(unlisted[:3])}); "
            "add a row for each image or move the files out"
        )
    images = _stack_images([(line, image_dir / name) for line, name, _ in rows], image_size, folder / LABELS_FILE)
    names = _read_class_names(folder / CLASSES_FILE) if (folder / CLASSES_FILE).is_file() else ()
    return images, rows, names


def _read_labels_csv(path: Path, multilabel: bool | None) -> list[tuple[int, str, list[int]]]:
    """(line number, file name, class ids) per data row; line 1 is the header."""
    reader = csv.reader(io.StringIO(_utf8_text(path), newline=""))
    try:
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != LABELS_HEADER:
            raise SiteFolderError(f"{path} line 1 is {str(header)[:200]}; expected the header 'file,labels'")
        rows, seen = [], {}
        for row in reader:
            line = reader.line_num  # the file's line, also when a quoted field spans lines
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != 2:
                raise SiteFolderError(f"{path} line {line} has {len(row)} fields {str(row)[:200]}; expected 2: file,labels")
            name, ids = row[0].strip(), _parse_class_ids(row[1], path, line, multilabel)
            _check_relative_name(name, path, line)
            if name in seen:
                raise SiteFolderError(f"{path} line {line}: {name!r} is already labelled on line {seen[name]}; one row per image")
            seen[name] = line
            rows.append((line, name, ids))
    except csv.Error as err:  # e.g. a field over csv's 131072-character limit
        raise SiteFolderError(f"{path} line {reader.line_num}: {err}; valid: rows 'file,labels' of short fields") from None
    if not rows:
        raise SiteFolderError(f"{path} has a header but no rows; the site needs at least one labelled image")
    return rows


def _utf8_text(path: Path) -> str:
    """A text file of the site folder; a byte that is not UTF-8 is reported with its line."""
    data = path.read_bytes()
    try:
        # utf-8-sig: spreadsheet exports often start with a byte-order mark.
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise SiteFolderError(f"{path} line {line} is not UTF-8 ({err.reason} at byte {err.start}); save the file as UTF-8") from None


def _parse_class_ids(field: str, path: Path, line: int, multilabel: bool | None) -> list[int]:
    parts = [part.strip() for part in field.split(LABEL_SEPARATOR)] if field.strip() else []
    # ASCII digits only: str.isdigit also accepts '²' (int() refuses it) and other scripts' digits.
    if not all(CLASS_ID.match(part) for part in parts):
        raise SiteFolderError(
            f"{path} line {line}: labels {field[:100]!r} are not class ids; valid: whole numbers >= 0 written with 0-9"
            + ("" if multilabel is False else f" joined by '{LABEL_SEPARATOR}' (empty = no label)")
        )
    ids = [int(part) for part in parts]
    if multilabel is False and len(ids) != 1:
        raise SiteFolderError(
            f"{path} line {line}: labels {field!r} are not exactly one class id, but this run is single-label "
            "(run-config labels = 'single'); give one id per image, or set labels to 'multi' or 'auto'"
        )
    if len(set(ids)) != len(ids):
        raise SiteFolderError(f"{path} line {line}: labels {field!r} repeat a class id; list each label once")
    return ids


def _check_relative_name(name: str, path: Path, line: int) -> None:
    parts = PurePosixPath(name).parts
    if not name or name.startswith("/") or ".." in parts or "\\" in name:
        raise SiteFolderError(
            f"{path} line {line}: file {name!r} is not a plain path under {IMAGES_DIR}/; valid: e.g. 'img001.png' or 'ward2/img001.png'"
        )


def _read_class_names(path: Path) -> tuple[str, ...]:
    names = tuple(line.strip() for line in _utf8_text(path).splitlines())
    while names and not names[-1]:
        names = names[:-1]
    if not names or not all(names):
        raise SiteFolderError(f"{path} has empty lines or no names; valid: one non-empty class name per line (line k = class k)")
    return names


def _stack_images(files: list[tuple[int, Path]], image_size: int, labels_path: Path) -> np.ndarray:
    images = [_read_image(path, line, labels_path) for line, path in files]
    first_line, first = files[0][0], images[0]
    for (line, path), image in zip(files, images):
        # image-size resizes height and width only: the colour mode must match either way.
        if image.shape[0] != first.shape[0] or (image_size == 0 and image.shape != first.shape):
            raise SiteFolderError(
                f"{path} (line {line} of {labels_path}) has shape {image.shape} (C, H, W) but the image on line "
                f"{first_line} has {first.shape}; give images of one colour mode (grey or RGB) and one size "
                "(image-size resizes, it does not convert colour)"
            )
    if image_size > 0:
        return np.concatenate([resize_images(image[None], image_size) for image in images])
    return np.stack(images)


def _read_image(path: Path, line: int, labels_path: Path) -> np.ndarray:
    if not path.is_file():
        raise SiteFolderError(f"{labels_path} line {line} names {path.name!r}, but {path} does not exist")
    # A link out of the folder would let whoever writes the folder make the site train on (and, through its
    # model, leak) any file the site's process can read.
    folder = labels_path.parent.resolve()
    if not path.resolve().is_relative_to(folder):
        raise SiteFolderError(
            f"{labels_path} line {line} names {path.name!r}, a link to {path.resolve()}, outside the site folder "
            f"{folder}; valid: image files inside the site folder (copy the image in instead of linking to it)"
        )
    return decode_image(path, where=f" (line {line} of {labels_path})")


def decode_image(path: Path, where: str = "") -> np.ndarray:
    """One image file as float32 (C, H, W) in [0, 1]: grey (8/16 bit) gives 1 channel, colour 3 (alpha dropped)."""
    try:
        # PIL only warns between 1x and 2x its pixel limit: refuse those too, before any pixel is decoded.
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(path)
        with img:
            img.load()
            if img.mode in ("I;16", "I;16B", "I;16L", "I"):
                pixels = np.asarray(img, dtype=np.float32)[None] / 65535.0
            elif img.mode in ("1", "L", "LA"):
                pixels = np.asarray(img.convert("L"), dtype=np.float32)[None] / 255.0
            else:
                pixels = np.asarray(img.convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255.0
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise SiteFolderError(
            f"{path}{where} is too large to read safely ({err}); valid: at most "
            f"{Image.MAX_IMAGE_PIXELS} pixels, resize it"
        ) from None
    except (UnidentifiedImageError, OSError) as err:
        raise SiteFolderError(f"{path}{where} is not a readable image: {err}") from err
    return np.clip(pixels, 0.0, 1.0)


def _read_npz_layout(path: Path, multilabel: bool | None, image_size: int) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    try:
        arrays = read_npz(path)
    except DataSourceError as err:
        raise SiteFolderError(str(err)) from err
    if "train_images" not in arrays or "train_labels" not in arrays:
        raise SiteFolderError(
            f"{path} has arrays {sorted(arrays)}; a site npz needs 'train_images' and 'train_labels' "
            "(MedMNIST layout; 'val_images'/'val_labels' and 'class_names' optional)"
        )
    splits = ["train"] + (["val"] if "val_images" in arrays and "val_labels" in arrays else [])
    try:
        images = same_pixel_type({s: _images_to_nchw(arrays[f"{s}_images"], str(path), f"{s}_images") for s in splits})
        labels = {s: _checked_labels(arrays[f"{s}_labels"], str(path), f"{s}_labels") for s in splits}
        images, labels = (joined(*parts.values()) if len(parts) == 2 else parts["train"] for parts in (images, labels))
    except (DataSourceError, ValueError) as err:
        raise SiteFolderError(f"{path}: {err}") from err
    if len(images) != len(labels) or len(images) == 0:
        raise SiteFolderError(f"{path} has {len(images)} images and {len(labels)} label rows; expected the same non-zero number")
    if multilabel is not None and (labels.ndim == 2) != multilabel:
        kind = "multi-hot (N, K) labels" if labels.ndim == 2 else "class ids"
        raise SiteFolderError(
            f"{path} holds {kind} but run-config labels = {('multi' if multilabel else 'single')!r}; set labels to "
            "'auto' (the kind is read from the data) or to the kind of this file"
        )
    names = tuple(str(n) for n in arrays["class_names"]) if "class_names" in arrays else ()
    return (resize_images(images, image_size) if image_size > 0 else images), labels, names


def _resolve_num_classes(folder: Path, names: tuple[str, ...], configured: int, multi_hot_width: int) -> int:
    """The label-space size every site must share: run-config num-classes, the folder's class names or
    an npz's multi-hot width (all that are given must agree); a plain list of ids cannot tell it."""
    known = {
        what: n
        for what, n in (("run-config num-classes", configured), ("class names", len(names)), ("multi-hot width", multi_hot_width))
        if n
    }
    if len(set(known.values())) > 1:
        raise SiteFolderError(f"{folder}: {' but '.join(f'{k} = {v}' for k, v in known.items())}; they must agree")
    if not known:
        raise SiteFolderError(
            f"{folder}: the number of classes is unknown (a site may lack the highest classes); add {CLASSES_FILE} "
            "(one name per line, line k = class k) or set run-config num-classes"
        )
    return next(iter(known.values()))


def _labels_from_rows(rows: list[tuple[int, str, list[int]]], num_classes: int, multilabel: bool, path: Path) -> np.ndarray:
    """int64 class ids (N,) or float32 multi-hot (N, num_classes); an id out of range names its line."""
    for line, _, ids in rows:
        if any(k >= num_classes for k in ids):
            raise SiteFolderError(
                f"{path} line {line}: class id {max(ids)} is out of range; there are {num_classes} classes, "
                f"valid ids: 0..{num_classes - 1}"
            )
    if not multilabel:
        return np.array([ids[0] for _, _, ids in rows], dtype=np.int64)
    multi_hot = np.zeros((len(rows), num_classes), dtype=np.float32)
    for row, (_, _, ids) in enumerate(rows):
        multi_hot[row, ids] = 1.0
    return multi_hot


# --- a deployed site ----------------------------------------------------------------------------------


def deployed_site(cfg: RunConfig, node_config: Mapping) -> DeployedSite:
    """The site behind a SuperNode started with `--node-config "data-dir='...' [site-id=K num-sites=N]"`.

    site-id (default: partition-id, else 0) seeds the site's validation split and names it in the
    partition record; num-sites (default: num-partitions, else 1) is only reported.
    """
    data_dir = Path(str(node_config[DATA_DIR_KEY])).expanduser()
    site_id, num_sites = _site_identity(node_config)
    official = _official_medmnist_file(cfg, data_dir)
    if official is not None and not any((data_dir / name).is_file() for name in (LABELS_FILE, SITE_NPZ)):
        return _official_medmnist_site(cfg, data_dir, node_config, site_id, num_sites)
    data = cached_folder(cfg, data_dir, node_config)
    return _split_site(cfg, data.images, data.labels, data.class_names, site_id, num_sites, data_dir)


def cached_folder(cfg: RunConfig, data_dir: Path, node_config: Mapping) -> LabelledImages:
    """read_labelled_folder through the site's cache (each message runs in a fresh process)."""

    def read() -> dict[str, np.ndarray]:
        data = read_labelled_folder(data_dir, multilabel=declared_multilabel(cfg), num_classes=cfg.num_classes, image_size=cfg.image_size)
        return {"images": data.images, "labels": data.labels, "class_names": np.array(data.class_names)}

    images_dir = data_dir / IMAGES_DIR
    files = [data_dir / LABELS_FILE, data_dir / CLASSES_FILE, data_dir / SITE_NPZ]
    files += [p for p in images_dir.rglob("*") if p.is_file()] if images_dir.is_dir() else []
    settings = {"labels": cfg.labels, "num-classes": cfg.num_classes, "image-size": cfg.image_size}
    arrays = cached_arrays(data_dir, files, site_cache_dir(data_dir, node_config), settings, read)
    return LabelledImages(arrays["images"], arrays["labels"], tuple(str(n) for n in arrays["class_names"]))


def declared_multilabel(cfg: RunConfig) -> bool | None:
    """Run-config `labels` as read_labelled_folder takes it: None (auto) reads the kind from the folder.
    mosaic-grid and the dataset name say nothing about a site's own folder, so only `labels` counts."""
    return {"multi": True, "single": False}.get(cfg.labels)


def _site_identity(node_config: Mapping) -> tuple[int, int]:
    def whole(key: str, default: int) -> int:
        value = node_config.get(key, default)
        if isinstance(value, bool) or not str(value).isdigit():
            raise SiteFolderError(f"node config {key} = {value!r} is invalid; valid: a whole number >= 0")
        return int(value)

    site_id = whole("site-id", whole("partition-id", 0))
    num_sites = whole("num-sites", whole("num-partitions", 1))
    if not 0 <= site_id < num_sites:
        raise SiteFolderError(f"node config site-id = {site_id} with num-sites = {num_sites}; valid site ids: 0..{num_sites - 1}")
    return site_id, num_sites


def _official_medmnist_file(cfg: RunConfig, data_dir: Path) -> Path | None:
    kind, _, name = cfg.dataset.partition(":")
    if kind != "medmnist":
        return None
    path = medmnist_file(name, data_dir, cfg.image_size)
    return path if path.exists() else None


def _official_medmnist_site(cfg: RunConfig, data_dir: Path, node_config: Mapping, site_id: int, num_sites: int) -> DeployedSite:
    # The same loader as simulation, rooted at the site's folder: it verifies the published MD5.
    local = cfg.model_copy(update={"data_root": str(data_dir), "allow_download": False})
    if "partition-id" in node_config:
        site = simulated_site(local, site_id, num_sites)
        return DeployedSite(**{f.name: getattr(site, f.name) for f in fields(site)}, data_dir=str(data_dir))
    dataset = load_task_dataset(local)
    if cfg.num_classes and cfg.num_classes != dataset.num_classes:
        raise SiteFolderError(
            f"{data_dir}: {dataset.name} has {dataset.num_classes} classes but run-config num-classes = {cfg.num_classes}; "
            "they must agree (or set num-classes to 0)"
        )
    return _split_site(cfg, dataset.train_images, dataset.train_labels, dataset.class_names, site_id, num_sites, data_dir)


def _split_site(
    cfg: RunConfig,
    images: np.ndarray,
    labels: np.ndarray,
    class_names: tuple[str, ...],
    site_id: int,
    num_sites: int,
    data_dir: Path,
) -> DeployedSite:
    """The site's data split into train and validation. Writable `images` (read for this call) are reordered
    in place, so the split holds no second copy of a large site; shared read-only ones are copied."""
    train_idx, val_idx = site_validation_split(cfg, np.arange(len(labels)), site_id)
    if images.flags.writeable:
        permute_rows_in_place(images, np.concatenate([train_idx, val_idx]))
        train_images, val_images = images[: len(train_idx)], images[len(train_idx) :]
    else:
        train_images, val_images = images[train_idx], images[val_idx]
    return DeployedSite(
        site_id=site_id,
        num_sites=num_sites,
        train_images=train_images,
        train_labels=labels[train_idx],
        val_images=val_images,
        val_labels=labels[val_idx],
        num_classes=len(class_names),
        class_names=class_names,
        data_dir=str(data_dir),
    )


def permute_rows_in_place(array: np.ndarray, order: np.ndarray) -> None:
    """array[:] = array[order] for a permutation `order`, one cycle at a time with one row of extra memory."""
    if not np.array_equal(np.sort(order), np.arange(len(array))):
        raise ValueError(f"order is not a permutation of the {len(array)} rows")
    placed = np.zeros(len(order), dtype=bool)
    for start in range(len(order)):
        if placed[start]:
            continue
        saved, row = array[start].copy(), start
        while True:  # row receives array[order[row]], which is read before it is overwritten
            placed[row] = True
            source = int(order[row])
            if source == start:
                array[row] = saved
                break
            array[row] = array[source]
            row = source


# --- simulated sites on their own folders (dataset = "sites:<dir>") ------------------------------------


def site_folders(cfg: RunConfig) -> list[Path]:
    """The site folders of run-config dataset `sites:<dir>`, site k at index k: every sub-folder of <dir>
    ordered by name with numbers compared as numbers (site-2 before site-10, as `fedskew prepare-sites`
    numbers them), leaving out hidden folders and the run's test-data and val-data (the server's data is no
    site's). A relative <dir> is under data-root, as for npz:<path>. ConfigError naming the path when <dir>
    is missing, holds no site folder, or a site folder holds neither layout (what is in the files is checked
    when a site reads them)."""
    written = sites_dir(cfg.dataset)
    if written is None:
        raise ValueError(f"dataset {cfg.dataset!r} is not sites:<dir>; only that dataset has site folders")
    root = Path(written).expanduser()
    root = root if root.is_absolute() else Path(cfg.data_root).expanduser() / root
    where = f"key 'dataset' = {cfg.dataset!r}"
    if not root.is_dir():
        raise ConfigError(f"{where}: {root} does not exist or is not a folder; valid: sites:<a folder holding one "
                          f"sub-folder per site> (a relative folder is under data-root = {cfg.data_root!r})")  # fmt: skip
    servers = {Path(p).expanduser().resolve() for p in (cfg.test_data, cfg.val_data) if p}
    folders = sorted(
        (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and p.resolve() not in servers),
        key=lambda p: [int(part) if part.isdigit() else part for part in re.split(r"([0-9]+)", p.name)],
    )
    if not folders:
        raise ConfigError(f"{where}: {root} holds no site folder (found: {_listing(root)}); valid: one sub-folder "
                          f"per site, each holding {FOLDER_LAYOUTS}")  # fmt: skip
    for folder in folders:
        found = [name for name in (LABELS_FILE, SITE_NPZ) if (folder / name).is_file()]
        if len(found) != 1:
            raise ConfigError(f"{where}: site folder {folder} holds {' and '.join(found) or 'neither'} of "
                              f"{LABELS_FILE} and {SITE_NPZ} (found: {_listing(folder)}); valid: exactly one "
                              f"layout, {FOLDER_LAYOUTS}")  # fmt: skip
    return folders


def site_names(cfg: RunConfig) -> dict[int, str]:
    """Site id -> the name of its folder with dataset sites:<dir>, as the server records the sites; {} for
    other datasets (a deployed site's folder name stays at the site)."""
    return {} if sites_dir(cfg.dataset) is None else {k: folder.name for k, folder in enumerate(site_folders(cfg))}


def check_site_count(cfg: RunConfig, num_sites: int) -> list[Path]:
    """The site folders of dataset sites:<dir> when the federation has one SuperNode for each, else
    ConfigError naming the key, both counts and the valid num-supernodes. The server can call it once it
    knows how many SuperNodes there are; every simulated site checks it before it reads its folder."""
    folders = site_folders(cfg)
    if num_sites != len(folders):
        names = ", ".join(f.name for f in folders[:5]) + (", ..." if len(folders) > 5 else "")
        raise ConfigError(
            f"key 'dataset' = {cfg.dataset!r} holds {len(folders)} site folder(s) ({names}) but the simulation has "
            f"{num_sites} SuperNode(s); valid: one SuperNode per site folder, --federation-config "
            f"\"num-supernodes={len(folders)}\""
        )
    return folders


def folder_site(cfg: RunConfig, site_id: int, num_sites: int) -> DeployedSite:
    """Simulated site `site_id` of `num_sites` with dataset sites:<dir>: its own folder, read and split
    exactly as a SuperNode deployed with `data-dir` = that folder and `site-id` = site_id would."""
    folders = check_site_count(cfg, num_sites)
    # deployed_site refuses a site id outside 0..num_sites - 1 before it indexes anything.
    return deployed_site(cfg, {DATA_DIR_KEY: str(folders[site_id]), "site-id": site_id, "num-sites": num_sites})


def load_test_set(cfg: RunConfig, path: str | Path) -> ImageDataset:
    """A coordinating centre's test data: a folder in the site layout (all of it is test data) or a
    MedMNIST-layout .npz file (its test split). Returned with an empty training split, as the server
    never trains on it; class count and image size follow the run config like a site's, and its label
    kind must be one the run config can use."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".npz":
        test = resize_dataset(load_npz(path), cfg.image_size)
        if cfg.num_classes not in (0, test.num_classes):
            raise SiteFolderError(
                f"test-data {path} has {test.num_classes} classes but run-config num-classes = {cfg.num_classes}; "
                "they must agree (or set num-classes to 0)"
            )
        data = LabelledImages(test.test_images, test.test_labels, test.class_names)
    elif path.is_dir():
        data = read_labelled_folder(path, multilabel=declared_multilabel(cfg), num_classes=cfg.num_classes, image_size=cfg.image_size)
    else:
        raise SiteFolderError(f"test-data {path} is neither a folder nor an .npz file; valid: a folder holding {LAYOUTS}, or a MedMNIST-layout .npz")
    check_label_kind(cfg, data.labels.ndim == 2, f"test-data {path}")
    return ImageDataset(
        train_images=data.images[:0],
        train_labels=data.labels[:0],
        test_images=data.images,
        test_labels=data.labels,
        num_classes=len(data.class_names),
        class_names=data.class_names,
        name=f"test-data:{path.name}",
    )


# --- writing (prepare-sites) --------------------------------------------------------------------------

FORMATS = ("png", "npz")


def write_labelled_folder(
    folder: str | Path, images: np.ndarray, labels: np.ndarray, class_names: tuple[str, ...], fmt: str = "png"
) -> Path:
    """Write images (N, C, H, W) (float32 in [0, 1] or uint8) and their labels in the `png` (images/ + labels.csv + classes.txt)
    or `npz` (site.npz) layout. PNG stores 8 bits per channel, so pixels are rounded to multiples of 1/255;
    npz keeps the values and their dtype exactly."""
    folder = Path(folder)
    if fmt not in FORMATS:
        raise SiteFolderError(f"format {fmt!r} is invalid; valid: {', '.join(FORMATS)}")
    if images.ndim != 4 or images.shape[1] not in (1, 3) or len(images) != len(labels) or len(images) == 0:
        raise SiteFolderError(
            f"images {images.shape} with {len(labels)} labels; expected (N, 1 or 3, H, W) images and N > 0 label rows"
        )
    if folder.exists() and any(folder.iterdir()):
        raise SiteFolderError(f"{folder} exists and is not empty; write sites into a new or empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "npz":
        channels_last = images.transpose(0, 2, 3, 1)
        np.savez_compressed(
            folder / SITE_NPZ,
            train_images=channels_last[..., 0] if images.shape[1] == 1 else channels_last,
            train_labels=labels if labels.ndim == 2 else labels[:, None],
            class_names=np.array(class_names),
        )
        return folder
    (folder / IMAGES_DIR).mkdir()
    pixels = np.rint(np.clip(unit_float(images), 0.0, 1.0) * 255).astype(np.uint8).transpose(0, 2, 3, 1)
    rows = []
    for index, (image, label) in enumerate(zip(pixels, labels)):
        name = f"{index:06d}.png"
        Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(folder / IMAGES_DIR / name)
        ids = np.flatnonzero(label) if labels.ndim == 2 else [label]
        rows.append([name, LABEL_SEPARATOR.join(str(int(k)) for k in ids)])
    with (folder / LABELS_FILE).open("w", newline="") as handle:
        csv.writer(handle).writerows([LABELS_HEADER, *rows])
    (folder / CLASSES_FILE).write_text("".join(f"{name}\n" for name in class_names))
    return folder


def prepare_sites(cfg: RunConfig, num_sites: int, out: str | Path, fmt: str = "png") -> dict[str, LabelledImages]:
    """Write `out/site-K` for K < num_sites (site K's whole share of the simulated partition; the site
    carves its validation split at load time) and `out/server-test` (the dataset's test split).
    Returns what each folder holds, by folder name."""
    out = Path(out)
    dataset = load_task_dataset(cfg)
    partition = load_partition(cfg, num_sites)
    contents = {
        f"site-{k}": LabelledImages(dataset.train_images[idx], dataset.train_labels[idx], dataset.class_names)
        for k, idx in enumerate(partition.site_indices)
    }
    contents["server-test"] = LabelledImages(dataset.test_images, dataset.test_labels, dataset.class_names)
    occupied = [name for name in contents if (out / name).exists() and any((out / name).iterdir())]
    if occupied:
        raise SiteFolderError(f"{out} already holds non-empty {', '.join(occupied)}; choose a new --out or remove them")
    for name, data in contents.items():
        write_labelled_folder(out / name, data.images, data.labels, data.class_names, fmt)
    return contents


def site_in_simulation(cfg: RunConfig, site_id: int, num_sites: int) -> SiteData:
    """What simulated SuperNode `site_id` of `num_sites` trains on: with dataset sites:<dir> its own site
    folder, otherwise its share of the partition."""
    if sites_dir(cfg.dataset) is None:
        return simulated_site(cfg, site_id, num_sites)
    return folder_site(cfg, site_id, num_sites)


def pooled_site_data(cfg: RunConfig, num_sites: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, validation images, validation labels): the union of every site's local
    training and validation splits, exactly what the federation trains and selects on, pooled."""
    sites = [site_in_simulation(cfg, k, num_sites) for k in range(num_sites)]
    task = {(s.multilabel, s.num_classes, s.train_images.shape[1:]) for s in sites}
    if len(task) > 1:
        # Only site folders can differ (a partition shares its dataset's task); site k is the k-th folder.
        raise ValueError("the sites' data cannot be pooled, their tasks differ: " + "; ".join(
            f"site {s.site_id}: {'multi' if s.multilabel else 'single'}-label, {s.num_classes} classes, images "
            f"{tuple(s.train_images.shape[1:])}" for s in sites
        ))  # fmt: skip
    return (
        np.concatenate([s.train_images for s in sites]),
        np.concatenate([s.train_labels for s in sites]),
        np.concatenate([s.val_images for s in sites]),
        np.concatenate([s.val_labels for s in sites]),
    )
