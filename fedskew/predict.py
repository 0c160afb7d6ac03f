"""`fedskew predict`: apply a saved model to new images, without the run that trained it.

The model comes from a self-contained model file (see fedskew.models.model_file) or a run directory
(its best-validation model, `model-selected.safetensors`). The images come from a site folder
(labels.csv or site.npz layout), a folder of PNG/JPEG files, or an npz in MedMNIST layout (its test
split). One CSV row per image: the file name (or index), the predicted labels and every class
probability, computed exactly as the run's evaluation did.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedskew.data.site_folder import (
    LABELS_FILE,
    SITE_NPZ,
    SiteFolderError,
    _read_labels_csv,
    decode_image,
    read_labelled_folder,
)
from fedskew.data.sources import load_npz, resize_images
from fedskew.metrics import multilabel_metrics, single_label_metrics
from fedskew.models.model_file import ModelCard, load_model_file
from fedskew.results import CHECKPOINT, SELECTED_MODEL
from fedskew.training import EVAL_BATCH_SIZE, make_loader, pick_device
from fedskew.training import predict as predict_probabilities

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass(frozen=True)
class Inputs:
    names: list[str]  # file names relative to the input folder, or row indices
    images: np.ndarray  # float32 (N, C, H, W) in [0, 1]
    labels: np.ndarray | None  # ground truth when the input carries it


def model_path(path: str | Path) -> Path:
    """A model file as given, or a run directory's selected (best-validation) model."""
    path = Path(path)
    if path.is_dir():
        for name in (SELECTED_MODEL, CHECKPOINT):
            if (path / name).is_file():
                return path / name
        raise SiteFolderError(f"{path} holds neither {SELECTED_MODEL} nor {CHECKPOINT}; valid: a fedskew run directory or model file")
    if not path.is_file():
        raise SiteFolderError(f"model {path} does not exist; valid: a fedskew run directory or a .safetensors model file")
    return path


def read_inputs(path: str | Path, card: ModelCard) -> Inputs:
    path = Path(path)
    if path.is_file() and path.suffix == ".npz":
        test = load_npz(path)
        return Inputs([str(k) for k in range(len(test.test_labels))], test.test_images, test.test_labels)
    if not path.is_dir():
        raise SiteFolderError(f"input {path} is neither a folder nor an .npz file; valid: a site folder, a folder of PNG/JPEG images, or an npz")
    if (path / LABELS_FILE).is_file() or (path / SITE_NPZ).is_file():
        data = read_labelled_folder(path, multilabel=card.multilabel, num_classes=len(card.class_names))
        if (path / LABELS_FILE).is_file():
            names = [name for _, name, _ in _read_labels_csv(path / LABELS_FILE, card.multilabel)]
        else:
            names = [str(k) for k in range(len(data.labels))]
        return Inputs(names, data.images, data.labels)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise SiteFolderError(f"{path} holds no {', '.join(IMAGE_SUFFIXES)} files, no {LABELS_FILE} and no {SITE_NPZ}")
    # Files may differ in size and colour mode: each is brought to the model's input on its own.
    images = np.concatenate([conform(decode_image(f)[None], card, str(f)) for f in files])
    return Inputs([f.relative_to(path).as_posix() for f in files], images, None)


def conform(images: np.ndarray, card: ModelCard, source: str) -> np.ndarray:
    """Images in the model's input shape: grey repeated to RGB for a colour model, resized when the side differs."""
    channels, height, width = card.image_shape
    if images.shape[1] == 1 and channels == 3:
        images = np.repeat(images, 3, axis=1)
    if images.shape[1] != channels:
        raise SiteFolderError(
            f"{source} has {images.shape[1]}-channel images but the model takes {channels} channel(s); "
            "give grey images to a grey model and colour (or grey) images to a colour model"
        )
    return images if images.shape[2:] == (height, width) else resize_images(images, height)


def predict(model_or_run: str | Path, input_path: str | Path, out: str | Path, device: str = "auto") -> dict:
    """Write predictions.csv; returns {"rows", "model", "metrics" (when the input has labels)}."""
    path = model_path(model_or_run)
    model, card = load_model_file(path)
    inputs = read_inputs(input_path, card)
    images = conform(inputs.images, card, str(input_path))
    dummy = np.zeros(len(images), dtype=np.int64)
    _, probs = predict_probabilities(
        model, make_loader(images, dummy, EVAL_BATCH_SIZE, shuffle=False), pick_device(device), card.multilabel
    )
    write_predictions(Path(out), inputs.names, probs, card)
    report = {"rows": len(probs), "model": str(path)}
    if inputs.labels is not None:
        # At the model's own decision threshold: the numbers its run reported for that round.
        scores = multilabel_metrics(inputs.labels, probs, card.threshold) if card.multilabel else single_label_metrics(inputs.labels, probs)
        report["metrics"] = {k: v for k, v in scores.items() if not isinstance(v, list)}
    return report


def predicted_labels(probs: np.ndarray, card: ModelCard) -> list[str]:
    names = np.array(card.class_names)
    if card.multilabel:
        return ["|".join(names[row > card.threshold]) for row in probs]
    return list(names[probs.argmax(axis=1)])


def write_predictions(out: Path, names: list[str], probs: np.ndarray, card: ModelCard) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "predicted", *(f"p:{name}" for name in card.class_names)])
        for name, label, row in zip(names, predicted_labels(probs, card), probs):
            # repr of the float32 value as a Python float: read back, it is the exact probability.
            writer.writerow([name, label, *(repr(float(p)) for p in row)])
