"""Modular unlearning of a finished FederatedFactory run.

The classifier's knowledge is a disjoint union of generator modules, so forgetting a site (or one
class) is: drop its modules from the library, drop the synthetic images they drew (the stored set,
so nothing is resampled and every other image stays bit-identical), retrain the classifier with the
run's recipe and seed; in P2P, also drop the experts of the sites whose modules are forgotten. No
site is contacted. The result is a new run directory; the source run is only read.

An expert trained in P2P saw synthetic images of every class it lacked, drawn from the other sites'
generators, so dropping one site's expert does not remove that site's classes from the remaining
experts: the before/after table shows what the ensemble still knows.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from fedskew.config import RunConfig
from fedskew.factory.classifier import ClassifierRecipe, run_classifier, train_classifier
from fedskew.factory.library import GUIDES_DIR, SYNTHETIC_FILE, Library, load_synthetic, read_library, save_class_grids, save_synthetic, write_library
from fedskew.methods import method_of, methods_where
from fedskew.models.build import weights_mismatch
from fedskew.models.ensemble import ExpertEnsemble
from fedskew.models.model_file import load_model_file
from fedskew.report import try_write_report
from fedskew.results import RunRecorder, read_json, write_json
from fedskew.server_tasks import load_server_test_set
from fedskew.training import evaluate, pick_device

COPIED_FILES = ("config.json", "partition.json", "partition.png")


def modules_to_forget(library: Library, site: int | None = None, class_id: int | None = None) -> list[str]:
    """Module ids of site `site`, or of every module that models class `class_id` (exactly one given)."""
    if (site is None) == (class_id is None):
        raise ValueError("give exactly one of site or class_id")
    if site is not None:
        chosen = [m for m in library.modules if m.site_id == site]
        what = f"site {site}"
    else:
        chosen = [m for m in library.modules if class_id in m.classes]
        what = f"class {class_id}"
        shared = [m.module_id for m in chosen if len(m.classes) > 1]
        if shared:
            raise ValueError(
                f"class {class_id} lives inside the conditional generator(s) {shared} together with other classes; "
                "one module cannot be split: forget the whole site with --site, or train with factory.conditional=false"
            )
    if not chosen:
        held = sorted({m.site_id for m in library.modules}) if site is not None else library.covered_classes()
        raise ValueError(f"the library has no module of {what}; it holds {'sites' if site is not None else 'classes'} {held}")
    return [m.module_id for m in chosen]


def _load_weights(path: Path, reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model's weights from the source run, checked against the model they belong to."""
    try:
        state = load_file(str(path))
    except (OSError, SafetensorError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    problem = weights_mismatch(state, reference)
    if problem:
        raise ValueError(f"{path} does not fit the run's classifier: {problem}")
    return state


def _load_experts(run_dir: Path, cfg: RunConfig, num_classes: int, image_shape: tuple[int, int, int]) -> dict[int, torch.nn.Module]:
    """The P2P experts of the source run. Each entry of experts/manifest.json must name its own file,
    `site-<id>.safetensors` in that folder (as the run wrote it): nothing else is opened."""
    path = run_dir / "experts" / "manifest.json"
    manifest = read_json(path)
    entries = manifest.get("experts") if isinstance(manifest, dict) else None
    if not isinstance(entries, list) or manifest.get("classifier") != cfg.factory.classifier:
        raise ValueError(f"{path} must list the experts of a {cfg.factory.classifier} classifier, as the run wrote it")
    experts = {}
    for entry in entries:
        site_id = entry.get("site-id") if isinstance(entry, dict) else None
        if not isinstance(site_id, int) or isinstance(site_id, bool) or site_id in experts:
            raise ValueError(f"{path}: expert entry {str(entry)[:200]} needs a distinct int site-id")
        if entry.get("file") != f"site-{site_id}.safetensors":
            raise ValueError(f"{path}: the expert of site {site_id} must be the file 'site-{site_id}.safetensors', got {str(entry.get('file'))[:200]!r}")
        model = run_classifier(cfg, image_shape, num_classes)
        model.load_state_dict(_load_weights(run_dir / "experts" / entry["file"], model.state_dict()))
        experts[site_id] = model.eval()
    return experts


def output_folder(run_dir: Path, out: Path | None, what: str) -> Path:
    """Where the unlearned run goes: `out`, or RUN_DIR-forget-<what> beside the source run; never inside
    the source run (the source stays unchanged) and never an existing path."""
    target = (Path(out) if out else run_dir.parent / f"{run_dir.name}-forget-{what}").resolve()
    if target == run_dir or run_dir in target.parents:
        raise ValueError(f"--out {target} lies inside the source run {run_dir}; valid: a new folder outside it")
    if target.exists():
        raise ValueError(f"{target} already exists; valid: a new folder (remove it or give another --out)")
    return target


def recall_table(class_names: list[str], columns: dict[str, list[float]], forgotten: list[int]) -> str:
    """Markdown: one row per class, one column per model; forgotten classes marked."""
    header = "| class | " + " | ".join(columns) + " |"
    rows = [header, "|---" * (len(columns) + 1) + "|"]
    for c, name in enumerate(class_names):
        label = f"{name} (forgotten)" if c in forgotten else name
        rows.append(f"| {label} | " + " | ".join(f"{values[c]:.3f}" for values in columns.values()) + " |")
    return "\n".join(rows) + "\n"


def unlearn(run_dir: Path, *, site: int | None = None, class_id: int | None = None, out: Path | None = None) -> Path:
    """Write a new run directory without the modules of `site` (or of `class_id`); returns its path. It is
    built in a staging folder beside it and renamed when complete, so a failure leaves nothing behind."""
    run_dir = Path(run_dir).resolve()
    config = read_json(run_dir / "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{run_dir / 'config.json'} is not a run config (a JSON object)")
    cfg = RunConfig.from_run_config(config)
    if method_of(cfg).family != "factory":
        raise ValueError(f"{run_dir} is a {cfg.method!r} run; unlearning needs a run of method {' or '.join(methods_where(family='factory'))}")
    target = output_folder(run_dir, out, f"site{site}" if site is not None else f"class{class_id}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        _write_unlearned(run_dir, cfg, staging, site, class_id)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _write_unlearned(run_dir: Path, cfg: RunConfig, target: Path, site: int | None, class_id: int | None) -> None:
    # The run's classifier, rebuilt from its model file's card; the retrained one is the same network: runs
    # from before the factory classifier followed `feature-side` (card: 0) had one stride-2 stage whatever
    # their config says.
    source_model, card = load_model_file(run_dir / "model.safetensors")
    cfg = cfg.model_copy(update={"feature_side": card.factory_feature_side})
    library = read_library(run_dir / "library")
    forgotten = modules_to_forget(library, site, class_id)
    kept = library.without(forgotten)
    lost_classes = sorted(set(library.covered_classes()) - set(kept.covered_classes()))
    test = load_server_test_set(cfg)
    if test is None:
        raise ValueError("the run has test-data = 'federated': the server holds no test split to measure unlearning on")
    device = pick_device(cfg.device)

    for name in COPIED_FILES:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, target / name)
    write_library(kept, target / "library")
    if (run_dir / "library" / GUIDES_DIR).is_dir():  # factory.guide-steps: the forgotten generators' guides go too
        guides = read_library(run_dir / "library" / GUIDES_DIR)
        guided = {g.module_id for g in guides.modules}
        write_library(guides.without(m for m in forgotten if m in guided), target / "library" / GUIDES_DIR)
    synthetic = load_synthetic(run_dir / SYNTHETIC_FILE).without_modules(forgotten)
    save_synthetic(synthetic, target / SYNTHETIC_FILE)
    save_class_grids(synthetic, target / "samples")

    recorder = RunRecorder(path=target, multilabel=False, method=cfg.method)
    before = evaluate(source_model, test.test_images, test.test_labels, device=device)
    model, stats = train_classifier(
        synthetic.images, synthetic.labels, library.num_classes, ClassifierRecipe.from_config(cfg),
        val_fraction=cfg.factory.classifier_val_fraction, seed=cfg.seed, device=device,
    )  # fmt: skip
    after = evaluate(model, test.test_images, test.test_labels, device=device)
    recorder.record_round(1, after, train=stats, val={"val_accuracy": stats["val_accuracy"]})
    recorder.save_checkpoint(model.state_dict())
    columns = {"server before": before["per_class_recall"], "server after": after["per_class_recall"]}
    report = {
        # Relative to the new run directory: the record stays valid when both are moved or shared together.
        "source_run": os.path.relpath(run_dir, target.resolve()),
        "forgotten_modules": forgotten,
        "request": {"site": site} if site is not None else {"class": class_id},
        "classes_without_generator_after": lost_classes,
        "synthetic_images": {"before": int(sum(j.count for j in load_synthetic(run_dir / SYNTHETIC_FILE).jobs)),
                             "after": len(synthetic.labels)},
        "server": {"before": before, "after": after},
    }  # fmt: skip

    if method_of(cfg).p2p:
        experts = _load_experts(run_dir, cfg, library.num_classes, library.image_shape)
        dropped_sites = sorted({library.module(m).site_id for m in forgotten})
        remaining = {s: e for s, e in experts.items() if s not in dropped_sites}
        if not remaining:
            raise ValueError(f"forgetting sites {dropped_sites} leaves no expert for the Product of Experts")
        # Only the files _load_experts checked are copied.
        (target / "experts").mkdir()
        for s in remaining:
            shutil.copy2(run_dir / "experts" / f"site-{s}.safetensors", target / "experts" / f"site-{s}.safetensors")
        manifest = read_json(run_dir / "experts" / "manifest.json")
        manifest["experts"] = [e for e in manifest["experts"] if e["site-id"] in remaining]
        write_json(target / "experts" / "manifest.json", manifest)
        poe_before = evaluate(ExpertEnsemble(list(experts.values())), test.test_images, test.test_labels, device=device)
        poe_after = evaluate(ExpertEnsemble(list(remaining.values())), test.test_images, test.test_labels, device=device)
        recorder.record_round(2, poe_after)
        columns.update({"PoE before": poe_before["per_class_recall"], "PoE after": poe_after["per_class_recall"]})
        report["p2p"] = {"dropped_experts": dropped_sites, "before": poe_before, "after": poe_after}

    table = recall_table(list(library.class_names), columns, lost_classes)
    report["per_class_recall"] = columns
    write_json(target / "unlearning.json", report)
    what = f"site {site}" if site is not None else f"class {class_id}"
    (target / "unlearning.md").write_text(
        f"Unlearning {what} of `{run_dir.name}`: dropped modules {', '.join(forgotten)}; synthetic images "
        f"{report['synthetic_images']['before']} -> {report['synthetic_images']['after']}.\n\n"
        f"Per-class recall on the real test split (before = source run, after = retrained / remaining experts):\n\n"
        + table
    )
    recorder.extra["unlearning"] = {k: v for k, v in report.items() if k not in ("server", "p2p", "per_class_recall")}
    recorder.write_summary("completed")
    recorder.plot_curves()
    try_write_report(target)
