"""What the server makes of the accepted uploads, with no Flower in it: the class-balanced synthetic set drawn
from the library and the classifier trained on it alone, and the P2P round's experts as files."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from fedskew.factory.classifier import ClassifierRecipe, train_classifier
from fedskew.factory.intensity import match_intensity
from fedskew.factory.library import Library, SYNTHETIC_FILE, class_balanced_set, save_class_grids, save_synthetic
from fedskew.factory.run import FactorySettings
from fedskew.factory.timing import Elapsed, timed
from fedskew.results import write_json

SAMPLES_DIR = "samples"
EXPERTS_DIR = "experts"


@dataclass
class Expert:
    """A site's P2P expert as the server accepted it: the node that sent it, the site it is, its metrics."""

    node: int
    site_id: int
    model: torch.nn.Module
    metrics: dict


def train_library_classifier(
    cfg: FactorySettings, library: Library, device: torch.device, run_dir: Path | None,
    checkpoints: dict | None = None, real_histograms: np.ndarray | None = None, guides: Library | None = None,
) -> tuple[torch.nn.Module, dict]:
    """Synthesise the class-balanced set (autoguided by `guides` when given; its pixels matched to
    `real_histograms` when given), store it with its sample grids under `run_dir` (None: nothing is written),
    train the classifier on it (`checkpoints`: see train_classifier)."""
    synthesis, training = Elapsed(), Elapsed()
    with timed(synthesis):
        synthetic = class_balanced_set(library, cfg.factory, cfg.seed, device, guides, cfg.factory.guidance_weight)
        if real_histograms is not None:
            synthetic = replace(synthetic, images=match_intensity(synthetic.images, synthetic.labels, real_histograms))
    if run_dir is not None:
        save_synthetic(synthetic, run_dir / SYNTHETIC_FILE)
        save_class_grids(synthetic, run_dir / SAMPLES_DIR)
    with timed(training):
        model, stats = train_classifier(
            synthetic.images, synthetic.labels, library.num_classes, ClassifierRecipe.from_config(cfg),
            val_fraction=cfg.factory.classifier_val_fraction, seed=cfg.seed, device=device, checkpoints=checkpoints,
        )  # fmt: skip
    stats.update(
        **synthesis.as_metrics("synthesis"),
        **training.as_metrics("classifier"),
        synthetic_images=len(synthetic.labels),
        synthetic_per_class=np.bincount(synthetic.labels, minlength=library.num_classes).tolist(),
        intensity_matched=real_histograms is not None,
    )
    return model, stats


def save_experts(
    experts: list[Expert], classifier: str, num_classes: int, image_shape: tuple[int, int, int], directory: Path
) -> None:
    """Each expert's weights and a manifest naming its site and node, the `classifier` architecture and the task
    (fedskew.unlearn rebuilds the Product of Experts from them)."""
    directory.mkdir(parents=True, exist_ok=False)
    entries = []
    for expert in experts:
        name = f"site-{expert.site_id}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in expert.model.state_dict().items()}, str(directory / name))
        entries.append({"site-id": expert.site_id, "node": str(expert.node), "file": name})
    write_json(
        directory / "manifest.json",
        {"classifier": classifier, "num-classes": num_classes, "image-shape": list(image_shape), "experts": entries},
    )
