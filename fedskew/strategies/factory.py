"""FederatedFactory over Flower: one upload round (`train.factory`) and, for `factory-p2p`, one relay
round (`train.p2p`).

Round 1: every site trains and audits its generators and replies with one ArrayRecord per generator (its
weights packed into one array, see `fedskew.protocol.packed_weights`) plus a JSON manifest of their metadata; the
server validates each upload (a bad one is rejected with its reason and the run goes on with the rest),
writes library/, samples a class-balanced synthetic set, trains the classifier on it and evaluates it
on the real test split. Every reply is bound to the node that sent it: its site id and label counts
come from that node's own survey reply (a site id claimed by two nodes is refused), and the modules it
may upload, their classes, image counts and configs follow from those and the run config, so a site
contributes only weights, checksums and its memorisation audit. Sizes are bounded before anything is
decoded: the manifest by characters and nesting, each payload by the run's model size.
Round 2 (P2P): Flower has no site-to-site channel, so the SuperLink relays the library to every site;
each site trains its own expert on real + synthetic images and returns it; the server evaluates the
Product of Experts and each expert alone.

Bytes are counted as Flower serialises each message (RecordingMixin), per site and direction.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from flwr.serverapp import Grid
from safetensors.torch import save_file

from fedskew.config import RunConfig
from fedskew.data.sources import ImageDataset
from fedskew.factory.classifier import ClassifierRecipe, train_classifier
from fedskew.factory.intensity import match_intensity
from fedskew.factory.library import GUIDES_DIR, SYNTHETIC_FILE, Library, class_balanced_set, save_class_grids, save_synthetic, write_library
from fedskew.factory.timing import Elapsed, timed
from fedskew.fidelity import record_fidelity
from fedskew.models.ensemble import ExpertEnsemble
from fedskew.results import RunRecorder, write_json
from fedskew.strategies.factory_flow import Expert, FactoryFlow, TaskLike
from fedskew.strategies.factory_validation import validate_at_sites
from fedskew.training import evaluate

LIBRARY_DIR = "library"
EXPERTS_DIR = "experts"
SAMPLES_DIR = "samples"
POE_MODEL = "model-poe.safetensors"


def test_metrics(model: torch.nn.Module, test: ImageDataset | None, device: torch.device) -> dict:
    """Metrics on the server's real test split ({} when the server holds none)."""
    return evaluate(model, test.test_images, test.test_labels, device=device) if test is not None else {}


def train_library_classifier(
    cfg: RunConfig, library: Library, device: torch.device, run_dir: Path, checkpoints: dict | None = None,
    real_histograms: np.ndarray | None = None, guides: Library | None = None,
) -> tuple[torch.nn.Module, dict]:
    """Synthesise the class-balanced set (autoguided by `guides` when given; its pixels matched to
    `real_histograms` when given; stored, with its plan), write the sample grids, train the classifier
    (`checkpoints`: see train_classifier)."""
    synthesis, training = Elapsed(), Elapsed()
    with timed(synthesis):
        synthetic = class_balanced_set(library, cfg.factory, cfg.seed, device, guides, cfg.factory.guidance_weight)
        if real_histograms is not None:
            synthetic = replace(synthetic, images=match_intensity(synthetic.images, synthetic.labels, real_histograms))
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


def save_experts(experts: list[Expert], cfg: RunConfig, task: TaskLike, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=False)
    entries = []
    for expert in experts:
        name = f"site-{expert.site_id}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in expert.model.state_dict().items()}, str(directory / name))
        entries.append({"site-id": expert.site_id, "node": str(expert.node), "file": name})
    write_json(
        directory / "manifest.json",
        {"classifier": cfg.factory.classifier, "num-classes": task.num_classes, "image-shape": list(task.image_shape),
         "experts": entries},
    )  # fmt: skip


def generators_privacy(library: Library, cfg: RunConfig) -> dict:
    """The run's DP guarantee from its DP-SGD generators: each image is in exactly one generator, so
    every upload, and the library, is (largest epsilon, largest delta)-DP for one training image. What
    else the run released from the sites' real images is listed beside it: the guarantee does not cover it."""
    guarantees = [m.privacy for m in library.modules]
    return {
        "mode": "dp-sgd-generators",
        "epsilon": max(g["epsilon"] for g in guarantees),
        "delta": max(g["delta"] for g in guarantees),
        "generators": len(guarantees),
        "accountant": guarantees[0]["accountant"],
        "unit": guarantees[0]["unit"],
        "not_covered": releases_outside_the_guarantee(cfg),
    }


def releases_outside_the_guarantee(cfg: RunConfig) -> list[str]:
    """What a run of `cfg` sends from the sites' real images besides the DP generators."""
    released = ["the survey's image counts per class", "each generator's memorization share (its manifest entry)"]
    if cfg.method == "factory-p2p":
        released.append("each site's expert classifier, trained on its real images without DP")
    if cfg.factory.site_validation:
        released.append("each site's per-class sums of the server's classifier on its real validation images")
    if cfg.factory.match_intensity:
        released.append("each site's pixel histograms per class")
    return released


def run_factory(
    grid: Grid,
    cfg: RunConfig,
    survey: dict[int, dict],
    task: TaskLike,
    test: ImageDataset | None,
    recorder: RunRecorder,
    device: torch.device,
) -> None:
    """method factory (round 1) or factory-p2p (rounds 1 and 2); results go to recorder.path."""
    flow = FactoryFlow(grid, recorder, cfg.round_timeout, floor=min(cfg.min_available_sites, len(survey)))
    recorder.selected_within = (
        "factory.classifier-val-fraction: the classifier's epoch is chosen on held-out synthetic images"
        if cfg.method == "factory"
        else "factory.p2p-val-fraction: the Product of Experts, each expert's epoch chosen on a held-out share of its "
        "site's real + synthetic images"
    )
    library, rejected = flow.collect_library(survey, task, cfg)
    write_library(library, recorder.path / LIBRARY_DIR)
    if flow.guides is not None:
        write_library(flow.guides, recorder.path / LIBRARY_DIR / GUIDES_DIR)
    missing = library.missing_classes()
    report = recorder.extra.setdefault("factory", {})
    report.update(
        modules=[{k: v for k, v in m.metadata().items() if k != "config"} for m in library.modules],
        rejected=rejected,
        missing_classes=missing,
        missing_class_names=[task.class_names[c] for c in missing],
    )
    if any(m.privacy is not None for m in library.modules):
        recorder.extra["privacy"] = generators_privacy(library, cfg)
    if missing:
        print(f"classes without a generator (not learnable this run): {[task.class_names[c] for c in missing]}", flush=True)
    if not library.modules:
        raise RuntimeError("no generator upload passed validation; see 'rejected' and 'dropped' in summary.json")

    checkpoints = {} if cfg.factory.site_validation else None
    model, stats = train_library_classifier(cfg, library, device, recorder.path, checkpoints, flow.real_histograms, flow.guides)
    if checkpoints is not None:
        model, report["site_validation"] = validate_at_sites(flow, survey, model, checkpoints, cfg, task)
    if cfg.factory.fidelity:
        record_fidelity(cfg, recorder, device)
    server_metrics = test_metrics(model, test, device)
    report["classifier"] = {k: v for k, v in stats.items()}
    report["server_test"] = server_metrics
    recorder.record_round(1, server_metrics, train=stats, val={"val_accuracy": stats["val_accuracy"]})
    recorder.save_checkpoint(model.state_dict())
    if cfg.method != "factory-p2p":
        return

    experts, expert_rejected = flow.collect_experts(survey, library, cfg, task)
    if not experts:
        raise RuntimeError("no site returned a valid expert in the P2P round; see 'dropped' in summary.json")
    save_experts(experts, cfg, task, recorder.path / EXPERTS_DIR)
    poe = test_metrics(ExpertEnsemble([e.model for e in experts]), test, device)
    recorder.extra["p2p"] = {
        "poe_test": poe,
        "rejected": expert_rejected,
        "experts": [
            {"site-id": e.site_id, "node": str(e.node), "train": e.metrics, "test": test_metrics(e.model, test, device)}
            for e in experts
        ],
    }
    mean = {k: float(np.mean([e.metrics[k] for e in experts])) for k in ("train_loss", "val_accuracy")}
    recorder.record_round(2, poe, train=mean)
    # The Product of Experts as one self-contained model file (model.safetensors stays the server's classifier).
    if recorder.model_card is not None:
        recorder.model_card = replace(recorder.model_card, experts=len(experts))
    recorder.save_checkpoint(ExpertEnsemble([e.model for e in experts]).state_dict(), name=POE_MODEL)
