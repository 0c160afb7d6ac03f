"""In-process search for FederatedFactory defaults: the factory pipeline without Flower, variant by
variant, on the exact sites a `flwr run` would simulate (single-class silos by default).

    python -m bench.factory_search --dataset digits --seeds 0 \
        --base "factory.classifier='small-cnn'" \
        --variant "fixed-6:" --variant "site-validation: factory.site-validation=true" \
        --out bench/results/factory-search/digits-8px

Every variant is a run-config overlay on --base; `method='factory-p2p'` evaluates the sites' experts and
their Product of Experts (a factory-p2p run's final round) instead of the server's classifier, and
`bench.match-experts=true` (an ablation, not a run-config key) matches the experts' synthetic images to
the sites' histograms as factory.match-intensity does the server's; with `factory.guide-steps` (autoguidance)
every site's guides are trained and cached as a library of their own. Sites train their generators with
fedskew.factory.site (cached under OUT/generators/, keyed by the settings that shape a generator, so
variants that differ only on the server's side reuse them); the server synthesises, trains its
classifier (fedskew.factory.classifier) and, with factory.site-validation, asks the sites' validation
splits through the same functions the Flower handlers call. Per variant and seed it records the test
accuracy, balanced accuracy, per-class recall, the ratio to the same classifier recipe trained on the
pooled real training images (the centralised bound), wall times, and per class the intensity mean /
std of synthetic vs real images and the share of synthetic images the centralised classifier assigns
to their class. OUT/results.json and OUT/results.md are rewritten after every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.compare import parse_run_config
from bench.gpu_check import DeviceClock, steady_rate
from fedskew.config import RunConfig
from fedskew.data.sites import SiteData, load_task_dataset, simulated_site
from fedskew.factory.classifier import ClassifierRecipe, run_classifier, train_classifier
from fedskew.factory.library import (
    GeneratorModule,
    Library,
    SyntheticSet,
    class_balanced_set,
    load_synthetic,
    read_library,
    save_class_grids,
    save_synthetic,
    write_library,
)
from fedskew.factory.intensity import class_histograms, match_intensity
from fedskew.factory.parallel import run_side_by_side
from fedskew.factory.site import (
    MemorizationRefusal,
    check_memorization,
    generator_config,
    guide_config,
    lacking_class_images,
    label_counts,
    p2p_samples_per_class,
    reference_lr,
    site_plan,
    train_site_expert,
    train_site_generators,
)
from fedskew.models.edm2 import train_generator
from fedskew.models.ensemble import ExpertEnsemble
from fedskew.factory.site_validation import class_scores, pooled, select_and_calibrate
from fedskew.fidelity import classifier_features, mean_over_classes, per_class_fidelity
from fedskew.methods import method_of
from fedskew.training import evaluate, pick_device

SILOS = {"mosaic-grid": 0, "partition": "classes-per-site", "classes-per-site": 1}
# The keys that shape a site's generator weights (everything else is the server's side; the audit's
# sampler settings change only the recorded memorisation share, not the weights).
NO_MODULES = "no-modules.json"  # a site's cache entry when it has no class to train a generator for
GENERATOR_KEYS = ("generator", "generator_channels", "generator_images", "generator_steps", "augment", "conditional", "min_class_images")
# The reference lr every library was trained at before it was a key: libraries trained at it keep their names.
FORMER_REF_LR = 0.01


def library_key(cfg: RunConfig, num_sites: int) -> str:
    """The JSON of everything that shapes a search's generator library: its cache directory's name is the hash."""
    shaping = {k: getattr(cfg.factory, k) for k in GENERATOR_KEYS}
    if reference_lr(cfg.factory) != FORMER_REF_LR:
        shaping["generator_lr"] = reference_lr(cfg.factory)
    return json.dumps({"data": [cfg.dataset, cfg.image_size, cfg.partition, cfg.classes_per_site, cfg.alpha, cfg.val_fraction],
                       "seed": cfg.seed, "sites": num_sites, **shaping}, sort_keys=True)  # fmt: skip


def site_library(cfg: RunConfig, sites: list[SiteData], cache: Path, device: torch.device,
                 workers: int = 1) -> tuple[Library, Path, float]:
    """Every site's generators (trained, or read from the cache) as one library, its cache directory, and
    the seconds spent training. With `workers` > 1 that many sites train side by side in worker processes,
    each with an equal share of this process's torch threads (as the sites of a run train side by side)."""
    key = library_key(cfg, len(sites))
    directory = cache / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (directory / "manifest.json").is_file():
        return read_library(directory), directory, 0.0
    # Each site's generators are kept as soon as they are trained: a search stopped half way resumes there.
    per_site = directory.with_name(directory.name + ".sites")
    start = time.perf_counter()
    jobs = [(cfg, site, per_site / f"site{site.site_id}", device) for site in sites]
    modules = [m for trained in run_side_by_side(site_modules, jobs, workers) for m in trained]
    seconds = time.perf_counter() - start
    library = Library(tuple(sorted(modules, key=lambda m: (m.site_id, m.classes))), sites[0].num_classes,
                      tuple(sites[0].train_images.shape[1:]), tuple(sites[0].class_names))  # fmt: skip
    write_library(library, directory)
    (directory / "settings.json").write_text(json.dumps({**json.loads(key), "train_seconds": seconds}, indent=2))
    shutil.rmtree(per_site)
    return library, directory, seconds


def site_modules(cfg: RunConfig, site: SiteData, directory: Path, device: torch.device) -> list[GeneratorModule]:
    """One site's generators, trained, or read from `directory` where an interrupted search left them. A
    site holding no class with factory.min-class-images images uploads nothing, as in a run (its reply is
    an error and the server goes on with the other sites)."""
    if (directory / NO_MODULES).is_file():
        return []
    if (directory / "manifest.json").is_file():
        return list(read_library(directory).modules)
    if not site_plan(cfg, site):
        counts = label_counts(site)
        print(f"site {site.site_id}: no class with >= factory.min-class-images = {cfg.factory.min_class_images} training "
              f"images (counts {counts}); it uploads nothing, as in a run", flush=True)  # fmt: skip
        directory.mkdir(parents=True, exist_ok=True)
        (directory / NO_MODULES).write_text(json.dumps({"counts": counts}) + "\n")
        return []
    modules = train_site_generators(cfg, site, device)[0]
    write_library(Library(tuple(modules), site.num_classes, tuple(site.train_images.shape[1:]), tuple(site.class_names)), directory)
    return modules


def uploaded_library(cfg: RunConfig, library: Library, directory: Path) -> tuple[Library, Path]:
    """The library less the generators the sites withhold at a set factory.max-memorization (what the sites
    of a deployed run upload), and the directory synthetic sets drawn from it are cached in."""
    limit = cfg.factory.memorization_limit(deployed=False)
    if limit <= 0:
        return library, directory
    kept = []
    for site_id in sorted({m.site_id for m in library.modules}):
        try:
            kept += check_memorization([m for m in library.modules if m.site_id == site_id], limit)[0]
        except MemorizationRefusal as refusal:
            print(f"site {site_id}: {refusal}", flush=True)
    withheld = sorted({m.module_id for m in library.modules} - {m.module_id for m in kept})
    print(f"factory.max-memorization = {limit}: the sites withhold {withheld}", flush=True)
    uploaded = directory.with_name(f"{directory.name}-max-memorization-{limit}")
    uploaded.mkdir(exist_ok=True)
    return dataclasses.replace(library, modules=tuple(kept)), uploaded


@dataclasses.dataclass(frozen=True)
class Guides:
    """Trained guides; `tag` names the synthetic sets and grids drawn with them (and the run config's
    factory.guidance-weight)."""

    library: Library
    tag: str


def server_synthetic_set(cfg: RunConfig, library: Library, directory: Path, device: torch.device,
                         guides: Guides | None = None) -> SyntheticSet:
    """The server's class-balanced synthetic set (autoguided by `guides`), cached next to the library it
    was drawn from."""
    samples = cfg.factory.server_samples_per_class(library.image_shape[-1])
    tag = guides.tag if guides else ""
    path = directory / f"synthetic-{samples}x-{cfg.factory.sampler_steps}steps{tag}-seed{cfg.seed}.safetensors"
    if path.is_file():
        return load_synthetic(path)
    synthetic = class_balanced_set(library, cfg.factory, cfg.seed, device, guides.library if guides else None,
                                   cfg.factory.guidance_weight)  # fmt: skip
    save_synthetic(synthetic, path)
    return synthetic


def site_answers(cfg: RunConfig, sites: list[SiteData], device: torch.device):
    """What the Flower validation query returns, computed in-process: pooled class-level sums."""
    shape, num_classes = tuple(sites[0].train_images.shape[1:]), sites[0].num_classes

    def ask(state: dict[str, torch.Tensor]):
        model = run_classifier(cfg, shape, num_classes)
        model.load_state_dict(state)
        return pooled([class_scores(model, s.val_images, s.val_labels, num_classes, device) for s in sites], num_classes)

    return ask


def intensity_report(synthetic_images, synthetic_labels, real_images, real_labels, reference, device) -> dict:
    """Per class: mean and std of pixel intensities, synthetic vs real, and the share of synthetic images
    the real-trained classifier puts in their class."""
    with torch.no_grad():
        predicted = reference.to(device).eval()(torch.from_numpy(synthetic_images).to(device)).argmax(1).cpu().numpy()
    rows = {}
    for c in np.unique(synthetic_labels):
        syn, real = synthetic_images[synthetic_labels == c], real_images[real_labels == c]
        rows[int(c)] = {"synthetic_mean": float(syn.mean()), "real_mean": float(real.mean()),
                        "synthetic_std": float(syn.std()), "real_std": float(real.std()),
                        "real_classifier_agrees": float((predicted[synthetic_labels == c] == c).mean())}  # fmt: skip
    return rows


def centralised_reference(cfg: RunConfig, sites: list[SiteData], test, device, epochs: int = 0) -> tuple[torch.nn.Module, dict]:
    """The factory's classifier recipe trained on the pooled real training images of the same sites, for
    `epochs` (0: the recipe's own factory.classifier-epochs)."""
    images = np.concatenate([s.train_images for s in sites])
    labels = np.concatenate([s.train_labels for s in sites])
    recipe = ClassifierRecipe.from_config(cfg)
    recipe = dataclasses.replace(recipe, epochs=epochs or recipe.epochs)
    start = time.perf_counter()
    model, _ = train_classifier(images, labels, sites[0].num_classes, recipe,
                                val_fraction=cfg.factory.classifier_val_fraction, seed=cfg.seed, device=device)  # fmt: skip
    metrics = evaluate(model, test.test_images, test.test_labels, device=device)
    # Its per-class recall says whether a class is hard on real images too: a recall target can be out of
    # reach of the synthetic route where the bound itself misses it.
    return model, {"accuracy": metrics["accuracy"], "per_class_recall": metrics["per_class_recall"], "epochs": recipe.epochs,
                   "seconds": time.perf_counter() - start}  # fmt: skip


def centralised_bound(cfg: RunConfig, num_sites: int, epochs: int) -> dict:
    """The centralised bound alone (no generator trained): its test accuracy, epochs and seconds for cfg's seed."""
    sites = [simulated_site(cfg, k, num_sites) for k in range(num_sites)]
    _, metrics = centralised_reference(cfg, sites, load_task_dataset(cfg), pick_device(cfg.device), epochs)
    bound = {"seed": cfg.seed, **metrics}
    print(f"centralised bound, seed {cfg.seed}, {bound['epochs']} epochs: accuracy {bound['accuracy']:.4f}", flush=True)
    return bound


def site_lacking_images(cfg: RunConfig, site: SiteData, library: Library, directory: Path, device: torch.device) -> SyntheticSet | None:
    """A site's P2P synthetic images of the classes it lacks, cached next to the library they come from."""
    samples = p2p_samples_per_class(site, cfg.factory)
    path = directory / f"site{site.site_id}-lacking-{samples}x-{cfg.factory.sampler_steps}steps-seed{cfg.seed}.safetensors"
    if path.is_file():
        return load_synthetic(path)
    synthetic = lacking_class_images(cfg, site, library, device)
    if synthetic is not None:
        save_synthetic(synthetic, path)
    return synthetic


def p2p_variant(cfg: RunConfig, sites: list[SiteData], library: Library, directory: Path, test, device,
                match_experts: bool = False) -> dict:
    """factory-p2p's second round in-process: every site's expert (the function the P2P handler calls) and
    their Product of Experts on the test split. `match_experts` (the `bench.match-experts` ablation, not a
    run-config key): the experts' synthetic images are matched to the sites' summed histograms, as the
    server's are under factory.match-intensity."""
    histograms = summed_histograms(sites, library.num_classes) if match_experts else None
    experts, rows, seconds = [], [], 0.0
    for site in sites:
        synthetic = site_lacking_images(cfg, site, library, directory, device)
        if histograms is not None and synthetic is not None:
            synthetic = dataclasses.replace(synthetic, images=match_intensity(synthetic.images, synthetic.labels, histograms))
        start = time.perf_counter()
        state, metrics = train_site_expert(cfg, site, library, device, synthetic)
        seconds += time.perf_counter() - start
        model = run_classifier(cfg, library.image_shape, library.num_classes)
        model.load_state_dict(state)
        experts.append(model.eval())
        rows.append({"site": site.site_id, "test_accuracy": evaluate(model, test.test_images, test.test_labels, device=device)["accuracy"],
                     **{k: metrics[k] for k in ("best_epoch", "last_epoch", "val_accuracy", "train_loss")}})  # fmt: skip
        print(f"  expert {site.site_id}: test accuracy {rows[-1]['test_accuracy']:.3f}, best epoch {metrics['best_epoch']} "
              f"of {metrics['last_epoch']}", flush=True)  # fmt: skip
    poe = evaluate(ExpertEnsemble(experts), test.test_images, test.test_labels, device=device)
    return {"poe": poe, "experts": rows, "classifier_seconds": seconds,
            "best_epoch": statistics.mean(r["best_epoch"] for r in rows), "last_epoch": statistics.mean(r["last_epoch"] for r in rows)}  # fmt: skip


def summed_histograms(sites: list[SiteData], num_classes: int) -> np.ndarray:
    """What the sites' uploads carry with factory.match-intensity, summed over the sites."""
    return sum(class_histograms(s.train_images, s.train_labels, num_classes) for s in sites)


def run_variant(cfg: RunConfig, num_sites: int, out: Path, name: str, references: dict, match_experts: bool = False,
                bound_epochs: int = 0, site_workers: int = 1) -> dict:
    device = pick_device(cfg.device)
    sites = [simulated_site(cfg, k, num_sites) for k in range(num_sites)]
    test = load_task_dataset(cfg)
    library, library_dir, generator_seconds = site_library(cfg, sites, out / "generators", device, site_workers)
    library, library_dir = uploaded_library(cfg, library, library_dir)
    ref_key = (cfg.seed, cfg.factory.classifier, bound_epochs or cfg.factory.classifier_epochs, cfg.factory.classifier_patience,
               cfg.factory.augment)
    if ref_key not in references:
        references[ref_key] = centralised_reference(cfg, sites, test, device, bound_epochs)
    reference, reference_metrics = references[ref_key]
    real = np.concatenate([s.train_images for s in sites]), np.concatenate([s.train_labels for s in sites])
    if method_of(cfg).p2p:  # the Product of Experts (a factory-p2p run's final round) instead of the server's classifier
        p2p = p2p_variant(cfg, sites, library, library_dir, test, device, match_experts)
        return {
            "variant": name, "seed": cfg.seed, "accuracy": p2p["poe"]["accuracy"], "balanced_accuracy": p2p["poe"]["balanced_accuracy"],
            "per_class_recall": p2p["poe"]["per_class_recall"], "centralised_accuracy": reference_metrics["accuracy"],
            "centralised_per_class_recall": reference_metrics["per_class_recall"],
            "centralised_min_class_recall": min(reference_metrics["per_class_recall"]), "centralised_epochs": reference_metrics["epochs"], "ratio_to_centralised": p2p["poe"]["accuracy"] / reference_metrics["accuracy"],
            "min_class_recall": min(p2p["poe"]["per_class_recall"]), "generator_seconds": generator_seconds,
            **{k: p2p[k] for k in ("best_epoch", "last_epoch", "classifier_seconds", "experts")},
        }  # fmt: skip
    guides, guide_seconds = None, 0.0
    guided = guide_config(cfg)
    if guided:  # the guides a run's sites would upload, cached like the generators
        guide_library, guide_dir, guide_seconds = site_library(guided, sites, out / "generators", device, site_workers)
        guides = Guides(guide_library, f"-guide{guide_dir.name}-w{cfg.factory.guidance_weight:g}")
    start = time.perf_counter()
    synthetic = server_synthetic_set(cfg, library, library_dir, device, guides)
    if cfg.factory.match_intensity:
        histograms = summed_histograms(sites, library.num_classes)
        synthetic = dataclasses.replace(synthetic, images=match_intensity(synthetic.images, synthetic.labels, histograms))
    synthesis_seconds = time.perf_counter() - start
    matched = "-matched" if cfg.factory.match_intensity else ""
    samples = cfg.factory.server_samples_per_class(library.image_shape[-1])
    tag = guides.tag if guides else ""
    grids = out / "samples" / f"{library_dir.name}-{samples}x-{cfg.factory.sampler_steps}steps{tag}{matched}-seed{cfg.seed}"
    if not grids.is_dir():  # variants that share the synthetic set share its grids
        save_class_grids(synthetic, grids)
    checkpoints = {} if cfg.factory.site_validation else None
    start = time.perf_counter()
    model, stats = train_classifier(
        synthetic.images, synthetic.labels, library.num_classes, ClassifierRecipe.from_config(cfg),
        val_fraction=cfg.factory.classifier_val_fraction, seed=cfg.seed, device=device, checkpoints=checkpoints,
    )  # fmt: skip
    site_report = {}
    if checkpoints is not None:
        state, site_report = select_and_calibrate(checkpoints, library.num_classes, site_answers(cfg, sites, device),
                                                  cfg.factory.calibration_rounds)  # fmt: skip
        model.load_state_dict(state)
    classifier_seconds = time.perf_counter() - start
    metrics = evaluate(model, test.test_images, test.test_labels, device=device)
    fd_key = ("features", cfg.seed)
    if fd_key not in references:  # the fidelity report's feature net, trained on the sites' pooled real images
        references[fd_key] = classifier_features(*real, library.num_classes, cfg.seed, device)
    fidelity = per_class_fidelity(references[fd_key], synthetic.images, synthetic.labels, real,
                                  (test.test_images, test.test_labels), tuple(library.class_names), cfg.seed)  # fmt: skip
    return {
        "variant": name, "seed": cfg.seed, "accuracy": metrics["accuracy"],
        "balanced_accuracy": metrics["balanced_accuracy"], "per_class_recall": metrics["per_class_recall"],
        "centralised_accuracy": reference_metrics["accuracy"], "centralised_epochs": reference_metrics["epochs"],
        "centralised_per_class_recall": reference_metrics["per_class_recall"],
        "centralised_min_class_recall": min(reference_metrics["per_class_recall"]),
        "ratio_to_centralised": metrics["accuracy"] / reference_metrics["accuracy"],
        "min_class_recall": min(metrics["per_class_recall"]), "best_epoch": stats["best_epoch"],
        "last_epoch": stats["last_epoch"], "synthetic_val_accuracy": stats["val_accuracy"],
        "generator_seconds": generator_seconds, "guide_seconds": guide_seconds, "synthesis_seconds": synthesis_seconds,
        "classifier_seconds": classifier_seconds, "site_validation": site_report, "samples": str(grids),
        "fd": mean_over_classes(fidelity)["fd"], "fd_floor": mean_over_classes(fidelity)["fd_floor"],
        "fidelity_per_class": fidelity,
        "intensity": intensity_report(synthetic.images, synthetic.labels, *real, reference, device),
    }  # fmt: skip


def generator_step_cost(sides: list[int], channels: int, steps: int) -> list[dict]:
    """CPU seconds per training step (loss, backward, Adam, EMA) of the `cpu` preset at each image side, at
    the batch a class of 180 images gets, with the torch threads set by --threads; process time, so other
    load on a shared machine does not inflate it. The first step (allocation) is not counted."""
    rows = []
    for side in sides:
        factory = RunConfig.from_run_config({**SILOS, "method": "factory", "factory.generator-steps": steps + 1}).factory
        config = generator_config(factory, (channels, side, side), 0, 180, seed=0)
        images = np.random.default_rng(0).random((180, channels, side, side), dtype=np.float32)
        times: list[float] = []
        clock = [time.process_time()]

        def lap(step: int, total: int, loss: float) -> None:
            now = time.process_time()
            if step > 1:
                times.append(now - clock[0])
            clock[0] = now

        train_generator(images, None, config, progress=lap, device=torch.device("cpu"))
        preset_steps = generator_config(RunConfig.from_run_config({**SILOS, "method": "factory"}).factory, (channels, side, side), 0, 180, 0).total_steps
        rows.append({"side": side, "channels": channels, "channel_mult": list(config.channel_mult),
                     "attn": list(config.attn_resolutions), "blocks": config.num_blocks, "batch": config.batch_size,
                     "preset_steps": preset_steps, "cpu_seconds_per_step": statistics.median(times)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def calibrated_generator_images(cfg: RunConfig, site: SiteData, seconds: float, device: torch.device,
                                steps: int = 15, warmup: int = 5) -> dict:
    """factory.generator-images that trains the site's first planned generator in about `seconds` on
    `device`: its steady images/s over `steps` training steps of its own configuration and class images
    (after `warmup` steps of CUDA context and autotuning), times the seconds, in whole batches. A search
    on a GPU gets a budget by wall time this way; the result names the images, so a run repeats it."""
    planned = site_plan(cfg, site)[0]
    images = site.train_images[np.isin(site.train_labels, planned.classes)]
    probe = dataclasses.replace(planned.config, total_images=planned.config.batch_size * steps)
    clock, step_ends = DeviceClock(device), []
    train_generator(images, None, probe, progress=lambda *_: step_ends.append(clock.now()), device=device)
    rate = steady_rate(step_ends, warmup, probe.batch_size)
    batches = max(1, int(seconds * rate) // probe.batch_size)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "batch": probe.batch_size, "images_per_s": rate, "seconds_per_generator": seconds,
            "generator_images": batches * probe.batch_size}  # fmt: skip


def summary_table(results: list[dict]) -> str:
    """Mean ± sd over seeds per variant."""
    columns = ("accuracy", "balanced_accuracy", "ratio_to_centralised", "min_class_recall", "centralised_accuracy",
               "best_epoch", "last_epoch", "fd", "fd_floor", "generator_seconds", "classifier_seconds",
               "centralised_min_class_recall")  # fmt: skip
    lines = ["| variant | " + " | ".join(columns) + " | seeds |", "|---" * (len(columns) + 2) + "|"]
    for name in dict.fromkeys(r["variant"] for r in results):
        rows = [r for r in results if r["variant"] == name]
        cells = []
        for column in columns:
            values = [float(r[column]) for r in rows if column in r]  # P2P rows have no server-side fd
            sd = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
            cells.append(f"{statistics.mean(values):.3f}{sd}" if values else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {','.join(str(r['seed']) for r in rows)} |")
    recall = ["", "Per-class recall (mean over seeds):", "", "| variant | " + " | ".join(str(c) for c in range(len(results[0]["per_class_recall"]))) + " |",
              "|---" * (len(results[0]["per_class_recall"]) + 1) + "|"]  # fmt: skip
    for name in dict.fromkeys(r["variant"] for r in results):
        per_class = np.mean([r["per_class_recall"] for r in results if r["variant"] == name], axis=0)
        recall.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in per_class) + " |")
    return "\n".join(lines + recall) + "\n"


def across_datasets(directories: list[Path]) -> str:
    """Variants (rows) x datasets (columns): accuracy / ratio to the centralised bound / lowest class recall,
    mean over seeds, and the mean ratio over the datasets that ran the variant (how a default is chosen)."""
    runs = {d.name: json.loads((d / "results.json").read_text()) for d in directories}
    variants = list(dict.fromkeys(r["variant"] for results in runs.values() for r in results))
    lines = ["| variant | " + " | ".join(runs) + " | mean ratio | lowest recall |", "|---" * (len(runs) + 3) + "|"]
    for name in variants:
        cells, ratios, recalls = [], [], []
        for results in runs.values():
            rows = [r for r in results if r["variant"] == name]
            if not rows:
                cells.append("not run")
                continue
            accuracy, ratio, recall = (statistics.mean(float(r[k]) for r in rows) for k in ("accuracy", "ratio_to_centralised", "min_class_recall"))
            ratios.append(ratio)
            recalls.append(recall)
            cells.append(f"{accuracy:.3f} / {ratio:.3f} / {recall:.2f}")
        complete = len(ratios) == len(runs)
        mean = f"{statistics.mean(ratios):.3f}" if complete else "incomplete"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} | {min(recalls):.2f} |")
    return "\n".join(lines) + "\n"


def parse_variant(text: str) -> tuple[str, dict]:
    name, sep, overlay = text.partition(":")
    if not sep or not name.strip():
        raise SystemExit(f"--variant {text!r}: expected 'NAME: key=value ...'")
    return name.strip(), parse_run_config(overlay)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--image-size", type=int, default=0)
    parser.add_argument("--num-sites", type=int, default=10)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--base", default="", help="run-config overlay shared by every variant (after the silo partition)")
    parser.add_argument("--variant", action="append", default=[], help="'NAME: key=value ...' (repeatable)")
    parser.add_argument("--step-cost", default="", help="instead of a search: comma-separated image sides whose "
                        "cpu-preset generator step time to measure (writes OUT/step-cost.json)")
    parser.add_argument("--channels", type=int, default=1, help="image channels for --step-cost")
    parser.add_argument("--across", default="", help="instead of a search: comma-separated result folders to "
                        "tabulate variant by dataset (writes OUT/across-datasets.md)")
    parser.add_argument("--bound-epochs", type=int, default=0, help="epochs of the centralised bound on the pooled "
                        "real images (0: the classifier's own factory.classifier-epochs; the real set is smaller than "
                        "the synthetic one, so at equal epochs the bound takes fewer steps)")
    parser.add_argument("--bound-only", action="store_true", help="instead of a search: train only the centralised "
                        "bound of --base per seed (no generators; writes OUT/bound.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--site-workers", type=int, default=1, help="sites whose generators train side by side in "
                        "worker processes, each with --threads / this many torch threads (on a GPU they share it: "
                        "a small generator leaves it idle between its short kernels)")
    parser.add_argument("--generator-seconds", type=float, default=0.0, help="set factory.generator-images in --base "
                        "so that each generator trains about this many seconds on this device (measured on site 0's "
                        "first generator of the first seed; written to OUT/generator-calibration.json)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step_cost:
        rows = generator_step_cost([int(s) for s in args.step_cost.split(",")], args.channels, steps=4)
        path = args.out / f"step-cost-{args.channels}ch.json"
        path.write_text(json.dumps(rows, indent=1) + "\n")
        return
    if args.across:
        table = across_datasets([Path(d) for d in args.across.split(",")])
        (args.out / "across-datasets.md").write_text(table)
        print(table)
        return
    base = {**SILOS, "dataset": args.dataset, "image-size": args.image_size, **parse_run_config(args.base)}
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.bound_only:
        bounds = [centralised_bound(RunConfig.from_run_config({"method": "factory", **base, "seed": seed}), args.num_sites,
                                    args.bound_epochs) for seed in seeds]  # fmt: skip
        (args.out / "bound.json").write_text(json.dumps(bounds, indent=1) + "\n")
        return
    if not args.variant:
        raise SystemExit("--variant is required (or --step-cost, --across, --bound-only)")
    if args.generator_seconds > 0:
        cfg = RunConfig.from_run_config({"method": "factory", **base, "seed": seeds[0]})
        calibration = calibrated_generator_images(cfg, simulated_site(cfg, 0, args.num_sites), args.generator_seconds,
                                                  pick_device(cfg.device))  # fmt: skip
        (args.out / "generator-calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
        print(f"generator calibration: {json.dumps(calibration)}", flush=True)
        base["factory.generator-images"] = calibration["generator_images"]
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else []
    done = {(r["variant"], r["seed"]) for r in results}
    references: dict = {}
    for seed in seeds:
        for name, overlay in map(parse_variant, args.variant):
            if (name, seed) in done:
                continue
            settings = {"method": "factory", **base, "seed": seed, **overlay}
            match_experts = bool(settings.pop("bench.match-experts", False))
            cfg = RunConfig.from_run_config(settings)
            result = run_variant(cfg, args.num_sites, args.out, name, references, match_experts, args.bound_epochs, args.site_workers)
            result["run_config"] = {**base, **overlay}
            results.append(result)
            path.write_text(json.dumps(results, indent=1) + "\n")
            (args.out / "results.md").write_text(summary_table(results))
            print(f"{name} seed {seed}: accuracy {result['accuracy']:.4f}, ratio {result['ratio_to_centralised']:.3f}, "
                  f"min recall {result['min_class_recall']:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
